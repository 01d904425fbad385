"""The trajectory writer: batched, validated, idempotent appends to ``trajectories``.

Rollout workers hand :class:`~sao.lake.records.TrajectoryRecord` objects (or their ``to_row()`` dicts)
to :meth:`TrajectoryWriter.add`. Records are buffered and flushed when ``flush_rows`` are waiting or the
oldest has waited ``flush_seconds``, and on :meth:`close` / leaving the ``with`` block. A flush:

1. converts the batch to Arrow columns (records that cannot be converted are quarantined, rule ``type``);
2. validates it (:mod:`sao.lake.validate`); each failing record goes to ``quarantine`` with every rule
   it broke, and the rest of the batch carries on;
3. drops repeated deliveries: within the batch the first delivery wins, and an id already stored for
   the run is skipped. The writer keeps the ids of each run it writes to, read once from the table and
   then topped up with the rows other writers committed since (a scan of ``ingest_seq > last seen``,
   which Delta's file statistics prune to the newest files; none when the table's latest commit is the
   writer's own), so a restarted writer, or a second one, still stores an id once;
4. numbers the rows of each run with ``ingest_seq`` (the next integers after the run's maximum) and
   commits them in one Delta commit through :func:`sao.lake.commit.append_exactly`: if another writer
   committed in between, steps 3-4 run again on the new snapshot.

Because each commit lands on exactly the snapshot it was planned on, no version of the table ever
holds a ``trajectory_id`` twice within a run, and ``ingest_seq`` is 1, 2, 3, ... per run with no gap,
in commit order: the reader uses it as the arrival order and as a watermark.

Policy versions: a record may not claim a version newer than the newest registered in
``policy_versions`` for its run. The writer caches the newest version per run and looks again only when
a record claims something newer (reading the commits since its last look:
:class:`sao.lake.ledger.NewestVersions`).

Thread safety: ``add``, ``flush`` and ``close`` may be called from several threads; a flush holds the
writer's lock, so producers wait for it. A background timer enforces ``flush_seconds``; an error it
meets is raised by the next ``add``, ``flush`` or ``close``, and nothing is lost: records leave the
buffer only once they are committed (or quarantined).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sao.lake.columnar import records_to_arrow
from sao.lake.commit import append_blind, append_exactly
from sao.lake.config import WriterConfig
from sao.lake.ledger import NewestVersions
from sao.lake.records import RecordTypeError, TrajectoryRecord, json_safe, utc_now
from sao.lake.store import Lake, LakeError, is_valid_run_id, sql_literal
from sao.lake.validate import NO_VERSION, Rule, Violation, validate_table
from schemas import quarantine, trajectories

__all__ = ["FlushReport", "TrajectoryWriter", "WriterClosedError", "WriterStats"]

log = logging.getLogger(__name__)


class WriterClosedError(LakeError):
    """``add`` after ``close``."""


@dataclass(frozen=True)
class FlushReport:
    """What one flush did.

    Attributes:
        received: records taken from the buffer.
        written: rows committed to ``trajectories``.
        duplicates: deliveries skipped because the id was already stored (or earlier in the batch).
        quarantined: records sent to ``quarantine``.
        version: the ``trajectories`` version committed; None when nothing was written.
        conflicts: commits lost to another writer and re-planned.
        seconds: wall time of the flush.
    """

    received: int
    written: int
    duplicates: int
    quarantined: int
    version: int | None
    conflicts: int
    seconds: float


@dataclass
class WriterStats:
    """Running totals over the writer's life (sums of its :class:`FlushReport`)."""

    received: int = 0
    written: int = 0
    duplicates: int = 0
    quarantined: int = 0
    flushes: int = 0
    commits: int = 0
    conflicts: int = 0

    def add(self, report: FlushReport) -> None:
        self.received += report.received
        self.written += report.written
        self.duplicates += report.duplicates
        self.quarantined += report.quarantined
        self.flushes += 1
        self.commits += report.version is not None
        self.conflicts += report.conflicts


@dataclass
class _RunState:
    """What the writer knows about one run's stored rows, as of the snapshot it last planned on."""

    ids: set[str] = field(default_factory=set)
    max_seq: int = 0
    version: int | None = None  # the snapshot the state is complete at (None: not read yet)


@dataclass(frozen=True)
class _Delivery:
    payload: TrajectoryRecord | Mapping[str, Any]
    arrived_at: dt.datetime  # stored in the row
    received: float  # time.monotonic(), for the age flush


