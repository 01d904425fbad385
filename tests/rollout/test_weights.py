"""The weight broker's bookkeeping, on the class itself (the Ray actor runs the same code)."""

import asyncio

import pytest

from sao.rollout.weights import WeightBroker


def test_the_broker_adds_up_what_the_trainer_passed_over_and_starts_over_on_reset():
    async def run():
        broker = WeightBroker()
        broker.add_skipped(2)
        await broker.publish(1, ["ref1"])
        broker.add_skipped(5)
        total = broker.skipped_total()
        with pytest.raises(ValueError, match="never negative"):
            broker.add_skipped(-1)
        with pytest.raises(ValueError, match="older than the published version 1"):
            await broker.publish(0, ["again"])
        after_refusals = broker.skipped_total()
        await broker.reset(7)
        return total, after_refusals, broker.skipped_total(), broker.latest()

    total, after_refusals, after_reset, latest = asyncio.run(run())
    assert total == 7 and after_refusals == 7
    assert after_reset == 0 and latest == (7, [])


def test_a_resumed_trainer_publishes_the_version_the_run_was_reset_to():
    """A resumed run resets the broker to its version, then its trainer publishes that same version
    (the replicas may be behind): accepted, waiters woken, published once."""

    async def run():
        broker = WeightBroker()
        await broker.reset(2)
        waiter = asyncio.ensure_future(broker.wait_newer(1, timeout_s=5))
        await broker.publish(2, ["resumed"])
        woken = await asyncio.wait_for(waiter, 1)
        published = dict(broker._published_at)
        await broker.publish(2, ["again"])  # a trainer restarted without a reset: same version
        return woken, published, broker._published_at, broker.latest()

    woken, published, published_after, latest = asyncio.run(run())
    assert woken == (2, ["resumed"])
    assert published_after == published  # the first publication's time is kept
    assert latest == (2, ["again"])


def test_a_stop_request_is_seen_until_the_next_reset():
    async def run():
        broker = WeightBroker()
        before = broker.stop_requested()
        broker.request_stop()
        during = broker.stop_requested()
        await broker.reset(0)
        return before, during, broker.stop_requested()

    assert asyncio.run(run()) == (False, True, False)


def test_wait_newer_returns_at_a_publication_or_after_its_timeout():
    async def run():
        broker = WeightBroker()
        await broker.publish(0, ["v0"])
        started = asyncio.get_running_loop().time()
        timed_out = await broker.wait_newer(0, timeout_s=0.05)
        waited = asyncio.get_running_loop().time() - started
        waiter = asyncio.ensure_future(broker.wait_newer(0, timeout_s=30))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # nothing newer yet
        await broker.publish(1, ["v1"])
        woken = await asyncio.wait_for(waiter, 1)
        at_once = await broker.wait_newer(0, timeout_s=30)  # already newer: no wait
        return timed_out, waited, woken, at_once

    timed_out, waited, woken, at_once = asyncio.run(run())
    assert timed_out == (0, ["v0"]) and waited >= 0.05
    assert woken == (1, ["v1"]) and at_once == (1, ["v1"])


def test_wait_version_returns_the_version_at_a_publication_or_after_its_timeout():
    async def run():
        broker = WeightBroker()
        await broker.publish(3, ["v3"])
        timed_out = await broker.wait_version(3, timeout_s=0.02)
        waiter = asyncio.ensure_future(broker.wait_version(3, timeout_s=30))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await broker.publish(4, ["v4"])
        return timed_out, await asyncio.wait_for(waiter, 1)

    assert asyncio.run(run()) == (3, 4)


def test_a_trainer_waiting_for_rows_wakes_at_a_commit_a_stop_or_its_timeout():
    async def run():
        broker = WeightBroker()
        started = asyncio.get_running_loop().time()
        timed_out = await broker.wait_committed(0, timeout_s=0.05)
        waited = asyncio.get_running_loop().time() - started
        waiter = asyncio.ensure_future(broker.wait_committed(0, timeout_s=30))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # no commit yet
        broker.rows_committed()
        woken = await asyncio.wait_for(waiter, 1)
        at_once = await broker.wait_committed(0, timeout_s=30)  # a commit since the count seen: no wait
        stopped = asyncio.ensure_future(broker.wait_committed(1, timeout_s=30))
        await asyncio.sleep(0.01)
        broker.request_stop()
        on_stop = await asyncio.wait_for(stopped, 1)
        await broker.reset(0)
        return timed_out, waited, woken, at_once, on_stop, await broker.wait_committed(-1, timeout_s=30)

    timed_out, waited, woken, at_once, on_stop, after_reset = asyncio.run(run())
    assert timed_out == 0 and waited >= 0.05
    assert woken == at_once == on_stop == 1 and after_reset == 0


