"""Masked reductions: the one place where a denominator is chosen.

Notation:
    B: sequences in the batch; T: tokens after the prompt (padded).
    mask: (B, T) bool, True where a token counts (usually ``action_mask``).

Every loss in :mod:`sao.algos.losses` builds a per-token loss, zero where it does not apply, and hands
it to :func:`aggregate` with the mask of the tokens that count in the denominator. No loss normalises
itself.

Denominator modes (:class:`LossAggregation`):
    ``token``: sum over the batch / number of masked-in tokens of the batch. Masked-out tokens of a DIS
        loss (outside the interval) are still action tokens, so they stay in this count: masking cannot
        inflate the step.
    ``sequence``: mean over sequences of each sequence's token mean; a sequence with no counted token
        contributes 0 and still counts as a sequence.

For gradient accumulation pass ``denominator``, the count for the whole update (tokens in ``token``
mode, sequences in ``sequence`` mode): the micro-batch losses then add up to the loss of the whole
batch, so the update does not depend on how the batch was split.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

__all__ = [
    "LossAggregation",
    "aggregate",
    "check_same_shape",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
]


class LossAggregation(enum.StrEnum):
    """How a per-token loss becomes a scalar (see the module docstring)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


def check_same_shape(reference: str, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming every tensor whose shape differs from ``tensors[reference]``."""
    expected = tuple(tensors[reference].shape)
    bad = {name: tuple(t.shape) for name, t in tensors.items() if tuple(t.shape) != expected}
    if bad:
        details = ", ".join(f"{name} has shape {shape}" for name, shape in bad.items())
        raise ValueError(f"shape mismatch: {reference} has shape {expected} but {details}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is True; masked-out entries (even NaN) contribute 0."""
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(mask.bool(), values, zeros)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over ``mask``; 0 (never NaN) where the mask selects nothing."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Normalise ``values`` to unit variance over ``mask`` (population variance), 0 outside it.

    With ``shift_mean`` the masked mean is also removed. Fewer than two selected entries leave the
    values unscaled (a variance of one entry is undefined). ``reduce`` sums a tensor across
    data-parallel workers, each holding a shard of the batch, so that the mean and the variance are
    the whole batch's (None: these values alone).
    """
    mask = mask.bool()
    total = (lambda tensor: tensor) if reduce is None else reduce
    count = total(mask.sum())

    def mean_of(tensor: torch.Tensor) -> torch.Tensor:  # masked_mean, over every shard
        return total(masked_sum(tensor, mask)) / count.clamp(min=1).to(values.dtype)

    mean = mean_of(values)
    centred = values - mean
    if int(count) >= 2:
        var = mean_of(centred.square())
        scaled = centred * torch.rsqrt(var + 1e-8)
    else:
        scaled = centred
    if not shift_mean:
        scaled = scaled + mean
    return torch.where(mask, scaled, torch.zeros_like(scaled))


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation | str = LossAggregation.TOKEN,
    denominator: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(B, T)`` to a scalar over ``mask`` ``(B, T)``.

    ``denominator`` overrides the count for the whole update (see the module docstring). A batch
    with no counted token gives a zero loss that still carries a (zero) gradient, never NaN.
    """
    mode = LossAggregation(mode)
    check_same_shape("per_token", {"per_token": per_token, "mask": mask})
    if denominator is not None and denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    mask = mask.bool()
    if mode is LossAggregation.TOKEN:
        total = masked_sum(per_token, mask)
        count = float(mask.sum()) if denominator is None else float(denominator)
        return total / max(count, 1.0)
    per_sequence = masked_mean(per_token, mask, dim=-1)
    count = float(per_sequence.shape[0]) if denominator is None else float(denominator)
    return per_sequence.sum() / max(count, 1.0)
