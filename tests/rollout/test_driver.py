"""The rollout driver with an in-process stand-in for the Serve handle: every task ends in one record,
failed replicas become error records and retries, the staleness gate holds generation back."""

import asyncio
import time

import pytest

from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.records import RecordedSampling, Segment, Timings, TrajectoryRecord, utc_now
from sao.rollout.driver import DriverConfig, RolloutDriver, RolloutsFailing

TASKS = generate_tasks(MathToolConfig(num_train=30, num_heldout=0))


def record(task, run_id, trajectory_id):
    now = utc_now()
    return TrajectoryRecord(
        trajectory_id=trajectory_id, run_id=run_id, task_id=task.task_id, env_name=task.env, prompt_ids=[1, 2],
        completion_ids=[5], action_mask=[True], logprobs=[-0.5], logprob_kind="sampling",
        segments=(Segment("action", 0, 1, 0),), reward=1.0,
        termination_reason="stop", num_turns=1,
        sampling=RecordedSampling(temperature=1.0, top_p=1.0, top_k=None, max_tokens=8, seed=None),
        tokenizer_version="t", chat_template_version="c", engine_name="torch", engine_version="x",
        worker_id="w", timings=Timings(now, now, now, 0.0, 0.0))


class Method:
    def __init__(self, fn):
        self.remote = fn


class FakeApp:
    """Answers ``rollout.remote`` like a Serve handle; fails the calls listed in ``fail_on``."""

    def __init__(self, fail_on=()):
        self.calls = 0
        self.fail_on = set(fail_on)
        self.active = 0
        self.peak = 0

        async def rollout(task, run_id, trajectory_id, seed):
            self.calls += 1
            call = self.calls
            self.active += 1
            self.peak = max(self.peak, self.active)
            await asyncio.sleep(0.001)
            self.active -= 1
            if call in self.fail_on:
                raise RuntimeError("replica died")
            return [record(task, run_id, trajectory_id)]

        self.rollout = Method(rollout)


class ListSink:
    def __init__(self):
        self.records = []
        self.flushed = 0

    def add_many(self, records):
        self.records.extend(records)

    def flush(self):
        self.flushed += 1


def test_every_task_ends_in_exactly_one_record_and_failures_are_retried():
    app, sink = FakeApp(fail_on={3, 7}), ListSink()
    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=4, max_staleness=None))
    stats = asyncio.run(driver.run(TASKS[:10]))
    ids = [r.trajectory_id for r in sink.records]
    assert len(ids) == len(set(ids)) == stats.finished == stats.launched == 12  # 10 tasks + 2 retries
    assert stats.retried == 2 and stats.by_reason == {"stop": 10, "error": 2}
    errors = [r for r in sink.records if r.termination_reason == "error"]
    assert {r.task_id for r in errors} <= {t.task_id for t in TASKS[:10]}
    assert sink.flushed == 1 and app.peak <= 4


def test_a_task_that_always_fails_is_retried_a_bounded_number_of_times():
    app, sink = FakeApp(fail_on=set(range(1, 100))), ListSink()
    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=2, max_staleness=None, max_retries=2))
    stats = asyncio.run(driver.run(TASKS[:3]))
    assert stats.finished == 9 and stats.retried == 6  # 3 tasks x (1 try + 2 retries), all error records
    assert stats.by_reason == {"error": 9}


def test_the_staleness_gate_holds_generation_until_the_trainer_moves():
    app, sink = FakeApp(), ListSink()
    version = {"v": 0}

    async def trainer_version():
        return version["v"]

    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=16, batch_size=4, max_staleness=1,
                                                        version_poll_s=0.01), trainer_version=trainer_version)

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=20))
        await asyncio.sleep(0.3)
        held = driver.stats.launched
        version["v"] = 3
        stats = await asyncio.wait_for(job, timeout=10)
        return held, stats

    held, stats = asyncio.run(run())
    assert held == 8  # (0 + 1 + 1) * 4 started before the trainer moved
    assert stats.finished == 20


class HeldApp:
    """Rollouts that run until ``release`` is set (a long tool call), counting those running."""

    def __init__(self):
        self.release = asyncio.Event()
        self.active = 0

        async def rollout(task, run_id, trajectory_id, seed, min_version=None):
            self.active += 1
            try:
                await self.release.wait()
            finally:
                self.active -= 1
            return [record(task, run_id, trajectory_id)]

        self.rollout = Method(rollout)


