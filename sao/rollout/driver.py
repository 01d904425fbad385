"""The rollout driver: keeps trajectories in flight, feeds tasks, streams finished records to a sink.

The sink is the lake writer in production (:class:`sao.lake.writer.TrajectoryWriter`, batched and
idempotent); an in-memory queue exists only as a benchmark comparison. Back-pressure: a new trajectory
starts only while fewer than ``max_in_flight`` run and the :class:`~sao.rollout.staleness.StalenessGate`
allows it at the trainer's current version, so no trajectory is generated further ahead than the
trainer can consume within ``max_staleness`` versions. A trajectory the trainer will never train on
gives its place back to the gate: the trainer reports how many it passed over (``trainer_skipped``,
the weight broker's count in a run); without that report, the driver releases those that finish
already too stale, or without an action token.

Every launched task ends in one record handed to the sink, or in several when an agent of one's own
split its episode by rewriting its history (the parts share ``episode_id``; the first keeps the launched
id: :mod:`sao.rollout.chat_endpoint`); the agent loop turns failures into ``error`` / ``cancelled``
records; a replica that dies mid-rollout surfaces as an exception from the
handle, which the driver records as an ``error`` trajectory and, if ``retry_failed``, relaunches the
task under a new trajectory id.

With an ``issue_log`` (:class:`sao.lake.issued.IssueLog`), every launch is also recorded in the lake's
``rollout_tasks`` table (a retry names the attempt it retries), on the sink's thread and before any of
its records, so ``sao lake check`` can account for every issued rollout.

The sink batches its commits (``WriterConfig.flush_rows`` / ``flush_seconds``). When nothing is in
flight and the gate lets nothing start (a synchronous batch is complete, or the trainer is
``max_staleness`` versions behind), the driver flushes the issue log and the sink at once: the trainer
is waiting for exactly those rows.

A rollout still in flight when the trainer is more than ``max_staleness`` versions past the version
seen at its launch can never be trained on: with ``cancel_stale`` (the default) the driver cancels it
then, and its slot and gate place open at once instead of when a long tool call returns. It ends in a
``cancelled`` record with no tokens, which the trainer passes over (``sao bench speed`` measures what it
buys under heavy-tailed tool latency).

Stopping: ``stop`` ends launching; the rollouts in flight then finish and are handed to the sink. With
``cancel`` as well (a Ctrl-C of the run, after its grace period), every rollout still in flight is
cancelled on its replica and recorded as a ``cancelled`` trajectory with no tokens, so the run stops
promptly and every launch still ends in exactly one record. A resumed run passes the rollouts its dead
predecessor left in flight (closed out as ``abandoned``: :func:`sao.lake.issued.close_out_unresolved`)
as ``relaunch``; their tasks are launched first, as new attempts naming the abandoned id.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

from sao.envs.base import Task
from sao.lake.issued import IssuedRollout
from sao.lake.records import TrajectoryRecord
from sao.rollout.staleness import StalenessGate

__all__ = ["DriverConfig", "DriverStats", "IssueSink", "RolloutDriver", "RolloutsFailing", "TrajectorySink"]

log = logging.getLogger(__name__)


class RolloutsFailing(RuntimeError):
    """Every rollout of the run so far ended with ``error``: nothing will ever be trained on."""


class TrajectorySink(Protocol):
    """Where finished trajectories go (the lake writer, or a queue in benchmarks)."""

    def add_many(self, records: list[TrajectoryRecord]) -> None: ...

    def flush(self) -> None: ...


class IssueSink(Protocol):
    """Where launches are recorded (:class:`sao.lake.issued.IssueLog`)."""

    def add_many(self, rollouts: list[IssuedRollout]) -> None: ...

    def flush(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class DriverConfig:
    """Attributes:
        max_in_flight: trajectories the driver runs at once (across replicas). A rollout it cancelled
            may go on on its replica while other rollouts of the same request run
            (:class:`sao.rollout.serve.RolloutBatcher`).
        batch_size: trajectories the trainer consumes per version (for the staleness gate).
        max_staleness: versions a trajectory may lag when consumed; None turns the gate off.
        seed: base of the per-trajectory sampling seeds.
        retry_failed: relaunch a task whose replica failed (under a new trajectory id).
        max_retries: relaunches of one task at most (its failed attempts stay as ``error`` records).
        version_poll_s: how often the trainer's version is re-read while the gate is closed.
        fail_after_errors: stop the run (:class:`RolloutsFailing`, naming the first error) when this many
            records have finished and every one of them ended with ``error`` (a broken agent, reward
            function or environment: nothing would ever be trained on); 0 never stops.
        synchronous: each rollout asks its replica to start only once it runs the trainer's version at
            launch (``min_version``), so with ``max_staleness = 0`` every batch is sampled by the policy
            the trainer holds (synchronous RL: rollouts wait for the update, the update for the batch).
        cancel_stale: cancel a rollout still in flight once the trainer is more than ``max_staleness``
            versions past the version the driver had seen at its launch: the trainer would pass it over,
            so its slot and its place in the gate open at once rather than when its last tool call
            returns (a ``cancelled`` record, as after a Ctrl-C). A replica runs no version newer than
            the newest published, which is what the driver looks at, so the rollout's oldest version is
            at most the one seen at its launch, except when a new version reaches its replica between
            the driver's look and the rollout's first token: then it is cancelled one version early.
            False: it runs to its end and the trainer passes it over.
    """

    max_in_flight: int = 64
    batch_size: int = 16
    max_staleness: int | None = 4
    seed: int = 0
    retry_failed: bool = True
    max_retries: int = 2
    version_poll_s: float = 0.05
    synchronous: bool = False
    fail_after_errors: int = 32
    cancel_stale: bool = True

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.synchronous and self.max_staleness != 0:
            raise ValueError(f"a synchronous driver needs max_staleness 0, got {self.max_staleness}")


@dataclasses.dataclass
class DriverStats:
    """What a driver run did (for progress output and the speed benchmark)."""

    launched: int = 0
    finished: int = 0  # launches that ended (each in one record, or in the parts of a split episode)
    records: int = 0
    episode_splits: int = 0  # records beyond one per launch: the parts after the first of split episodes
    retried: int = 0
    by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    wall_s: float = 0.0
    slot_busy_s: float = 0.0  # sum over trajectories of their generation wall time
    released: int = 0  # never to be trained on (too stale, or no actions): the gate's places freed
    cancelled_stale: int = 0  # cancelled in flight, too stale to be trained on (``cancel_stale``)
    first_error: str | None = None  # the text of the first ``error`` record

    def slot_utilisation(self, max_in_flight: int) -> float:
        return self.slot_busy_s / (self.wall_s * max_in_flight) if self.wall_s > 0 else 0.0


class _Launch(NamedTuple):
    """A launch to make: a task's ``attempt`` (0 first), naming the trajectory it retries, if any."""

    task: Task
    attempt: int
    retry_of: str | None


