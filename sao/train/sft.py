"""SFT warm start: teach the tiny policy an environment's format, then save it as policy version 0.

Demonstrations are generated, not collected, for the environment ``SFTConfig.env`` names:

- ``math_tool`` (the default): for each train task, the ideal conversation of
  :func:`sao.envs.math_tool.demonstration` (tool call, tool output, answer);
- ``style_preference``: for each train task, one reply in **every** style
  (:func:`style_demonstrations`, sentences of :func:`sao.envs.style_preference.render_in_style`), so
  the warm-started policy writes all styles about equally often and RL can move the preference
  between them (the online-learning benchmark). No style is preferred in the demonstrations, unless
  ``StylePreferenceConfig.warm_start_bias`` adds more in the first style of the reader a prompt names.

Each conversation is laid out as token segments exactly as the agent loop lays out a trajectory
(:mod:`sao.models.chat`). The loss is the token-mean
negative log-likelihood over **action tokens only** (what the assistant samples: the tool call up to
``</tool_call>``, the answer up to ``<|im_end|>``); prompt and observation tokens are context.

The math tool outputs in the demonstrations are the reference answers (the sandbox would print exactly
these; a test checks a sample), so building thousands of demonstrations costs no tool calls.

SFT deliberately stops short, because RL needs room above it. Rather than a fixed step count (the
copy skill appears abruptly, at a seed-dependent step), training stops once the *validation success
probability* reaches ``target_success``:

    p_success = mean over validation demonstrations i of  prod_t pi_theta(a_t | s_t)  over i's action tokens

the probability that sampling at temperature 1 reproduces the demonstration exactly, computed by
teacher forcing on train-split tasks held out of training. Other correct paths are rare, so sampled
accuracy tracks it closely and the target sets the warm start's accuracy (measured 0.42-0.48 on
held-out tasks for the default 0.45, see docs/RESULTS.md). With ``target_success=None`` training runs
``max_steps``; that is the setting for ``style_preference``, whose demonstrations are equally good
alternatives (the success probability of one of them is at most about 1 / (styles x templates)).
Validation tasks are whole tasks (all of a task's demonstrations) taken from the end of the train split. The result is saved
with the tokenizer and ``sao_policy.json`` (version 0, tokenizer and template versions, the config
and the training metrics), loadable with :func:`sao.models.policy.load_policy`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sao.algos.masked import aggregate
from sao.envs import math_tool, style_preference
from sao.envs.base import Split, Task
from sao.envs.math_tool import MathToolConfig, demonstration
from sao.envs.style_preference import Style, StylePreferenceConfig, render_in_style, topic_of
from sao.models.chat import ChatTokens, Message, action_text, observation_ids, prompt_ids
from sao.models.policy import PolicyConfig, build_policy, save_policy
from sao.models.tokenizer import TokenizerConfig, build_tokenizer

__all__ = [
    "Example",
    "LogPoint",
    "SFTConfig",
    "SFTResult",
    "action_logprobs",
    "collate",
    "conversation_example",
    "demonstration_example",
    "demonstrations",
    "sft_loss",
    "sft_warm_start",
    "style_demonstrations",
    "success_probability",
]

SFT_ENVS: tuple[str, ...] = (math_tool.ENV_NAME, style_preference.ENV_NAME)
"""Environments the warm start has demonstrations for."""


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The SFT warm start. Defaults: well under 4 minutes on 2 CPU cores, leaving room for RL.

    Attributes:
        max_steps: optimiser steps at most (the cosine schedule spans them).
        target_success: stop once the validation success probability reaches this; ``None`` = never.
        eval_every: steps between validation measurements (and ``on_log`` callbacks).
        validation_tasks: train-split tasks set aside (never trained on) for the validation measure.
        env: whose demonstrations to train on, one of :data:`SFT_ENVS`.
        batch_size: demonstrations per step.
        learning_rate: AdamW peak learning rate.
        warmup_steps: linear warm-up from 0 to the peak.
        min_lr_ratio: cosine decay ends at ``learning_rate * min_lr_ratio``.
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient clipping.
        seed: seeds the policy initialisation and the batch order.
        num_threads: torch intra-op threads.
        policy: architecture of the policy.
        tokenizer: tokenizer training.
        math: the math_tool task generator (its train split supplies the demonstrations).
        style: the style_preference task generator (likewise, when ``env`` is ``style_preference``).
    """

    max_steps: int = 600
    target_success: float | None = 0.45
    eval_every: int = 10
    validation_tasks: int = 256
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    num_threads: int = 2
    policy: PolicyConfig = PolicyConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    math: MathToolConfig = MathToolConfig()
    env: str = math_tool.ENV_NAME
    style: StylePreferenceConfig = StylePreferenceConfig()

    def __post_init__(self) -> None:
        if self.env not in SFT_ENVS:
            raise ValueError(f"SFTConfig.env must be one of {SFT_ENVS}, got {self.env!r}")
        for name in ("max_steps", "eval_every", "validation_tasks", "batch_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.target_success is not None and not 0 < self.target_success < 1:
            raise ValueError(f"SFTConfig.target_success must lie in (0, 1) or be None, got {self.target_success}")
        if not self.learning_rate > 0:
            raise ValueError(f"SFTConfig.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"SFTConfig.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"SFTConfig.warmup_steps must be >= 0, got {self.warmup_steps}")


class Example(NamedTuple):
    """One demonstration as a trajectory: ``input_ids`` and ``action_mask`` (1 = assistant-sampled)."""

    input_ids: list[int]
    action_mask: list[int]


class LogPoint(NamedTuple):
    """One validation measurement: ``step``, mean training ``loss`` since the last point, ``success``."""

    step: int
    loss: float
    success: float


@dataclasses.dataclass(frozen=True)
class SFTResult:
    """What a warm start produced.

    Attributes:
        path: the policy directory (version 0).
        steps: optimiser steps taken.
        reached_target: training stopped because the validation success reached the target.
        success: the last validation success probability.
        action_tokens: action tokens trained on (the loss's denominator, summed over steps).
        tokens: all tokens processed in training (padding excluded).
        wall_s: seconds from start to the saved directory.
        train_s: seconds in the optimisation loop (validation included).
        log: the validation measurements, in order.
    """

    path: Path
    steps: int
    reached_target: bool
    success: float
    action_tokens: int
    tokens: int
    wall_s: float
    train_s: float
    log: tuple[LogPoint, ...]


def style_demonstrations(task: Task, rng: random.Random, answer_tag: bool = False, favoured: Style | None = None,
                         extra: int = 0) -> list[list[Message]]:
    """One conversation per style (in :class:`~sao.envs.style_preference.Style` order), then ``extra``
    more in the ``favoured`` style: ``task``'s prompt answered by a sentence about its topic in that
    style (templates drawn from ``rng``; inside ``<answer>...</answer>`` with ``answer_tag``)."""
    topic = topic_of(task)
    styles = [*Style, *([favoured] * extra if favoured is not None else [])]
    return [[{"role": "user", "content": task.prompt},
             {"role": "assistant", "content": render_in_style(topic, style, rng, answer_tag)}] for style in styles]


def demonstrations(config: SFTConfig) -> list[list[list[Message]]]:
    """The demonstrations of ``config.env``, grouped by train task (task order): math_tool one per
    task, style_preference one per style (and ``warm_start_bias`` more in the style of the reader the
    prompt names); deterministic for a config."""
    if config.env == style_preference.ENV_NAME:
        rng = random.Random(config.seed)
        tasks = style_preference.generate_tasks(config.style)
        style = config.style

        def favoured(task: Task) -> Style | None:
            persona = style_preference.persona_of(task)
            return style.judge.schedule_of(persona).preferred(0) if persona else None

        return [style_demonstrations(task, rng, style.answer_tag, favoured(task), style.warm_start_bias)
                for task in tasks if task.split is Split.TRAIN]
    return [[demonstration(task)] for task in math_tool.generate_tasks(config.math) if task.split is Split.TRAIN]


def conversation_example(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> Example:
    """Lay out a conversation as prompt / action / observation / action segments: the messages before
    the first assistant message are the prompt."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = prompt_ids(tokenizer, messages[:first])
    mask = [0] * len(ids)
    for message in messages[first:]:
        if message["role"] == "tool":
            segment, flag = observation_ids(tokenizer, message["content"]), 0
        else:
            segment, flag = tokenizer.encode(action_text(message), add_special_tokens=False), 1
        ids += segment
        mask += [flag] * len(segment)
    return Example(ids, mask)


def demonstration_example(tokenizer: PreTrainedTokenizerBase, task: Task) -> Example:
    """Lay out math_tool ``task``'s demonstration (:func:`sao.envs.math_tool.demonstration`)."""
    return conversation_example(tokenizer, demonstration(task))


def collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to ``(input_ids, attention_mask, action_mask)``, each (B, L); action_mask bool."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    action_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention_mask[row, :n] = 1
        action_mask[row, :n] = torch.tensor(example.action_mask, dtype=torch.bool)
    return input_ids, attention_mask, action_mask


def action_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(token t | tokens < t) at action tokens: ``(logp, mask)``, both (B, L - 1).

    Token t is predicted from the logits at t - 1, so the targets are ``input_ids[:, 1:]`` and the
    mask is ``action_mask[:, 1:]``; ``logp`` is 0 where the mask is False.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = action_mask[:, 1:]
    return torch.where(mask, logp, torch.zeros((), dtype=logp.dtype)), mask


def sft_loss(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Token-mean NLL over the action tokens of the batch: ``(loss, number of action tokens)``."""
    logp, mask = action_logprobs(model, input_ids, attention_mask, action_mask)
    return aggregate(-logp, mask, "token"), int(mask.sum())


def success_probability(model: PreTrainedModel, examples: Sequence[Example], pad_id: int, batch_size: int = 128) -> float:
    """Mean over ``examples`` of prod_t pi(a_t | s_t) over each one's action tokens (teacher-forced)."""
    if not examples:
        raise ValueError("success_probability: no examples")
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            input_ids, attention_mask, action_mask = collate(examples[start : start + batch_size], pad_id)
            logp, _ = action_logprobs(model, input_ids, attention_mask, action_mask)
            total += float(logp.sum(dim=-1).exp().sum())
    model.train(was_training)
    return total / len(examples)


def _learning_rate(config: SFTConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    floor = config.min_lr_ratio
    return config.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def sft_warm_start(
    config: SFTConfig | None = None,
    out_dir: str | Path = "runs/sft",
    *,
    on_log: Callable[[LogPoint], None] | None = None,
) -> SFTResult:
    """Build tokenizer and policy, train on ``config.env``'s demonstrations, save policy version 0 to ``out_dir``."""
    config = config or SFTConfig()
    start = time.monotonic()
    torch.set_num_threads(config.num_threads)
    tokenizer = build_tokenizer(config.tokenizer)
    if len(tokenizer) > config.policy.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but PolicyConfig.vocab_size is {config.policy.vocab_size}")
    chat = ChatTokens.from_tokenizer(tokenizer)
    model = build_policy(config.policy, seed=config.seed)
    model.train()
    per_task = demonstrations(config)
    if len(per_task) <= config.validation_tasks:
        source = "math" if config.env == math_tool.ENV_NAME else "style"
        raise ValueError(f"SFTConfig.{source} has {len(per_task)} train tasks, not more than "
                         f"validation_tasks={config.validation_tasks}")
    cut = len(per_task) - config.validation_tasks
    train = [conversation_example(tokenizer, messages) for group in per_task[:cut] for messages in group]
    validation = [conversation_example(tokenizer, messages) for group in per_task[cut:] for messages in group]
    steps, reached, log, action_tokens, tokens, train_s = _fit(model, train, validation, chat.pad_id, config, on_log)
    model.eval()
    metrics = {"steps": steps, "reached_target": reached, "validation_success": log[-1].success,
               "action_tokens": action_tokens, "tokens": tokens, "train_s": train_s}  # fmt: skip
    extra = {"source": "sao.train.sft", "sft_config": dataclasses.asdict(config), "sft_metrics": metrics}
    path = save_policy(model, out_dir, tokenizer, policy_version=0, extra=_jsonable(extra))
    return SFTResult(
        path=path,
        steps=steps,
        reached_target=reached,
        success=log[-1].success,
        action_tokens=action_tokens,
        tokens=tokens,
        wall_s=time.monotonic() - start,
        train_s=train_s,
        log=tuple(log),
    )


def _fit(model: PreTrainedModel, train: Sequence[Example], validation: Sequence[Example], pad_id: int,
         config: SFTConfig, on_log: Callable[[LogPoint], None] | None
         ) -> tuple[int, bool, list[LogPoint], int, int, float]:
    """The SFT optimisation: (steps, reached the target, validation log, action tokens, tokens, seconds)."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    generator = torch.Generator().manual_seed(config.seed)
    log: list[LogPoint] = []
    window: list[float] = []
    action_tokens = tokens = steps = 0
    reached = False
    train_start = time.monotonic()
    while steps < config.max_steps and not reached:
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, steps)
        rows = torch.randint(len(train), (config.batch_size,), generator=generator).tolist()
        input_ids, attention_mask, action_mask = collate([train[r] for r in rows], pad_id)
        loss, count = sft_loss(model, input_ids, attention_mask, action_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        steps += 1
        action_tokens += count
        tokens += int(attention_mask.sum())
        window.append(float(loss.detach()))
        if steps % config.eval_every == 0 or steps == config.max_steps:
            point = LogPoint(steps, sum(window) / len(window), success_probability(model, validation, pad_id))
            log.append(point)
            window = []
            reached = config.target_success is not None and point.success >= config.target_success
            if on_log is not None:
                on_log(point)
    train_s = time.monotonic() - train_start
    return steps, reached, log, action_tokens, tokens, train_s


def own_example(tokenizer: PreTrainedTokenizerBase, chat: ChatTokens, task: Task, completion: str,
                system_prompt: str = "", tools: list | None = None) -> Example:
    """A demonstration for a model of one's own, laid out as its rollouts are: the task's prompt
    through the model's chat template with the generation prompt (and ``tools``, the ones its rollouts
    offer: :func:`sao.runs.own_format_tools`), then the completion's tokens and the turn's end token as
    the action (what the engine samples, and where it stops)."""
    from sao.envs.dataset import task_messages

    if tools:  # rendered as the chat endpoint renders a rollout's first request
        from sao.rollout.chat_endpoint import ChatRendering, normalise_messages

        rendering = ChatRendering(tokenizer, chat)
        ids = rendering.encode(rendering.render(normalise_messages(task_messages(task, system_prompt)), tools))
    else:
        ids = prompt_ids(tokenizer, task_messages(task, system_prompt))
    # The end of the turn: in this project's tool format the stop ids begin with </tool_call>, not it.
    end = chat.im_end_id if chat.supports_tools else chat.stop_token_ids[0]
    action = tokenizer.encode(completion, add_special_tokens=False) + [end]
    return Example(ids + action, [0] * len(ids) + [1] * len(action))


def sft_own_model(model_dir: str | Path, demonstrations: Sequence[tuple[Task, str]], out_dir: str | Path,
                  config: SFTConfig | None = None, *, system_prompt: str = "", tools: list | None = None,
                  template_variables: Mapping[str, Any] | None = None,
                  on_log: Callable[[LogPoint], None] | None = None) -> SFTResult:
    """SFT of the model at ``model_dir`` on ``demonstrations`` ((task, completion) pairs,
    :func:`sao.data.load_demonstrations`), saved as policy version 0 to ``out_dir``; ``system_prompt``
    and ``tools`` lay the prompts out as the run's rollouts have them (:func:`own_example`), and
    ``template_variables`` are set in its chat template as the run's (``model.chat_template_kwargs``:
    :func:`sao.models.tokenizer.with_template_variables`). A seeded tenth of
    the demonstrations (at most ``config.validation_tasks``, at least one) is held out for the success
    measure; ``config``'s policy, tokenizer and task settings do not apply."""
    from sao.models.policy import check_model_directory, load_policy

    config = config or SFTConfig()
    if len(demonstrations) < 2:
        raise ValueError(f"SFT needs at least 2 demonstrations (one is held out), got {len(demonstrations)}")
    start = time.monotonic()
    torch.set_num_threads(config.num_threads)
    tokenizer = check_model_directory(model_dir, template_variables=template_variables)
    chat = ChatTokens.from_tokenizer(tokenizer)
    torch.manual_seed(config.seed)
    model = load_policy(model_dir)
    model.train()
    examples = [own_example(tokenizer, chat, task, completion, system_prompt, tools) for task, completion in demonstrations]
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    held = max(1, min(config.validation_tasks, len(examples) // 10))
    validation = [examples[i] for i in order[:held]]
    train = [examples[i] for i in order[held:]]
    steps, reached, log, action_tokens, tokens, train_s = _fit(model, train, validation, chat.pad_id, config, on_log)
    model.eval()
    metrics = {"steps": steps, "reached_target": reached, "validation_success": log[-1].success,
               "action_tokens": action_tokens, "tokens": tokens, "train_s": train_s,
               "demonstrations": len(train), "held_out": held}  # fmt: skip
    extra = {"source": str(Path(model_dir).resolve()), "chat_template_kwargs": dict(template_variables or {}),
             "sft_config": dataclasses.asdict(config), "sft_metrics": metrics}
    path = save_policy(model, out_dir, tokenizer, policy_version=0, extra=_jsonable(extra))
    return SFTResult(path=path, steps=steps, reached_target=reached, success=log[-1].success,
                     action_tokens=action_tokens, tokens=tokens, wall_s=time.monotonic() - start, train_s=train_s,
                     log=tuple(log))


def _jsonable(value: object) -> object:
    """Config dicts with tuples and enums made JSON-friendly."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
