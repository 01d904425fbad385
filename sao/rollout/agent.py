"""The agent loop: one task in, one complete trajectory record out.

Rollout replicas run every episode on their chat endpoint (:mod:`sao.rollout.env_agent` for these
environments); this in-process loop, straight on an engine, is what that path is tested against (the
same records, token for token) and what benchmarks and tests use without a replica.

    prompt -> action segment (sampled until a tool call ends or the turn ends)
           -> environment step (sandboxed tool) -> observation segment (action_mask 0, logprob 0.0)
           -> action segment -> ... -> answer / budget / timeout

Budgets and termination reasons (every path ends in exactly one):
    ``stop``      the environment ended the episode (an answer was given, or the turn ended);
    ``turns``     ``max_turns`` action segments ran (or the environment reports its own turn budget);
    ``length``    the completion reached ``max_tokens`` (actions and observations count), or the next
                  observation would not fit in what is left of it (it is then not appended);
    ``timeout``   the wall-clock budget ran out; tokens sampled so far are kept;
    ``cancelled`` the engine cancelled the request (shutdown, replica drain);
    ``error``     the engine or the environment failed; the message goes to the log.

Routing (MoE policies whose engine records it): each generation returns the routing of every token the
engine ran for that request, and the next turn's request runs the whole context again, so the last
generation's routing covers the whole trajectory but its final token (and any observation appended after
it): the trajectory keeps the longest routing it was given (the latest, unless a later request ran fewer
tokens, e.g. one cancelled before it started). See ``routed_experts`` in :mod:`schemas.trajectories`.

The reward comes from the environment on ``stop`` (and on its own ``turns`` end); every other end has
reward 0 and is bootstrapped by the trainer with V(s_end).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from sao.envs.base import Environment, Task
from sao.lake.records import RecordedSampling, Segment, Timings, TrajectoryRecord, utc_now
from sao.models.chat import ChatTokens, observation_ids, prompt_ids
from sao.models.tokenizer import chat_template_version, tokenizer_version
from sao.rollout.engine import Engine, FinishReason, SamplingParams, generate_until
from schemas.trajectories import SegmentKind, TerminationReason

__all__ = ["AgentConfig", "AgentLoop"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Budgets and sampling of the agent loop.

    Attributes:
        max_tokens: completion budget (action and observation tokens together).
        max_turns: most action segments per trajectory.
        timeout_s: wall-clock budget per trajectory.
        temperature, top_k, top_p: sampling settings (recorded with every trajectory).
        logprob_kind: record ``sampling`` or ``raw`` log-probabilities.
        tool_threads: threads that run environment steps (tools block, generation does not wait).
    """

    max_tokens: int = 192
    max_turns: int = 4
    timeout_s: float = 120.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logprob_kind: str = "sampling"
    tool_threads: int = 64

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_turns", "tool_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)  # validates


@dataclasses.dataclass
class _Trace:
    """What one trajectory has accumulated so far."""

    completion: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    segments: list[Segment] = dataclasses.field(default_factory=list)
    turns: int = 0
    error: str | None = None
    generation_s: float = 0.0
    tool_s: float = 0.0
    routed_experts: torch.Tensor | None = None

    def add_routing(self, routed_experts: torch.Tensor | None) -> None:
        """Keep the longest routing record seen (each covers a prefix of prompt + completion)."""
        if routed_experts is not None and (
                self.routed_experts is None or len(routed_experts) >= len(self.routed_experts)):
            self.routed_experts = routed_experts

    def add_action(self, token_ids, logprobs, spans) -> None:
        offset = len(self.completion)
        self.completion += list(token_ids)
        self.action_mask += [True] * len(token_ids)
        self.logprobs += [float(v) for v in logprobs]
        for span in spans:
            self.segments.append(Segment(SegmentKind.ACTION, offset + span.start, offset + span.end, span.version))

    def add_observation(self, token_ids: list[int]) -> None:
        start = len(self.completion)
        self.completion += token_ids
        self.action_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.segments.append(Segment(SegmentKind.OBSERVATION, start, len(self.completion), None))


