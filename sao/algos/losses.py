"""Losses: the DIS policy loss (SAO), a PPO clipped loss (baselines), a value loss.

Each returns ``(loss, metrics)``: ``loss`` a scalar to minimise, ``metrics`` floats under namespaced
keys (``actor/...``, ``critic/...``). Reductions go through :func:`sao.algos.masked.aggregate`.

Notation (B sequences, T tokens after the prompt):
    logp_current: (B, T) log pi_theta of each sampled token, carries the graph.
    logp_rollout: (B, T) log pi_behave recorded by the rollout engine (ignored off actions).
    advantages: (B, T) A_t at action tokens (0 elsewhere).
    action_mask: (B, T) bool, tokens sampled by the policy.
    keep_mask: (B, T) bool, action tokens inside the DIS interval; loss_mask = action_mask & keep_mask.

DIS objective (maximised): J = mean_t[ sg(f(rho_t)) * A_t * log pi_theta(a_t|s_t) ]; we minimise -J.

Choices where the paper is silent (documented config options):
    * ``detach_weight=True`` (default) is the REINFORCE form above. ``False`` is the ratio form
      ``-f(rho) * A`` with the gradient through rho. Since grad rho = rho * grad log pi, both forms give
      the same gradient at the current parameters; they differ in the reported loss value (and in
      numerics), which is why the default is the form the paper writes.
    * The denominator is every action token of the batch, masked ones included (``token`` mode), so
      dropping tokens cannot inflate the step; ``sequence`` mode is available.
    * No KL and no entropy term, as in the paper (the trainer can add an entropy bonus:
      ``UpdateConfig.entropy_coef``, default 0).
"""

from __future__ import annotations

import torch

from sao.algos.dis import check_logprobs, dis_weights
from sao.algos.masked import LossAggregation, aggregate, check_same_shape, masked_mean

__all__ = ["dis_policy_loss", "ppo_clip_loss", "value_loss"]


