"""The issue log: which rollouts a driver launched (table ``rollout_tasks``), so none can vanish unseen.

The rollout driver hands one :class:`IssuedRollout` per launch to an :class:`IssueLog`, which batches
them into blind Delta appends (every row is a new event; nothing is read before writing). The driver
calls it on the same single thread that feeds the trajectory writer, before it hands over any record of
the rollouts, and flushes it before the writer's last flush, so a finished run's issue log is complete.
Before each trajectory commit the writer has it commit the launches of that commit's records it still
holds (:meth:`IssueLog.flush_for`): no record is stored before its launch.
``sao lake check`` (:mod:`sao.audit`) then accounts for every issued ``trajectory_id``.

A driver process that dies (SIGKILL, out of memory, a node restart) leaves the rollouts it had in
flight issued but never stored. When the run resumes, :func:`close_out_unresolved` records each of them
as ``abandoned`` (with the reason and the time of the resume) before the new driver launches anything,
and returns them so the driver can launch their tasks again as new attempts (``retry_of``). It must run
while no other driver of the run is alive: a live driver's in-flight rollouts look the same.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
import uuid
from collections.abc import Collection, Iterable

import pyarrow as pa
from deltalake import DeltaTable

from sao.faults import crash_point
from sao.lake.commit import append_blind
from sao.lake.config import WriterConfig
from sao.lake.records import utc_now
from sao.lake.store import Lake, sql_literal
from schemas import rollout_tasks

__all__ = ["IssueLog", "IssuedRollout", "close_out_unresolved", "unresolved_rollouts"]

CRASH_REASON = "in flight when the run's driver process stopped without closing it (crash or kill); closed out on resume"


@dataclasses.dataclass(frozen=True)
class IssuedRollout:
    """One launched rollout (a row of ``rollout_tasks``).

    Attributes:
        run_id, trajectory_id, task_id, env_name: what was launched, under which id.
        attempt: 0 for a task's first rollout, +1 per retry of a failed one.
        retry_of: the failed attempt's ``trajectory_id`` (None for a first attempt).
        issued_at: launch time (timezone-aware UTC); for ``abandoned``, the time of the close-out.
        event: ``issued`` (a launch) or ``abandoned`` (a close-out, see the module docstring).
        reason: why an abandoned rollout was closed out (None for a launch).
    """

    run_id: str
    trajectory_id: str
    task_id: str
    env_name: str
    attempt: int = 0
    retry_of: str | None = None
    issued_at: dt.datetime = dataclasses.field(default_factory=utc_now)
    event: str = rollout_tasks.ISSUED
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.event not in rollout_tasks.EVENTS:
            raise ValueError(f"event must be one of {rollout_tasks.EVENTS}, got {self.event!r}")


class IssueLog:
    """Batches :class:`IssuedRollout` rows into appends to ``rollout_tasks``; thread-safe.

    Flushes when ``config.flush_rows`` rows wait or the oldest has waited ``config.flush_seconds``
    (checked on :meth:`add_many`), and on :meth:`flush` / :meth:`close`. A failed append raises and keeps
    the rows buffered for the next flush.
    """

    def __init__(self, lake: Lake, config: WriterConfig | None = None, *, issuer_id: str | None = None):
        self.lake = lake
        self.config = config or WriterConfig()
        self.issuer_id = issuer_id or f"driver-{uuid.uuid4().hex[:12]}"
        self.written = 0
        self._buffer: list[IssuedRollout] = []
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._table: DeltaTable | None = None  # rollout_tasks, kept loaded between appends
        self._appends = 0

    def add_many(self, rollouts: Iterable[IssuedRollout]) -> None:
        """Buffer launched rollouts; flush if the batch is full or old."""
        with self._lock:
            added = list(rollouts)
            if added and not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.extend(added)
            old = self._oldest is not None and time.monotonic() - self._oldest >= self.config.flush_seconds
            if len(self._buffer) >= self.config.flush_rows or (self._buffer and old):
                self._flush_locked()

    def flush(self) -> int:
        """Append everything buffered; returns the rows appended."""
        with self._lock:
            return self._flush_locked()

    close = flush

    def flush_for(self, trajectory_ids: Collection[str] | None) -> int:
        """Append everything buffered if it holds the launch of any of ``trajectory_ids`` (records about
        to be committed; None: unknown ids, so flush), else nothing: no record is committed before its
        launch, and launches long since buffered stay off the records' commit (the buffer's own flush,
        at ``flush_rows`` or ``flush_seconds``, commits them). Returns the rows appended."""
        with self._lock:
            if trajectory_ids is not None and not any(item.trajectory_id in trajectory_ids
                                                      for item in self._buffer):
                return 0
            return self._flush_locked()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _flush_locked(self) -> int:
        if not self._buffer:
            return 0
        rows = pa.Table.from_pylist(
            [
                {
                    **dataclasses.asdict(item),
                    "issuer_id": self.issuer_id,
                    "schema_version": rollout_tasks.SCHEMA_VERSION,
                }
                for item in self._buffer
            ],
            schema=rollout_tasks.SCHEMA,
        )
        if self._table is None:
            self._table = self.lake.table(rollout_tasks.NAME)
        append_blind(self.lake, rollout_tasks.NAME, rows, metadata={"sao.writer_id": self.issuer_id},
                     table=self._table)
        count = len(self._buffer)
        self.written += count
        self._buffer, self._oldest = [], None
        self._appends += 1
        crash_point("after-issue", self._appends)  # the crash harness: launches committed, no record of them
        return count


def unresolved_rollouts(lake: Lake, run_id: str) -> tuple[list[IssuedRollout], list[IssuedRollout]]:
    """The run's launches that have no outcome yet, as ``(open, abandoned_without_retry)``:

    * ``open``: issued, neither stored in ``trajectories`` nor quarantined, nor closed out;
    * ``abandoned_without_retry``: closed out as abandoned, but no launch names them in ``retry_of``
      (a resume that died between its close-out and its re-launch)."""
    from schemas import quarantine, trajectories

    literal = sql_literal(run_id)
    events = lake.read(rollout_tasks.NAME, predicate=f"run_id = {literal}").to_pylist()
    if not events:
        return [], []
    stored = set(lake.read(trajectories.NAME, columns=["trajectory_id"],
                           predicate=f"run_id = {literal}")["trajectory_id"].to_pylist())
    rejected = set(lake.read(quarantine.NAME, columns=["record_id"],
                             predicate=f"run_id = {literal} OR run_id IS NULL")["record_id"].to_pylist())
    launches = [row for row in events if row["event"] in (None, rollout_tasks.ISSUED)]
    abandoned = {row["trajectory_id"] for row in events if row["event"] == rollout_tasks.ABANDONED}
    retried = {row["retry_of"] for row in launches if row["retry_of"] is not None}
    fields = [f.name for f in dataclasses.fields(IssuedRollout)]
    as_rollout = [IssuedRollout(**{k: row[k] if k != "event" else rollout_tasks.ISSUED for k in fields})
                  for row in launches]
    open_ = [r for r in as_rollout
             if r.trajectory_id not in stored and r.trajectory_id not in rejected and r.trajectory_id not in abandoned]
    unretried = [r for r in as_rollout if r.trajectory_id in abandoned and r.trajectory_id not in retried]
    return open_, unretried


def close_out_unresolved(lake: Lake, run_id: str, issuer_id: str, reason: str = CRASH_REASON) -> list[IssuedRollout]:
    """Record every open launch of the run as ``abandoned`` (one blind append) and return the
    launches whose tasks should be launched again: those closed out now and those an earlier resume
    closed out without re-launching. Idempotent: a second call closes out nothing new."""
    open_, unretried = unresolved_rollouts(lake, run_id)
    if open_:
        now = utc_now()
        closing = [dataclasses.replace(r, issued_at=now, event=rollout_tasks.ABANDONED, reason=reason) for r in open_]
        log = IssueLog(lake, issuer_id=issuer_id)
        log.add_many(closing)
        log.flush()
    return sorted(unretried + open_, key=lambda r: r.issued_at)
