"""The quality benchmark runs end to end (``--quick``): four arms, their curves, the equal-wall-time
versions, the PPO arm's recomputed ratios, a figure, and nothing written under docs/."""

from __future__ import annotations

import json

import pytest

from benchmarks.quality import main


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_every_arm(tmp_path):
    assert main(["--quick", "--workdir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "quality-quick.json").read_text())
    assert set(data["summary"]) == {"sao", "grpo", "grpo_dis", "ppo_async"}
    runs = {r["arm"]: r for r in data["runs"]}
    assert set(runs) == set(data["summary"]) and all(r["seed"] == 0 for r in data["runs"])
    for arm, run in runs.items():
        assert run["steps"] == 2 and [s["step"] for s in run["step_rows"]] == [0, 1]
        elapsed = [s["elapsed_s"] for s in run["step_rows"]]
        assert 0 < elapsed[0] <= elapsed[1] == run["wall_s"]
        assert run["trajectories_stored"] >= 2 * 4
        assert [e["version"] for e in run["curve"]] == [0, 1, 2]
        assert all(0.0 <= e["accuracy"] <= 1.0 and e["num_tasks"] == 8 for e in run["curve"])
        assert run["final"]["version"] == 2
        # the version at T was committed by T, and T is the shortest run's wall time
        assert run["at_t"]["elapsed_s"] <= data["t_equal"] + 1e-6
        assert run["settings"]["algorithm"]["name"] == arm
    assert data["t_equal"] == min(r["wall_s"] for r in data["runs"])
    assert runs["grpo"]["settings"]["train"]["synchronous"] is True
    assert all(s["metrics"]["batch/staleness_max"] == 0 for s in runs["grpo"]["step_rows"])
    # version 0 is the same SFT policy for every arm of a seed: one evaluation, the same figure
    assert len({json.dumps(r["curve"][0], sort_keys=True) for r in data["runs"]}) == 1
    ratios = runs["ppo_async"]["ratios"]
    assert [r["step"] for r in ratios] == [0, 1]
    assert ratios[0]["by_staleness"].keys() == {"0"}  # step 0 trains on version 0's own rollouts
    assert ratios[0]["outside_clip"] == 0.0 and ratios[0]["abs_log_rho"] < 1e-4
    # the DIS interval (0.7, 6) holds the clip range (0.8, 1.2): what DIS drops, PPO's range leaves too
    assert all(0.0 <= r["outside_dis"] <= r["outside_clip"] <= 1.0 for r in ratios)
    assert set(data["paired"]) >= {"sao-grpo@final", "sao-grpo@t"}
    assert (tmp_path / "quality-quick.png").stat().st_size > 0
    assert "<!-- quality:begin -->" in (tmp_path / "RESULTS.md").read_text()
