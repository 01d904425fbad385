"""A small multi-turn evaluator: sampled accuracy of a policy on math_tool tasks, with the real tool loop.

Each episode runs the same loop the rollout engine will (prompt, action segment until a stop id,
sandboxed tool call, observation segment, ...), on batches of episodes in lock-step, with the same
budgets (``max_tokens`` over the whole completion, ``max_turns`` action segments) and the same ends (a
reward function that fails ends its episode with ``error`` and reward 0). Sampling is plain
ancestral sampling from ``softmax(logits / temperature)`` (no top-k / top-p), with a KV cache within
each action segment and a seeded generator, so a run is reproducible. This is the reference used to
report SFT quality; the batched, asynchronous rollout engine lives in :mod:`sao.rollout`.

Notation: B episodes in a batch, L context tokens (left-padded), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.envs.base import StepResult, Task, Termination
from sao.envs.math_tool import MathToolConfig, MathToolEnv
from sao.models.chat import ChatTokens, observation_ids, prompt_ids, without_turn_end
from sao.rewards import RewardError

__all__ = ["EvalConfig", "EvalResult", "Episode", "action_segments", "evaluate_agent", "evaluate_math",
           "run_math_episodes", "sample_segments"]

log = logging.getLogger(__name__)


EVAL_TIMEOUT_S = 86_400.0
"""An evaluated agent episode's wall-clock budget (:func:`evaluate_agent`): a day, in effect none."""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How the evaluator samples.

    Attributes:
        num_tasks: held-out tasks evaluated (the first ``num_tasks`` of the list given).
        temperature: sampling temperature (1.0: the policy's own distribution).
        max_tokens: token budget of an episode's completion, sampled and observation tokens together
            (a run's ``rollout.max_tokens``, as :class:`sao.rollout.agent.AgentConfig` spends it): each
            action segment may sample what is left of it, and an episode that spends it, or whose next
            observation would not fit in it, ends with ``length``.
        max_turns: action segments per episode; running out ends it (``turns``).
        batch_size: episodes decoded together.
        seed: seeds the sampler.
        tool_workers: threads running the sandboxed tool calls of a batch concurrently.
    """

    num_tasks: int = 500
    temperature: float = 1.0
    max_tokens: int = 192
    max_turns: int = 4
    batch_size: int = 64
    seed: int = 0
    tool_workers: int = 4

    def __post_init__(self) -> None:
        for name in ("num_tasks", "max_tokens", "max_turns", "batch_size", "tool_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"EvalConfig.temperature must be > 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class Episode:
    """One evaluated episode.

    Attributes:
        task_id: the task.
        reward: the terminal reward (0.0 unless the environment gave one).
        termination: why it ended.
        tool_calls: tool calls made.
        token_ids: prompt and every segment after it.
        action_mask: 1 at sampled tokens, 0 at prompt and observation tokens (same length as token_ids).
        error: what failed, for an episode that ended with ``error`` (a reward function); else None.
    """

    task_id: str
    reward: float
    termination: Termination
    tool_calls: int
    token_ids: tuple[int, ...]
    action_mask: tuple[int, ...]
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Aggregate of a run: ``accuracy`` = mean reward, ``stderr`` its binomial standard error."""

    accuracy: float
    stderr: float
    num_tasks: int
    mean_tool_calls: float
    terminations: dict[str, int]
    wall_s: float
    episodes: tuple[Episode, ...]


def action_segments(episode: Episode, tokenizer) -> list[str]:
    """The episode's action segments (each run of sampled tokens), decoded with special tokens kept, as
    the environment read them."""
    segments: list[list[int]] = []
    previous = 0
    for token, sampled in zip(episode.token_ids, episode.action_mask, strict=True):
        if sampled:
            if not previous:
                segments.append([])
            segments[-1].append(token)
        previous = sampled
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in segments]


def sample_segments(
    model: PreTrainedModel,
    contexts: Sequence[Sequence[int]],
    *,
    stop_token_ids: Sequence[int],
    max_new_tokens: int | Sequence[int],
    temperature: float,
    generator: torch.Generator,
    pad_id: int,
) -> list[tuple[list[int], bool]]:
    """Sample one action segment per context: ``(tokens, stopped)``; ``tokens`` ends with the stop id.

    The contexts are left-padded into one (B, L) batch; positions count real tokens only, so every row
    sees exactly the positions it would alone. Decoding stops for a row at a stop id or after
    ``max_new_tokens`` (``stopped`` False): one limit for every row, or one per row (what is left of
    each episode's budget). A row that stops early leaves the draws of the others as they were.
    """
    batch = len(contexts)
    limits = [max_new_tokens] * batch if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
    if len(limits) != batch or min(limits, default=1) < 1:
        raise ValueError(f"sample_segments: need a limit >= 1 for each of {batch} contexts, got {max_new_tokens!r}")
    limit = torch.tensor(limits, dtype=torch.long)
    width = max(len(c) for c in contexts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, context in enumerate(contexts):
        input_ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        attention_mask[row, width - len(context) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    finished = torch.zeros(batch, dtype=torch.bool)
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        next_position = position_ids[:, -1:] + 1
        for step in range(max(limits)):
            probs = torch.softmax(out.logits[:, -1, :].float() / temperature, dim=-1)
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            sampled = torch.where(finished, torch.full_like(sampled, pad_id), sampled)
            for row in (~finished).nonzero().flatten().tolist():
                tokens[row].append(int(sampled[row]))
            finished |= torch.isin(sampled, stops) | (limit <= step + 1)
            if bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            out = model(
                input_ids=sampled[:, None],
                attention_mask=attention_mask,
                position_ids=next_position,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            next_position = next_position + 1
    stop_set = set(int(s) for s in stop_token_ids)
    return [(row, bool(row) and row[-1] in stop_set) for row in tokens]


@dataclasses.dataclass
class _State:
    env: MathToolEnv
    task: Task
    ids: list[int]
    mask: list[int]
    prompt_length: int
    result: StepResult | None = None
    termination: Termination | None = None
    error: str | None = None

    def remaining(self, max_tokens: int) -> int:
        """What is left of the episode's completion budget (sampled and observation tokens)."""
        return max_tokens - (len(self.ids) - self.prompt_length)


def _step(state: _State, text: str) -> StepResult | None:
    """The environment's answer to an action; None when a reward function failed (the message is kept
    in ``state.error``): the episode ends with ``error``, as a trajectory does (sao.rewards), and the
    evaluation goes on. Any other exception is a fault of the evaluation itself and propagates."""
    try:
        return state.env.step(text)
    except RewardError as error:
        state.error = str(error)
        log.warning("evaluation of task %s: %s", state.task.task_id, error)
        return None


def _turn_text(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int], chat: ChatTokens) -> str:
    """The action text an environment steps on: the segment decoded with special tokens kept, less a
    closing end-of-turn token of the plain format (``<|eot_id|>``, ``<end_of_turn>``, ...), which ends
    the turn and is no part of the reply: the chat endpoint leaves it out of what the rollout's
    environment steps on (``ChatEndpoint.reply``), and a reward given it would compare
    ``'42<|eot_id|>'`` with ``'42'``. This format's tokenizer has no such ids (``end_ids`` is empty):
    its text keeps its ``<|im_end|>`` as before, which every built-in environment reads past itself."""
    return without_turn_end(tokenizer.decode(list(tokens), skip_special_tokens=False), tokens, chat.end_ids, tokenizer)


def run_math_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    config: EvalConfig | None = None,
    env_config: MathToolConfig | None = None,
    env_factory: Callable[[Task], MathToolEnv] | None = None,
) -> list[Episode]:
    """Run one sampled episode per task (multi-turn, real sandboxed tool) and return them in order.
    ``env_factory``: the environment of a task (default: math_tool with ``env_config``); it must
    follow math_tool's action format and count ``tool_calls`` (the ``dataset`` environment does).
    Budgets and ends as a rollout's (:class:`EvalConfig`); a step whose reward function fails ends
    its episode with ``error`` and reward 0 (:class:`sao.rewards.RewardError`)."""
    config = config or EvalConfig()
    chat = ChatTokens.from_tokenizer(tokenizer)
    generator = torch.Generator().manual_seed(config.seed)
    states = []
    for task in tasks:
        env = MathToolEnv(env_config) if env_factory is None else env_factory(task)
        context = prompt_ids(tokenizer, env.reset(task))
        states.append(_State(env, task, context, [0] * len(context), len(context)))
    was_training = model.training
    model.eval()
    with ThreadPoolExecutor(config.tool_workers) as pool:
        for _ in range(config.max_turns):
            for state in states:  # the budget is checked before the turn count, as in the agent loop
                if state.termination is None and state.remaining(config.max_tokens) <= 0:
                    state.termination = Termination.LENGTH
            active = [s for s in states if s.termination is None]
            for start in range(0, len(active), config.batch_size):
                chunk = active[start : start + config.batch_size]
                segments = sample_segments(
                    model,
                    [s.ids for s in chunk],
                    stop_token_ids=chat.stop_token_ids,
                    max_new_tokens=[s.remaining(config.max_tokens) for s in chunk],
                    temperature=config.temperature,
                    generator=generator,
                    pad_id=chat.pad_id,
                )
                stepped = [s for s, (_, stopped) in zip(chunk, segments, strict=True) if stopped]
                step_texts = [_turn_text(tokenizer, tokens, chat) for tokens, stopped in segments if stopped]
                results = dict(zip(map(id, stepped), pool.map(_step, stepped, step_texts), strict=True))
                for state, (tokens, stopped) in zip(chunk, segments, strict=True):
                    state.ids += tokens
                    state.mask += [1] * len(tokens)
                    if not stopped:
                        state.termination = Termination.LENGTH
                        continue
                    result = results[id(state)]
                    if result is None:
                        state.termination = Termination.ERROR
                    elif result.done:
                        state.result, state.termination = result, result.termination
                    else:
                        observation = observation_ids(tokenizer, result.observation)
                        if state.remaining(config.max_tokens) < len(observation):  # not appended
                            state.termination = Termination.LENGTH
                            continue
                        state.ids += observation
                        state.mask += [0] * len(observation)
    model.train(was_training)
    return [
        Episode(
            task_id=s.task.task_id,
            reward=s.result.reward if s.result is not None else 0.0,
            termination=s.termination or (Termination.LENGTH if s.remaining(config.max_tokens) <= 0
                                          else Termination.TURNS),
            tool_calls=s.env.tool_calls,
            token_ids=tuple(s.ids),
            action_mask=tuple(s.mask),
            error=s.error,
        )
        for s in states
    ]


def evaluate_agent(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    config: EvalConfig,
    env_factory: Callable[[Task], object],
    agent: str | None,
    agent_config,
) -> EvalResult:
    """:func:`evaluate_math`'s figures for ``agent``'s episodes on the first ``config.num_tasks`` of
    ``tasks``: one episode of ``agent`` (``module:function``: an agent of one's own, or a verifiers
    environment's rollout loop; None: the built-in tool loop in a model's own tool-call format,
    :mod:`sao.rollout.env_agent`) per task, run as a rollout replica runs it. The agent talks to the chat
    endpoint over the torch engine, both in this process (:class:`sao.rollout.user_agent.UserAgentRunner`),
    within the token and turn budgets of ``config``, sampling as ``agent_config`` (the run's
    :class:`sao.rollout.agent.AgentConfig`) says, so an agent that names the run's temperature in its
    requests is served as in a rollout (``config.temperature`` is not used). There is no wall-clock
    budget (:data:`EVAL_TIMEOUT_S`): how fast the machine evaluating is must not decide a figure. At most
    ``config.batch_size`` episodes run at once; episode ``i`` is seeded with ``config.seed`` and ``i``.
    The engine batches the episodes' calls, so the same seed gives the same samples up to rounding that
    depends on which calls were batched together. An episode's ``tool_calls``: its calls of the policy
    after its first (a reply with several tool calls counts once)."""
    import asyncio

    from sao.rollout.chat_endpoint import ChatEndpoint
    from sao.rollout.env_agent import environment_agent, tool_schema
    from sao.rollout.torch_engine import TorchEngine, TorchEngineConfig
    from sao.rollout.user_agent import UserAgentRunner

    if not tasks:
        raise ValueError("evaluate_agent: no tasks given")
    start = time.monotonic()
    agent_config = dataclasses.replace(agent_config, max_tokens=config.max_tokens, max_turns=config.max_turns,
                                       timeout_s=EVAL_TIMEOUT_S)
    engine = TorchEngine(model, config=TorchEngineConfig(max_batch=config.batch_size), seed=config.seed)

    async def episodes() -> list[Episode]:
        endpoint = ChatEndpoint(engine, tokenizer)
        runner = UserAgentRunner(endpoint, agent_config, "evaluation")
        slots = asyncio.Semaphore(config.batch_size)  # episodes in flight: what the engine decodes together

        async def one(index: int, task: Task) -> Episode:
            async with slots:
                env = env_factory(task)
                played = (runner.agent(agent, tuple(env.config.paths)) if agent else
                          environment_agent(env, task, steps, tool_schema(env, endpoint.tokens)))
                parts = await runner.run(played, env, task, "evaluation", f"evaluation-{index}",
                                         config.seed * 1_000_003 + index, built_in=not agent)
            first = parts[0]
            return Episode(task_id=task.task_id, reward=float(first.reward),
                           termination=Termination(first.termination_reason),
                           tool_calls=max(sum(part.num_turns for part in parts) - 1, 0),
                           token_ids=(*first.prompt_ids, *first.completion_ids),
                           action_mask=(0,) * len(first.prompt_ids) + tuple(int(m) for m in first.action_mask),
                           error=first.error)

        try:
            return list(await asyncio.gather(*(one(i, task) for i, task in enumerate(list(tasks)[: config.num_tasks]))))
        finally:
            await runner.close()
            await endpoint.close()

    try:
        with ThreadPoolExecutor(config.tool_workers) as steps:  # the built-in loop's environment steps (tools)
            return _result(asyncio.run(episodes()), time.monotonic() - start)
    finally:
        engine.close()


def evaluate_math(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    config: EvalConfig | None = None,
    env_config: MathToolConfig | None = None,
    env_factory: Callable[[Task], MathToolEnv] | None = None,
) -> EvalResult:
    """Sampled accuracy on the first ``config.num_tasks`` of ``tasks``: the mean reward (with a reward
    other than 0 or 1, the mean reward and its standard error)."""
    config = config or EvalConfig()
    if not tasks:
        raise ValueError("evaluate_math: no tasks given")
    start = time.monotonic()
    episodes = run_math_episodes(model, tokenizer, list(tasks)[: config.num_tasks], config, env_config, env_factory)
    return _result(episodes, time.monotonic() - start)


def _result(episodes: list[Episode], wall_s: float) -> EvalResult:
    n = len(episodes)
    accuracy = sum(e.reward for e in episodes) / n
    variance = sum((e.reward - accuracy) ** 2 for e in episodes) / n  # p(1 - p) for rewards of 0 and 1
    return EvalResult(
        accuracy=accuracy,
        stderr=math.sqrt(max(variance, 0.0) / n),
        num_tasks=n,
        mean_tool_calls=sum(e.tool_calls for e in episodes) / n,
        terminations=dict(Counter(str(e.termination) for e in episodes)),
        wall_s=wall_s,
        episodes=tuple(episodes),
    )
