"""From trajectory rows to padded training tensors, and micro-batches by token budget.

Notation: B sequences; L = longest prompt + completion (the model's input, right-padded); T = longest
completion. Completion token j of sequence b sits at input position ``prompt_len[b] + j``; the logits
that sampled it, and the value of the state it was sampled in, are read at position
``prompt_len[b] + j - 1``. The value after the last token (``V(s_end)``, the bootstrap of a budget
end) is read at the last real position.

:func:`collate` builds every tensor on CPU; the trainer moves a batch to its models' device
(:meth:`TrainBatch.to`), and what is computed from a batch stays on the batch's device.

MoE routing (R3): rows that carry a ``routed_experts`` record give ``routed_experts`` (B, L, M, K) and
``routing_mask`` (B, L), True at the input positions the rollout engine routed (a prefix of each row's
prompt + completion); the trainer replays them (:mod:`sao.models.routing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from sao.algos.sampling import LogprobKind
from sao.lake.records import decode_routing
from schemas.vocabulary import TerminationReason

__all__ = ["BOOTSTRAP_REASONS", "END_REASONS", "SKIP_REASONS", "TrainBatch", "collate", "completion_positions", "split_by_token_budget"]

# SAO.md section 2: after a budget end (max tokens, max turns, timeout) the return is bootstrapped with
# V(s_end); after a natural end V beyond it is 0. ``cancelled`` and ``error`` ends were cut short by the
# system, not by a budget the policy spent: by default the trainer stores them and passes over them
# (``SKIP_REASONS``; counted in ``batch/cut_short_skipped``). ``UpdateConfig.bootstrap_reasons`` and
# ``UpdateConfig.skip_reasons`` choose per run.
BOOTSTRAP_REASONS = (TerminationReason.LENGTH.value, TerminationReason.TURNS.value, TerminationReason.TIMEOUT.value)
SKIP_REASONS = (TerminationReason.CANCELLED.value, TerminationReason.ERROR.value)
END_REASONS = tuple(r.value for r in TerminationReason if r is not TerminationReason.STOP)
"""Every termination reason but ``stop`` (a natural end, always valued 0)."""


class TrainBatch(NamedTuple):
    """A padded batch of trajectories.

    Attributes:
        input_ids: (B, L) long, prompt + completion, right-padded with 0.
        attention_mask: (B, L) long, 1 on real tokens.
        prompt_lens: (B,) long.
        completion_lens: (B,) long.
        action_mask: (B, T) bool, completion tokens sampled by the policy.
        logp_rollout: (B, T) float32, engine log-probabilities (0 off actions).
        rewards: (B, T) float32, the trajectory reward on its last action token.
        bootstrap: (B,) bool, True where the termination reason is one of ``bootstrap_reasons``.
        staleness: (B,) long, trainer version minus the oldest version that sampled the trajectory.
        group_ids: (B,) long, sequences sampled from the same prompt share an id (GRPO).
        scalar_rewards: (B,) float32, one reward per trajectory.
        temperature, top_k, top_p: (B,) sampling settings the rollout recorded.
        raw_logprobs: (B,) bool, the rollout recorded raw (not sampling) log-probabilities.
        trajectory_ids: the ids, in row order.
        routed_experts: (B, L, M, K) uint8 expert ids the rollout routed each input position to, per MoE
            layer (M) in top-k order (K); None when no row carries a routing record.
        routing_mask: (B, L) bool, True where ``routed_experts`` holds a recorded routing; None with it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    action_mask: torch.Tensor
    logp_rollout: torch.Tensor
    rewards: torch.Tensor
    bootstrap: torch.Tensor
    staleness: torch.Tensor
    group_ids: torch.Tensor
    scalar_rewards: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    raw_logprobs: torch.Tensor
    trajectory_ids: tuple[str, ...]
    routed_experts: torch.Tensor | None = None
    routing_mask: torch.Tensor | None = None

    @property
    def num_action_tokens(self) -> torch.Tensor:
        """(B,) action tokens per sequence."""
        return self.action_mask.sum(-1)

    @property
    def device(self) -> torch.device:
        """Where the batch's tensors are (all on one device: :func:`collate` makes them on CPU, :meth:`to`
        moves them)."""
        return self.input_ids.device

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch with every tensor on ``device``; the batch itself when they are there already."""
        device = torch.device(device)
        if self.device == device:
            return self
        return TrainBatch(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                             for name, value in self._asdict().items()})

    def select(self, index: Sequence[int]) -> TrainBatch:
        """Rows ``index`` of the batch, trimmed to their own longest lengths."""
        rows = torch.as_tensor(list(index), dtype=torch.long, device=self.device)
        width_l = int((self.prompt_lens[rows] + self.completion_lens[rows]).max()) if len(rows) else 0
        width_t = int(self.completion_lens[rows].max()) if len(rows) else 0
        fields = {}
        for name, value in self._asdict().items():
            if name == "trajectory_ids":
                fields[name] = tuple(self.trajectory_ids[i] for i in rows.tolist())
            elif value is None:
                fields[name] = None
            elif name in ("input_ids", "attention_mask", "routed_experts", "routing_mask"):
                fields[name] = value[rows, :width_l]
            elif name in ("action_mask", "logp_rollout", "rewards"):
                fields[name] = value[rows, :width_t]
            else:
                fields[name] = value[rows]
        return TrainBatch(**fields)


def collate(rows: Sequence[Mapping], trainer_version: int,
            bootstrap_reasons: Sequence[str] = BOOTSTRAP_REASONS) -> TrainBatch:
    """Pad trajectory rows (as stored in the ``trajectories`` table) into a :class:`TrainBatch`.

    Each row needs ``trajectory_id``, ``task_id``, ``prompt_ids``, ``completion_ids``,
    ``action_mask``, ``logprobs``, ``reward``, ``termination_reason``, ``min_policy_version``,
    ``logprob_kind`` and ``sampling`` (with ``temperature``, ``top_k`` (None or 0 = off), ``top_p``);
    ``routed_experts`` and ``router_top_k`` are optional (absent or null: the row is routed live).
    """
    if not rows:
        raise ValueError("collate needs at least one trajectory row")
    batch = len(rows)
    prompt_lens = [len(r["prompt_ids"]) for r in rows]
    completion_lens = [len(r["completion_ids"]) for r in rows]
    width_l = max(p + c for p, c in zip(prompt_lens, completion_lens, strict=True))
    width_t = max(max(completion_lens), 1)
    input_ids = torch.zeros(batch, width_l, dtype=torch.long)
    attention_mask = torch.zeros(batch, width_l, dtype=torch.long)
    action_mask = torch.zeros(batch, width_t, dtype=torch.bool)
    logp_rollout = torch.zeros(batch, width_t, dtype=torch.float32)
    rewards = torch.zeros(batch, width_t, dtype=torch.float32)
    group_of: dict[str, int] = {}
    for b, row in enumerate(rows):
        ids = list(row["prompt_ids"]) + list(row["completion_ids"])
        n, t = len(ids), completion_lens[b]
        if len(row["action_mask"]) != t or len(row["logprobs"]) != t:
            raise ValueError(
                f"trajectory {row['trajectory_id']}: completion_ids ({t}), action_mask "
                f"({len(row['action_mask'])}) and logprobs ({len(row['logprobs'])}) differ in length"
            )
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        mask = torch.tensor(list(row["action_mask"]), dtype=torch.bool)
        action_mask[b, :t] = mask
        logp = torch.tensor([0.0 if v is None else float(v) for v in row["logprobs"]], dtype=torch.float32)
        logp_rollout[b, :t] = torch.where(mask, logp, torch.zeros(()))
        actions = mask.nonzero()
        if len(actions):
            rewards[b, int(actions[-1])] = float(row["reward"])
        group_of.setdefault(str(row["task_id"]), len(group_of))
    sampling = [r["sampling"] for r in rows]
    routed_experts, routing_mask = _collate_routing(rows, width_l)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
        completion_lens=torch.tensor(completion_lens, dtype=torch.long),
        action_mask=action_mask,
        logp_rollout=logp_rollout,
        rewards=rewards,
        bootstrap=torch.tensor([r["termination_reason"] in bootstrap_reasons for r in rows]),
        staleness=torch.tensor([trainer_version - int(r["min_policy_version"]) for r in rows], dtype=torch.long),
        group_ids=torch.tensor([group_of[str(r["task_id"])] for r in rows], dtype=torch.long),
        scalar_rewards=torch.tensor([float(r["reward"]) for r in rows], dtype=torch.float32),
        temperature=torch.tensor([float(s["temperature"]) for s in sampling], dtype=torch.float32),
        top_k=torch.tensor([int(s["top_k"] or 0) for s in sampling], dtype=torch.long),
        top_p=torch.tensor([float(s["top_p"]) for s in sampling], dtype=torch.float32),
        raw_logprobs=torch.tensor([LogprobKind(r["logprob_kind"]) is LogprobKind.RAW for r in rows]),
        trajectory_ids=tuple(str(r["trajectory_id"]) for r in rows),
        routed_experts=routed_experts,
        routing_mask=routing_mask,
    )


def _collate_routing(rows: Sequence[Mapping], width_l: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(routed_experts (B, L, M, K) uint8, routing_mask (B, L) bool)`` of the rows, or ``(None, None)``
    when none carries a routing record."""
    records = [decode_routing(r.get("routed_experts"), r.get("router_top_k")) for r in rows]
    shapes = {rec.shape[1:] for rec in records if rec is not None and len(rec)}
    if not shapes:
        return None, None
    if len(shapes) > 1:
        raise ValueError(f"collate: rows route through different (layers, top_k) shapes {sorted(shapes)}; "
                         "a batch needs one policy architecture")
    layers, top_k = shapes.pop()
    routed = torch.zeros(len(rows), width_l, layers, top_k, dtype=torch.uint8)
    mask = torch.zeros(len(rows), width_l, dtype=torch.bool)
    for b, (row, rec) in enumerate(zip(rows, records, strict=True)):
        if rec is None or not len(rec):
            continue
        tokens = len(row["prompt_ids"]) + len(row["completion_ids"])
        if len(rec) > tokens:
            raise ValueError(f"trajectory {row['trajectory_id']}: routed_experts has {len(rec)} entries, more "
                             f"than its {tokens} prompt and completion tokens")
        routed[b, : len(rec)] = torch.from_numpy(rec.copy())
        mask[b, : len(rec)] = True
    return routed, mask


def completion_positions(batch: TrainBatch, width: int | None = None) -> torch.Tensor:
    """(B, T) input positions whose outputs score completion token j: ``prompt_len + j - 1``
    (clamped into range on padding); ``width`` columns instead of T (T + 1 also reads the state after
    the last token)."""
    width_t = batch.action_mask.shape[1] if width is None else width
    positions = batch.prompt_lens.unsqueeze(-1) - 1 + torch.arange(width_t, device=batch.device).unsqueeze(0)
    return positions.clamp(max=batch.input_ids.shape[1] - 1)


def split_by_token_budget(batch: TrainBatch, token_budget: int) -> list[list[int]]:
    """Row groups whose padded size (rows x longest length) stays within ``token_budget``.

    Rows are bucketed by length (sorted, longest first) so that short sequences are not padded to the
    longest of the batch; a sequence longer than the budget gets a micro-batch of its own. The split
    changes no gradient: losses use the whole batch's denominators.
    """
    lengths = (batch.prompt_lens + batch.completion_lens).tolist()
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
