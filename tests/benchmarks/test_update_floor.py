"""The update-floor benchmark: the update and its floor see the same tokens, the figures come back."""

from __future__ import annotations

import json
import os

import torch

from benchmarks.update_floor import _packed, main, make_rows
from sao.train.batch import collate


def test_rows_are_the_peer_shape_in_groups_of_eight():
    rows = make_rows(24, 16, seed=3)
    assert len(rows) == 24 and len({r["task_id"] for r in rows}) == 3
    assert all(8 <= len(r["completion_ids"]) <= 16 == 16 for r in rows)
    assert all(r["termination_reason"] == ("length" if len(r["completion_ids"]) == 16 else "stop") for r in rows)
    assert rows == make_rows(24, 16, seed=3)  # fixed by the seed


def test_packing_puts_every_sequence_whole_into_rows_of_the_width():
    batch = collate(make_rows(10, 16, seed=0), trainer_version=0)
    lengths = (batch.prompt_lens + batch.completion_lens).tolist()
    width = 2 * max(lengths)
    ids, positions, starts = _packed(batch, width)
    assert ids.shape[1] == width and ids.shape[0] < len(lengths)  # packing saved rows
    flat_ids, flat_positions = ids.reshape(-1), positions.reshape(-1)
    for i, n in enumerate(lengths):
        begin = int(starts[i])
        assert begin // width == (begin + n - 1) // width  # within one row
        assert torch.equal(flat_ids[begin: begin + n], batch.input_ids[i, :n])
        assert torch.equal(flat_positions[begin: begin + n], torch.arange(n))
    spans = sorted((int(starts[i]), int(starts[i]) + n) for i, n in enumerate(lengths))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no two overlap


def test_a_quick_run_times_update_and_floor_on_the_same_tokens(tmp_path):
    out, results = tmp_path / "update.json", tmp_path / "RESULTS.md"
    assert main(["--quick", "--out", str(out), "--results-md", str(results)]) == 0
    data = json.loads(out.read_text())
    assert len(data["pairs"]) == 2 and data["critic_updates"] == 2 and data["threads"] == 1
    tokens = data["tokens"]
    assert tokens["floor_padded"] == tokens["update_micro_batches"]  # the floor runs the update's micro-batches
    assert tokens["floor_packed"] >= tokens["real"]
    for pair in data["pairs"]:
        floor = pair["floor"][pair["floor_used"]]
        assert pair["ratio"] == pair["update_s"] / floor["total_s"] > 0
        assert floor["total_s"] == floor["actor_s"] + floor["critic_forward_s"] + floor["critic_updates_s"]
        assert pair["strict_ratio"] > pair["ratio"]
        assert pair["update_whole_s"] > 0  # the same update with the last layers run everywhere
    assert data["summary"]["ratio"]["median"] > 0 and "sao bench update --quick" in results.read_text()
    assert "last layers run at every position" in results.read_text()
    # the update with its critic steps beside the actor is timed apart where a core is left idle
    idle_core = len(os.sched_getaffinity(0)) > data["threads"]
    assert all((pair["update_beside_s"] is not None and pair["update_beside_s"] > 0) == idle_core
               for pair in data["pairs"])
    assert ("critic steps on a second thread" in results.read_text()) == idle_core


def test_the_budget_sweep_times_every_budget_and_thread_count_against_the_default(tmp_path):
    from sao.train.config import UpdateConfig

    out = tmp_path / "update.json"
    argv = ["--quick", "--budgets", "64,256", "--sweep-threads", "1,2", "--out", str(out),
            "--results-md", str(tmp_path / "RESULTS.md")]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    defaults = {t: UpdateConfig().micro_batch_tokens(t) for t in (1, 2)}  # one thread's differs from two's
    budgets = sorted({64, 256, *defaults.values()})
    sweep = data["budget_sweep"]
    assert [(r["threads"], r["token_budget"]) for r in sweep] == [(t, b) for t in (1, 2) for b in budgets]
    for r in sweep:
        assert len(r["update_s"]) == len(r["vs_default"]) == 2 and all(x > 0 for x in r["update_s"])
        assert r["default"] == (r["token_budget"] == defaults[r["threads"]])
        if r["default"]:
            assert r["vs_default"] == [1.0, 1.0]
    # quick rows are about 60 tokens: at budget 64 each is a micro-batch of its own, with no padding
    alone = next(r for r in sweep if r["token_budget"] == 64)
    assert alone["micro_batches"] == 16 and alone["token_places"] == data["tokens"]["real"]
    assert next(r for r in sweep if r["token_budget"] == 256)["micro_batches"] < 16
    assert data["threads"] == 1 and torch.get_num_threads() == data["threads"]  # the sweep put the threads back
