"""Agents of one's own: ``env.agent: "module:function"``, run against the chat endpoint.

An agent is an ``async`` function of an ``openai.AsyncOpenAI`` client and the task's row::

    async def agent(client, task) -> float | None | tuple[float | None, dict]:
        reply = await client.chat.completions.create(model="policy", messages=task["messages"])
        ...
        return reward            # or None: the run's reward functions score the conversation

The client is the real ``openai`` package's, pointed at the episode's endpoint
(:mod:`sao.rollout.chat_endpoint`) with the episode's own token; it makes no retries (a retried call
would be a second generation). ``task`` is a dict: ``task_id``, ``prompt`` (as the data gave it: a
string or chat messages), ``messages`` (the prompt as chat messages, ``env.system_prompt`` applied),
``answer`` and ``info`` (an object). Agents run concurrently in the rollout replica's event loop, so
they must not block it (run blocking tools with ``asyncio.to_thread``).

How an episode ends (``termination_reason``):

    ``stop``      the agent returned; its reward, or (None) the reward functions' score of the last
                  call's conversation (``reward.functions``, :mod:`sao.rewards`)
    ``turns``     it asked for more calls than ``rollout.max_turns``
    ``length``    a trajectory reached ``rollout.max_tokens`` (a reply that reached it is still given)
    ``timeout``   it ran past ``rollout.timeout_s`` (it is cancelled)
    ``cancelled`` the engine cancelled a generation (replica shutdown)
    ``error``     it raised, returned something that is not a reward, a reward function failed, or the
                  engine failed; the exception's text is kept in ``trajectories.error``

A budget end (``turns``, ``length``, ``timeout``) stands even when the agent catches the refused call
and returns a reward: as in the built-in loop, such an end has reward 0 and is bootstrapped by the
trainer. Every part of a split episode gets the episode's reward and termination reason.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sao.envs.base import Environment, Task
from sao.envs.dataset import task_messages
from sao.lake.records import RecordedSampling, Timings, TrajectoryRecord, utc_now
from sao.models.tokenizer import chat_template_version, tokenizer_version
from sao.rewards import RewardError, call_arguments, resolve_function
from sao.rollout.agent import AgentConfig
from sao.rollout.chat_endpoint import ChatEndpoint, Episode, EpisodePart
from schemas.vocabulary import TerminationReason

__all__ = ["AgentFunction", "AgentImportError", "EndpointCallError", "EndpointClient", "EpisodeEnded", "UserAgentRunner", "load_agent", "part_trajectory_id",
           "resolve_agent", "task_row"]

log = logging.getLogger(__name__)

AgentFunction = Callable[[Any, dict[str, Any]], Awaitable[Any]]


class EpisodeEnded(Exception):  # noqa: N818 - an end, not an error
    """Raised by an agent to end its episode with ``reason`` (``turns``: a budget of its own ran out;
    the reward is then 0 and the trainer bootstraps)."""

    def __init__(self, reason: TerminationReason | str) -> None:
        super().__init__(str(reason))
        self.reason = TerminationReason(reason)


class AgentImportError(ValueError):
    """``env.agent`` names nothing importable, or not an ``async`` function."""


def resolve_agent(spec: str, paths: tuple[str, ...] = ()) -> tuple[AgentFunction, str | None]:
    """The agent function of ``module:function`` (imported from ``paths``, the working directory or an
    installed package) and the folder it came from. Raises :class:`AgentImportError` naming what is wrong."""
    try:
        function, folder = resolve_function(spec, paths, what="agent")
    except ValueError as error:
        raise AgentImportError(str(error)) from None
    if not inspect.iscoroutinefunction(function):
        raise AgentImportError(f"agent {spec!r} must be an async function agent(client, task) (it runs in the "
                               "rollout replica's event loop)")
    return function, folder


def load_agent(spec: str, paths: tuple[str, ...] = ()) -> AgentFunction:
    """:func:`resolve_agent`'s function."""
    return resolve_agent(spec, paths)[0]


def task_row(task: Task, system_prompt: str = "") -> dict[str, Any]:
    """What an agent is given for ``task`` (the module docstring)."""
    return {"task_id": task.task_id, "prompt": json.loads(task.messages) if task.messages else task.prompt,
            "messages": task_messages(task, system_prompt), "answer": task.answer,
            "info": json.loads(task.info) if task.info else {}}


