"""The built-in environments on the chat endpoint (what every replica runs) give the agent loop's
records, token for token, for the same seeds: prompts, actions, observations, masks, log-probabilities,
versions, rewards and ends."""

import asyncio
import concurrent.futures

import numpy as np
import pytest

from sao.envs import make_env
from sao.envs.base import Split, Task
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.chat_endpoint import ChatEndpoint
from sao.rollout.env_agent import environment_agent
from sao.rollout.torch_engine import TorchEngine
from sao.rollout.user_agent import UserAgentRunner
from tests.test_user_agent import PROMPTS

TASKS = [Task(task_id=f"t{i}", env="math_tool", prompt=p["prompt"], answer=p["answer"], split=Split.TRAIN)
         for i, p in enumerate(PROMPTS[:12])]  # the prompts the policy below was taught on


@pytest.fixture(scope="module")
def engine(tokenizer, tmp_path_factory):
    """The tiny policy taught to open with a tool call and answer after its output (tests/test_user_agent.py)."""
    from sao.models.policy import load_policy
    from tests.test_user_agent import tool_calling_policy

    engine = TorchEngine(load_policy(tool_calling_policy(tokenizer, tmp_path_factory.mktemp("taught") / "model")))
    yield engine
    engine.close()


def both_paths(engine, tokenizer, config, env_options):
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env, **env_options), config)
    tools = concurrent.futures.ThreadPoolExecutor(4)

    async def go():
        endpoint = ChatEndpoint(engine, tokenizer)
        runner = UserAgentRunner(endpoint, config, "local")
        try:
            pairs = []
            for seed, task in enumerate(TASKS):
                looped = await loop.run(task, "r", f"t{seed}", seed)
                for built_in in (True, False):  # the built-in client, and the openai client an own agent gets
                    env = make_env(task.env, **env_options)
                    (served,) = await runner.run(environment_agent(env, task, tools), env, task, "r", f"t{seed}",
                                                 seed, built_in=built_in)
                    pairs.append((looped, served))
            return pairs
        finally:
            await runner.close()
            await endpoint.close()

    try:
        return asyncio.run(go())
    finally:
        loop.close()
        tools.shutdown()


@pytest.mark.parametrize("config, options, end", [
    (AgentConfig(max_tokens=160, max_turns=3), {}, "stop"),
    (AgentConfig(max_tokens=18, max_turns=4), {}, "length"),
    (AgentConfig(max_tokens=160, max_turns=1), {}, "turns"),
    (AgentConfig(max_tokens=160, max_turns=3), {"max_tool_calls": 0}, "turns"),
], ids=["stop", "length budget", "turn budget", "environment's turn budget"])
def test_the_endpoint_path_records_what_the_agent_loop_records(engine, tokenizer, config, options, end):
    pairs = both_paths(engine, tokenizer, config, options)
    reasons, observations = set(), 0
    for looped, served in pairs:
        assert list(served.prompt_ids) == list(looped.prompt_ids)
        assert list(served.completion_ids) == list(looped.completion_ids), looped.trajectory_id
        np.testing.assert_array_equal(served.action_mask, looped.action_mask)
        np.testing.assert_array_equal(served.logprobs, looped.logprobs)
        assert served.segments == looped.segments
        assert (served.reward, served.termination_reason, served.num_turns) == (
            looped.reward, looped.termination_reason, looped.num_turns)
        assert served.episode_id == looped.trajectory_id and looped.episode_id is None
        reasons.add(looped.termination_reason)
        observations += sum(s.kind == "observation" for s in looped.segments)
    assert end in reasons, reasons
    assert observations > 0 or end != "stop"  # tool calls and their outputs compared too
