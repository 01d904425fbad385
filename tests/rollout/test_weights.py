"""The weight broker's bookkeeping, on the class itself (the Ray actor runs the same code)."""

import asyncio

import pytest

from sao.rollout.weights import WeightBroker


def test_the_broker_adds_up_what_each_step_passed_over_and_starts_over_on_reset():
    async def run():
        broker = WeightBroker()
        await broker.publish(1, ["ref1"], skipped=2)
        await broker.publish(2, ["ref2"])
        await broker.publish(3, ["ref3"], skipped=5)
        total = broker.skipped_total()
        with pytest.raises(ValueError, match="not newer"):
            await broker.publish(3, ["again"], skipped=9)
        after_refusal = broker.skipped_total()
        await broker.reset(7)
        return total, after_refusal, broker.skipped_total(), broker.latest()

    total, after_refusal, after_reset, latest = asyncio.run(run())
    assert total == 7 and after_refusal == 7  # a refused publication adds nothing
    assert after_reset == 0 and latest == (7, [])