class TrajectoryWriter:
    """Buffers trajectories and stores each exactly once (see the module docstring).

    Use as a context manager, or call :meth:`close`::

        with TrajectoryWriter(lake) as writer:
            for record in records:
                writer.add(record)
    """

    def __init__(
        self,
        lake: Lake,
        config: WriterConfig | None = None,
        *,
        writer_id: str | None = None,
        before_flush: Callable[[frozenset[str] | None], object] | None = None,
        after_commit: Callable[[], object] | None = None,
    ) -> None:
        """``before_flush(ids)`` runs (under the writer's lock) before each flush that has records, with
        the ids the flush's records were launched under (each one's ``trajectory_id`` and
        ``episode_id``; None when a delivery names none, as bad input may): the pipeline commits the
        launches among them its issue log still holds there, so no record is committed before its
        launch is (:meth:`sao.lake.issued.IssueLog.flush_for`).
        ``after_commit`` runs after each commit that wrote rows: the pipeline tells the trainer there
        (:meth:`sao.rollout.weights.WeightBroker.rows_committed`); a failure of it is logged, the rows
        stay committed."""
        self.lake = lake
        self.before_flush = before_flush
        self.after_commit = after_commit
        self.config = config or WriterConfig()
        self.writer_id = writer_id or f"writer-{uuid.uuid4().hex[:12]}"
        self.stats = WriterStats()
        self._buffer: list[_Delivery] = []
        self._demand: int | None = None  # a reader waits for this many rows (see demand)
        self._runs: dict[str, _RunState] = {}
        self._table: DeltaTable | None = None
        self._versions = NewestVersions(lake)  # policy_versions, followed from its log
        self._lock = threading.RLock()
        self._error: BaseException | None = None
        self._closed = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if self.config.background_flush:
            self._timer = threading.Thread(
                target=self._flush_on_age, name=f"{self.writer_id}-timer", daemon=True
            )
            self._timer.start()

    # Public API ---------------------------------------------------------------------------------

    def add(self, record: TrajectoryRecord | Mapping[str, Any]) -> None:
        """Buffer one record (stamped with its arrival time); flush if the batch is full or old."""
        self.add_many((record,))

    def add_many(self, records: Iterable[TrajectoryRecord | Mapping[str, Any]]) -> None:
        """Buffer several records at once, then flush every full batch (and an old remainder).

        All records are buffered before any flush, so an error raised by a flush loses nothing:
        what was not committed is still in the buffer (see :attr:`buffered`).
        """
        with self._lock:
            self._raise_pending_error()
            if self._closed:
                raise WriterClosedError(f"{self.writer_id} is closed")
            now, received = utc_now(), time.monotonic()
            self._buffer.extend(_Delivery(record, now, received) for record in records)
            while len(self._buffer) >= self.config.flush_rows:
                self._flush_locked(self.config.flush_rows)
            if self._is_old() or self._demanded():
                self._flush_locked()

    def demand(self, rows: int) -> None:
        """A reader waits for ``rows`` more rows: flush as soon as that many are buffered (at once if
        they are), rather than at ``flush_rows`` or ``flush_seconds``. The demand holds until the next
        flush that commits rows; a reader still short then asks again. The pipeline passes on the
        trainer's wait for its batch here (:meth:`sao.rollout.weights.WeightBroker.wait_demand`).
        A flush this call makes fails as the age flush does: the next ``add``, ``flush`` or ``close``
        raises its error."""
        if rows < 1:
            return
        with self._lock:
            if self._closed or self._error is not None:
                return
            self._demand = rows
            if self._demanded():
                try:
                    self._flush_locked()
                except BaseException as error:  # raised again by the next add/flush/close
                    self._error = error

    def flush(self) -> FlushReport:
        """Commit everything buffered now (a report of zeros when the buffer is empty)."""
        with self._lock:
            self._raise_pending_error()
            return self._flush_locked()

    def close(self) -> None:
        """Stop the timer and flush what is left. Idempotent."""
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        with self._lock:
            if self._closed:
                return
            self._raise_pending_error()
            self._flush_locked()
            self._closed = True

    @property
    def buffered(self) -> int:
        """Records waiting for the next flush."""
        return len(self._buffer)

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # Flushing -----------------------------------------------------------------------------------

    def _demanded(self) -> bool:
        return self._demand is not None and len(self._buffer) >= self._demand

    def _is_old(self) -> bool:
        return (
            bool(self._buffer)
            and time.monotonic() - self._buffer[0].received >= self.config.flush_seconds
        )

    def _flush_on_age(self) -> None:
        interval = min(self.config.flush_seconds / 4, 0.25)
        while not self._stop.wait(interval):
            with self._lock:
                if self._error is None and not self._closed and self._buffer and self._is_old():
                    try:
                        self._flush_locked()
                    except BaseException as error:  # raised again by the next add/flush/close
                        self._error = error

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _flush_locked(self, limit: int | None = None) -> FlushReport:
        """Flush the first ``limit`` buffered records (all when None)."""
        started = time.perf_counter()
        batch, rest = (
            self._buffer[:limit],
            self._buffer[len(self._buffer) if limit is None else limit :],
        )
        if not batch:
            return FlushReport(0, 0, 0, 0, None, 0, 0.0)
        if self.before_flush is not None:
            self.before_flush(_launch_ids(batch))
        records, rejected = self._to_records(batch)
        table, kept, unconvertible = self._to_arrow(records)
        rejected += unconvertible
        violations = self._validate(table) if table is not None else []
        bad_rows = {v.row for v in violations}
        if rejected or bad_rows:
            self._quarantine(batch, kept, rejected, violations)
        # The invalid records are stored (in quarantine): only the valid ones are still pending.
        valid_rows = [i for i in range(len(kept)) if i not in bad_rows]
        pending = [batch[kept[i][0]] for i in valid_rows]
        self._buffer = pending + rest
        written, duplicates, version, conflicts = 0, 0, None, 0
        if table is not None and valid_rows:
            arrived = [delivery.arrived_at for delivery in pending]
            valid = table if len(valid_rows) == table.num_rows else table.take(valid_rows)
            written, duplicates, version, conflicts = self._commit(valid, arrived)
            if written:
                self._demand = None
            if written and self.after_commit is not None:
                try:
                    self.after_commit()
                except Exception as exc:  # the rows are in: a trainer not told looks at its next poll
                    log.warning("the writer's after_commit call failed: %s", exc)
        self._buffer = rest
        report = FlushReport(
            received=len(batch),
            written=written,
            duplicates=duplicates,
            quarantined=len(rejected) + len(bad_rows),
            version=version,
            conflicts=conflicts,
            seconds=time.perf_counter() - started,
        )
        self.stats.add(report)
        return report

    def _to_records(
        self, batch: list[_Delivery]
    ) -> tuple[list[tuple[int, TrajectoryRecord]], list[tuple[int, Violation]]]:
        """(position, record) of each delivery that is a record; a type violation for the rest."""
        records: list[tuple[int, TrajectoryRecord]] = []
        rejected: list[tuple[int, Violation]] = []
        for position, delivery in enumerate(batch):
            payload = delivery.payload
            if isinstance(payload, TrajectoryRecord):
                records.append((position, payload))
                continue
            try:
                if not isinstance(payload, Mapping):
                    raise RecordTypeError(
                        "record",
                        f"needs a TrajectoryRecord or a mapping, got {type(payload).__name__}",
                    )
                records.append((position, TrajectoryRecord.from_row(payload)))
            except RecordTypeError as error:
                rejected.append(
                    (position, Violation(position, Rule.TYPE, error.field, None, str(error)))
                )
        return records, rejected

    def _to_arrow(
        self, records: list[tuple[int, TrajectoryRecord]]
    ) -> tuple[pa.Table | None, list[tuple[int, TrajectoryRecord]], list[tuple[int, Violation]]]:
        """(table, the records it holds in row order, rejections). A record whose values do not fit
        the schema (an int beyond int32, say) is found by converting one at a time, and rejected."""
        if not records:
            return None, [], []
        try:
            return records_to_arrow([r for _, r in records]), records, []
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            pass
        kept: list[tuple[int, TrajectoryRecord]] = []
        rejected: list[tuple[int, Violation]] = []
        for position, record in records:
            try:
                records_to_arrow([record])
                kept.append((position, record))
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as error:
                message = f"a value does not fit the trajectories schema: {error}"
                rejected.append((position, Violation(position, Rule.TYPE, "record", None, message)))
        table = records_to_arrow([r for _, r in kept]) if kept else None
        return table, kept, rejected

    def _validate(self, table: pa.Table) -> list[Violation]:
        run_ids = table["run_id"].to_pylist()
        claimed = table["max_policy_version"].to_pylist()
        # A rollout of a version newer than the one known (so once per new version): one look at the
        # commits to policy_versions since the last, for every such run of the flush.
        if any(is_valid_run_id(run_id) and ((known := self._versions.get(run_id)) is None
                                           or (version is not None and version > known))
               for run_id, version in zip(run_ids, claimed, strict=True)):
            self._versions.look()
        newest = {run_id: self._newest_version(run_id) for run_id in set(run_ids)}
        return validate_table(table, np.array([newest[r] for r in run_ids], dtype=np.int64), self.config.limits)

    def _newest_version(self, run_id: str) -> int:
        """``run_id``'s newest registered version as of the last look (``NO_VERSION``: none, or not a run id)."""
        found = self._versions.get(run_id) if is_valid_run_id(run_id) else None
        return NO_VERSION if found is None else found

    def _quarantine(
        self,
        batch: list[_Delivery],
        kept: list[tuple[int, TrajectoryRecord]],
        rejected: list[tuple[int, Violation]],
        violations: list[Violation],
    ) -> None:
        by_position: dict[int, list[Violation]] = {}
        for position, violation in rejected:
            by_position.setdefault(position, []).append(violation)
        for violation in violations:  # rows of the Arrow table -> positions in the batch
            position = kept[violation.row][0]
            moved = Violation(
                position, violation.rule, violation.field, violation.position, violation.message
            )
            by_position.setdefault(position, []).append(moved)
        now = utc_now()
        cap = self.config.limits.max_quarantine_payload_bytes
        rows = [
            _quarantine_row(batch[position].payload, position, found, self.writer_id, now, cap)
            for position, found in sorted(by_position.items())
        ]
        table = pa.Table.from_pylist(rows, schema=quarantine.SCHEMA)
        append_blind(self.lake, quarantine.NAME, table, metadata={"sao.writer_id": self.writer_id})

    def _commit(
        self, valid: pa.Table, arrived: list[dt.datetime]
    ) -> tuple[int, int, int | None, int]:
        """Store the validated rows once each. Returns (written, duplicates, version, conflicts)."""
        first = _first_occurrences(valid["run_id"], valid["trajectory_id"])
        in_batch_duplicates = valid.num_rows - len(first)
        if in_batch_duplicates:
            valid = valid.take(first)
            arrived = [arrived[i] for i in first.tolist()]
        outcome: dict[str, np.ndarray] = {}

        def plan(delta: DeltaTable) -> pa.Table | None:
            rows, keep = self._plan_rows(delta, valid, arrived)
            outcome["keep"] = keep
            return rows

        if self._table is None:
            self._table = self.lake.table(trajectories.NAME)
        result = append_exactly(
            self.lake,
            trajectories.NAME,
            plan,
            self.config.commit,
            table=self._table,
            metadata={"sao.writer_id": self.writer_id},
        )
        keep = outcome["keep"]
        if result.version is not None:
            self._remember(valid, keep, result.version)
        return (
            result.rows,
            in_batch_duplicates + int((~keep).sum()),
            result.version,
            result.conflicts,
        )

    def _plan_rows(
        self, delta: DeltaTable, valid: pa.Table, arrived: list[dt.datetime]
    ) -> tuple[pa.Table | None, np.ndarray]:
        """Rows to append on snapshot ``delta``: the ids not stored yet, numbered after each run's
        maximum ``ingest_seq``. Returns (rows, keep mask over ``valid``)."""
        run_ids = valid["run_id"].to_pylist()
        for run_id in set(run_ids):
            self._catch_up(delta, run_id)
        ids = valid["trajectory_id"].to_pylist()
        keep = np.array(
            [i not in self._runs[r].ids for i, r in zip(ids, run_ids, strict=True)], dtype=np.bool_
        )
        if not keep.any():
            return None, keep
        next_seq = {r: self._runs[r].max_seq for r in set(run_ids)}
        seqs = np.zeros(valid.num_rows, dtype=np.int64)
        for index in np.flatnonzero(keep).tolist():
            run_id = run_ids[index]
            next_seq[run_id] += 1
            seqs[index] = next_seq[run_id]
        rows = valid.filter(pa.array(keep))
        count = rows.num_rows
        now = utc_now()
        columns = {
            "arrived_at": pa.array(
                [a for a, k in zip(arrived, keep, strict=True) if k],
                trajectories.SCHEMA.field("arrived_at").type,
            ),
            "ingested_at": pa.array([now] * count, trajectories.SCHEMA.field("ingested_at").type),
            "writer_id": pa.array([self.writer_id] * count, pa.string()),
            "ingest_seq": pa.array(seqs[keep], pa.int64()),
            "schema_version": pa.array(np.full(count, trajectories.SCHEMA_VERSION, dtype=np.int32)),
        }
        for name, column in columns.items():
            rows = rows.append_column(trajectories.SCHEMA.field(name), column)
        return rows.select(trajectories.SCHEMA.names).cast(trajectories.SCHEMA), keep

    def _catch_up(self, delta: DeltaTable, run_id: str) -> None:
        """Add the ids and the max ``ingest_seq`` of rows of ``run_id`` committed since we last looked
        (nothing to read when the snapshot is the one the state is complete at: no commit followed this
        writer's own last one)."""
        state = self._runs.setdefault(run_id, _RunState())
        if state.version == delta.version():
            return
        predicate = f"run_id = {sql_literal(run_id)}"
        if state.version is not None:
            predicate += f" AND ingest_seq > {state.max_seq}"
        new = self.lake.read_from(
            delta, trajectories.NAME, columns=["trajectory_id", "ingest_seq"], predicate=predicate
        )
        if new.num_rows:
            state.ids.update(new["trajectory_id"].to_pylist())
            state.max_seq = max(state.max_seq, int(pc.max(new["ingest_seq"]).as_py()))
        state.version = delta.version()

    def _remember(self, valid: pa.Table, keep: np.ndarray, version: int) -> None:
        """Record the rows just committed as ``version`` (numbered ``max_seq + 1, ...`` per run by the
        plan): a run's state caught up on the snapshot right before is then complete at ``version``."""
        run_ids = valid["run_id"].to_pylist()
        ids = valid["trajectory_id"].to_pylist()
        for index in np.flatnonzero(keep).tolist():
            state = self._runs[run_ids[index]]
            state.ids.add(ids[index])
            state.max_seq += 1
        for run_id in set(run_ids):
            state = self._runs[run_id]
            if state.version == version - 1:
                state.version = version