def part_trajectory_id(episode_id: str, part: int) -> str:
    """Part 0 keeps the id the rollout was issued under; part k is ``<episode_id>.k``."""
    return episode_id if part == 0 else f"{episode_id}.{part}"


def _outcome(result: Any) -> tuple[float | None, str | None]:
    """(reward or None, info as JSON or None) of what an agent returned; raises ``TypeError``."""
    info = None
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], Mapping):
            raise TypeError(f"the agent returned {result!r:.200}: expected a reward, None or (reward, info dict)")
        result, info = result[0], json.dumps(dict(result[1]), default=str)
    if result is None:
        return None, info
    if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
        raise TypeError(f"the agent returned {result!r:.200}: expected a finite number, None or (reward, info)")
    return float(result), info


class EndpointCallError(Exception):
    """The chat endpoint refused a call of :class:`EndpointClient` (its status and error, as the ``openai``
    client words them)."""

    def __init__(self, status: int, payload: Mapping[str, Any]) -> None:
        super().__init__(f"Error code: {status} - {dict(payload)}")
        self.status, self.payload = status, payload


class EndpointClient:
    """The built-in environments' client of an episode's chat endpoint: ``chat.completions.create(**body)``
    hands ``body`` as JSON to :meth:`ChatEndpoint.serve` in this process, as the ``openai`` client's
    in-process transport does, and returns the reply as the ``openai`` package's ``ChatCompletion``; a
    refusal raises :class:`EndpointCallError`. The endpoint's work is the same (parsing, rendering, the
    token record); what it leaves out is the ``openai`` client's request building and ``httpx``, about
    6 ms of a replica's CPU per episode in ``sao bench peer``'s single-turn shape (profiled), on the
    cores the engine decodes on."""

    def __init__(self, endpoint: ChatEndpoint, token: str) -> None:
        self._endpoint, self._authorization = endpoint, f"Bearer {token}"
        self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self._create))

    async def _create(self, **body: Any):
        from openai.types.chat import ChatCompletion

        status, payload = await self._endpoint.serve("POST", "/v1/chat/completions", self._authorization,
                                                     json.dumps(body).encode())
        if status != 200:
            raise EndpointCallError(status, payload)
        return ChatCompletion.model_validate(payload)


