"""The trajectory lake: Delta tables for trajectories, quarantine, policy versions and train steps.

Public API (what the rollout and trainer code use):

- :class:`Lake` (``Lake.open(LakeConfig(root=...))``): the tables under one root, local or ``s3://``.
- :class:`TrajectoryRecord` (+ :class:`Segment`, :class:`RecordedSampling`, :class:`Timings`): what a
  rollout worker builds; :class:`TrajectoryWriter` stores them (batched, validated, exactly once).
- :class:`TrajectoryReader`: the trainer's next micro-batch; :func:`record_train_step` records the
  step in ``train_steps``, which marks its rows consumed, and then ``reader.consumed(ids)`` forgets them.
- :func:`register_policy_version`, :func:`newest_policy_version`: the checkpoint registry.
- :func:`read_trajectories`, :func:`read_step_trajectories`: pinned snapshots and replay input.
- :class:`IssueLog`: the driver's record of every launched rollout (``rollout_tasks``).
- The run audit (``sao lake check``) reads these tables from above the lake: :mod:`sao.audit`.
- :func:`run_sql`: read-only SQL; :func:`compact`, :func:`vacuum`: maintenance.
"""

from __future__ import annotations

from sao.lake.commit import CommitConflictError, CommitResult
from sao.lake.config import CommitConfig, LakeConfig, MaintenanceConfig, WriterConfig
from sao.lake.issued import IssuedRollout, IssueLog
from sao.lake.ledger import (
    ConsumptionError,
    LedgerError,
    consumed_ids,
    newest_policy_version,
    protected_versions,
    record_train_step,
    register_policy_version,
)
from sao.lake.maintenance import CompactReport, MaintenanceError, VacuumReport, compact, vacuum
from sao.lake.reader import (
    MicroBatch,
    TrajectoryReader,
    read_step_trajectories,
    read_trajectories,
    select_unconsumed,
)
from sao.lake.records import (
    PolicyVersionRecord,
    RecordedSampling,
    RecordTypeError,
    Segment,
    Timings,
    TrainStepRecord,
    TrajectoryRecord,
    utc_now,
)
from sao.lake.sql import ReadOnlyQueryError, run_sql
from sao.lake.store import Lake, LakeError, LakeNotFoundError, SchemaMismatchError
from sao.lake.validate import Rule, Violation
from sao.lake.writer import FlushReport, TrajectoryWriter, WriterClosedError, WriterStats
from schemas.trajectories import LogprobKind, SegmentKind, TerminationReason

__all__ = [
    "CommitConfig",
    "CommitConflictError",
    "CommitResult",
    "CompactReport",
    "ConsumptionError",
    "FlushReport",
    "IssueLog",
    "IssuedRollout",
    "Lake",
    "LakeConfig",
    "LakeError",
    "LakeNotFoundError",
    "LedgerError",
    "LogprobKind",
    "MaintenanceConfig",
    "MaintenanceError",
    "MicroBatch",
    "PolicyVersionRecord",
    "ReadOnlyQueryError",
    "RecordTypeError",
    "RecordedSampling",
    "Rule",
    "SchemaMismatchError",
    "Segment",
    "SegmentKind",
    "TerminationReason",
    "Timings",
    "TrainStepRecord",
    "TrajectoryReader",
    "TrajectoryRecord",
    "TrajectoryWriter",
    "VacuumReport",
    "Violation",
    "WriterClosedError",
    "WriterConfig",
    "WriterStats",
    "compact",
    "consumed_ids",
    "newest_policy_version",
    "protected_versions",
    "read_step_trajectories",
    "read_trajectories",
    "record_train_step",
    "register_policy_version",
    "run_sql",
    "select_unconsumed",
    "utc_now",
    "vacuum",
]
