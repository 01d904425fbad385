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