class UserAgentRunner:
    """Runs agents of one's own on one replica: its endpoint, one shared HTTP connection pool.

    Args:
        endpoint: the replica's chat endpoint.
        config: budgets and sampling (as the built-in loop's).
        worker_id: recorded in every trajectory.
    """

    def __init__(self, endpoint: ChatEndpoint, config: AgentConfig, worker_id: str) -> None:
        self.endpoint = endpoint
        self.config = config
        self.worker_id = worker_id
        self.tokenizer_version = tokenizer_version(endpoint.tokenizer)
        self.chat_template_version = chat_template_version(endpoint.tokenizer)
        self._agents: dict[tuple[str, tuple[str, ...]], AgentFunction] = {}
        self._http = None

    def agent(self, spec: str, paths: tuple[str, ...]) -> AgentFunction:
        key = (spec, paths)
        if key not in self._agents:
            self._agents[key] = load_agent(spec, paths)
        return self._agents[key]

    def client(self, token: str):
        """An ``openai.AsyncOpenAI`` client of one episode (no retries, the episode's token), whose requests
        reach the endpoint in this process; its ``base_url`` and ``api_key`` also work over 127.0.0.1 for
        an HTTP client of the agent's own."""
        import httpx
        import openai

        if self._http is None:  # in process: the endpoint's transport, no socket (chat_endpoint.ChatEndpoint.transport)
            self._http = httpx.AsyncClient(transport=self.endpoint.transport(), trust_env=False,
                                           timeout=httpx.Timeout(self.config.timeout_s))
        return openai.AsyncOpenAI(base_url=self.endpoint.url, api_key=token, max_retries=0,
                                  timeout=self.config.timeout_s, http_client=self._http)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def run(self, agent: AgentFunction, env: Environment, task: Task, run_id: str, episode_id: str,
                  seed: int | None = None, *, built_in: bool = False) -> list[TrajectoryRecord]:
        """One episode of ``agent`` on ``task``: its trajectories (one per part, in order). An agent of
        one's own gets the ``openai`` client (:meth:`client`); a ``built_in`` one (the environments'
        :func:`sao.rollout.env_agent.environment_agent`) an :class:`EndpointClient`."""
        await self.endpoint.start()
        created = utc_now()
        episode = self.endpoint.open(episode_id, self.config, seed)
        row = task_row(task, getattr(getattr(env, "config", None), "system_prompt", ""))
        reward, info = 0.0, None
        try:
            client = EndpointClient(self.endpoint, episode.token) if built_in else self.client(episode.token)
            result = await asyncio.wait_for(agent(client, row),
                                            timeout=max(episode.deadline - time.monotonic(), 0.0))
            reward, info = _outcome(result)
        except TimeoutError:
            if time.monotonic() >= episode.deadline:
                episode.end(TerminationReason.TIMEOUT)
            else:
                episode.end(TerminationReason.ERROR, "agent raised TimeoutError")
        except EpisodeEnded as ended:
            episode.end(ended.reason)
        except asyncio.CancelledError:
            episode.end(TerminationReason.CANCELLED)
            raise  # the finally below closes the episode
        except Exception as failure:  # the agent's own code: stored, never raised
            log.info("the agent of episode %s on task %s failed: %s", episode_id, task.task_id, failure)
            episode.end(TerminationReason.ERROR, f"{type(failure).__name__}: {failure}")
        finally:
            self.endpoint.finish(episode)
        if episode.ended is None:
            episode.end(TerminationReason.STOP)
            if reward is None:
                reward = await self._score(env, task, row, episode, info)
        if episode.ended is not TerminationReason.STOP:
            reward = 0.0
        return self._records(episode, task, row["messages"], run_id, created, float(reward or 0.0), info)

    async def _score(self, env: Environment, task: Task, row: dict[str, Any], episode: Episode,
                     info: str | None) -> float:
        """The reward functions' score of the last call's conversation (0.0 and ``error`` if one fails)."""
        messages = episode.last_messages
        completion = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        arguments = call_arguments(prompt=row["prompt"], completion=completion, messages=messages,
                                   answer=task.answer, info=row["info"], task_id=task.task_id)
        if info is not None:
            arguments["agent_info"] = json.loads(info)
        try:  # in a thread: RewardSet.score runs async reward functions with asyncio.run
            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(env.rewards.score,
                                                                                            **arguments))
        except RewardError as error:
            episode.ended, episode.error = TerminationReason.ERROR, str(error)
            return 0.0

    def _records(self, episode: Episode, task: Task, messages: list[dict[str, Any]], run_id: str, created,
                 reward: float, info: str | None) -> list[TrajectoryRecord]:
        """The episode's trajectories; ``messages``: the prompt the agent was given (the system prompt
        included), the record's prompt when the agent never called."""
        cfg = self.config
        parts = episode.parts or [EpisodePart(prompt=self.endpoint.encode(
            self.endpoint.render(messages, None)))]  # the agent never called: no tokens sampled
        finished, ended = utc_now(), time.monotonic()
        sampling = RecordedSampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None,
                                    max_tokens=cfg.max_tokens, seed=episode.seed)
        records = []
        for k, part in enumerate(parts):
            trace = part.trace
            part_end = parts[k + 1].began if k + 1 < len(parts) else ended
            records.append(TrajectoryRecord(
                trajectory_id=part_trajectory_id(episode.episode_id, k), run_id=run_id, task_id=task.task_id,
                env_name=task.env, prompt_ids=part.prompt, completion_ids=trace.completion,
                action_mask=trace.action_mask, logprobs=trace.logprobs, logprob_kind=str(cfg.logprob_kind),
                segments=tuple(trace.segments), reward=reward, termination_reason=str(episode.ended),
                num_turns=trace.turns, sampling=sampling, tokenizer_version=self.tokenizer_version,
                chat_template_version=self.chat_template_version, engine_name=self.endpoint.engine.name,
                engine_version=self.endpoint.engine.engine_version, worker_id=self.worker_id,
                timings=Timings(created_at=created, started_at=created, finished_at=finished,
                                generation_s=trace.generation_s,
                                tool_s=max(part_end - part.began - trace.generation_s, 0.0)),
                routed_experts=None if trace.routed_experts is None else trace.routed_experts.numpy(),
                error=episode.error if episode.ended is TerminationReason.ERROR else None,
                episode_id=episode.episode_id, episode_part=k, agent_info=info,
            ))
        return records

