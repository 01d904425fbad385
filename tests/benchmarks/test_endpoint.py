"""The endpoint benchmark runs end to end (``--quick``): both arms on one engine, every level measured,
the ratio of each pair computed, and nothing written under docs/."""

from __future__ import annotations

import json

import pytest

from benchmarks.endpoint import main


@pytest.mark.slow
def test_quick_run_measures_both_arms(tmp_path):
    out, md = tmp_path / "endpoint.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--quick", "--out-json", str(out), "--results-md", str(md)]) == 0
    data = json.loads(out.read_text())
    point = data["levels"]["4"]
    assert all(point[arm]["median"] > 0 for arm in ("direct", "endpoint", "loop", "env_agent"))
    assert point["env_agent_ratio"]["runs"] == [e / d for d, e in zip(point["loop"]["runs"],
                                                                      point["env_agent"]["runs"], strict=True)]
    assert point["ratio"]["runs"] == [e / d for d, e in zip(point["direct"]["runs"], point["endpoint"]["runs"],
                                                            strict=True)]
    assert "chat endpoint's cost" in md.read_text() and "not measured" in md.read_text()
