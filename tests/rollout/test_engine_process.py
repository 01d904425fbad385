"""The engine process beyond the shared contract (``test_engine_contract.py`` runs that on it too):
a dying child fails its requests loudly, a child that cannot start says why, stats come back."""

import os
import signal

import pytest

from sao.rollout.engine import FinishReason, SamplingParams
from sao.rollout.engine_process import TorchEngineProcess
from tests.rollout.conftest import tiny_policy
from tests.rollout.test_engine_contract import PROMPTS, wait_for_progress


def broken_factory():
    raise OSError("no such checkpoint: /nowhere")


def test_a_child_that_cannot_build_the_model_says_why():
    with pytest.raises(RuntimeError, match="could not start: OSError: no such checkpoint: /nowhere"):
        TorchEngineProcess(broken_factory)


def test_a_killed_child_ends_requests_in_flight_as_errors_and_turns_unhealthy():
    engine = TorchEngineProcess(tiny_policy)
    try:
        assert engine.healthy()
        future = engine.submit(PROMPTS[1], SamplingParams(max_tokens=900, seed=0), request_id="k")
        wait_for_progress(engine, "k", 2)
        os.kill(engine._process.pid, signal.SIGKILL)
        generation = future.result(timeout=30)
        assert generation.finish_reason is FinishReason.ERROR
        assert "engine process died" in generation.error
        assert not engine.healthy()
        with pytest.raises(RuntimeError, match="the engine is closed: exit code -9"):
            engine.submit(PROMPTS[0], SamplingParams(max_tokens=4))
    finally:
        engine.close()


def test_stats_count_the_child_engine_work(process_engine):
    before = process_engine.stats()
    process_engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=6, seed=1), timeout=60)
    after = process_engine.stats()
    assert after.decode_steps - before.decode_steps == 5  # the first token comes from the join's forward
    assert after.prefilled_requests - before.prefilled_requests == 1
    assert after.busy_s > before.busy_s
