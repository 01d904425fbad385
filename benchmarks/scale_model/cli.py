"""The command ``sao bench scale``: the model re-run on the validation runs and on the data-centre grid.

It writes ``docs/results/scale.json`` (``--results-dir``), the ``scale`` section of ``docs/RESULTS.md``
and the predictions section of ``docs/SCALING.md`` (see :mod:`.report`). ``--validate`` first runs the
real pipeline here (:mod:`.validation_runs`); without it, the runs a previous ``--validate`` measured
(stored in ``scale.json``) are compared again with the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._report import machine, update_section, write_json
from benchmarks.scale_model.datacentre import datacentre_grid
from benchmarks.scale_model.hardware import Hardware
from benchmarks.scale_model.measurement import RunMeasurement
from benchmarks.scale_model.paths import RESULTS_DIR, ROOT
from benchmarks.scale_model.report import results_markdown, scaling_markdown
from benchmarks.scale_model.scenario import Prediction, Scenario
from benchmarks.scale_model.simulator import simulate
from benchmarks.scale_model.validation import validate
from benchmarks.scale_model.validation_runs import VALIDATION_CONFIGS, run_validation

__all__ = ["main"]

DESCRIPTION = "A discrete-event model of the pipeline, calibrated here, extrapolated to data-centre sizes."


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench scale", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="two data-centre scenarios, short runs (a smoke test)")
    parser.add_argument("--validate", action="store_true",
                        help="run the real pipeline here at (replicas, batch) = " + ", ".join(
                            f"({r}, {b})" for r, b in VALIDATION_CONFIGS) + " and compare (about 4-6 minutes)")
    parser.add_argument("--steps", type=int, default=16, help="trainer steps of each validation run")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where scale.json goes")
    parser.add_argument("--results-md", type=Path, default=ROOT / "docs" / "RESULTS.md",
                        help="the results file whose `scale` section is replaced")
    parser.add_argument("--scaling-md", type=Path, default=ROOT / "docs" / "SCALING.md",
                        help="the document whose predictions section is replaced")
    return parser.parse_args(list(argv))


def _prediction_row(sc: Scenario, p: Prediction) -> dict[str, Any]:
    return {"scenario": sc.name, "params": sc.params, "replicas": sc.replicas, "batch": sc.batch,
            "context_tokens": sc.context_tokens, "max_in_flight": sc.max_in_flight, "flush_rows": sc.flush_rows,
            "broadcast_s": sc.broadcast_s, **dataclasses.asdict(p)}


def _previous_validation(path: Path) -> tuple[list[RunMeasurement], str] | None:
    """The runs a previous ``--validate`` measured, and its command (the model is re-run on them)."""
    if not path.exists():
        return None
    stored = json.loads(path.read_text()).get("validation", {})
    if not stored.get("rows"):
        return None
    fields = {f.name for f in dataclasses.fields(RunMeasurement)}
    runs = [RunMeasurement(**{k: v for k, v in row["measured"].items() if k in fields}) for row in stored["rows"]]
    return runs, stored.get("measured_by", "sao bench scale --validate")


def _validation(args: argparse.Namespace, json_path: Path, command: str) -> dict[str, Any] | None:
    """``scale.json``'s ``validation``: runs measured now (``--validate``) or by a previous
    ``--validate``, against the model calibrated on the first; None when there are none."""
    measured: list[RunMeasurement] | None = None
    measured_by = command
    if args.validate:
        with tempfile.TemporaryDirectory(prefix="sao-bench-scale-") as workdir:
            measured = run_validation(Path(workdir), VALIDATION_CONFIGS, args.steps)
    elif previous := _previous_validation(json_path) or _previous_validation(RESULTS_DIR / "scale.json"):
        measured, measured_by = previous
    if not measured:
        return None
    fitted, rows = validate(measured)
    for row in rows:
        print(f"{row['run_id']}: measured {row['measured_trajectories_per_s']:.2f} traj/s, predicted "
              f"{row['predicted_trajectories_per_s']:.2f} ({row['error'] * 100:+.0f}%)", file=sys.stderr)
    return {"calibration": fitted, "rows": rows, "measured_by": measured_by}


def _datacentre(quick: bool) -> list[dict[str, Any]]:
    """``scale.json``'s ``datacentre``: one row per scenario of the grid."""
    rows = []
    for sc in datacentre_grid(quick=quick):
        prediction = simulate(sc)
        rows.append(_prediction_row(sc, prediction))
        print(f"{sc.name}: {prediction.trajectories_per_s:,.1f} traj/s, bottleneck {prediction.bottleneck}",
              file=sys.stderr)
    return rows


def main(argv: Sequence[str]) -> int:
    """``sao bench scale [ARGS]``: write ``scale.json`` and the two documents' sections."""
    args = _parse(argv)
    json_path = args.results_dir / "scale.json"
    data: dict[str, Any] = {"command": " ".join(["sao bench scale", *argv]), "machine": machine(),
                            "hardware_assumed": dataclasses.asdict(Hardware())}
    if validation := _validation(args, json_path, data["command"]):
        data["validation"] = validation
    data["datacentre"] = _datacentre(args.quick)
    write_json(json_path, data)
    update_section(args.results_md, "scale", results_markdown(data))
    if args.scaling_md.exists():
        update_section(args.scaling_md, "scaling-predictions", scaling_markdown(data))
    return 0
