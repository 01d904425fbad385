"""The one definition of the sampling distribution, shared by the rollout engine and the trainer.

    log pi_sample(. | s) = log_softmax(top_p(top_k(logits / temperature)))

``top_k`` keeps the k largest logits (0 = off); ``top_p`` then keeps the smallest prefix of tokens,
in descending probability of the top-k distribution, whose mass reaches ``top_p`` (the most likely
token is always kept; 1.0 = off). Filtered tokens get log-probability ``-inf``.

The ``raw`` kind is ``log_softmax(logits)``: the model's own distribution, before any transform. An
engine records which kind its log-probabilities are (``LogprobKind``, the lake's ``logprob_kind`` values
from the standard-library-only :mod:`schemas.vocabulary`) and the trainer recomputes the current policy's
log-probabilities under the same kind and settings, so that rho compares like with like.

Parameters may be Python scalars (one setting for the whole batch) or tensors of shape ``logits.shape[:-1]``
(one setting per row, e.g. per request in a decode batch).
"""

from __future__ import annotations

import torch

from schemas.vocabulary import LogprobKind

__all__ = ["LogprobKind", "check_sampling", "sampling_logprobs", "token_logprobs"]


Param = float | int | torch.Tensor


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ``ValueError`` naming the setting that is out of range."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy decoding), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 turns it off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (1 turns it off), got {top_p}")


def _as_rows(value: Param, rows: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=dtype, device=device)
    return tensor.expand(rows) if tensor.dim() == 0 else tensor


def _is_off(value: Param, off: float) -> bool:
    if isinstance(value, torch.Tensor):
        return bool((value == off).all())
    return value == off


def sampling_logprobs(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
) -> torch.Tensor:
    """Log-probabilities of the sampling distribution, same shape as ``logits`` ``(..., V)``."""
    vocab = logits.shape[-1]
    rows = tuple(logits.shape[:-1])
    temp = _as_rows(temperature, rows, logits.dtype, logits.device)
    scaled = logits / temp.unsqueeze(-1)
    if _is_off(top_k, 0) and _is_off(top_p, 1.0):
        return torch.log_softmax(scaled, dim=-1)
    k = _as_rows(top_k, rows, torch.long, logits.device)
    k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
    p = _as_rows(top_p, rows, logits.dtype, logits.device)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    keep = ranks < k.unsqueeze(-1)
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(torch.where(keep, sorted_logits, neg_inf), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = keep & (mass_before < p.unsqueeze(-1))
    sorted_logp = torch.log_softmax(torch.where(keep, sorted_logits, neg_inf), dim=-1)
    return torch.empty_like(sorted_logp).scatter_(-1, order, sorted_logp)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    kind: LogprobKind | str = LogprobKind.SAMPLING,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
) -> torch.Tensor:
    """Log-probability of each token in ``tokens`` ``(...)`` under ``logits`` ``(..., V)``."""
    if LogprobKind(kind) is LogprobKind.RAW:
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = sampling_logprobs(logits, temperature, top_k, top_p)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
