"""Assumed data-centre hardware (stated once, not measured here) and what a rollout replica makes of it."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Hardware", "decode_curve", "replica_gpus"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Assumed hardware of a data-centre deployment (not measured here).

    Attributes:
        gpu_flops: dense bf16 FLOP/s of one GPU (H100 SXM: about 989e12).
        gpu_hbm_bytes_s, gpu_memory_bytes: memory bandwidth and capacity of one GPU.
        train_mfu: model FLOP utilisation of training; decode_mfu: of decoding's compute-bound part.
        nic_bytes_s: network bandwidth of one node (400 Gb/s = 50 GB/s).
        commit_s: one Delta commit on the object store (conditional put + log read, S3-like).
        writer_bytes_s: bytes/s one lake writer uploads.
        bytes_per_token: stored bytes per token (token id, log-probability, mask, segments).
        kv_bytes_per_token_per_param: KV-cache bytes per context token per model parameter
            (a 32B dense model with 64 layers and 8 KV heads of 128: 262 kB/token = 8.2e-6 per param).
        request_s: fixed cost of one generation call (scheduling, network).
        tool_median_s, tool_sigma: agent tool latency (code execution, search): log-normal.
    """

    gpu_flops: float = 989e12
    gpu_hbm_bytes_s: float = 3.35e12
    gpu_memory_bytes: float = 80e9
    train_mfu: float = 0.4
    decode_mfu: float = 0.3
    nic_bytes_s: float = 50e9
    commit_s: float = 0.25
    writer_bytes_s: float = 1e9
    bytes_per_token: float = 9.0
    kv_bytes_per_token_per_param: float = 8.2e-6
    request_s: float = 0.02
    tool_median_s: float = 2.0
    tool_sigma: float = 1.2


def replica_gpus(params: float, hw: Hardware) -> int:
    """GPUs of one rollout replica: tensor-parallel so that bf16 weights take at most half the memory."""
    return max(1, 2 ** math.ceil(math.log2(max(1.0, 2 * params / (0.5 * hw.gpu_memory_bytes)))))


def decode_curve(params: float, context_tokens: float, hw: Hardware) -> tuple[tuple[float, float], ...]:
    """Tokens/s of one replica at each concurrency up to what its KV memory holds: a decode step reads
    the weights once and each running request's KV cache (half the trajectory on average), or is
    compute-bound, whichever is slower."""
    gpus = replica_gpus(params, hw)
    kv_per_request = 0.5 * context_tokens * hw.kv_bytes_per_token_per_param * params
    free = 0.9 * gpus * hw.gpu_memory_bytes - 2 * params
    max_batch = max(1, int(free // kv_per_request))
    points = []
    for b in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_batch}):
        if b > max_batch:
            continue
        memory_s = (2 * params + b * kv_per_request) / (gpus * hw.gpu_hbm_bytes_s)
        compute_s = 2 * params * b / (gpus * hw.gpu_flops * hw.decode_mfu)
        points.append((float(b), b / max(memory_s, compute_s)))
    return tuple(points)