def held_run(config, limit, versions):
    """Drive ``limit`` held rollouts: at each of ``versions`` in turn (after 0.2 s each) the trainer's
    version moves there and the rollouts running are counted; then they are released. Returns the
    counts (the first at version 0), the driver's stats and the records."""
    app, sink = HeldApp(), ListSink()
    version = {"v": 0}

    async def trainer_version():
        return version["v"]

    driver = RolloutDriver(app, sink, "r", config, trainer_version=trainer_version)

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=limit))
        counts = []
        for moved in versions:
            await asyncio.sleep(0.2)
            counts.append(app.active)
            version["v"] = moved
        await asyncio.sleep(0.2)
        counts.append(app.active)
        app.release.set()
        return counts, await asyncio.wait_for(job, timeout=10)

    counts, stats = asyncio.run(run())
    return counts, stats, sink.records


@pytest.mark.parametrize(("max_in_flight", "running"), [(16, 12), (10, 10)])
def test_the_gate_opens_places_beside_the_rollouts_still_running(max_in_flight, running):
    # Window (0 + 1 + 1) * 4 = 8 at version 0. At version 1 the gate has (1 + 1 + 1) * 4 - 8 = 4 places
    # more while the first 8 still run: they start at once, as far as the slots allow (16 slots: all 4,
    # 12 running; 10 slots: 2 of them). The gate's places already count the running rollouts; taking
    # those off again would start nothing until 4 of the 8 had finished.
    config = DriverConfig(max_in_flight=max_in_flight, batch_size=4, max_staleness=1, version_poll_s=0.01,
                          cancel_stale=False)
    counts, stats, _ = held_run(config, 12, [1])
    assert counts == [8, running]
    assert stats.finished == 12


@pytest.mark.parametrize("cancel_stale", [True, False])
def test_rollouts_too_stale_to_train_on_are_cancelled_in_flight(cancel_stale):
    # Window (0 + 1 + 1) * 4 = 8 at version 0. At version 2 the 8 rollouts of version 0 are 2 > 1 versions
    # behind: cancelled, each a `cancelled` record with no tokens that gives its place back; then 4 more
    # start at version 2 (the limit of 12) and finish. Without cancel_stale they run on.
    config = DriverConfig(max_in_flight=16, batch_size=4, max_staleness=1, version_poll_s=0.01,
                          cancel_stale=cancel_stale)
    (first, active), stats, records = held_run(config, 12, [2])
    cancelled = [r for r in records if r.termination_reason == "cancelled"]
    assert first == 8
    if cancel_stale:
        assert active == 4  # the 4 started at version 2; the 8 of version 0 were cancelled
        assert stats.cancelled_stale == 8 and len(cancelled) == 8
        assert stats.released == 12  # and the stand-in's 4 records say version 0: too stale at 2 as well
        assert all(len(r.completion_ids) == 0 and r.min_policy_version is None for r in cancelled)
        assert len(records) == 12 and len({r.trajectory_id for r in records}) == 12
    else:
        assert active == 12  # the gate opened 4 places at version 2: (2 + 1 + 1) * 4 - 12 started
        assert stats.cancelled_stale == 0 and not cancelled
    assert stats.finished == 12


def test_a_synchronous_driver_cancels_nothing():
    # A synchronous batch's rollouts run at the trainer's version; the trainer does not move while they
    # run, and a driver that saw a jump would still leave them be.
    config = DriverConfig(max_in_flight=16, batch_size=4, max_staleness=0, version_poll_s=0.01, synchronous=True)
    counts, stats, records = held_run(config, 4, [3])
    assert counts == [4, 4] and stats.cancelled_stale == 0
    assert [r.termination_reason for r in records] == ["stop"] * 4


class ListIssueLog:
    def __init__(self):
        self.rows = []

    def add_many(self, rows):
        self.rows.extend(rows)

    def flush(self):
        return 0


def test_every_launch_is_issued_before_its_record_and_retries_name_their_attempt():
    app, sink, issued = FakeApp(fail_on={2}), ListSink(), ListIssueLog()
    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=3, max_staleness=None), issue_log=issued)
    asyncio.run(driver.run(TASKS[:5]))
    assert sorted(r.trajectory_id for r in issued.rows) == sorted(r.trajectory_id for r in sink.records)
    (retry,) = [r for r in issued.rows if r.attempt == 1]
    failed = next(r for r in sink.records if r.termination_reason == "error")
    assert retry.retry_of == failed.trajectory_id and retry.task_id == failed.task_id


class VersionedApp:
    """A stand-in whose replica runs ``version["v"]`` and honours ``min_version`` like a Serve replica."""

    def __init__(self, version):
        self.started_at = []  # (trajectory id, the version the rollout started at)

        async def rollout(task, run_id, trajectory_id, seed, min_version=None):
            while min_version is not None and version["v"] < min_version:
                await asyncio.sleep(0.001)
            self.started_at.append((trajectory_id, version["v"], min_version))
            await asyncio.sleep(0.001)
            return [record(task, run_id, trajectory_id)]

        self.rollout = Method(rollout)


