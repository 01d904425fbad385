"""The routing-replay benchmark runs end to end (``--quick``): both arms, the routing metrics of every
step, a figure, and nothing written under docs/."""

from __future__ import annotations

import json

from benchmarks.routing import main


def test_quick_run_reports_both_arms(tmp_path):
    assert main(["--quick", "--workdir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "routing-quick.json").read_text())
    assert set(data["arms"]) == {"replay", "live routing"}
    for label, steps in data["arms"].items():
        assert [s["step"] for s in steps] == [0.0, 1.0, 2.0]
        assert all(s["routing/replay"] == float(label == "replay") for s in steps)
        assert all(0.0 <= s["routing/disagree_frac"] <= 1.0 for s in steps)
        assert steps[0]["routing/disagree_frac"] == 0.0  # step 0 trains on version 0's own routing
        assert all("routing/disagree_frac/layer_1" in s and "routing/kept_frac_live" in s for s in steps)
    assert (tmp_path / "routing-quick.png").stat().st_size > 0
