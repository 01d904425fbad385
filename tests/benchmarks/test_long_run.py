"""The long-run benchmark: the real training loop against a producer process, its windows and parts."""

from __future__ import annotations

import json

import pytest

from benchmarks.long_run import PARTS, flat_windows, main, summarise


def test_windows_are_five_to_fifteen_percent_and_the_last_ten():
    assert flat_windows(1000) == {"early": (50, 150), "late": (900, 1000)}
    assert flat_windows(20) == {"early": (1, 3), "late": (18, 20)}


def test_summary_of_hand_worked_periods():
    run = {"periods": [1.0] * 18 + [2.0, 4.0], "commits_per_step": 1, "writer_commit_s": [0.1] * 20,
           "timings": [{"wait_read_s": 0.5, "update_s": 0.25}] * 20, "trajectories_files": 3,
           "trajectories_versions": 21, "train_steps_versions": 21}
    summary = summarise(run, 20)
    assert summary["early"]["period_s"] == 1.0 and summary["late"]["period_s"] == 3.0
    assert summary["ratio"] == 3.0 and summary["update_ratio"] == 1.0
    assert summary["late"]["rest_s"] == pytest.approx(3.0 - 0.75)
    assert summary["early"]["read_s"] == 0.0  # a part a step did not time counts as 0


def test_a_short_run_trains_every_step_and_writes_its_figures(tmp_path):
    out, results = tmp_path / "long_run.json", tmp_path / "RESULTS.md"
    assert main(["--steps", "20", "--runs", "1", "--out", str(out), "--results-md", str(results)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert data["steps"] == 20 and data["batch_size"] == 8 and data["commits_per_step"] == 4
    assert run["trajectories_files"] >= 1 and run["train_steps_versions"] >= 21  # every step committed
    assert all(run[w]["period_s"] > 0 and set(PARTS) <= set(run[w]) for w in ("early", "late"))
    assert all(run[w]["writer_commit_s"] > 0 for w in ("early", "late"))  # every commit's time came back
    assert data["ratio"]["median"] == run["ratio"] and data["machine"]["commit"]
    assert data["update_ratio"]["median"] == run["update_ratio"] > 0
    assert "sao bench longrun" in results.read_text()
