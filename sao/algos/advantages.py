"""Advantages: skip-observation GAE (SAO section 2), GRPO group baselines, a running-mean baseline, and
the self-imitation control's success indicator.

Notation:
    B sequences, T tokens after the prompt; ``action_mask`` (B, T) True at tokens the policy sampled.
    Action tokens of one sequence, in order and with observation tokens removed: a_0 ... a_{n-1}.

    delta_i = r_i + gamma * V(a_{i+1}) - V(a_i)
    A_i     = delta_i + gamma * lam * A_{i+1}
    V(a_n)  = bootstrap value: 0 after a natural end, V(s_end) after a budget truncation.

Observation (tool output) and padding tokens are transparent: the recursion carries ``next_value`` and
the running advantage across them unchanged, exactly like ordinary GAE on the action-only subsequence.
Rewards must sit on action tokens (the last action token for a terminal reward): a non-zero reward on a
non-action token is an error rather than being dropped silently.

Departures and choices (the paper leaves them open):
    * gamma defaults to 1.0 in callers (public ports); lam_critic = 1.0; lam_policy is length-adaptive.
    * ``length_adaptive_lambda`` clamps the count to at least one token and the result to [0, 1].
    * GRPO's std is the unbiased sample std (as TRL computes it); a group of one gets advantage 0.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch

from sao.algos.masked import check_same_shape

__all__ = [
    "RunningMeanBaseline",
    "broadcast_to_actions",
    "flat_groups",
    "grpo_advantages",
    "length_adaptive_lambda",
    "skip_observation_gae",
    "success_advantages",
]


def _per_sequence(lam: float | torch.Tensor, batch: int, like: torch.Tensor) -> torch.Tensor:
    """``lam`` as a (B,) tensor of ``like``'s dtype; a float becomes a constant tensor."""
    if isinstance(lam, torch.Tensor):
        if lam.dim() == 0:
            return lam.to(like.dtype).expand(batch)
        if tuple(lam.shape) != (batch,):
            raise ValueError(f"lam must be a float or a (B,) tensor with B={batch}, got shape {tuple(lam.shape)}")
        return lam.to(like.dtype)
    return torch.full((batch,), float(lam), dtype=like.dtype, device=like.device)


@torch.no_grad()
def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    bootstrap_values: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over action tokens only.

    Args:
        rewards: (B, T) float, reward on action tokens (0 elsewhere; non-zero elsewhere is an error).
        values: (B, T) float, V(s_t) at action positions; ignored (may hold anything) elsewhere.
        action_mask: (B, T) bool, True at tokens sampled by the policy.
        bootstrap_values: (B,) float, the value after the last token: 0 for a natural end,
            V(s_end) for a budget truncation.
        gamma: discount per action token.
        lam: GAE lambda, a float or a (B,) tensor (per-sequence, e.g. length-adaptive).

    Returns:
        advantages: (B, T), A_i at action positions, 0 elsewhere.
        returns: (B, T), ``advantages + values`` at action positions, 0 elsewhere (critic targets).
    """
    check_same_shape("rewards", {"rewards": rewards, "values": values, "action_mask": action_mask})
    batch, length = rewards.shape
    if tuple(bootstrap_values.shape) != (batch,):
        raise ValueError(f"bootstrap_values must have shape (B,)=({batch},), got {tuple(bootstrap_values.shape)}")
    action = action_mask.bool()
    stray = (~action) & (rewards != 0)
    if bool(stray.any()):
        row, col = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"rewards has a non-zero value {float(rewards[row, col])} at non-action position "
            f"(row {row}, token {col}); put rewards on action tokens (the last one for a terminal reward)"
        )
    values = values.detach()
    lam_b = _per_sequence(lam, batch, values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    next_value = bootstrap_values.detach().to(values.dtype).clone()
    last_gae = torch.zeros(batch, dtype=values.dtype, device=values.device)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        is_action = action[:, t]
        value_t = torch.where(is_action, values[:, t], zero)
        delta = rewards[:, t].to(values.dtype) + gamma * next_value - value_t
        gae = delta + gamma * lam_b * last_gae
        last_gae = torch.where(is_action, gae, last_gae)
        next_value = torch.where(is_action, value_t, next_value)
        advantages[:, t] = torch.where(is_action, gae, zero)
    returns = torch.where(action, advantages + values, zero)
    return advantages, returns


def length_adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """VAPO's length-adaptive lambda for the policy: ``1 - 1 / (alpha * l)``, (B,).

    ``l`` is clamped to at least 1 and the result to [0, 1] (a sequence with no action token has no
    advantage to weight, so its lambda does not matter).
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = num_action_tokens.to(torch.float64).clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0).to(torch.float32)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6,
                    scale_by_std: bool = True) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean_g) / (std_g + eps)`` per sequence, (B,).

    Args:
        rewards: (B,) float, one scalar reward per sequence.
        group_ids: (B,) int, sequences with the same id were sampled from the same prompt.
        scale_by_std: divide by the group's std (GRPO); False keeps only the mean baseline (Dr. GRPO).
    """
    check_same_shape("rewards", {"rewards": rewards, "group_ids": group_ids})
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    advantages = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        group = rewards[members]
        if group.numel() < 2:
            continue
        centred = group - group.mean()
        advantages[members] = centred / (group.std() + eps) if scale_by_std else centred
    return advantages


def flat_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[int, int]:
    """``(groups, flat)``: how many groups of ``group_ids`` have at least two sequences, and how many of
    those have every reward equal (their GRPO advantages are all 0: the group gives no signal)."""
    check_same_shape("rewards", {"rewards": rewards, "group_ids": group_ids})
    groups = flat = 0
    for gid in torch.unique(group_ids):
        group = rewards[group_ids == gid]
        if group.numel() < 2:
            continue
        groups += 1
        flat += int(bool((group == group[0]).all()))
    return groups, flat


def success_advantages(rewards: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,) advantages of the self-imitation control: 1 for a trajectory whose reward reaches
    ``threshold``, 0 otherwise. With a policy-gradient loss this is fine-tuning on the policy's own
    successful rollouts (rejection-sampling fine-tuning): failures add nothing, no baseline is
    subtracted, and a batch with no success leaves the policy where it is."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    return (rewards.to(torch.float32) >= threshold).to(torch.float32)


def broadcast_to_actions(per_sequence: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Spread a (B,) per-sequence advantage over the action tokens of (B, T); 0 elsewhere."""
    if per_sequence.shape[0] != action_mask.shape[0]:
        raise ValueError(f"per_sequence has {per_sequence.shape[0]} rows but action_mask has {action_mask.shape[0]}")
    spread = per_sequence.to(torch.float32).unsqueeze(-1).expand(action_mask.shape)
    return torch.where(action_mask.bool(), spread, torch.zeros((), dtype=spread.dtype, device=spread.device))


class RunningMeanBaseline:
    """The paper's comparison baseline: advantage = reward - mean of the last ``window`` rewards.

    The baseline for a reward is computed before that reward enters the window; before any reward it
    is 0.
    """

    def __init__(self, window: int = 8) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def value(self) -> float:
        """The current baseline (mean of the window, 0 when empty)."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def update(self, rewards: Iterable[float]) -> None:
        """Push rewards into the window, oldest first."""
        self._recent.extend(float(r) for r in rewards)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """(B,) advantages against the baseline before this batch, then push the batch."""
        baseline = self.value
        advantages = rewards.to(torch.float32) - baseline
        self.update(rewards.tolist())
        return advantages
