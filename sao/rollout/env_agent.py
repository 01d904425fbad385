"""The built-in environments on the chat endpoint: one agent path for every episode.

A rollout replica runs math_tool, style_preference and the ``dataset`` environment's tool loop as an
agent (:func:`environment_agent`) on its chat endpoint, the same way as an agent of one's own
(:mod:`sao.rollout.user_agent`; its client is the endpoint's in-process
:class:`~sao.rollout.user_agent.EndpointClient`, not the ``openai`` package's, which records the
same: tested): the environment's prompt goes out as chat messages, each reply comes
back as the policy's action (its text, a tool call as ``<tool_call>code</tool_call>``), the
environment steps on it (in a thread: tools block), and a tool's output goes back as a ``tool``
message, which the endpoint records as the observation. The records are those of
:class:`sao.rollout.agent.AgentLoop`, token for token, for the same seeds (``tests/rollout/test_env_agent.py``):
the same prompt ids, the same per-call seeds, the same observation ids (a tool's output as plain text),
the same ends (the environment's ``stop`` and ``turns``; the endpoint's ``length``, ``turns`` and
``timeout``; ``error`` with the text of what failed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

from sao.envs.base import Environment, Task, Termination
from sao.models.chat import TOOL_CALL_END, TOOL_CALL_START
from sao.rollout.chat_endpoint import MODEL_NAME
from sao.rollout.user_agent import AgentFunction, EpisodeEnded
from schemas.vocabulary import TerminationReason

__all__ = ["action_of", "environment_agent"]


def action_of(message: Any) -> str:
    """The action text an environment steps on, from an endpoint reply's message: its content, then its
    tool calls as the built-in format writes them."""
    text = message.content or ""
    for call in message.tool_calls or ():
        text += f"{TOOL_CALL_START}{json.loads(call.function.arguments)['code']}{TOOL_CALL_END}"
    return text


def environment_agent(env: Environment, task: Task, tools: concurrent.futures.Executor) -> AgentFunction:
    """The agent of one episode of ``env`` on ``task``; environment steps run on ``tools``."""

    async def agent(client: Any, row: dict[str, Any]) -> float:
        loop = asyncio.get_running_loop()
        messages = list(env.reset(task))
        while True:
            reply = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
            choice = reply.choices[0]
            if choice.finish_reason == "length":  # the trajectory's budget: the endpoint ended it (length)
                return 0.0
            result = await loop.run_in_executor(tools, env.step, action_of(choice.message))
            if result.done:
                if result.termination == Termination.TURNS:
                    raise EpisodeEnded(TerminationReason.TURNS)
                return float(result.reward)
            messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "content": result.observation}]

    return agent
