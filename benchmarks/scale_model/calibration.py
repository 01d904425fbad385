"""This machine as a :class:`Scenario`, and its full-speed costs fitted to one real run.

The component figures come from the benchmarks' results (``rollout.json``: the replica's tokens/s at
each concurrency; ``lake.json``: a writer commit's cost), the trajectory shape and tool latency from the
calibration run; :func:`calibrate` then scales the per-turn cost and the update's work until the model
reproduces that run's in-situ stage timings.
"""

from __future__ import annotations

import json

import numpy as np

from benchmarks.scale_model.measurement import RunMeasurement
from benchmarks.scale_model.paths import RESULTS_DIR
from benchmarks.scale_model.scenario import Scenario
from benchmarks.scale_model.simulator import Simulation

__all__ = ["DRIVER_LOAD_CORES", "calibrate", "here_scenario"]

# A development estimate, no result file behind it: the calling process's Serve handle and router and the
# replica's request handling keep about 0.4 of a core busy while rollouts run (docs/HISTORY.md, "How the
# rollout target was met", has the per-thread profile it came from: 0.28 and 0.26 of a core at 64 requests).
DRIVER_LOAD_CORES = 0.4


def _rollout_curve() -> tuple[tuple[float, float], ...]:
    data = json.loads((RESULTS_DIR / "rollout.json").read_text())
    return tuple(sorted((float(c), float(v["tokens_s"])) for c, v in data["serve"].items()))


def _lake_commit() -> tuple[float, float]:
    """(fixed seconds, seconds per stored token) of one writer commit, fitted to ``sao bench lake``."""
    data = json.loads((RESULTS_DIR / "lake.json").read_text())
    tokens = data["tokens"] + data["prompt_tokens"]
    x = np.array([row["batch"] * tokens for row in data["ingest"]], dtype=float)
    y = np.array([row["ms_per_commit"] / 1000 for row in data["ingest"]])
    slope, intercept = np.polyfit(x, y, 1)
    return float(max(intercept, 1e-3)), float(max(slope, 0.0))


def here_scenario(calibration: RunMeasurement, replicas: int, batch: int, max_in_flight: int, *,
                  turn_overhead_s: float, update_full_s: float, steps: int = 40, name: str | None = None
                  ) -> Scenario:
    """This machine (2 shared cores): component figures from the benchmark results and from the
    calibration run's trajectories (shape, tool latency); full-speed costs from :func:`calibrate`."""
    commit_s, commit_per_token = _lake_commit()
    per_token = update_full_s / (calibration.batch * calibration.context_tokens)
    return Scenario(
        name=name or f"here-r{replicas}-b{batch}", replicas=replicas, max_in_flight=max_in_flight,
        rate_curve=_rollout_curve(), turn_overhead_s=turn_overhead_s, tokens_per_turn=calibration.tokens_per_turn,
        context_tokens=calibration.context_tokens, turns=max(1, round(calibration.turns)),
        tool_median_s=calibration.tool_median_s, tool_sigma=calibration.tool_sigma,
        # The pipeline's writer flushes at 16 rows, after 1 s, or as soon as the rows a waiting trainer
        # needs are in (TrajectoryWriter.demand); the simulator has no demand, and a 0.25 s age flush
        # stands in for it.
        flush_rows=16, flush_seconds=0.25, commit_s=commit_s, commit_s_per_token=commit_per_token,
        batch=batch, max_staleness=2, read_s=calibration.wait_read_s, step_s=0.0, step_s_per_token=per_token,
        # The trainer is blocked, without using a core, for the step's commit (checkpoint, rows) and what
        # follows it (publication, the Ray Train report): measured per step in the calibration run.
        params=625_408, publish_put_s_per_param=(calibration.commit_s + calibration.trainer_gap_s) / 625_408,
        broadcast_s=0.03,
        shared_cores=2.0, driver_load=DRIVER_LOAD_CORES, steps=steps, warmup_steps=5,
    )


def calibrate(calibration: RunMeasurement, iterations: int = 6) -> dict[str, float]:
    """Full-speed costs from the calibration run's in-situ stage timings, which ran on shared cores:
    the per-turn fixed cost and the update's work are scaled until the model, run at the calibration
    run's configuration, reproduces its mean generation time per turn and its mean update time. The
    run's throughput is not used."""
    overhead, update = 0.5 * calibration.generation_s_per_turn, calibration.update_s
    for _ in range(iterations):
        sim = Simulation(here_scenario(calibration, calibration.replicas, calibration.batch, calibration.max_in_flight,
                                       turn_overhead_s=overhead, update_full_s=update, steps=25))
        sim.run()
        overhead *= calibration.generation_s_per_turn / (sim.turn_time / max(sim.turns_done, 1))
        update *= calibration.update_s / (sim.update_time / max(sim.updates_done, 1))
    return {"turn_overhead_s": overhead, "update_full_s": update}

