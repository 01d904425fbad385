"""The TRL side-by-side benchmark runs end to end (``--quick``): every arm through its real trainer (TRL's
GRPOTrainer, our pipeline synchronous and asynchronous, single- and multi-turn), its figures and a figure
written under the test's folder, nothing under docs/. Its summaries are checked on hand-made records."""

from __future__ import annotations

import json

import pytest

from benchmarks.peer import _split_ours, summarize
from benchmarks.peer_report import SPLIT_PARTS, THREAD_GROUPS


def _record(ends: list[float], rewards: list[float], trained: int = 8) -> dict:
    steps = [{"step": k, "begin": (ends[k - 1] if k else 0.0), "end": end, "reward": r, "trained": trained,
              "split": {"generation": 0.5, "training": 0.25, "lake": 0.0, "other": 0.25}}
             for k, (end, r) in enumerate(zip(ends, rewards, strict=True))]
    events = [[end, 100, trained] for end in ends]
    return {"steps": steps, "events": events, "peak_rss_gib": 1.0, "peak_pss_gib": 0.5,
            "cpu_window_s": {"rollout replicas": 2.4, "driver + trainer process": 1.2}}


def test_summary_counts_only_the_steady_state_window():
    record = _record([2.0, 3.0, 4.0, 5.0, 6.0], [0.1, 0.2, 0.6, 0.7, 0.8])
    s = summarize(record, warmup=2, target_reward=0.5)
    assert s["window_s"] == 3.0  # from the end of step 1 to the end of step 4
    assert s["trained_per_s"] == pytest.approx(3 * 8 / 3.0)
    assert s["tokens_per_s"] == pytest.approx(3 * 100 / 3.0)
    assert s["split_frac"]["generation"] == pytest.approx(0.5)
    assert s["cpu_ms_per_completion"] == pytest.approx({"rollout replicas": 100.0, "driver + trainer process": 50.0})
    # rolling 3-step means 0.1, 0.15, 0.3, 0.5, 0.7: the target is reached at step 3, 5 s after step 0 began
    assert s["target_step"] == 3 and s["time_to_target_s"] == pytest.approx(5.0)
    assert summarize(record, warmup=2, target_reward=0.9)["time_to_target_s"] is None


def test_synchronous_split_separates_generation_training_and_the_lake():
    steps = [
        {"begin": 0.0, "end": 10.0, "batch_created_first": 0.5, "batch_finished_last": 6.0,
         "timings": {"wait_read_s": 6.5, "update_s": 2.0, "commit_s": 0.5}},
        {"begin": 10.2, "end": 20.0, "batch_created_first": 10.4, "batch_finished_last": 16.0,
         "timings": {"wait_read_s": 6.0, "update_s": 2.5, "commit_s": 0.3}},
    ]
    second = _split_ours(steps, synchronous=True)[1]["split"]
    assert second["generation"] == pytest.approx(5.6)  # first launch to last finish
    assert second["training"] == 2.5
    assert second["lake"] == pytest.approx(0.3 + 0.2)  # commit + last finish (16.0) -> batch selected (16.2)
    assert sum(second.values()) == pytest.approx(10.0)  # the whole cycle, end of step 0 -> end of step 1
    asynchronous = _split_ours(steps, synchronous=False)[1]["split"]
    assert asynchronous["generation"] == 6.0 and asynchronous["lake"] == 0.3
    assert sum(asynchronous.values()) == pytest.approx(10.0)


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_each_kind_of_arm(tmp_path):
    pytest.importorskip("trl", reason="TRL's GRPOTrainer is the peer: install the bench extra (pip install -e '.[bench]')")
    from benchmarks.peer import main

    # TRL, our synchronous pipeline (single-turn) and our asynchronous one (multi-turn, tool latency); the
    # other arms differ from these only in settings (algorithm, shape, Ray Train)
    arms = ["trl-single", "grpo-single", "sao-multi"]
    assert main(["--quick", "--arms", ",".join(arms), "--workdir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "peer-quick.json").read_text())
    assert set(data["arms"]) == set(arms) == set(data["summary"])  # (the JSON's keys are sorted)
    for name, record in data["arms"].items():
        steps = record["steps"]
        assert [s["step"] for s in steps] == [0, 1, 2], name
        assert all(s["trained"] == 8 and s["begin"] <= s["end"] for s in steps), name  # 2 prompts x 4
        assert all(0.0 <= s["reward"] <= 1.0 for s in steps), name
        assert all(s["split"][part] >= 0.0 for s in steps for part in SPLIT_PARTS), name
        summary = data["summary"][name]
        assert summary["trained_per_s"] > 0 and summary["tokens_per_s"] >= 0, name
        assert 0.9 < sum(summary["split_frac"].values()) < 1.1, name  # the parts make up the step
        assert 0.05 < summary["peak_rss_gib"] < 64 and summary["peak_pss_gib"] <= summary["peak_rss_gib"], name
        assert sum(record["cpu_s"].values()) > 0 and record["setup_s"] > 0, name
    trl = data["arms"]["trl-single"]
    assert trl["versions"]["trl"] and set(trl["cpu_s"]) == {"TRL process"}
    assert trl["kernel_thread_names"] and trl["thread_names"]  # the sampler saw the threads, the arm named them
    for summary in data["summary"].values():  # (a quick window may fall between two samples: no threads then)
        assert set(summary["root_threads_ms_per_completion"]) <= set(THREAD_GROUPS)
    assert all(0 < s["tokens"] <= 8 * 24 for s in trl["steps"])  # completions of at most 24 tokens
    grpo = data["arms"]["grpo-single"]
    assert data["summary"]["grpo-single"]["tokens_per_s"] > 0  # synchronous: generated inside the window
    assert all(s["batch_created_first"] <= s["batch_finished_last"] <= s["end"] for s in grpo["steps"])
    assert {"rollout replicas", "Ray system", "driver + trainer process"} <= set(grpo["cpu_s"])
    sao = data["arms"]["sao-multi"]
    assert sao["arm"]["latency"]["kind"] == "lognormal" and sao["arm"]["algorithm"] == "sao"
    assert sao["driver"]["finished"] >= 3 * 8
    assert all(s["critic_s"] > 0 for s in sao["steps"])  # SAO's critic trained every step
    assert "## Side by side with TRL's GRPOTrainer" in (tmp_path / "peer-quick.md").read_text()
    assert (tmp_path / "peer-quick.png").stat().st_size > 0
