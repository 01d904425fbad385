"""The issue log: which rollouts a driver launched (table ``rollout_tasks``), so none can vanish unseen.

The rollout driver hands one :class:`IssuedRollout` per launch to an :class:`IssueLog`, which batches
them into blind Delta appends (every row is a new event; nothing is read before writing). The driver
calls it on the same single thread that feeds the trajectory writer, before it hands over any record of
the rollouts, and flushes it before the writer's last flush, so a finished run's issue log is complete.
``sao lake check`` (:mod:`sao.lake.check`) then accounts for every issued ``trajectory_id``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterable

import pyarrow as pa

from sao.lake.commit import append_blind
from sao.lake.config import WriterConfig
from sao.lake.records import utc_now
from sao.lake.store import Lake
from schemas import rollout_tasks

__all__ = ["IssueLog", "IssuedRollout"]


@dataclasses.dataclass(frozen=True)
class IssuedRollout:
    """One launched rollout (a row of ``rollout_tasks``).

    Attributes:
        run_id, trajectory_id, task_id, env_name: what was launched, under which id.
        attempt: 0 for a task's first rollout, +1 per retry of a failed one.
        retry_of: the failed attempt's ``trajectory_id`` (None for a first attempt).
        issued_at: launch time (timezone-aware UTC).
    """

    run_id: str
    trajectory_id: str
    task_id: str
    env_name: str
    attempt: int = 0
    retry_of: str | None = None
    issued_at: dt.datetime = dataclasses.field(default_factory=utc_now)


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

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _flush_locked(self) -> int:
        if not self._buffer:
            return 0
        rows = [
            {
                **dataclasses.asdict(item),
                "issuer_id": self.issuer_id,
                "schema_version": rollout_tasks.SCHEMA_VERSION,
            }
            for item in self._buffer
        ]
        table = pa.Table.from_pylist(rows, schema=rollout_tasks.SCHEMA)
        append_blind(self.lake, rollout_tasks.NAME, table, metadata={"sao.writer_id": self.issuer_id})
        count = len(self._buffer)
        self.written += count
        self._buffer, self._oldest = [], None
        return count
