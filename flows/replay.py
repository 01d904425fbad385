"""Prefect flow ``replay``: re-run recorded training steps on the frozen snapshots they read.

Calls :func:`sao.train.replay.replay_steps` (what ``sao replay --run R --steps N:M`` runs) and shows a
table artifact with one row per step: weights hash recomputed vs recorded, metrics equal. A replay
that disagrees fails the flow run after publishing the table, so the UI shows it red; a replay that
cannot start (unknown run or step, no checkpoint) fails with the reason. Replay only reads the lake
and the checkpoints, so its task may be retried (an object store that hiccups).

With ``overrides``, a what-if replay (``sao replay --set``): the same steps re-run on their data with
changed update settings, recorded and re-run metrics side by side in a table artifact.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact

from flows.train import artifact_key
from sao import runs
from sao.config import RunConfig
from sao.lake.config import LakeConfig
from sao.lake.store import Lake
from sao.train.replay import (
    WHAT_IF_METRICS,
    RowSource,
    StepReplayReport,
    WhatIfReport,
    replay_steps,
)

_DEFAULTS = RunConfig()


class ReplayMismatchError(RuntimeError):
    """A replayed step did not reproduce the recorded weights or metrics."""


@task(name="replay-steps", retries=1, retry_delay_seconds=5)
def replay_task(lake_root: str, run_id: str, first: int, last: int, checkpoint_root: str | None,
                metric_tolerance: float) -> StepReplayReport:
    """Replay steps ``first`` .. ``last`` (reads only: safe to retry)."""
    lake = Lake.open(LakeConfig(root=lake_root), create=False)
    return replay_steps(lake, run_id, first, last, checkpoint_root=checkpoint_root, source=RowSource.LAKE,
                        metric_tolerance=metric_tolerance)


def _rows(report: StepReplayReport) -> list[dict]:
    return [{"step": s.step, "versions": f"{s.policy_version_before}->{s.policy_version_after}",
             "snapshot": s.trajectories_version, "trajectories": s.num_trajectories,
             "weights": "match" if s.hash_ok else "MISMATCH", "metrics equal":
             f"{s.metrics_compared - len(s.metric_mismatches)}/{s.metrics_compared}",
             "lead-in": s.lead_in, "seconds": round(s.seconds, 2)} for s in report.steps]


@task(name="what-if-steps")
def what_if_task(lake_root: str, run_id: str, first: int, last: int, overrides: dict, as_run_id: str | None,
                 checkpoint_root: str | None) -> tuple[WhatIfReport, str]:
    """Re-run steps ``first`` .. ``last`` with changed settings; records the what-if run (not retried)."""
    lake = Lake.open(LakeConfig(root=lake_root), create=False)
    return runs.what_if(lake, run_id, first, last, overrides, as_run=as_run_id, checkpoint_root=checkpoint_root)


@flow(name="replay", log_prints=True)
def replay(
    run_id: str = _DEFAULTS.run_id,
    step: int = 0,
    last_step: int | None = None,
    lake_root: str = _DEFAULTS.lake.root,
    checkpoint_root: str | None = None,
    metric_tolerance: float = 0.0,
    overrides: dict[str, Any] | None = None,
    as_run_id: str | None = None,
) -> dict:
    """Replay steps ``step`` .. ``last_step`` (default: ``step`` alone) of ``run_id`` and compare them
    with what was recorded (bit for bit on CPU when ``metric_tolerance`` is 0). With ``overrides``
    (``{"algorithm.eps_high": 4.0}``: run-config keys of the algorithm section), a what-if replay: the
    same frozen data re-run with those settings, recorded and re-run metrics side by side, recorded in
    the lake's ``runs`` table as run ``as_run_id``."""
    last = step if last_step is None else last_step
    if as_run_id and not overrides:
        raise ValueError("as_run_id names the run a what-if replay is recorded under: it goes with overrides")
    if overrides and metric_tolerance:
        raise ValueError("metric_tolerance is for a replay without overrides: a what-if replay shows the recorded "
                         "and the re-run metrics side by side and compares nothing")
    if overrides:
        report, new_run = what_if_task(lake_root, run_id, step, last, overrides, as_run_id, checkpoint_root)
        rows = [{"step": s.step, "metric": name, "recorded": s.recorded.get(name), "re-run": s.rerun.get(name)}
                for s in report.steps for name in WHAT_IF_METRICS if name in s.recorded or name in s.rerun]
        rows += [{"step": s.step, "metric": "weight distance from the recorded", "recorded": 0.0,
                  "re-run": s.weight_distance} for s in report.steps]
        create_table_artifact(rows, key=artifact_key(new_run, "what-if"),
                              description=f"what-if replay of run {run_id} steps {step}..{last} with {overrides}")
        return report.to_dict() | {"as_run": new_run}
    report = replay_task(lake_root, run_id, step, last, checkpoint_root, metric_tolerance)
    create_table_artifact(_rows(report), key=artifact_key(run_id, f"replay-{step}-{last}"),
                          description=f"replay of steps {step}..{last} of run {run_id} from the checkpoint "
                                      f"of version {report.start_version}")
    get_run_logger().info("replay of run %s steps %d..%d: %s", run_id, step, last,
                          "every step matches" if report.ok else "MISMATCH")
    if not report.ok:
        bad = [s.step for s in report.steps if not s.ok]
        start = "" if report.start_ok else f"the start checkpoint (version {report.start_version}) differs; "
        raise ReplayMismatchError(f"run {run_id!r}: {start}steps {bad} did not reproduce (see the table artifact)")
    return report.to_dict()