def test_the_rows_a_trainer_waits_for_reach_the_writers_side_only_when_it_waits():
    """wait_demand returns at the trainer's next announced wait with the rows it wants; a wait that
    returns at once (a commit it has not seen) or wants nothing announces nothing; a reset starts over."""
    async def run():
        broker = WeightBroker()
        nothing = await broker.wait_demand(0, timeout_s=0.05)  # no wait announced yet
        follower = asyncio.ensure_future(broker.wait_demand(0, timeout_s=30))
        trainer = asyncio.ensure_future(broker.wait_committed(0, timeout_s=30, wanted=7))
        demanded = await asyncio.wait_for(follower, 1)
        broker.rows_committed()
        assert await asyncio.wait_for(trainer, 1) == 1
        await broker.wait_committed(0, timeout_s=30, wanted=3)  # returns at once: commit 1 is unseen
        await broker.wait_committed(1, timeout_s=0.01)  # waits, wanting nothing
        unchanged = await broker.wait_demand(demanded[0], timeout_s=0.05)
        await broker.reset(0)
        return nothing, demanded, unchanged, await broker.wait_demand(0, timeout_s=0.01)

    nothing, demanded, unchanged, after_reset = asyncio.run(run())
    assert nothing == (0, 0) and demanded == (1, 7) and unchanged == (1, 7) and after_reset == (0, 0)


def test_publish_latency_is_the_time_until_the_nth_replica_runs_the_version(monkeypatch):
    import sao.rollout.weights as weights

    clock = iter([100.0, 100.5, 101.25, 102.0])
    monkeypatch.setattr(weights.time, "time", lambda: next(clock))

    async def run():
        broker = WeightBroker()
        await broker.publish(3, ["v3"])  # at 100.0
        broker.ack("a", 2)  # an older version: not counted (100.5)
        first = broker.publish_latency(3, 1)
        broker.ack("a", 3)  # 101.25
        broker.ack("b", 4)  # a newer version counts as running 3 (102.0)
        return first, broker.publish_latency(3, 1), broker.publish_latency(3, 2), broker.publish_latency(3, 3), \
            broker.publish_latency(9, 1), broker.replica_versions()

    first, one, two, three, unknown, versions = asyncio.run(run())
    assert first is None and one == 1.25 and two == 2.0 and three is None and unknown is None
    assert versions == {"a": 3, "b": 4}


@pytest.mark.ray
def test_a_subscriber_applies_each_newer_version_and_acknowledges_it(ray_session):
    import threading

    import ray
    import torch

    from sao.rollout.weights import WeightSubscriber, get_or_create_broker, publish_weights

    broker = get_or_create_broker("test-subscriber")
    ray.get(broker.reset.remote(0))
    running = {"version": 0}
    applied: list[tuple[int, float]] = []
    done = threading.Event()

    def apply(version, weights):
        applied.append((version, float(weights["w"].sum())))
        running["version"] = version
        if version == 2:
            done.set()

    subscriber = WeightSubscriber(broker, "replica-1", lambda: running["version"], apply, wait_s=0.2)
    try:
        publish_weights(broker, 1, {"w": torch.ones(3)})
        publish_weights(broker, 2, {"w": torch.full((3,), 2.0)})
        assert done.wait(30)
        deadline = threading.Event()
        for _ in range(100):  # the acknowledgement of version 2 follows its application
            if ray.get(broker.replica_versions.remote()).get("replica-1") == 2:
                break
            deadline.wait(0.05)
        assert ray.get(broker.replica_versions.remote()) == {"replica-1": 2}
        assert applied[-1] == (2, 6.0) and [v for v, _ in applied] == sorted(v for v, _ in applied)
        assert ray.get(broker.publish_latency.remote(2, 1)) is not None
    finally:
        subscriber.close()
        ray.kill(broker)


@pytest.mark.ray
@pytest.mark.parametrize("apply_timeout_s, handed_twice", [(30.0, False), (0.3, True)], ids=["waits", "hands again"])
def test_a_version_the_engine_takes_long_to_run_is_handed_to_it_once(ray_session, apply_timeout_s, handed_twice):
    """A vLLM reload of a large model can outlast a minute: the subscriber waits the engine's own update
    timeout for a version to run (``apply_timeout_s``, :func:`sao.rollout.serve.update_timeout_s`) before
    handing the same weights over again (a second staged copy and reload)."""
    import threading

    import ray
    import torch

    from sao.rollout.weights import WeightSubscriber, get_or_create_broker, publish_weights

    broker = get_or_create_broker("test-slow-apply")
    ray.get(broker.reset.remote(0))
    running = {"version": 0}
    handed: list[int] = []

    def apply(version, weights):  # queued: the engine runs it 1.5 s later
        handed.append(version)
        threading.Timer(1.5, lambda: running.update(version=version)).start()

    subscriber = WeightSubscriber(broker, "replica-1", lambda: running["version"], apply, wait_s=0.1,
                                  apply_timeout_s=apply_timeout_s)
    try:
        publish_weights(broker, 1, {"w": torch.ones(3)})
        for _ in range(100):
            if running["version"] == 1:
                break
            threading.Event().wait(0.05)
        assert running["version"] == 1 and set(handed) == {1}
        assert (len(handed) > 1) is handed_twice, handed
    finally:
        subscriber.close()
        ray.kill(broker)


def test_the_engines_own_update_timeout_bounds_the_wait():
    from sao.rollout.serve import update_timeout_s
    from sao.rollout.vllm_engine import VLLMEngineConfig

    # vLLM's reload may take its whole update_timeout_s, and the pause and version label come on top
    assert update_timeout_s(type("Engine", (), {"config": VLLMEngineConfig(update_timeout_s=900.0)})()) == 960.0
    assert update_timeout_s(object()) == 60.0  # the torch engine swaps between decode steps
