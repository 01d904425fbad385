"""Exactly-once appends: decide what to write on a snapshot, commit at the very next version.

Delta appends from two writers never conflict (delta-rs rebases a blind append onto whatever landed
first), which is what makes them fast, and also what makes "insert unless the id exists" unsafe: two
writers that both checked the same snapshot would both insert. :func:`append_exactly` closes that race
without MERGE: ``plan`` looks at snapshot ``V`` and returns the rows to append, and the commit is made
with ``max_commit_retries=0``, so it lands as version ``V + 1`` or fails. On failure (another writer
committed first) the table is refreshed, ``plan`` runs again on the new snapshot, and the commit is
retried after a jittered exponential pause. Every version of the table therefore holds exactly what a
plan saw plus what it decided, which is what lets the trajectory writer keep ``trajectory_id`` unique and
``ingest_seq`` gap-free with several writers at once.

Cost of a lost race: one refresh of the log and one re-plan (the trajectory writer's plan reads only the
rows committed since its last look), plus rewriting the data file that delta-rs wrote before it tried
to commit; the orphan is never referenced by the log and vacuum removes it.

On object stores the commit itself relies on delta-rs's conditional put (``If-None-Match``) of the log
entry; on a local folder, on an atomic create.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from sao.lake.config import CommitConfig
from sao.lake.store import Lake, LakeError
from schemas import table_spec

__all__ = ["CommitConflictError", "CommitResult", "append_exactly", "append_blind"]

Plan = Callable[[DeltaTable], pa.Table | None]


class CommitConflictError(LakeError):
    """Other writers kept committing first for ``max_attempts`` attempts; nothing was written."""


@dataclass(frozen=True)
class CommitResult:
    """Outcome of one :func:`append_exactly`.

    Attributes:
        version: the Delta version committed; None when the last plan had nothing to write.
        rows: rows appended.
        attempts: plans made (1 + lost races).
    """

    version: int | None
    rows: int
    attempts: int

    @property
    def conflicts(self) -> int:
        return self.attempts - 1


def append_exactly(
    lake: Lake,
    name: str,
    plan: Plan,
    config: CommitConfig,
    *,
    table: DeltaTable | None = None,
    metadata: Mapping[str, Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> CommitResult:
    """Append ``plan(snapshot)`` to table ``name`` as the version right after ``snapshot``.

    Args:
        plan: called with the table refreshed to its latest version; returns the rows to append (in
            the table's schema) or None / an empty table for nothing. It may be called several times
            and must decide from the snapshot it is given.
        table: a ``DeltaTable`` of ``name`` to reuse (its loaded state saves reading the log again;
            refreshed by :meth:`Lake.refresh`, which skips the log listing when no commit followed it).
        metadata: recorded in the commit's ``commitInfo``.

    Raises:
        CommitConflictError: after ``config.max_attempts`` lost races.
    """
    spec = table_spec(name)
    delta = table if table is not None else lake.table(name)
    for attempt in range(1, config.max_attempts + 1):
        if attempt > 1:
            delta.update_incremental()
        elif table is not None:
            lake.refresh(name, delta)
        rows = plan(delta)
        if rows is None or rows.num_rows == 0:
            return CommitResult(None, 0, attempt)
        try:
            write_deltalake(
                delta,
                rows,
                mode="append",
                partition_by=list(spec.partition_by) or None,
                commit_properties=CommitProperties(
                    max_commit_retries=0, custom_metadata=dict(metadata or {})
                ),
            )
        except CommitFailedError:
            pause = min(config.max_backoff_s, config.backoff_s * 2 ** (attempt - 1))
            sleep(random.uniform(0.0, pause))
            continue
        return CommitResult(delta.version(), rows.num_rows, attempt)
    raise CommitConflictError(
        f"table {name}: other writers committed first {config.max_attempts} times in a row; "
        "nothing was written (raise CommitConfig.max_attempts or batch more per commit)"
    )


def append_blind(
    lake: Lake,
    name: str,
    rows: pa.Table,
    *,
    metadata: Mapping[str, Any] | None = None,
    table: DeltaTable | None = None,
) -> int:
    """Plain append (delta-rs rebases it over concurrent commits): for event logs such as
    ``quarantine`` where every row is new by construction. ``table``: a ``DeltaTable`` of ``name`` to
    reuse, brought up to date first (:meth:`Lake.refresh`) instead of loading the table's log again.
    Returns the committed version."""
    spec = table_spec(name)
    delta = table if table is not None else lake.table(name)
    if table is not None:
        lake.refresh(name, delta)
    write_deltalake(
        delta,
        rows,
        mode="append",
        partition_by=list(spec.partition_by) or None,
        commit_properties=CommitProperties(custom_metadata=dict(metadata or {})),
    )
    return delta.version()
