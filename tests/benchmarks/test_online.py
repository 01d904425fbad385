"""The online-learning benchmark: recovery after stale batches and with nothing to recover to, the target,
and a ``--quick`` run of all three methods end to end (Serve rollouts on style_preference, the lake, the
trainer) into tmp_path."""

from __future__ import annotations

import json

import pytest

from benchmarks.online import METHODS, main, measurable, recovery, target_met


def test_recovery_counts_from_the_shift_to_the_first_step_back_above_the_threshold_after_the_dip():
    # Steps 0-3 at 1.0 (pre-shift), shift at 4; stale batches keep 4 high, then the dip, then recovery.
    rewards = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    result = recovery(rewards, window=2, shift=4, end=len(rewards), pre_window=4, fraction=0.9)
    # smoothed: ..., 1.0 (4), 0.5 (5), 0.0 (6), 0.25 (7), 0.75 (8), 1.0 (9), 1.0 (10)
    assert result["pre_shift_reward"] == 1.0 and result["threshold"] == pytest.approx(0.9)
    assert result["dip_step"] == 5 and result["min_smoothed"] == 0.0
    assert result["recovered_step"] == 9 and result["steps_to_recover"] == 5
    never = recovery(rewards[:9], window=2, shift=4, end=9, pre_window=4, fraction=0.9)
    assert never["dip_step"] == 5 and never["recovered_step"] is None and never["steps_to_recover"] is None
    flat = recovery([0.5] * 8, window=2, shift=4, end=8, pre_window=4, fraction=0.9)
    assert flat["dip_step"] is None and flat["steps_to_recover"] == 0
    assert measurable(flat, min_pre=0.1)["measurable"] and measurable(flat, min_pre=0.1)["steps_to_recover"] == 0
    collapsed = measurable(recovery([0.05] * 8, window=2, shift=4, end=8, pre_window=4, fraction=0.9), min_pre=0.1)
    assert not collapsed["measurable"] and collapsed["steps_to_recover"] is None  # nothing to recover to


def test_target_needs_sao_strictly_faster_than_every_baseline_after_every_shift():
    def runs(sao, mean, group):
        return {m: {"recovery": [{"steps_to_recover": v} for v in values]}
                for m, values in (("sao", sao), ("running_mean", mean), ("grpo_dis", group))}

    assert target_met(runs([10, 20], [11, 30], [None, 21])) is True
    assert target_met(runs([10, 20], [10, 30], [50, 50])) is False  # a tie is not fewer
    assert target_met(runs([None, 20], [None, 30], [None, 40])) is False  # SAO must recover
    assert target_met({"sao": runs([1], [2], [3])["sao"]}) is None


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_compares_the_three_methods(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    argv = ["--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            "--results-md", str(results_md)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "out" / "online.json").read_text())
    steps, shifts = data["settings"]["steps"], data["settings"]["shifts"]
    assert set(data["methods"]) == set(METHODS)
    for method, run in data["methods"].items():
        assert run["steps"] == steps == len(run["rewards"]) == len(run["smoothed"])
        assert [m["step"] for m in run["metrics"]] == list(range(steps))
        assert all(0.0 <= r <= 1.0 for r in run["rewards"])
        assert run["rewards"] == [m["batch/reward_mean"] for m in run["metrics"]]
        assert all(m["batch/trajectories"] == data["settings"]["batch"] for m in run["metrics"])
        assert [r["shift"] for r in run["recovery"]] == shifts
        for rec in run["recovery"]:
            assert 0.0 <= rec["pre_shift_reward"] <= 1.0
            if rec["steps_to_recover"] is not None:
                assert 0 <= rec["steps_to_recover"] < steps - rec["shift"]
        assert run["trajectories_generated"] >= steps * data["settings"]["batch"]
        shares = run["styles"]["shares"]
        assert shares and all(sum(s.values()) == pytest.approx(1.0) for s in shares.values())
        assert ("critic/loss" in run["metrics"][0]) == (method == "sao")
    groups = data["methods"]["grpo_dis"]["groups"]
    assert groups["rows"] == steps * data["settings"]["batch"] and groups["batches"] == steps
    assert data["target_met"] is target_met(data["methods"])  # the verdict is the written figures'
    assert data["target_met"] is not None  # all three methods ran
    for figure in ("online.png", "online-styles.png"):
        assert (tmp_path / "out" / figure).stat().st_size > 10_000
    text = results_md.read_text()
    assert "<!-- online:begin -->" in text and "steps to recover" in text
