"""sao.rollout.engine: a generation bounded by a deadline, as the agent loop and the chat endpoint run it."""

from __future__ import annotations

import asyncio
import time

import pytest

from sao.rollout.engine import FinishReason, Generation, SamplingParams, generate_until


class SlowEngine:
    """Samples one token after ``delay_s``; a cancelled request ends at once with what it has (nothing)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.cancelled: list[str] = []
        self._stop: dict[str, asyncio.Event] = {}

    async def generate(self, prompt_ids, sampling, request_id=None) -> Generation:
        stop = self._stop.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(stop.wait(), self.delay_s)
            return Generation((), (), "sampling", FinishReason.CANCELLED, ())
        except TimeoutError:
            return Generation((7,), (-0.5,), "sampling", FinishReason.STOP, ())

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        self._stop.setdefault(request_id, asyncio.Event()).set()
        return True


SAMPLING = SamplingParams(max_tokens=4)


def test_a_generation_done_before_the_deadline_is_returned_as_it_is():
    engine = SlowEngine(0.01)
    generation, timed_out = asyncio.run(generate_until(engine, [1, 2], SAMPLING, "a", time.monotonic() + 5))
    assert (generation.token_ids, generation.finish_reason, timed_out) == ((7,), FinishReason.STOP, False)
    assert engine.cancelled == []


def test_at_the_deadline_the_request_is_cancelled_and_what_it_ends_with_is_kept():
    engine = SlowEngine(5.0)
    began = time.monotonic()
    generation, timed_out = asyncio.run(generate_until(engine, [1, 2], SAMPLING, "b", began + 0.05))
    assert timed_out and generation.finish_reason is FinishReason.CANCELLED and engine.cancelled == ["b"]
    assert time.monotonic() - began < 2.0


def test_a_caller_cancelled_while_it_waits_cancels_the_request_in_the_engine():
    engine = SlowEngine(5.0)

    async def cancel_the_caller():
        job = asyncio.ensure_future(generate_until(engine, [1], SAMPLING, "c", time.monotonic() + 60))
        await asyncio.sleep(0.05)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(cancel_the_caller())
    assert engine.cancelled == ["c"]
