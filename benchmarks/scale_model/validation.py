"""The model against the real pipeline: calibrated on one measured run, it predicts the others."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from benchmarks.scale_model.calibration import calibrate, here_scenario
from benchmarks.scale_model.measurement import RunMeasurement
from benchmarks.scale_model.simulator import simulate

__all__ = ["validate"]


def validate(measured: Sequence[RunMeasurement]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Calibrate on the first run's stage timings, predict every run's throughput. The first run's own
    prediction reproduces it nearly by construction (its read-and-wait stage is derived from its step
    period); the others are the test: other replica counts and batch sizes."""
    calibration = measured[0]
    fitted = calibrate(calibration)
    rows = []
    for run in measured:
        predicted = simulate(here_scenario(calibration, run.replicas, run.batch, run.max_in_flight, **fitted,
                                           steps=40))
        rows.append({"run_id": run.run_id, "replicas": run.replicas, "batch": run.batch,
                     "measured_trajectories_per_s": run.trajectories_per_s,
                     "predicted_trajectories_per_s": predicted.trajectories_per_s,
                     "error": predicted.trajectories_per_s / run.trajectories_per_s - 1.0,
                     "predicted_bottleneck": predicted.bottleneck, "calibration_run": run is calibration,
                     "measured": dataclasses.asdict(run) | {"wait_read_s": run.wait_read_s}})
    return fitted, rows
