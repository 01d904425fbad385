"""Compaction and vacuum, with every snapshot a recorded step read kept replayable.

Compaction rewrites the many small files of batched appends into a few large ones (within each
partition, keeping their order, so ``ingest_seq`` statistics still prune). It is a new Delta version;
older versions still point at the small files, which become tombstones. The trainer compacts its run
(:func:`compact_run`: the ledger, ``train_steps`` and ``policy_versions``, and the run's partition of
``trajectories`` and ``rollout_tasks``) itself every ``TrainConfig.compact_every`` steps, while the
rollouts go on appending: every read, refresh and commit of a Delta table costs in proportion to the
files it holds (its log state), so without it a run's steps slow down in proportion to its length;
``sao lake compact`` does every table on demand.

Vacuum deletes tombstoned files older than the retention, and files no commit ever referenced (left
by commits that lost a race). Replay of a step reads ``trajectories`` at the version the step recorded,
so vacuum is told to keep the files of every ``trajectories`` version listed in ``train_steps``
(delta-rs ``keep_versions``), whatever the retention. Two more guards:

- a retention shorter than ``MaintenanceConfig.min_retention_hours`` is refused unless forced: it could
  delete a data file that a writer has written but not yet committed, or one that a trainer is reading
  for a step it has not recorded yet;
- the Delta log itself is never expired (see ``sao.lake.store.TABLE_CONFIGURATION``), so old versions
  stay loadable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from deltalake.exceptions import CommitFailedError

from sao.lake.config import MaintenanceConfig
from sao.lake.ledger import protected_versions
from sao.lake.store import Lake, LakeError
from schemas import TABLES, table_spec, trajectories

log = logging.getLogger(__name__)

__all__ = ["LEDGER_TABLES", "RUN_TABLES", "CompactReport", "MaintenanceError", "VacuumReport", "compact",
           "compact_ledger", "compact_run", "vacuum"]


class MaintenanceError(LakeError):
    """A maintenance request that would break replay or a concurrent writer."""


@dataclass(frozen=True)
class CompactReport:
    """One table's compaction: files before/after and the versions around it."""

    table: str
    files_removed: int
    files_added: int
    version_before: int
    version_after: int


@dataclass(frozen=True)
class VacuumReport:
    """One table's vacuum.

    Attributes:
        removed: paths deleted (or that would be, on a dry run).
        kept_versions: versions whose files were protected (``trajectories`` only).
        retention_hours: the retention used.
    """

    table: str
    removed: tuple[str, ...]
    kept_versions: tuple[int, ...]
    retention_hours: int
    dry_run: bool


def _tables(names: Sequence[str] | None) -> list[str]:
    return [table_spec(n).name for n in names] if names else list(TABLES)


def compact(
    lake: Lake, tables: Sequence[str] | None = None, config: MaintenanceConfig | None = None, *,
    run_id: str | None = None,
) -> list[CompactReport]:
    """Compact ``tables`` (all when None) towards ``config.target_file_mb`` files; with ``run_id``, only
    that run's partition, of tables partitioned by ``run_id`` (``trajectories`` and ``rollout_tasks``;
    another table is refused with it)."""
    config = config or MaintenanceConfig()
    partitions = None if run_id is None else [("run_id", "=", run_id)]
    if run_id is not None:
        unpartitioned = [name for name in _tables(tables) if "run_id" not in table_spec(name).partition_by]
        if unpartitioned:
            raise ValueError(f"{unpartitioned} are not partitioned by run_id: compact them whole (run_id None)")
    reports = []
    for name in _tables(tables):
        table = lake.table(name)
        before = table.version()
        metrics = table.optimize.compact(partition_filters=partitions,
                                         target_size=int(config.target_file_mb * 1024 * 1024))
        reports.append(
            CompactReport(
                table=name,
                files_removed=int(metrics.get("numFilesRemoved", 0)),
                files_added=int(metrics.get("numFilesAdded", 0)),
                version_before=before,
                version_after=table.version(),
            )
        )
    return reports


LEDGER_TABLES: tuple[str, ...] = ("train_steps", "policy_versions")
"""The trainer's ledger: one small file per commit, and each commit reads the run's rows first (to
check order and exactly-once consumption), so without compaction a step's commits slow down in
proportion to the steps before it."""


RUN_TABLES: tuple[str, ...] = ("trajectories", "rollout_tasks")
"""The tables a run's rollouts append to while it trains, a few files per step: the trainer's reads
and the rollout writer's commits of ``trajectories`` cost in proportion to their files (in the demo the
trainer's wait for a batch grew from 0.23 s to 0.82 s over 150 steps)."""


def compact_ledger(lake: Lake) -> list[CompactReport]:
    """Compact the ledger tables (:data:`LEDGER_TABLES`). A table whose compaction lost a race with
    another writer (another run's trainer on the same lake) is left for the next call and not reported."""
    return _compact_each(lake, LEDGER_TABLES, None)


def compact_run(lake: Lake, run_id: str, config: MaintenanceConfig | None = None) -> list[CompactReport]:
    """Compact the ledger and ``run_id``'s partition of :data:`RUN_TABLES` towards
    ``config.run_target_file_mb`` files; the trainer calls this every ``TrainConfig.compact_every``
    steps. Rollouts appending meanwhile are not disturbed (an append and a compaction of other files do
    not conflict; a writer whose planned commit version was taken plans again), and the reader tells the
    rewritten rows from new ones by ``ingest_seq``. A compaction that lost a race is left for the next
    call and not reported."""
    config = config or MaintenanceConfig()
    live = replace(config, target_file_mb=config.run_target_file_mb)
    return _compact_each(lake, LEDGER_TABLES, None, live) + _compact_each(lake, RUN_TABLES, run_id, live)


def _compact_each(lake: Lake, tables: Sequence[str], run_id: str | None,
                  config: MaintenanceConfig | None = None) -> list[CompactReport]:
    reports = []
    for name in tables:
        try:
            reports += compact(lake, [name], config, run_id=run_id)
        except CommitFailedError as error:
            log.info("compacting %s lost a race with another writer (%s); next time", name, error)
    return reports


def vacuum(
    lake: Lake,
    tables: Sequence[str] | None = None,
    *,
    retention_hours: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    config: MaintenanceConfig | None = None,
) -> list[VacuumReport]:
    """Vacuum ``tables`` (all when None), keeping every ``trajectories`` version in ``train_steps``.

    Raises:
        MaintenanceError: ``retention_hours`` below ``config.min_retention_hours`` without ``force``.
    """
    config = config or MaintenanceConfig()
    retention = config.retention_hours if retention_hours is None else retention_hours
    if retention < 0:
        raise MaintenanceError(f"retention_hours must be >= 0, got {retention}")
    if retention < config.min_retention_hours and not force:
        raise MaintenanceError(
            f"retention of {retention} h is below the minimum of {config.min_retention_hours} h: it could "
            "delete files a running writer or trainer still needs; pass force=True (--force) only when "
            "nothing is writing to or training from the lake"
        )
    reports = []
    for name in _tables(tables):
        keep = protected_versions(lake) if name == trajectories.NAME else []
        table = lake.table(name)
        removed = table.vacuum(
            retention_hours=retention,
            dry_run=dry_run,
            enforce_retention_duration=False,
            keep_versions=keep or None,
            full=True,
        )
        reports.append(VacuumReport(name, tuple(removed), tuple(keep), retention, dry_run))
    return reports