def test_a_synchronous_driver_launches_one_batch_per_version_at_that_version():
    trainer = {"v": 0}
    replica = {"v": 0}
    app, sink = VersionedApp(replica), ListSink()

    async def trainer_version():
        return trainer["v"]

    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=16, batch_size=4, max_staleness=0,
                                                        version_poll_s=0.01, synchronous=True),
                           trainer_version=trainer_version)

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=8))
        await asyncio.sleep(0.2)
        first = driver.stats.launched
        trainer["v"] = 1  # the trainer published version 1; the replica has not loaded it yet
        await asyncio.sleep(0.2)
        waiting = len(app.started_at)
        replica["v"] = 1
        await asyncio.wait_for(job, timeout=10)
        return first, waiting

    first, waiting = asyncio.run(run())
    assert first == 4  # one batch at version 0
    assert waiting == 4  # the second batch was launched but waits for its replica to run version 1
    assert [(v, m) for _, v, m in app.started_at] == [(0, 0)] * 4 + [(1, 1)] * 4


def test_a_driver_told_of_the_trainers_versions_launches_the_next_batch_at_once():
    """With ``trainer_newer`` the driver waits there while its gate is closed, from the version it last
    saw: a new version launches the next batch without waiting out ``version_poll_s`` (here 30 s)."""
    trainer = {"v": 0}
    app, sink = VersionedApp(trainer), ListSink()
    waits = []

    async def trainer_version():
        return trainer["v"]

    async def trainer_newer(seen, timeout_s):
        waits.append((seen, timeout_s))
        while trainer["v"] <= seen:
            await asyncio.sleep(0.001)
        return trainer["v"]

    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=16, batch_size=4, max_staleness=0,
                                                        version_poll_s=30, synchronous=True),
                           trainer_version=trainer_version, trainer_newer=trainer_newer)

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=8))
        while len(sink.records) < 4:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        batch_one = driver.stats.launched
        started = time.monotonic()
        trainer["v"] = 1
        await asyncio.wait_for(job, timeout=10)
        return batch_one, time.monotonic() - started

    batch_one, second_batch_s = asyncio.run(run())
    assert batch_one == 4 and second_batch_s < 5  # not the 30 s poll
    assert waits and waits[0] == (0, 30)
    assert [(v, m) for _, v, m in app.started_at] == [(0, 0)] * 4 + [(1, 1)] * 4


def test_a_complete_synchronous_batch_is_flushed_at_once_and_once():
    # The trainer waits for the batch: its rows (and their launches, first) are committed as soon as
    # nothing is in flight, not when the writer's buffer fills or ages; the idle polls flush no more.
    events = []

    class Issues(ListIssueLog):
        def flush(self):
            events.append("issues flushed")
            return 0

    class Records(ListSink):
        def add_many(self, records):
            super().add_many(records)
            events.append(f"recorded {len(self.records)}")

        def flush(self):
            super().flush()
            events.append("records flushed")

    trainer = {"v": 0}

    async def trainer_version():
        return trainer["v"]

    sink = Records()
    driver = RolloutDriver(VersionedApp(trainer), sink, "r", DriverConfig(max_in_flight=16, batch_size=4, max_staleness=0,
                                                               version_poll_s=0.01, synchronous=True),
                           trainer_version=trainer_version, issue_log=Issues())

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=8))
        await asyncio.sleep(0.3)  # the first batch is done; about 30 polls of a closed gate
        flushed_while_waiting = list(events)
        trainer["v"] = 1
        await asyncio.wait_for(job, timeout=10)
        return flushed_while_waiting

    waiting = asyncio.run(run())
    assert len(sink.records) == 8 and {r.termination_reason for r in sink.records} == {"stop"}
    assert waiting[-2:] == ["issues flushed", "records flushed"] and waiting.count("records flushed") == 1
    assert waiting.index("records flushed") > max(i for i, e in enumerate(waiting) if e.startswith("recorded"))
    assert events.count("records flushed") == 2  # after the first batch, and the run's last flush


def test_a_synchronous_driver_needs_max_staleness_zero():
    import pytest

    with pytest.raises(ValueError, match="max_staleness 0"):
        DriverConfig(max_staleness=1, synchronous=True)


