"""A compiled CPU kernel of the torch engine's decode step: attention of one new token per running request.

Decoding one token per request reads every running request's cached keys and values once and does
little arithmetic on them, so on a CPU its time is the bytes it reads. Batched matrix products over a
padded batch read every row up to the longest row of its batch (or chunk), which on the rollout
benchmark's workload is 1.3-1.9 times the columns the rows really have, and the scores go through
memory three times (scaled product, mask, softmax). :func:`decode_attention` reads each row's keys and
values once, up to the row's own length, and keeps its scores in a scratch line: one pass over K,
one over V. Each key and value of a grouped KV head is read once for all the query heads of its
group. Compiled by Numba (``nogil``: the engine thread's GIL is free while it runs) and cached on disk
next to this module, so a process compiles it at most once (about a second, the first time).

Floating point: products are summed in float32 in a different order from ``scaled_dot_product_attention``
(the kernel may reassociate sums, ``fastmath`` without the no-NaN / no-infinity assumptions); the result
agrees with it to about 1e-7 on unit-scale inputs (tested in ``tests/rollout/test_kernels.py``), well
inside the engine's 1e-5 log-probability contract.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["decode_attention"]

# Reassociation and contraction (vectorised sums, fused multiply-add) but none of the no-NaN / no-inf
# assumptions: the kernel's running maximum starts at a real score, and a model that produced a NaN must
# still show it.
_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


# exp(x) for x <= 0 as 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-7 polynomial of Cephes'
# expf (relative error about 1e-7, like expf). A loop of these is vectorised by the compiler, where a loop
# calling the C library's expf is not: 2.6-2.9% more engine tokens/s at 16 and 64 requests.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.0)  # exp(-87) ~ 1.6e-38, the smallest power of two kept normal below


@numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, boundscheck=False, inline="always")
def _exp_shifted(row: np.ndarray, top: float, length: int, bits: np.ndarray) -> float:  # pragma: no cover
    """``row[:length] = exp(row[:length] - top)`` in place (every value <= ``top``; NaN stays NaN); returns
    their sum."""
    scale = bits.view(np.float32)
    for c in range(length):
        x = row[c] - top
        x = _EXP_FLOOR if x < _EXP_FLOOR else x  # a NaN fails the test and stays
        n = np.floor(x * _LOG2E + np.float32(0.5))
        x = x - n * _LN2_HI - n * _LN2_LO
        y = ((((((np.float32(1.9875691500e-4) * x + np.float32(1.3981999507e-3)) * x
                 + np.float32(8.3334519073e-3)) * x + np.float32(4.1665795894e-2)) * x
               + np.float32(1.6666665459e-1)) * x + np.float32(5.0000001201e-1)) * x * x + x + np.float32(1.0))
        row[c] = y
        bits[c] = (np.int32(n) + np.int32(127)) << 23  # 2^n as a float32's exponent bits
    total = np.float32(0.0)
    for c in range(length):
        e = row[c] * scale[c]
        row[c] = e
        total += e
    return total


@numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, boundscheck=False)
def _decode_attention_kernel(query: np.ndarray, key: np.ndarray, value: np.ndarray, lengths: np.ndarray,
                             scaling: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    rows, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = np.float32(scaling)
    scores = np.empty((group, key.shape[2]), dtype=np.float32)
    acc = np.empty((group, head_dim), dtype=np.float32)
    q = np.empty((group, head_dim), dtype=np.float32)
    top = np.empty(group, dtype=np.float32)
    total = np.empty(group, dtype=np.float32)
    bits = np.empty(key.shape[2], dtype=np.int32)  # scratch of _exp_shifted
    for r in range(rows):
        length = lengths[r]
        for h in range(kv_heads):
            for g in range(group):
                for d in range(head_dim):
                    q[g, d] = query[r, h * group + g, d] * scale
            for c in range(length):  # scores: one read of each key for the whole group
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q[g, d] * key[r, h, c, d]
                    scores[g, c] = s
                    if c == 0 or s > top[g]:
                        top[g] = s
            for g in range(group):
                total[g] = _exp_shifted(scores[g], top[g], length, bits)
            acc[:, :] = 0.0
            for c in range(length):  # weighted values: one read of each value for the whole group
                for g in range(group):
                    p = scores[g, c]
                    for d in range(head_dim):
                        acc[g, d] += p * value[r, h, c, d]
            for g in range(group):
                inverse = np.float32(1.0) / total[g]
                for d in range(head_dim):
                    out[r, h * group + g, d] = acc[g, d] * inverse


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: np.ndarray,
                     scaling: float) -> torch.Tensor:
    """Attention of ``rows`` single query tokens, row ``i`` over columns ``0 .. lengths[i] - 1`` of slot ``i``.

    Args:
        query: ``(rows, heads, head_dim)`` float32.
        key, value: the slot cache, ``(slots, kv_heads, capacity, head_dim)`` float32, contiguous, with
            ``slots >= rows``; query head ``j`` reads KV head ``j // (heads // kv_heads)``.
        lengths: ``(rows,)`` int64, each in ``1 .. capacity``.
        scaling: the factor on the scores (``head_dim ** -0.5`` usually).

    Returns:
        ``(rows, heads, head_dim)`` float32.
    """
    rows, heads, head_dim = query.shape
    if query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32:
        raise TypeError(f"decode_attention takes float32 tensors, got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.shape != value.shape or key.shape[0] < rows or key.shape[3] != head_dim or heads % key.shape[1]:
        raise ValueError(f"decode_attention: query {tuple(query.shape)} does not fit a cache {tuple(key.shape)} / "
                         f"{tuple(value.shape)}")
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("decode_attention: key and value must be contiguous")
    if len(lengths) != rows or (rows and not (1 <= lengths.min() and lengths.max() <= key.shape[2])):
        raise ValueError(f"decode_attention: lengths must be {rows} values in 1 .. {key.shape[2]}, got {lengths}")
    out = torch.empty(rows, heads, head_dim, dtype=torch.float32)
    if rows:
        _decode_attention_kernel(query.contiguous().numpy(), key.numpy(), value.numpy(),
                                 np.ascontiguousarray(lengths, dtype=np.int64), scaling, out.numpy())
    return out