def _zero_off(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask``, exactly 0 elsewhere (so NaN padding cannot leak into a gradient)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def dis_policy_loss(
    logp_current: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    detach_weight: bool = True,
    aggregation: LossAggregation | str = LossAggregation.TOKEN,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAO's DIS policy loss (minimised). Shapes as in the module docstring.

    A micro-batch whose action tokens are all masked (or that has none) gives loss 0 with a zero
    gradient, never NaN, and reports ``actor/all_masked = 1``.
    """
    check_same_shape("logp_current", {"logp_current": logp_current, "advantages": advantages})
    weights, keep_mask = dis_weights(logp_current, logp_rollout, action_mask, eps_low, eps_high)
    action = action_mask.bool()
    adv = _zero_off(keep_mask, advantages.detach().to(logp_current.dtype))
    if detach_weight:
        per_token = -weights.detach() * adv * _zero_off(keep_mask, logp_current)
    else:
        per_token = -weights * adv
    loss = aggregate(per_token, action, aggregation, denominator)

    with torch.no_grad():
        n_action = int(action.sum())
        n_kept = int(keep_mask.sum())
        log_rho = _zero_off(action, logp_current.detach() - logp_rollout.detach().to(logp_current.dtype))
        rho = _zero_off(action, log_rho.exp())
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/num_action_tokens": float(n_action),
            "actor/num_kept_tokens": float(n_kept),
            "actor/kept_frac": n_kept / n_action if n_action else 0.0,
            "actor/masked_low_frac": float(((rho <= 1.0 - eps_low) & action).sum()) / max(n_action, 1),
            "actor/masked_high_frac": float(((rho >= 1.0 + eps_high) & action).sum()) / max(n_action, 1),
            "actor/rho_mean": float(masked_mean(rho, action)),
            "actor/rho_max": float(rho[action].max()) if n_action else 0.0,
            "actor/rho_min": float(rho[action].min()) if n_action else 0.0,
            "actor/weight_mean": float(masked_mean(weights.detach(), keep_mask)),
            "actor/all_masked": float(n_kept == 0),
        }
    return loss, metrics


def ppo_clip_loss(
    logp_current: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    *,
    aggregation: LossAggregation | str = LossAggregation.TOKEN,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with the ratio taken against the rollout log-probability (baselines).

    ``pg_loss1 = -A * rho``, ``pg_loss2 = -A * clip(rho, 1 - clip_low, 1 + clip_high)``,
    per-token loss ``max(pg_loss1, pg_loss2)`` at action tokens. Unlike DIS, a ratio that moved the
    wrong way keeps its corrective gradient.
    """
    check_same_shape(
        "logp_current",
        {"logp_current": logp_current, "logp_rollout": logp_rollout, "advantages": advantages,
         "action_mask": action_mask},
    )
    if not (0.0 < clip_low < 1.0 and clip_high > 0.0):
        raise ValueError(f"PPO clip range (1 - {clip_low}, 1 + {clip_high}) must straddle 1")
    check_logprobs("logp_current", logp_current, action_mask)
    check_logprobs("logp_rollout", logp_rollout, action_mask)
    action = action_mask.bool()
    log_rho = _zero_off(action, logp_current - logp_rollout.to(logp_current.dtype))
    rho = log_rho.exp()
    adv = _zero_off(action, advantages.detach().to(logp_current.dtype))
    pg_loss1 = -adv * rho
    pg_loss2 = -adv * rho.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = _zero_off(action, torch.maximum(pg_loss1, pg_loss2))
    loss = aggregate(per_token, action, aggregation, denominator)
    with torch.no_grad():
        n_action = int(action.sum())
        clipped = action & (pg_loss2 > pg_loss1)
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/num_action_tokens": float(n_action),
            "actor/clip_frac": float(clipped.sum()) / max(n_action, 1),
            "actor/rho_mean": float(masked_mean(rho.detach(), action)),
            "actor/rho_max": float(rho.detach()[action].max()) if n_action else 0.0,
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
    reward_range: tuple[float, float] | None = None,
    aggregation: LossAggregation | str = LossAggregation.TOKEN,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Squared-error value loss ``0.5 * (V - R)^2`` over action tokens only.

    Args:
        values: (B, T) V(s_t) from the critic, carries the graph.
        returns: (B, T) targets (GAE with lam_critic plus the values that computed it).
        action_mask: (B, T) bool; values are never trained on observation or prompt tokens.
        old_values, clip: optional value clipping, ``V_clip = old + clamp(V - old, -clip, clip)`` and
            the per-token max of the two squared errors (PPO style). Both or neither.
        reward_range: (low, high) to report ``critic/frac_outside_reward_range``: a value outside it
            can flip an advantage's sign (SAO section 3), so it is monitored.
    """
    check_same_shape("values", {"values": values, "returns": returns, "action_mask": action_mask})
    if (old_values is None) != (clip is None):
        raise ValueError("value clipping needs both old_values and clip (or neither)")
    action = action_mask.bool()
    target = _zero_off(action, returns.detach().to(values.dtype))
    current = _zero_off(action, values)
    per_token = 0.5 * (current - target).square()
    clip_frac = 0.0
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"clip must be > 0, got {clip}")
        check_same_shape("values", {"values": values, "old_values": old_values})
        old = _zero_off(action, old_values.detach().to(values.dtype))
        clipped_values = old + (current - old).clamp(-clip, clip)
        per_token_clipped = 0.5 * (clipped_values - target).square()
        clip_frac = float(((per_token_clipped > per_token) & action).sum()) / max(int(action.sum()), 1)
        per_token = torch.maximum(per_token, per_token_clipped)
    loss = aggregate(_zero_off(action, per_token), action, aggregation, denominator)
    with torch.no_grad():
        v = current.detach()
        metrics = {
            "critic/value_loss": float(loss.detach()),
            "critic/value_mean": float(masked_mean(v, action)),
            "critic/return_mean": float(masked_mean(target, action)),
            "critic/value_clip_frac": clip_frac,
        }
        if reward_range is not None:
            low, high = reward_range
            outside = action & ((v < low) | (v > high))
            metrics["critic/frac_outside_reward_range"] = float(outside.sum()) / max(int(action.sum()), 1)
    return loss, metrics
