"""The agent loop on math_tool with the torch engine: segments, masks and every termination reason."""

import asyncio

import numpy as np
import pytest
import torch

from sao.envs import make_env
from sao.envs.base import StepResult, Termination
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.validate import validate_record
from sao.models.chat import ChatTokens, observation_ids
from sao.models.policy import load_policy
from sao.models.routing import record_routing
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.torch_engine import TorchEngine


def stopping_policy(policy_dir, tokenizer, boost=4.0):
    """The random tiny policy with a bias towards the two stop ids, so turns end after ~10 tokens."""
    policy = load_policy(policy_dir)
    bias = torch.zeros(policy.config.vocab_size)
    bias[list(ChatTokens.from_tokenizer(tokenizer).stop_token_ids)] = boost
    policy.lm_head.bias = torch.nn.Parameter(bias)
    return policy


@pytest.fixture
def engine(policy_dir, tokenizer):
    engine = TorchEngine(stopping_policy(policy_dir, tokenizer))
    yield engine
    engine.close()


TASKS = generate_tasks(MathToolConfig(num_train=8, num_heldout=0))


def run(loop, task, **kw):
    return asyncio.run(loop.run(task, run_id="r1", **kw))


class ScriptedEnv:
    """Answers every action with a fixed observation, then ends after ``turns`` steps."""

    name = "math_tool"

    def __init__(self, turns=2, output="42", reward=1.0, termination=Termination.STOP):
        self.turns, self.output, self.reward, self.termination = turns, output, reward, termination
        self.steps = 0

    def reset(self, task):
        return [{"role": "user", "content": task.prompt}]

    def step(self, action_text):
        self.steps += 1
        if self.steps >= self.turns:
            return StepResult(None, True, self.reward, self.termination)
        return StepResult(self.output, False)


def check_record(record, tokenizer):
    n = len(record.completion_ids)
    assert len(record.action_mask) == len(record.logprobs) == n
    covered = np.zeros(n, dtype=int)
    for seg in record.segments:
        covered[seg.start:seg.end] += 1
        is_action = seg.kind == "action"
        assert record.action_mask[seg.start:seg.end].all() == is_action
        assert (seg.policy_version is not None) == is_action
    assert (covered == 1).all()
    obs = ~record.action_mask
    assert (record.logprobs[obs] == 0.0).all()
    assert (record.logprobs[record.action_mask] <= 0).all()


def test_observation_tokens_are_never_actions(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(turns=3, output="1234"),
                     AgentConfig(max_tokens=300, max_turns=5))
    record = run(loop, TASKS[0], seed=1)
    check_record(record, tokenizer)
    assert record.termination_reason == "stop" and record.reward == 1.0 and record.num_turns == 3
    observation = observation_ids(tokenizer, "1234")
    kinds = [s.kind for s in record.segments]
    assert kinds == ["action", "observation", "action", "observation", "action"]
    obs_segment = record.segments[1]
    assert list(record.completion_ids[obs_segment.start:obs_segment.end]) == observation
    stops = ChatTokens.from_tokenizer(tokenizer).stop_token_ids
    first = record.segments[0]
    assert record.completion_ids[first.end - 1] in stops  # an action segment ends at a stop id
    loop.close()


def test_turn_budget_ends_with_turns(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(turns=100), AgentConfig(max_tokens=400, max_turns=2))
    record = run(loop, TASKS[1], seed=2)
    check_record(record, tokenizer)
    assert record.termination_reason == "turns" and record.num_turns == 2 and record.reward == 0.0
    assert record.segments[-1].kind == "observation"


def test_token_budget_ends_with_length(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(turns=100), AgentConfig(max_tokens=5, max_turns=50))
    record = run(loop, TASKS[2], seed=3)
    check_record(record, tokenizer)
    assert record.termination_reason == "length" and len(record.completion_ids) <= 5


def test_timeout_keeps_the_tokens_sampled_so_far(engine, tokenizer):
    engine.pause()  # nothing decodes: the deadline passes mid-generation
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(), AgentConfig(timeout_s=0.3))
    record = run(loop, TASKS[3], seed=4)
    engine.resume()
    assert record.termination_reason == "timeout" and record.reward == 0.0
    check_record(record, tokenizer)


