"""Oracle values from demonstrations: a diagnostic of the critic (``algorithm.oracle_values``).

Does a better critic lift a plateau, or is the optimiser the limit? With ``oracle_values`` the policy's
advantages use, in place of the critic's values, the value of each state as the task's demonstration
gives it (the critic is still trained and reported, so its figures compare with the oracle's):

- a state on the demonstration's path (the completion so far is a prefix of the demonstration's
  completion, observations included, up to the stop token that ends its answer) is worth the
  probability that the current policy, sampling at temperature 1, completes the demonstration from
  there: the product of ``pi(token | prefix)`` over the demonstration's action tokens still to come,
  teacher-forced (one forward pass per trajectory, under the rollout's own prompt);
- a state off the path is worth 0.

For math_tool (:func:`sao.envs.math_tool.demonstration`: the tool call with the task's expression, the
tool's output, the answer) this is the success probability wherever the demonstration's wording is the
only way to succeed, and a lower bound elsewhere: a state after a wrong digit is worth 0, the state
before it the chance of copying the rest right. Only tasks with a demonstration have oracle values:
the built-in math_tool tasks (an unknown task id is an error, never a silent 0).

:func:`value_steps_off_path` measures the other side: how the critic's own value moves at the first
token of a failed rollout that leaves its demonstration's path (for a digit copied wrongly, that digit),
where the oracle's falls to 0, beside how it moves at the tokens on the path before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from sao.envs.base import Task
from sao.envs.math_tool import demonstration, generate_tasks
from sao.models.chat import ChatTokens, prompt_ids
from sao.train.batch import TrainBatch
from sao.train.batch import collate as collate_rows
from sao.train.sft import Example, action_logprobs, collate, conversation_example
from sao.train.step import critic_values

__all__ = ["DemonstrationOracle", "attach_oracle", "on_path", "value_steps_off_path"]


class DemonstrationOracle:
    """Values ``(values (B, T), v_end (B,))`` of a batch's states from its tasks' demonstrations, laid
    out as :func:`sao.train.step.critic_values` lays out the critic's.

    Args:
        policy: the policy being trained (its current weights give the probabilities).
        tokenizer: the policy's tokenizer (the demonstration is laid out as the rollouts are).
        tasks: task id -> task with a demonstration; None: the built-in math_tool tasks.
    """

    def __init__(self, policy: torch.nn.Module, tokenizer, tasks: Mapping[str, Task] | None = None) -> None:
        if tasks is None:
            tasks = {task.task_id: task for task in generate_tasks()}
        self.policy = policy
        self.tokenizer = tokenizer
        self.tasks = tasks
        self._completions: dict[str, tuple[list[int], list[int]]] = {}
        self._stop_ids = set(ChatTokens.from_tokenizer(tokenizer).stop_token_ids)

    def completion(self, task_id: str) -> tuple[list[int], list[int]]:
        """The demonstration's completion tokens (actions and observations) and its action mask."""
        if task_id not in self._completions:
            task = self.tasks.get(task_id)
            if task is None:
                raise ValueError(f"oracle values: task {task_id!r} has no demonstration (they exist for the built-in "
                                 "math_tool tasks only); turn algorithm.oracle_values off for this run")
            messages = demonstration(task)
            example = conversation_example(self.tokenizer, messages)
            start = len(prompt_ids(self.tokenizer, messages[:1]))
            ids, mask = example.input_ids[start:], example.action_mask[start:]
            # a rollout's last action ends at its first stop token (``</answer>``): the demonstration's
            # ``<|im_end|>`` after it is never sampled, so it is no part of succeeding
            last = max(i for i, flag in enumerate(mask) if not flag) + 1 if 0 in mask else 0
            end = next((i + 1 for i in range(last, len(ids)) if ids[i] in self._stop_ids), len(ids))
            self._completions[task_id] = (ids[:end], mask[:end])
        return self._completions[task_id]

    @torch.no_grad()
    def __call__(self, rows: Sequence[Mapping], batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The oracle's values of ``rows`` (the rows of ``batch``, in its order)."""
        device = batch.action_mask.device
        width_t = batch.action_mask.shape[1]
        values = torch.zeros((len(rows), width_t), device=device)
        v_end = torch.zeros(len(rows), device=device)
        sequences, masks, spans = [], [], []
        for row in rows:
            demo_ids, demo_mask = self.completion(row["task_id"])
            prompt = list(row["prompt_ids"])
            sequences.append(prompt + demo_ids)
            masks.append([0] * len(prompt) + demo_mask)
            spans.append((len(prompt), demo_ids))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids, attention_mask, action_mask = collate(
            [Example(ids, mask) for ids, mask in zip(sequences, masks, strict=True)], pad)
        logp, mask = action_logprobs(self.policy, input_ids.to(device), attention_mask.to(device),
                                     action_mask.to(device))
        zero = torch.zeros((len(rows), 1), device=device)
        # token[b, i]: log pi of the demonstration's input token i if it is an action token, else 0
        token = torch.cat([zero, torch.where(mask, logp.float(), 0.0)], 1)  # (B, L)
        # to_come[b, i]: the sum of token[b, i:], the log-probability of completing from position i
        to_come = torch.cat([torch.flip(torch.cumsum(torch.flip(token, [1]), 1), [1]), zero], 1)  # (B, L + 1)
        for b, (row, (start, demo_ids)) in enumerate(zip(rows, spans, strict=True)):
            completion = list(row["completion_ids"])
            shared = on_path(completion, demo_ids)
            # the state before completion token j is on the path for j <= shared
            reach = min(shared, len(completion) - 1)
            if reach >= 0:
                values[b, : reach + 1] = to_come[b, start : start + reach + 1].exp()
            if len(completion) <= shared:  # the whole completion is on the path
                v_end[b] = to_come[b, start + len(completion)].exp()
        return torch.where(batch.action_mask, values, torch.zeros_like(values)), v_end


def on_path(completion: Sequence[int], demonstration_ids: Sequence[int]) -> int:
    """How many of ``completion``'s first tokens are the demonstration's (its tokens from there on are
    off the path; all of them on it when this is ``len(completion)``)."""
    shared = 0
    while shared < min(len(completion), len(demonstration_ids)) and completion[shared] == demonstration_ids[shared]:
        shared += 1
    return shared


@torch.no_grad()
def value_steps_off_path(critic: torch.nn.Module, demonstrations: DemonstrationOracle, rows: Sequence[Mapping],
                         *, oracle_too: bool = False) -> dict[str, float | int | None]:
    """How ``critic``'s value moves where each of ``rows`` (trajectory rows; failed rollouts are what
    this is for) leaves its task's demonstration's path, beside how it moves on the path.

    A rollout counts when its first token off the path is an action token ``j`` (one that leaves at
    an observation, or never, does not). Its step off the path is ``V(after) - V(before)``: ``V(before)``
    the value of the state token ``j`` was sampled in, ``V(after)`` that of the state of its next action
    token (``V(s_end)`` when ``j`` is its last). Its steps on the path are the same differences at its
    action tokens before ``j``. ``demonstrations``: their completions
    (:meth:`DemonstrationOracle.completion`); with ``oracle_too``, its values as well (they need its
    policy), whose step off the path is minus its value before, as its value falls to 0 there.

    Returns ``rollouts`` (counted), ``not_counted``, ``value_before`` (mean ``V(before)``),
    ``step_off_path`` (mean over the rollouts) and ``step_on_path`` (mean over their action tokens
    before ``j``), and with ``oracle_too`` the last three of the oracle's prefixed ``oracle_``; a mean
    over nothing is None.
    """
    counted: list[tuple[int, list[int], int]] = []  # (row, its action tokens, the index among them of j)
    for b, row in enumerate(rows):
        completion, mask = list(row["completion_ids"]), list(row["action_mask"])
        first = on_path(completion, demonstrations.completion(row["task_id"])[0])
        if first < len(completion) and mask[first]:
            actions = [j for j, flag in enumerate(mask) if flag]
            counted.append((b, actions, actions.index(first)))
    out: dict[str, float | int | None] = {"rollouts": len(counted), "not_counted": len(rows) - len(counted)}
    batch = collate_rows(rows, trainer_version=0) if counted else None
    sources = [("", lambda: critic_values(critic, batch))]
    if oracle_too:
        sources.append(("oracle_", lambda: demonstrations(rows, batch)))
    for prefix, read in sources:
        values, v_end = read() if counted else (None, None)
        before, off, on = [], [], []
        for b, actions, at in counted:
            value = [float(values[b, j]) for j in actions] + [float(v_end[b])]  # V at each action, then V(s_end)
            before.append(value[at])
            off.append(value[at + 1] - value[at])
            on.extend(value[i + 1] - value[i] for i in range(at))
        out |= {f"{prefix}value_before": _mean(before), f"{prefix}step_off_path": _mean(off),
                f"{prefix}step_on_path": _mean(on)}
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def attach_oracle(learner, tokenizer) -> None:
    """Give ``learner`` the demonstration oracle when its config asks for oracle values; ``tokenizer``:
    the policy's, or the directory to load it from (only then)."""
    if learner.config.oracle_values and learner.policy_values is None:
        if isinstance(tokenizer, str | Path):
            from sao.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        learner.policy_values = DemonstrationOracle(learner.policy, tokenizer)