def _launch_ids(batch: list[_Delivery]) -> frozenset[str] | None:
    """The ids ``batch``'s records were launched under: each ``trajectory_id``, and the ``episode_id``
    of a part of a split episode (its first part keeps the launched id); None if a delivery has no
    string ``trajectory_id``."""
    ids: set[str] = set()
    for delivery in batch:
        payload = delivery.payload
        if isinstance(payload, TrajectoryRecord):
            found = (payload.trajectory_id, payload.episode_id)
        elif isinstance(payload, Mapping):
            found = (payload.get("trajectory_id"), payload.get("episode_id"))
        else:
            return None
        if not isinstance(found[0], str):
            return None
        ids.update(i for i in found if isinstance(i, str))
    return frozenset(ids)


def _first_occurrences(run_ids: pa.ChunkedArray, ids: pa.ChunkedArray) -> np.ndarray:
    """Indices of the first occurrence of each (run_id, trajectory_id), in order."""
    seen: dict[tuple[str, str], int] = {}
    for index, key in enumerate(zip(run_ids.to_pylist(), ids.to_pylist(), strict=True)):
        seen.setdefault(key, index)
    return np.fromiter(seen.values(), dtype=np.int64, count=len(seen))


def _quarantine_row(
    payload: TrajectoryRecord | Mapping[str, Any],
    position: int,
    violations: list[Violation],
    writer_id: str,
    now: dt.datetime,
    max_payload_bytes: int,
) -> dict[str, Any]:
    row = payload.to_row() if isinstance(payload, TrajectoryRecord) else payload
    first = violations[0]
    payload_json = json.dumps(json_safe(row), allow_nan=False)
    if len(payload_json) > max_payload_bytes:  # an oversized payload: keep its head, say how big
        payload_json = f"{payload_json[:max_payload_bytes]}...[truncated: {len(payload_json)} bytes]"
    return {
        "quarantine_id": uuid.uuid4().hex,
        "table_name": trajectories.NAME,
        "run_id": _string_or_none(row, "run_id"),
        "record_id": _string_or_none(row, "trajectory_id"),
        "reason": str(first.rule),
        "field": first.field,
        "row": position,
        "position": first.position,
        "message": first.message,
        "violations": [
            {"reason": str(v.rule), "field": v.field, "position": v.position, "message": v.message}
            for v in violations
        ],
        "payload_json": payload_json,
        "writer_id": writer_id,
        "quarantined_at": now,
        "schema_version": quarantine.SCHEMA_VERSION,
    }


def _string_or_none(row: Any, key: str) -> str | None:
    value = row.get(key) if isinstance(row, Mapping) else None
    return value if isinstance(value, str) else None