def test_engine_cancellation_ends_with_cancelled(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(), AgentConfig())

    async def cancel_in_flight():
        engine.pause()
        job = asyncio.ensure_future(loop.run(TASKS[4], run_id="r1", trajectory_id="tc"))
        while engine.in_flight == 0:
            await asyncio.sleep(0.001)
        assert engine.cancel("tc-0")
        engine.resume()
        return await asyncio.wait_for(job, timeout=60)

    record = asyncio.run(cancel_in_flight())
    assert record.termination_reason == "cancelled" and record.num_turns == 1
    check_record(record, tokenizer)


def test_a_cancelled_rollout_stops_its_request_in_the_engine(engine, tokenizer):
    # A rollout cancelled from outside (the driver: stale, or a Ctrl-C) must not leave the engine
    # decoding its request to the token budget for nobody.
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(), AgentConfig())

    async def cancel_the_rollout():
        engine.pause()  # its request waits in the engine, as one being decoded would
        job = asyncio.ensure_future(loop.run(TASKS[5], run_id="r1", trajectory_id="tr"))
        while engine.in_flight == 0:
            await asyncio.sleep(0.001)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        left = engine.in_flight
        engine.resume()
        return left

    assert asyncio.run(cancel_the_rollout()) == 0


class BrokenEnv(ScriptedEnv):
    def step(self, action_text):
        raise RuntimeError("the environment broke")


def test_environment_failure_ends_with_error_not_an_exception(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, lambda task: BrokenEnv(), AgentConfig(max_tokens=300))
    record = run(loop, TASKS[5], seed=5)
    assert record.termination_reason == "error"
    assert record.error is not None and record.error.startswith("RuntimeError: ")  # stored with the record
    check_record(record, tokenizer)


def test_a_reward_function_that_raises_ends_the_trajectory_with_error_and_its_message(engine, tokenizer):
    from sao.envs.base import Task
    from sao.envs.dataset import DatasetEnv, DatasetEnvConfig

    config = DatasetEnvConfig(rewards=("tests.envs.test_dataset:raises",), max_tool_calls=0)
    loop = AgentLoop(engine, tokenizer, lambda task: DatasetEnv(config), AgentConfig(max_tokens=300, max_turns=1))
    task = Task("t1", "dataset", "What is 2 + 2?", "4", "train")
    record = run(loop, task, seed=3)  # this seed's turn ends within the budget, so the reward is asked for
    assert record.termination_reason == "error" and record.reward == 0.0
    assert "reward function tests.envs.test_dataset:raises raised ValueError: no reward for you" in record.error
    assert validate_record(record, newest_version=0) == []


def test_natural_end_is_distinguishable_from_budget_ends(engine, tokenizer):
    natural = run(AgentLoop(engine, tokenizer, lambda t: ScriptedEnv(turns=1), AgentConfig()), TASKS[6], seed=6)
    budget = run(AgentLoop(engine, tokenizer, lambda t: ScriptedEnv(turns=9), AgentConfig(max_turns=1)), TASKS[6], seed=6)
    assert natural.termination_reason == "stop" and budget.termination_reason == "turns"


def test_real_math_tool_records_pass_lake_validation(engine, tokenizer):
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env), AgentConfig(max_tokens=160, max_turns=3))

    async def many():
        return await asyncio.gather(*[loop.run(t, run_id="r1", seed=i) for i, t in enumerate(TASKS)])

    records = asyncio.run(many())
    for record in records:
        check_record(record, tokenizer)
        assert record.sampling.temperature == 1.0 and record.engine_name == "torch"
    for record in records:
        assert validate_record(record, newest_version=0) == []
    loop.close()


def test_multi_turn_routing_covers_the_whole_trajectory_but_its_last_token(engine, tokenizer, policy_dir):
    loop = AgentLoop(engine, tokenizer, lambda task: ScriptedEnv(turns=3, output="1234"),
                     AgentConfig(max_tokens=300, max_turns=5))
    record = run(loop, TASKS[1], seed=2)
    assert record.num_turns == 3 and (~record.action_mask).any()  # observations between the turns
    ids = record.prompt_ids.tolist() + record.completion_ids.tolist()
    assert record.routed_experts.shape == (len(ids) - 1, 2, 2)
    # The last turn's request ran the whole context again: its routing is a plain forward's.
    reference = stopping_policy(policy_dir, tokenizer).eval()
    with record_routing(reference) as recorder, torch.no_grad():
        reference(torch.tensor([ids[:-1]]))
    expected = recorder.pop().numpy()
    assert (np.sort(record.routed_experts, -1) == np.sort(expected, -1)).all()
    assert validate_record(record, newest_version=0) == []
    loop.close()