class AgentLoop:
    """Runs tasks against one engine; one instance serves many concurrent trajectories.

    Args:
        engine: the generation backend (records log-probabilities and versions).
        tokenizer: the policy's tokenizer, following :mod:`sao.models.chat`'s format.
        env_factory: a fresh environment for a task (one per episode).
        config: budgets and sampling.
        worker_id: recorded in every trajectory (the replica's id).
    """

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase,
                 env_factory: Callable[[Task], Environment], config: AgentConfig | None = None,
                 worker_id: str = "local") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.config = config or AgentConfig()
        self.worker_id = worker_id
        self.tokens = ChatTokens.from_tokenizer(tokenizer)
        self.tokenizer_version = tokenizer_version(tokenizer)
        self.chat_template_version = chat_template_version(tokenizer)
        self._tools = concurrent.futures.ThreadPoolExecutor(self.config.tool_threads, thread_name_prefix="tool")

    def close(self) -> None:
        self._tools.shutdown(wait=False, cancel_futures=True)

    async def run(self, task: Task, run_id: str, trajectory_id: str | None = None,
                  seed: int | None = None) -> TrajectoryRecord:
        """Roll out ``task`` to its end; never raises for a failing engine or tool (``error``)."""
        cfg = self.config
        trajectory_id = trajectory_id or uuid.uuid4().hex
        created = utc_now()
        started_clock = time.monotonic()
        deadline = started_clock + cfg.timeout_s
        trace = _Trace()
        env = self.env_factory(task)
        prompt = prompt_ids(self.tokenizer, env.reset(task))
        reward, reason = 0.0, None
        try:
            reason, reward = await self._episode(env, prompt, trace, trajectory_id, seed, deadline)
        except Exception as failure:  # the environment, a tool or a reward function: stored, never raised
            log.exception("trajectory %s of task %s failed", trajectory_id, task.task_id)
            reason, reward = TerminationReason.ERROR, 0.0
            trace.error = f"{type(failure).__name__}: {failure}"
        finished = utc_now()
        return TrajectoryRecord(
            trajectory_id=trajectory_id, run_id=run_id, task_id=task.task_id, env_name=task.env,
            prompt_ids=prompt, completion_ids=trace.completion, action_mask=trace.action_mask,
            logprobs=trace.logprobs, logprob_kind=str(cfg.logprob_kind), segments=tuple(trace.segments),
            reward=float(reward), termination_reason=str(reason), num_turns=trace.turns,
            sampling=RecordedSampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None,
                                      max_tokens=cfg.max_tokens, seed=seed),
            tokenizer_version=self.tokenizer_version, chat_template_version=self.chat_template_version,
            engine_name=self.engine.name, engine_version=self.engine.engine_version, worker_id=self.worker_id,
            timings=Timings(created_at=created, started_at=created, finished_at=finished,
                            generation_s=trace.generation_s, tool_s=trace.tool_s),
            routed_experts=None if trace.routed_experts is None else trace.routed_experts.numpy(),
            error=trace.error,
        )

    async def _episode(self, env: Environment, prompt: list[int], trace: _Trace, trajectory_id: str,
                       seed: int | None, deadline: float) -> tuple[TerminationReason, float]:
        cfg = self.config
        loop = asyncio.get_running_loop()
        while True:
            remaining = cfg.max_tokens - len(trace.completion)
            if remaining <= 0:
                return TerminationReason.LENGTH, 0.0
            if trace.turns >= cfg.max_turns:
                return TerminationReason.TURNS, 0.0
            sampling = SamplingParams(
                temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_tokens=remaining,
                seed=None if seed is None else seed * 1009 + trace.turns, stop_token_ids=self.tokens.stop_token_ids,
                logprob_kind=cfg.logprob_kind,
            )
            request_id = f"{trajectory_id}-{trace.turns}"
            began = time.monotonic()
            generation, timed_out = await generate_until(self.engine, prompt + trace.completion, sampling,
                                                         request_id, deadline)
            trace.generation_s += time.monotonic() - began
            trace.add_action(generation.token_ids, generation.logprobs, generation.spans)
            trace.add_routing(generation.routed_experts)
            trace.turns += 1
            if timed_out:
                return TerminationReason.TIMEOUT, 0.0
            if generation.finish_reason is FinishReason.CANCELLED:
                return TerminationReason.CANCELLED, 0.0
            if generation.finish_reason is FinishReason.ERROR:
                log.error("engine error in %s: %s", request_id, generation.error)
                trace.error = f"engine: {generation.error}"
                return TerminationReason.ERROR, 0.0
            if generation.finish_reason is FinishReason.LENGTH:
                return TerminationReason.LENGTH, 0.0
            text = self.tokenizer.decode(list(generation.token_ids), skip_special_tokens=False)
            began = time.monotonic()
            result = await loop.run_in_executor(self._tools, env.step, text)
            trace.tool_s += time.monotonic() - began
            if result.done:
                return TerminationReason(str(result.termination)), float(result.reward)
            if time.monotonic() >= deadline:
                return TerminationReason.TIMEOUT, 0.0
            observation = observation_ids(self.tokenizer, result.observation)
            if len(trace.completion) + len(observation) > cfg.max_tokens:
                return TerminationReason.LENGTH, 0.0
            trace.add_observation(observation)

