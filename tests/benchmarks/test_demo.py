"""The demo benchmark: a quick variant of the demo run as a newcomer runs it, in an empty folder, its
recorded result read back and reported; nothing written under docs/."""

from __future__ import annotations

import json

import pytest

from benchmarks.demo import main, run_demo


def test_a_folder_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(RuntimeError, match="is not empty"):
        run_demo(tmp_path, [])


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_the_demo_runs_recorded_result(tmp_path):
    out, md = tmp_path / "demo.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--quick", "--workdir", str(tmp_path / "work"), "--out-json", str(out), "--results-md", str(md)]) == 0
    data = json.loads(out.read_text())
    result = data["result"]
    assert result["steps"] == 2 and result["eval_tasks"] == 8 and result["settings"]["train"]["steps"] == 2
    assert 0.0 <= result["accuracy_after"] <= 1.0 and data["wall_s"] > result["train_wall_s"] > 0
    assert data["demo_command"].startswith("sao train --config configs/demo.yaml --set train.steps=2")
    assert "| held-out accuracy after training |" in md.read_text()
