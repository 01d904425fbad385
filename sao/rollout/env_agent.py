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

**A model's own tool-call format.** A policy whose tokenizer lacks this project's tool-call tokens
(a model of one's own) calls the sandboxed Python tool in its own format, when its chat template
renders tool calls in a layout the loop reads (:func:`sao.models.chat.renders_tool_calls`: Hermes JSON,
as Qwen2.5, Qwen3 and others write it; XML, as Qwen3.5 and later do; key-value lines, as GLM-4.5's
does; one bare JSON call a reply, as Llama 3.1 to 3.3 do; a ``[TOOL_CALLS]`` list, as Mistral 7B Instruct
v0.3's and Mistral Small 3.1's do, or ``[TOOL_CALLS]`` before each call, as Mistral's templates from
tokenizer version 11 on do, each call with an id its model writes where the template renders one) and the environment allows tool
calls (``max_tool_calls`` > 0): every request offers the one tool :func:`python_tool` (``python``,
argument ``code``; the template writes it into the prompt), each ``python`` call of a reply is one
environment step (several calls in a reply run in order), and each result goes back as a ``tool``
message answering its call's id, rendered by the template. A call of another name, or without a ``code`` string, is answered by a ``tool`` message
saying so (:func:`tool_answer`) and is no environment step; the episode goes on within its budgets
(:func:`answer_reply`). The environment's conversation, which the reward functions get as
``messages``, holds each call as this project's format writes one (``<tool_call>code</tool_call>``,
an assistant message per call, without the reply's text before its calls).
This runs in the ``dataset`` environment (tasks of one's own); the built-in math_tool task asks for
this project's format.
Trajectory replay renders such an episode again the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

from sao.envs.base import Environment, StepResult, Task, Termination
from sao.envs.dataset import ENV_NAME as DATASET
from sao.envs.dataset import tool_signatures
from sao.models.chat import IM_END, TOOL_CALL_END, TOOL_CALL_START, ChatTokens
from sao.rollout.chat_endpoint import MODEL_NAME
from sao.rollout.user_agent import AgentFunction, EpisodeEnded
from schemas.vocabulary import TerminationReason

__all__ = ["action_of", "answer_reply", "environment_agent", "python_tool", "steps_of", "tool_answer", "tool_schema"]


def action_of(message: Any) -> str:
    """The action text an environment steps on, from an endpoint reply's message: its content, then its
    tool calls as the built-in format writes them."""
    text = message.content or ""
    for call in message.tool_calls or ():
        text += f"{TOOL_CALL_START}{json.loads(call.function.arguments)['code']}{TOOL_CALL_END}"
    return text


def python_tool(functions: tuple[str, ...] = ()) -> dict[str, Any]:
    """The sandboxed Python tool as a chat template's tool definition (OpenAI's function format); the
    run's own tool functions (``env.tools``), defined before the code, are in its description, one
    line each (:func:`sao.envs.dataset.tool_signatures`)."""
    description = "Run Python code in a sandbox; the result is what the code prints."
    if functions:
        description += " Functions defined for the code to call: " + "; ".join(functions)
    return {"type": "function", "function": {"name": "python", "description": description, "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "description": "the Python code to run"}},
        "required": ["code"]}}}


def tool_schema(env: Environment, tokens: ChatTokens) -> list[dict[str, Any]] | None:
    """The tools every request of an episode of ``env`` offers: ``[python_tool(...)]`` when the policy
    calls tools in its own format (``tokens`` lack this project's tool-call tokens) in the ``dataset``
    environment (tasks of one's own) with tool calls allowed; None otherwise (this project's format, or
    single-turn: requests offer no tools). The built-in math_tool task asks for this project's format
    (its answers are ``<answer>`` tags), so a model of one's own runs it only with those tokens
    (:func:`sao.models.policy.check_model_directory`)."""
    config = getattr(env, "config", None)
    if tokens.supports_tools or getattr(env, "name", None) != DATASET or getattr(config, "max_tool_calls", 0) <= 0:
        return None
    return [python_tool(tool_signatures(tuple(config.tools), tuple(config.paths)))]


def steps_of(message: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    """How a reply in a model's own format steps the environment: ``(call id, action text)`` for each
    ``python`` call with a ``code`` string, in order (the action as the built-in format writes it); a
    call of another name or without code: ``(call id, None)``, answered without a step
    (:func:`tool_answer`); a reply without calls: ``[(None, its content and IM_END)]``, a final reply (a
    ``<tool_call>`` the reply holds as text, not a call in a layout the loop reads, is not run).
    ``message``: the assistant message as the endpoint keeps it (arguments as objects)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return [(None, (message.get("content") or "") + IM_END)]
    steps: list[tuple[str | None, str | None]] = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments")
        code = arguments.get("code") if isinstance(arguments, dict) else None
        ok = function.get("name") == "python" and isinstance(code, str)
        steps.append((call["id"], f"{TOOL_CALL_START}{code}{TOOL_CALL_END}" if ok else None))
    return steps


def tool_answer(message: dict[str, Any], call_id: str, output: str | None) -> dict[str, Any]:
    """The ``tool`` message that answers call ``call_id`` of ``message`` (a reply in a model's own
    format): the environment's ``output``, or for a call :func:`steps_of` does not step on (None), an
    error naming the one tool there is."""
    name = next(c["function"].get("name") for c in message["tool_calls"] if c["id"] == call_id)
    content = output if output is not None else (
        f"error: no tool {name!r} with these arguments; the one tool is python, called with {{\"code\": \"...\"}}")
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def answer_reply(env: Environment, message: dict[str, Any]) -> tuple[StepResult | None, list[dict[str, Any]]]:
    """Step ``env`` on a reply in a model's own format (``message``, as the endpoint keeps it): each
    of its calls in order (:func:`steps_of`), until one ends the episode. Returns (the result that
    ended it, or None; the ``tool`` messages that answer the calls, :func:`tool_answer`). A reply
    without calls is a final reply, which ends an episode of the ``dataset`` environment."""
    answers: list[dict[str, Any]] = []
    for call, action in steps_of(message):
        if action is None:
            answers.append(tool_answer(message, call, None))
            continue
        result = env.step(action)
        if result.done:
            return result, answers
        answers.append(tool_answer(message, call, result.observation))
    return None, answers


def environment_agent(env: Environment, task: Task, tools: concurrent.futures.Executor,
                      schema: list[dict[str, Any]] | None = None) -> AgentFunction:
    """The agent of one episode of ``env`` on ``task``; environment steps run on ``tools``. ``schema``:
    the tools a model of one's own is offered (:func:`tool_schema`; the module docstring), None with
    this project's format."""

    async def agent(client: Any, row: dict[str, Any]) -> float:
        loop = asyncio.get_running_loop()
        messages = list(env.reset(task))
        offered = {"tools": schema} if schema else {}
        while True:
            reply = await client.chat.completions.create(model=MODEL_NAME, messages=messages, **offered)
            choice = reply.choices[0]
            if choice.finish_reason == "length":  # the trajectory's budget: the endpoint ended it (length)
                return 0.0
            if schema:  # the model's own format: each call a step, each answered
                ended, answers = await loop.run_in_executor(tools, answer_reply, env, _kept(choice.message))
            else:
                result = await loop.run_in_executor(tools, env.step, action_of(choice.message))
                ended, answers = (result, []) if result.done else (None, [{"role": "tool", "content": result.observation}])
            if ended is not None:
                if ended.termination == Termination.TURNS:
                    raise EpisodeEnded(TerminationReason.TURNS)
                return float(ended.reward)
            messages += [choice.message.model_dump(exclude_none=True), *answers]

    return agent


def _kept(message: Any) -> dict[str, Any]:
    """An ``openai`` reply message as the endpoint keeps it: tool-call arguments as objects."""
    kept = message.model_dump(exclude_none=True)
    for call in kept.get("tool_calls", ()):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return kept
