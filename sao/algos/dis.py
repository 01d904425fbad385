"""Direct double-sided importance sampling (DIS), SAO section 1.

Notation:
    pi_theta: the policy being trained (the trainer's current weights).
    pi_behave: the policy that sampled the token, as the rollout engine saw it at generation time.
    rho_t = pi_theta(a_t | s_t) / pi_behave(a_t | s_t) = exp(logp_current_t - logp_rollout_t).

    f(rho) = rho  if 1 - eps_low < rho < 1 + eps_high   (strict on both sides)
             0    otherwise, and at every non-action token.

``logp_rollout`` is the engine's value recorded at generation time, never a recomputation from a saved
"old" checkpoint; ``logp_current`` must be computed under the same distribution (raw or sampling).

The interval test is done in log space in float64 (``log(1 - eps_low) < log rho < log(1 + eps_high)``),
which is the same test as on rho because log is monotonic, and does not depend on rounding in ``exp``.
Paper settings: math with Python tools eps_low=0.3, eps_high=5.0; coding agent eps_low=0.8, eps_high=3.0.
"""

from __future__ import annotations

import math

import torch

from sao.algos.masked import check_same_shape

__all__ = ["check_interval", "check_logprobs", "dis_weights", "log_interval"]


def check_interval(eps_low: float, eps_high: float) -> None:
    """Raise ``ValueError`` unless ``0 < 1 - eps_low < 1 < 1 + eps_high``."""
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not math.isfinite(eps):
            raise ValueError(f"{name} must be finite, got {eps}")
    if not 0.0 < 1.0 - eps_low < 1.0:
        raise ValueError(
            f"eps_low={eps_low} gives a lower bound 1 - eps_low = {1.0 - eps_low}; "
            "the bounds must straddle 1, so eps_low must lie in (0, 1)"
        )
    if not 1.0 + eps_high > 1.0:
        raise ValueError(
            f"eps_high={eps_high} gives an upper bound 1 + eps_high = {1.0 + eps_high}; "
            "the bounds must straddle 1, so eps_high must be > 0"
        )


def log_interval(eps_low: float, eps_high: float) -> tuple[float, float]:
    """``(log(1 - eps_low), log(1 + eps_high))`` after validating the bounds."""
    check_interval(eps_low, eps_high)
    return math.log1p(-eps_low), math.log1p(eps_high)


def check_logprobs(name: str, logp: torch.Tensor, action_mask: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` and the first bad position if a log-probability at an
    action position is non-finite or positive."""
    values = logp.detach()
    action = action_mask.bool()
    non_finite = action & ~torch.isfinite(values)
    positive = action & torch.isfinite(values) & (values > 0)
    for bad, problem in ((non_finite, "non-finite"), (positive, "positive")):
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} has a {problem} log-probability {float(values[row, col])} at action "
                f"position (row {row}, token {col}); log-probabilities must be finite and <= 0"
            )


def dis_weights(
    logp_current: torch.Tensor,
    logp_rollout: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DIS weights and the mask of kept tokens.

    Args:
        logp_current: (B, T) float, log pi_theta of each sampled token; may require grad.
        logp_rollout: (B, T) float, log pi_behave recorded by the engine; ignored where
            ``action_mask`` is 0 (padding and observation tokens may hold anything).
        action_mask: (B, T) bool, True at tokens sampled by the policy.
        eps_low, eps_high: the interval is (1 - eps_low, 1 + eps_high), open on both sides.

    Returns:
        weights: (B, T), ``rho`` where kept, 0 elsewhere; carries the graph of ``logp_current``
            (the loss decides whether to detach it).
        keep_mask: (B, T) bool, action tokens whose rho lies strictly inside the interval.

    Raises:
        ValueError: bounds that do not straddle 1, shape mismatch, non-finite or positive
            log-probability at an action position.
    """
    log_low, log_high = log_interval(eps_low, eps_high)
    check_same_shape(
        "logp_current",
        {"logp_current": logp_current, "logp_rollout": logp_rollout, "action_mask": action_mask},
    )
    check_logprobs("logp_current", logp_current, action_mask)
    check_logprobs("logp_rollout", logp_rollout, action_mask)
    action = action_mask.bool()
    zero = torch.zeros((), dtype=logp_current.dtype, device=logp_current.device)
    log_rho = torch.where(action, logp_current - logp_rollout.to(logp_current.dtype), zero)
    log_rho64 = torch.where(
        action, logp_current.detach().double() - logp_rollout.detach().double(), zero.double()
    )
    keep_mask = action & (log_rho64 > log_low) & (log_rho64 < log_high)
    # exp of the kept tokens' log-ratios only: a dropped token's may overflow, and where() passes a
    # gradient of 0 * inf = NaN through the branch it did not take (the ratio form differentiates it).
    weights = torch.where(keep_mask, torch.exp(torch.where(keep_mask, log_rho, zero)), zero)
    return weights, keep_mask