class _InFlight(NamedTuple):
    """A rollout that runs: what it was launched as, when it began (``time.monotonic``), and the trainer's
    version the driver had seen at its launch (None without a gate)."""

    task: Task
    attempt: int
    began: float
    trajectory_id: str
    version: int | None = None


@dataclasses.dataclass
class _RunState:
    """What one :meth:`RolloutDriver.run` carries from one iteration to the next."""

    source: Iterator[Task]
    retry: collections.deque[_Launch]  # relaunches and failed attempts, launched before new tasks
    running: dict[asyncio.Future, _InFlight] = dataclasses.field(default_factory=dict)
    exhausted: bool = False  # the task source has run out
    index: int = 0  # launches so far in this run: the offset of the next seed
    pending_sink: list[asyncio.Future] = dataclasses.field(default_factory=list)  # calls on the sink's thread
    idle_flushed: bool = False  # the sink was flushed since the last rollout was in flight
    stale: set[asyncio.Future] = dataclasses.field(default_factory=set)  # cancelled: never to be trained on

    def next_launch(self) -> _Launch | None:
        """A waiting retry, else the source's next task as a first attempt; None when both have run out."""
        if self.retry:
            return self.retry.popleft()
        task = next(self.source, None)
        return None if task is None else _Launch(task, 0, None)