def test_trajectories_too_stale_to_train_give_their_places_back():
    # Every record is sampled by version 0 while the trainer is at version 3 with max_staleness 1: none
    # can be trained on. Without releasing their places the gate would stop at (3 + 1 + 1) * 2 = 10
    # launches and the run would never reach 20.
    app, sink = FakeApp(), ListSink()

    async def trainer_version():
        return 3

    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=4, batch_size=2, max_staleness=1,
                                                        version_poll_s=0.01), trainer_version=trainer_version)
    stats = asyncio.run(asyncio.wait_for(driver.run(TASKS, limit=20), timeout=10))
    assert stats.finished == 20 and stats.released == 20


def test_trainable_trajectories_keep_their_places():
    app, sink = FakeApp(), ListSink()

    async def trainer_version():
        return 1  # records of version 0 are within max_staleness 1

    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=16, batch_size=2, max_staleness=1,
                                                        version_poll_s=0.01), trainer_version=trainer_version)

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=20))
        await asyncio.sleep(0.3)
        job.cancel()
        return driver.stats

    stats = asyncio.run(run())
    assert stats.launched == 6 and stats.released == 0  # (1 + 1 + 1) * 2, held until the trainer moves


def launched_before_and_after_skips(config, version, skipped, **driver_kwargs):
    """Drive quick rollouts with the trainer at ``version``; after 0.2 s the trainer reports that it has
    passed over ``skipped`` trajectories, and 0.2 s later the run is cancelled. Returns (launched
    before the report, the driver's stats)."""
    app, sink = FakeApp(), ListSink()
    reported = {"n": 0}

    async def trainer_version():
        return version

    async def trainer_skipped():
        return reported["n"]

    driver = RolloutDriver(app, sink, "r", config, trainer_version=trainer_version,
                           trainer_skipped=trainer_skipped, **driver_kwargs)

    async def run():
        job = asyncio.ensure_future(driver.run(TASKS, limit=20))
        await asyncio.sleep(0.2)
        before = driver.stats.launched
        reported["n"] = skipped
        await asyncio.sleep(0.2)
        job.cancel()
        return before, driver.stats

    return asyncio.run(run())


def test_what_the_trainer_passed_over_gives_its_places_back():
    # The trainer stays at version 0 and reports that it passed over 3 of the 4 trajectories started
    # (stale when it got to them): the gate of (0 + 0 + 1) * 4 = 4 places admits 3 more, and no more.
    config = DriverConfig(max_in_flight=16, batch_size=4, max_staleness=0, version_poll_s=0.01)
    before, stats = launched_before_and_after_skips(config, 0, 3)
    assert before == 4  # fresh records of version 0 hold their places (no release at finish)
    assert stats.launched == 7 and stats.released == 3


def test_a_resumed_runs_stored_backlog_holds_places_in_the_gate():
    # A run resumed at version 5 finds 3 stored rows its trainer has yet to consume or pass over: of the
    # gate's (0 + 1 + 1) * 4 = 8 places, 5 are left for new rollouts. When the trainer reports that it
    # passed over those 3 (too stale), their places open: 8 new in all. Uncounted, the backlog would
    # have let 11 start, 3 more than the trainer can consume within max_staleness.
    config = DriverConfig(max_in_flight=16, batch_size=4, max_staleness=1, version_poll_s=0.01)
    before, stats = launched_before_and_after_skips(config, 5, 3, initial_version=5, backlog=3)
    assert before == 5
    assert stats.launched == 8 and stats.released == 3


def test_cancel_ends_every_rollout_in_flight_as_a_cancelled_record():
    """After a Ctrl-C's grace period the driver cancels what is still running: each launch still ends
    in exactly one record, and the replica's coroutine is cancelled (it never returns a record)."""

    class SlowApp:
        def __init__(self):
            self.cancelled = 0

            async def rollout(task, run_id, trajectory_id, seed):
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
                return [record(task, run_id, trajectory_id)]

            self.rollout = Method(rollout)

    app, sink, issued = SlowApp(), ListSink(), ListIssueLog()
    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=3, max_staleness=None), issue_log=issued)

    async def run():
        stop, cancel = asyncio.Event(), asyncio.Event()

        async def interrupt():
            await asyncio.sleep(0.2)
            stop.set()
            cancel.set()

        asyncio.ensure_future(interrupt())
        return await asyncio.wait_for(driver.run(TASKS, stop=stop, cancel=cancel), 10)

    stats = asyncio.run(run())
    assert stats.launched == stats.finished == 3 and app.cancelled == 3
    assert [r.termination_reason for r in sink.records] == ["cancelled"] * 3
    assert {r.trajectory_id for r in sink.records} == {i.trajectory_id for i in issued.rows}
    assert all(len(r.completion_ids) == 0 for r in sink.records)  # nothing the trainer could take


