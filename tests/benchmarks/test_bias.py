"""The bias benchmark's analysis, worked by hand on a small run, and a quick end-to-end run."""

from __future__ import annotations

import json

import pytest

from benchmarks.bias import analyse, length_label, main


def test_length_labels_are_the_trainers_buckets():
    assert [length_label(n) for n in (0, 16, 17, 64, 65, 5000)] == ["le_16", "le_16", "le_32", "le_64", "le_128",
                                                                    "gt_4096"]


def test_analysis_worked_by_hand():
    trajectories = [
        {"trajectory_id": "a", "num_action_tokens": 10, "num_turns": 1, "min_policy_version": 0},
        {"trajectory_id": "b", "num_action_tokens": 10, "num_turns": 1, "min_policy_version": 1},
        {"trajectory_id": "c", "num_action_tokens": 30, "num_turns": 2, "min_policy_version": 0},
        {"trajectory_id": "d", "num_action_tokens": 30, "num_turns": 2, "min_policy_version": 0},  # never trained
    ]
    steps = [
        {"trajectory_ids": ["a", "b"], "policy_version_before": 1,
         "metrics": {"actor/kept_frac/length_le_16": 1.0, "actor/kept_frac/staleness_1": 1.0,
                     "actor/kept_frac/staleness_0": 1.0}},
        {"trajectory_ids": ["c"], "policy_version_before": 2,
         "metrics": {"actor/kept_frac/length_le_32": 0.5, "actor/kept_frac/staleness_2": 0.5}},
    ]
    r = analyse(trajectories, steps)
    assert r["length_labels"] == ["le_16", "le_32"]
    assert r["generated_by_length"] == {"le_16": 2, "le_32": 2}
    assert r["trained_by_length"] == {"le_16": 2, "le_32": 1} and r["never_trained_by_length"] == {"le_32": 1}
    assert r["staleness_mean_by_length"] == {"le_16": 0.5, "le_32": 2.0}  # a: 1, b: 0; c: 2
    # tokens generated 10+10+30+30 = 80; trained 10+10+30 = 50; kept 10+10+15 = 35
    assert r["generated_tokens_share_by_length"] == pytest.approx({"le_16": 20 / 80, "le_32": 60 / 80})
    assert r["trained_tokens_share_by_length"] == pytest.approx({"le_16": 20 / 50, "le_32": 30 / 50})
    assert r["gradient_tokens_share_by_length"] == pytest.approx({"le_16": 20 / 35, "le_32": 15 / 35})
    assert r["kept_frac_by_length"] == pytest.approx({"le_16": 1.0, "le_32": 0.5})
    assert r["kept_frac_by_staleness"] == pytest.approx({"0": 1.0, "1": 1.0, "2": 0.5})
    assert r["tokens_by_staleness"] == {"0": 10, "1": 10, "2": 30}
    assert r["gradient_share_by_turns"] == pytest.approx({"1": 20 / 35, "2": 15 / 35})
    assert r["generated"] == 4 and r["trained"] == 3


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_the_bias(tmp_path, ray_session):
    out = tmp_path / "out"
    assert main(["--quick", "--workdir", str(tmp_path / "work"), "--out", str(out),
                 "--results-md", str(tmp_path / "RESULTS.md")]) == 0
    data = json.loads((out / "bias.json").read_text())
    r = data["result"]
    assert r["trained"] == 3 * 4 and r["generated"] >= r["trained"]
    assert sum(r["trained_by_length"].values()) == r["trained"]
    assert all(0.0 <= v <= 1.0 for v in r["kept_frac_by_staleness"].values())
    assert sum(r["gradient_tokens_share_by_length"].values()) == pytest.approx(1.0)
    assert data["findings"] and (out / "bias.png").stat().st_size > 0
    assert not (tmp_path / "RESULTS.md").exists()