class RolloutDriver:
    """Drives a rollout app (anything with ``rollout.remote(task, run_id, trajectory_id, seed)``).

    Args:
        rollout: the Serve handle (``rollout_handle()``) or any object with the same method.
        sink: receives every finished record.
        run_id: recorded in every trajectory.
        config: driver settings.
        trainer_version: async callable returning the trainer's current policy version.
        initial_version: the version the run starts (or resumes) at.
        backlog: trajectories of the run already stored that the trainer has yet to consume or pass over
            (a resumed run's rows beyond its last step). They hold places in the gate from the start, as
            any trajectory does until consumed or reported passed over; uncounted, the resumed run's
            rows would queue that many deep for good, and age past ``max_staleness`` in the queue.
        on_record: optional callback per finished record (progress bars, counters).
        issue_log: optional record of every launch (the lake's ``rollout_tasks``).
        trainer_skipped: async callable returning how many trajectories the trainer has passed over
            so far (too stale when it reached them, or without an action token).
        trainer_newer: async callable ``(version, timeout_s)`` that returns as soon as the trainer's
            version is newer than ``version``, or after ``timeout_s``: while its gate lets nothing
            start, the driver waits there (told of the trainer's next version) instead of sleeping
            ``version_poll_s`` between looks.
    """

    def __init__(self, rollout, sink: TrajectorySink, run_id: str, config: DriverConfig | None = None,
                 trainer_version: Callable[[], Awaitable[int]] | None = None, initial_version: int = 0,
                 backlog: int = 0, on_record: Callable[[TrajectoryRecord], None] | None = None,
                 issue_log: IssueSink | None = None,
                 trainer_skipped: Callable[[], Awaitable[int]] | None = None,
                 trainer_newer: Callable[[int, float], Awaitable[object]] | None = None) -> None:
        self.rollout = rollout
        self.sink = sink
        self.run_id = run_id
        self.config = config or DriverConfig()
        self.trainer_version = trainer_version
        self.on_record = on_record
        self.issue_log = issue_log
        self.trainer_skipped = trainer_skipped
        self.trainer_newer = trainer_newer
        self._version_seen: int | None = None  # the trainer's version at the last look
        self._skipped_seen = 0
        cfg = self.config
        self.gate = (StalenessGate(cfg.batch_size, cfg.max_staleness, initial_version, started=backlog)
                     if cfg.max_staleness is not None and trainer_version is not None else None)
        self.stats = DriverStats()
        self._sink_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sink")

    async def _capacity(self, running: int) -> tuple[int, int | None]:
        """(how many rollouts may start now, the trainer's version when known): the slots that ``running``
        rollouts leave free, at most the gate's places left (which already count the running ones)."""
        room = self.config.max_in_flight - running
        if self.gate is None:
            return room, None
        version = self._version_seen = await self.trainer_version()
        if self.trainer_skipped is not None:
            skipped = await self.trainer_skipped()
            if skipped > self._skipped_seen:
                released = min(skipped - self._skipped_seen, self.gate.started)
                self.gate.release(released)
                self.stats.released += released
                self._skipped_seen = skipped
        return min(room, self.gate.capacity(version)), version

    async def run(self, tasks: Iterable[Task], limit: int | None = None,
                  stop: asyncio.Event | None = None, cancel: asyncio.Event | None = None,
                  relaunch: Iterable[tuple[Task, IssuedRollout]] = ()) -> DriverStats:
        """Roll out tasks until ``tasks`` is exhausted, ``limit`` trajectories finished, or ``stop``;
        ``cancel`` cancels what is in flight (see the module docstring); ``relaunch``: (task, abandoned
        launch) pairs launched first, each as the next attempt of its abandoned launch."""
        started = time.monotonic()
        state = _RunState(iter(tasks), collections.deque(
            _Launch(task, abandoned.attempt + 1, abandoned.trajectory_id) for task, abandoned in relaunch))
        while True:
            stopping = (stop is not None and stop.is_set()) or (limit is not None and self.stats.launched >= limit)
            if not stopping and (state.retry or not state.exhausted):
                await self._launch(state, limit)
            self._cancel_stale(state)
            if not state.running:
                if (state.exhausted and not state.retry) or stopping:
                    break
                if not state.idle_flushed:
                    self._flush_when_idle(state)
                await self._wait_for_trainer()  # gate closed
                continue
            state.idle_flushed = False
            if cancel is not None and cancel.is_set():
                done = await self._cancel_all(state.running)
            else:
                done, _ = await asyncio.wait(state.running, timeout=self.config.version_poll_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            records = self._collect(state, done, may_retry=not stopping)
            if records:
                await self._record(state, records)
        await self._finish(state)
        self.stats.wall_s = time.monotonic() - started
        return self.stats

    async def _launch(self, state: _RunState, limit: int | None) -> None:
        """Fill the places free now (:meth:`_capacity`) with retries first, then new tasks, up to ``limit``
        launches; the launches go to the issue log on the sink's thread, so ahead of any of their records."""
        free, version = await self._capacity(len(state.running))
        min_version = version if self.config.synchronous else None
        issued: list[IssuedRollout] = []
        while free > 0 and (limit is None or self.stats.launched < limit):
            launch = state.next_launch()
            if launch is None:
                state.exhausted = True
                break
            issued.append(self._start(state, launch, version, min_version))
            free -= 1
        if issued and self.issue_log is not None:  # same thread as the records: logged first
            state.pending_sink.append(self._on_sink_thread(self.issue_log.add_many, issued))

    def _start(self, state: _RunState, launch: _Launch, version: int | None,
               min_version: int | None) -> IssuedRollout:
        """Start one rollout under a new trajectory id and the run's next seed (in launch order), take
        its place in the gate (at the trainer's ``version``), and return its issue-log row."""
        task = launch.task
        trajectory_id = uuid.uuid4().hex
        seed = self.config.seed * 1_000_003 + state.index
        state.index += 1
        issued = IssuedRollout(self.run_id, trajectory_id, task.task_id, task.env, launch.attempt, launch.retry_of)
        future = asyncio.ensure_future(self._call(task, trajectory_id, seed, min_version))
        state.running[future] = _InFlight(task, launch.attempt, time.monotonic(), trajectory_id, version)
        self.stats.launched += 1
        if self.gate is not None:
            self.gate.start()
        return issued

    async def _wait_for_trainer(self) -> None:
        """Wait while the gate lets nothing start: until the trainer's next version (``trainer_newer``),
        at most ``version_poll_s``, which is also when places the trainer passed over are looked for."""
        if self.trainer_newer is not None and self._version_seen is not None:
            await self.trainer_newer(self._version_seen, self.config.version_poll_s)
        else:
            await asyncio.sleep(self.config.version_poll_s)

    def _collect(self, state: _RunState, done: Iterable[asyncio.Future], may_retry: bool) -> list[TrajectoryRecord]:
        """The records of the ``done`` rollouts (a cancelled one becomes a ``cancelled`` record); with
        ``may_retry``, a failed attempt that has retries left is queued to be launched again."""
        records = []
        for future in done:
            flight = state.running.pop(future)
            self.stats.slot_busy_s += time.monotonic() - flight.began
            stale = future in state.stale
            state.stale.discard(future)
            if future.cancelled():
                why = (f"the trainer reached version {self._version_seen} while it was in flight, more than "
                       f"max_staleness past version {flight.version} at its launch: never to be trained on"
                       if stale else "the run was stopped (Ctrl-C) while it was in flight")
                parts, failed = [failed_record(flight.task, self.run_id, flight.trajectory_id, why,
                                               reason="cancelled")], False
            else:
                parts, failed = future.result()
            records += parts
            self.stats.finished += 1
            self.stats.episode_splits += len(parts) - 1
            if failed and self.config.retry_failed and flight.attempt < self.config.max_retries and may_retry:
                state.retry.append(_Launch(flight.task, flight.attempt + 1, flight.trajectory_id))
                self.stats.retried += 1
        return records

    async def _record(self, state: _RunState, records: list[TrajectoryRecord]) -> None:
        """Account for finished records (the gate's places of untrainable ones, stats, ``on_record``) and
        hand them to the sink on its thread; a sink call that has failed meanwhile stops the run."""
        if self.gate is not None and self.trainer_skipped is None:
            await self._release_untrainable(records)
        self.stats.records += len(records)
        for record in records:
            self.stats.by_reason[str(record.termination_reason)] += 1
            if record.termination_reason == "error" and self.stats.first_error is None:
                self.stats.first_error = record.error
            if self.on_record is not None:
                self.on_record(record)
        state.pending_sink.append(self._on_sink_thread(self.sink.add_many, records))
        for finished in [f for f in state.pending_sink if f.done()]:
            finished.result()  # a sink failure stops the run loudly
            state.pending_sink.remove(finished)
        limit = self.config.fail_after_errors
        if limit and self.stats.records >= limit and self.stats.by_reason["error"] == self.stats.records:
            await asyncio.gather(*state.pending_sink)  # the failed records are stored, then the run stops
            raise RolloutsFailing(f"the first {self.stats.records} rollouts all ended with error; the first: "
                                  f"{self.stats.first_error}")

    def _flush_when_idle(self, state: _RunState) -> None:
        """Nothing is in flight and the gate lets nothing start: nothing more arrives until the trainer
        moves (a synchronous batch is complete, or the trainer is ``max_staleness`` behind), and the
        trainer waits for the rows held in the sink's buffer, so they are committed now rather than when
        the buffer fills or ages (once per idle spell)."""
        state.idle_flushed = True
        if self.issue_log is not None:  # before the records: no record without its launch
            state.pending_sink.append(self._on_sink_thread(self.issue_log.flush))
        state.pending_sink.append(self._on_sink_thread(self.sink.flush))

    async def _finish(self, state: _RunState) -> None:
        """Drain the sink's thread, then flush the issue log before the records' last flush."""
        await asyncio.gather(*state.pending_sink)
        if self.issue_log is not None:  # before the records' last flush: no record without its launch
            await self._on_sink_thread(self.issue_log.flush)
        await self._on_sink_thread(self.sink.flush)

    def _on_sink_thread(self, fn: Callable, *args) -> asyncio.Future:
        """``fn(*args)`` on the sink's one thread, in submission order."""
        return asyncio.get_running_loop().run_in_executor(self._sink_thread, fn, *args)

    def _cancel_stale(self, state: _RunState) -> None:
        """Cancel the rollouts in flight that the trainer's version seen last has left more than
        ``max_staleness`` behind (``DriverConfig.cancel_stale``); each ends in a ``cancelled`` record,
        collected as it ends, and gives its place back as the trainer passes that record over."""
        cfg = self.config
        if not cfg.cancel_stale or cfg.synchronous or self.gate is None or self._version_seen is None:
            return
        oldest = self._version_seen - self.gate.max_staleness
        for future, flight in state.running.items():
            if flight.version is not None and flight.version < oldest and future not in state.stale:
                if future.cancel():  # False: it has just ended, and its record is collected as it is
                    state.stale.add(future)
                    self.stats.cancelled_stale += 1

    @staticmethod
    async def _cancel_all(running: dict[asyncio.Future, _InFlight]) -> set[asyncio.Future]:
        """Cancel every rollout in flight (the Serve request is cancelled on its replica) and wait until
        each has ended; one that finished meanwhile keeps its record."""
        for future in running:
            future.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return set(running)

    async def _release_untrainable(self, records: list[TrajectoryRecord]) -> None:
        """Give back the gate's places of records the trainer will never consume (see the module
        docstring): no action token, or already more than ``max_staleness`` behind the trainer."""
        version = await self.trainer_version()
        limit = self.config.max_staleness
        untrainable = sum(1 for r in records
                          if r.min_policy_version is None or version - r.min_policy_version > limit)
        if untrainable:
            self.gate.release(untrainable)
            self.stats.released += untrainable

    async def _call(self, task: Task, trajectory_id: str, seed: int,
                    min_version: int | None = None) -> tuple[list[TrajectoryRecord], bool]:
        """One rollout's records; a failing replica becomes an ``error`` record (and a retry, if configured)."""
        try:
            if min_version is None:
                records = await self.rollout.rollout.remote(task, self.run_id, trajectory_id, seed)
            else:
                records = await self.rollout.rollout.remote(task, self.run_id, trajectory_id, seed,
                                                            min_version=min_version)
            return list(records), False
        except Exception as exc:
            log.warning("rollout %s of task %s failed on its replica: %s", trajectory_id, task.task_id, exc)
            return [failed_record(task, self.run_id, trajectory_id, f"{type(exc).__name__}: {exc}")], True


def failed_record(task: Task, run_id: str, trajectory_id: str, message: str,
                  reason: str = "error") -> TrajectoryRecord:
    """A trajectory with no tokens that ended with ``reason``: ``error`` for a rollout whose replica
    failed before answering, ``cancelled`` for one the driver cancelled."""
    from sao.lake.records import RecordedSampling, Timings, utc_now

    now = utc_now()
    log.info("recording %s as %s: %s", trajectory_id, reason, message)
    return TrajectoryRecord(
        trajectory_id=trajectory_id, run_id=run_id, task_id=task.task_id, env_name=task.env, prompt_ids=[],
        completion_ids=[], action_mask=[], logprobs=[], logprob_kind="sampling", segments=(), reward=0.0,
        termination_reason=reason, num_turns=0,
        sampling=RecordedSampling(temperature=1.0, top_p=1.0, top_k=None, max_tokens=1, seed=None),
        tokenizer_version="unknown", chat_template_version="unknown", engine_name="unknown",
        engine_version="unknown", worker_id="driver", timings=Timings(now, now, now, 0.0, 0.0),
        error=message if reason == "error" else None,
    )
