"""The demo benchmark: a quick variant of the demo run as a newcomer runs it, in an empty folder, its
recorded result read back and reported; nothing written under docs/."""

from __future__ import annotations

import json

import pytest

from benchmarks.demo import _failures, main, run_demo, summarise


def test_a_folder_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(RuntimeError, match="is not empty"):
        run_demo(tmp_path, [])


def test_the_targets_figures_are_medians_over_the_runs():
    runs = [{"wall_s": w, "result": {"accuracy_before": b, "accuracy_after": a}}
            for w, b, a in ((300.0, 0.4, 0.7), (360.0, 0.5, 0.7), (330.0, 0.45, 0.75))]
    summary = summarise(runs)
    assert summary["accuracy_after"] == {"median": 0.7, "min": 0.7, "max": 0.75}
    assert summary["rise"] == pytest.approx({"median": 0.3, "min": 0.2, "max": 0.3})
    assert summary["wall_s"] == {"median": 330.0, "min": 300.0, "max": 360.0}


def test_failures_are_shown_as_shares_of_the_tasks_and_their_absence_said():
    result = {"eval_tasks": 200, "failures_after": {"tool_call": 30, "answer": 5, "structure": 1}}
    assert _failures(result) == "15.0% / 2.5% / 0.5%"
    assert _failures({"eval_tasks": 200}) == "not recorded"


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_the_demo_runs_recorded_result(tmp_path):
    out, md = tmp_path / "demo.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--quick", "--workdir", str(tmp_path / "work"), "--out-json", str(out), "--results-md", str(md)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    result = run["result"]
    assert result["steps"] == 2 and result["eval_tasks"] == 8 and result["settings"]["train"]["steps"] == 2
    assert 0.0 <= result["accuracy_after"] <= 1.0 and run["wall_s"] > result["train_wall_s"] > 0
    assert data["summary"]["accuracy_after"]["median"] == result["accuracy_after"]
    assert data["demo_command"].startswith("sao train --config configs/demo.yaml --set train.steps=2")
    assert "| held-out accuracy after training > 0.8 |" in md.read_text()