def test_abandoned_rollouts_are_launched_first_as_their_next_attempt():
    from sao.lake.issued import IssuedRollout

    abandoned = [IssuedRollout("r", "old-1", TASKS[4].task_id, TASKS[4].env, attempt=0),
                 IssuedRollout("r", "old-2", TASKS[5].task_id, TASKS[5].env, attempt=1, retry_of="older")]
    app, sink, issued = FakeApp(), ListSink(), ListIssueLog()
    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=2, max_staleness=None), issue_log=issued)
    stats = asyncio.run(driver.run(TASKS[:3], relaunch=[(TASKS[4], abandoned[0]), (TASKS[5], abandoned[1])]))
    assert stats.launched == stats.finished == 5
    first = issued.rows[:2]
    assert [(r.task_id, r.attempt, r.retry_of) for r in first] == [
        (TASKS[4].task_id, 1, "old-1"), (TASKS[5].task_id, 2, "old-2")]
    assert [r.retry_of for r in issued.rows[2:]] == [None] * 3


def test_launches_reach_the_issue_log_before_their_records_and_are_flushed_first():
    """One event log shared by the issue log and the sink: each launch is written (on the sink's
    thread) before its record, and the issue log is flushed before the records' last flush."""
    import threading

    events = []

    class Issues:
        def add_many(self, rows):
            events.extend(("issued", r.trajectory_id, threading.current_thread().name) for r in rows)

        def flush(self):
            events.append(("issues flushed",))
            return 0

    class Records:
        def add_many(self, records):
            events.extend(("recorded", r.trajectory_id, threading.current_thread().name) for r in records)

        def flush(self):
            events.append(("records flushed",))

    driver = RolloutDriver(FakeApp(fail_on={2, 5}), Records(), "r",
                           DriverConfig(max_in_flight=3, max_staleness=None), issue_log=Issues())
    stats = asyncio.run(driver.run(TASKS[:8]))
    at = {(e[0], e[1]): i for i, e in enumerate(events) if len(e) == 3}
    launched = [tid for kind, tid in at if kind == "issued"]
    assert len(launched) == stats.launched == stats.finished == 10  # 8 tasks + 2 retries
    assert all(at["issued", tid] < at["recorded", tid] for tid in launched)
    assert {e[2] for e in events if len(e) == 3} == {"sink_0"}  # one thread: submission order holds
    assert events[-2:] == [("issues flushed",), ("records flushed",)]


def test_seeds_follow_the_launch_order_retries_included():
    seeds = {}

    class SeedApp(FakeApp):
        def __init__(self):
            super().__init__(fail_on={1, 4})
            inner = self.rollout.remote

            async def rollout(task, run_id, trajectory_id, seed):
                seeds[trajectory_id] = seed
                return await inner(task, run_id, trajectory_id, seed)

            self.rollout = Method(rollout)

    issued = ListIssueLog()
    driver = RolloutDriver(SeedApp(), ListSink(), "r", DriverConfig(max_in_flight=2, max_staleness=None, seed=7),
                           issue_log=issued)
    asyncio.run(driver.run(TASKS[:5]))
    assert [seeds[r.trajectory_id] for r in issued.rows] == [7 * 1_000_003 + i for i in range(7)]
    assert [r.attempt for r in issued.rows].count(1) == 2


def test_a_run_whose_rollouts_all_fail_stops_naming_the_first_error():
    app, sink = FakeApp(fail_on=range(1, 10_000)), ListSink()
    driver = RolloutDriver(app, sink, "r", DriverConfig(max_in_flight=4, max_staleness=None, fail_after_errors=8))
    with pytest.raises(RolloutsFailing, match=r"rollouts all ended with error; the first: RuntimeError: replica died"):
        asyncio.run(driver.run(TASKS * 10))
    assert 8 <= len(sink.records) < 30 and all(r.termination_reason == "error" for r in sink.records)


def test_split_episodes_count_every_part_but_launch_once():
    class SplittingApp(FakeApp):
        def __init__(self):
            super().__init__()

            async def rollout(task, run_id, trajectory_id, seed):
                first = record(task, run_id, trajectory_id)
                return [first, record(task, run_id, f"{trajectory_id}.1")]

            self.rollout = Method(rollout)

    sink = ListSink()
    driver = RolloutDriver(SplittingApp(), sink, "r", DriverConfig(max_in_flight=4, max_staleness=None))
    stats = asyncio.run(driver.run(TASKS[:5]))
    assert stats.launched == stats.finished == 5 and stats.records == len(sink.records) == 10
    assert stats.episode_splits == 5
