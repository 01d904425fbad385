"""Data-centre deployments as :class:`Scenario` s, from the assumed :class:`Hardware`, and the grid of
them that ``docs/SCALING.md`` tabulates."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.scale_model.hardware import Hardware, decode_curve, replica_gpus
from benchmarks.scale_model.scenario import Scenario

__all__ = ["datacentre_grid", "datacentre_scenario"]


def datacentre_scenario(name: str, *, params: float, replicas: int, trainer_gpus: int, trajectory_tokens: float,
                        batch: int = 1024, max_staleness: int = 2, flush_rows: int = 16,
                        broadcast: str = "naive", hw: Hardware | None = None, steps: int = 14) -> Scenario:
    """A data-centre deployment: ``replicas`` rollout replicas (each :func:`replica_gpus` GPUs), a
    trainer on ``trainer_gpus`` GPUs, trajectories of ``trajectory_tokens`` (half generated, half tool
    observations, in turns of 2k tokens), weights published ``naive`` (one source serves every
    replica) or ``sharded`` (each trainer node sends its shard; replicas relay along a tree). The
    driver keeps as many rollouts in flight as the staleness gate admits, ``batch * (max_staleness +
    1)``, at most what the replicas' KV memory holds. ``hw``: the assumed hardware (None: :class:`Hardware`'s
    defaults)."""
    hw = Hardware() if hw is None else hw
    curve = decode_curve(params, trajectory_tokens, hw)
    max_batch = int(curve[-1][0])
    turns = max(1, round(trajectory_tokens / 2000))
    generated_per_turn = 0.5 * trajectory_tokens / turns
    observation_per_turn = trajectory_tokens / turns - generated_per_turn
    gpus = replica_gpus(params, hw)
    prefill_s = 2 * params * observation_per_turn / (gpus * hw.gpu_flops * 0.5)
    weight_bytes = 2 * params
    trainer_nodes = max(1, trainer_gpus // 8)
    if broadcast == "naive":
        broadcast_s = replicas * weight_bytes / hw.nic_bytes_s
    elif broadcast == "sharded":
        broadcast_s = weight_bytes / (hw.nic_bytes_s * min(trainer_nodes, 8)) + math.log2(max(replicas, 2)) * 0.05
    else:
        raise ValueError(f"broadcast must be 'naive' or 'sharded', got {broadcast!r}")
    # Training FLOPs per token: actor forward + backward (6P), critic of the same size (6P), the
    # recomputed log-probabilities (2P).
    step_per_token = 14 * params / (trainer_gpus * hw.gpu_flops * hw.train_mfu)
    commit_per_token = 6.8e-8 + hw.bytes_per_token / hw.writer_bytes_s  # Arrow + validation (measured) + upload
    return Scenario(
        name=name, replicas=replicas, max_in_flight=min(replicas * max_batch, batch * (max_staleness + 1)),
        rate_curve=curve,
        turn_overhead_s=hw.request_s + prefill_s, tokens_per_turn=generated_per_turn,
        context_tokens=trajectory_tokens, turns=turns, tool_median_s=hw.tool_median_s, tool_sigma=hw.tool_sigma,
        flush_rows=flush_rows, flush_seconds=0.25, commit_s=hw.commit_s, commit_s_per_token=commit_per_token,
        batch=batch, max_staleness=max_staleness,
        read_s=0.2 + batch * trajectory_tokens * hw.bytes_per_token / (trainer_nodes * hw.writer_bytes_s),
        step_s=1.0, step_s_per_token=step_per_token, params=params,
        publish_put_s_per_param=2 / (hw.nic_bytes_s * trainer_nodes), broadcast_s=broadcast_s,
        shared_cores=None, max_sim_replicas=16, steps=steps, warmup_steps=4)


def datacentre_grid(quick: bool = False) -> list[Scenario]:
    """The scenarios of docs/SCALING.md: each row grows one dimension, or applies one remedy to the
    bottleneck the row before it hit ("..." = as the row above, except)."""
    B = 1e9
    base = dict(params=7 * B, replicas=64, trainer_gpus=64, trajectory_tokens=8_000, batch=1024)
    fast = base | dict(trainer_gpus=512)
    shard = fast | dict(broadcast="sharded")
    big = shard | dict(replicas=512, batch=8192)
    long = dict(params=30 * B, replicas=4096, trainer_gpus=512, trajectory_tokens=100_000, batch=8192,
                broadcast="sharded", flush_rows=1024)
    rows: list[tuple[str, dict[str, Any]]] = [
        ("7B, 64 replicas, 8k-token trajectories, 64 trainer GPUs, batch 1024", base),
        ("... 512 trainer GPUs", fast),
        ("... sharded weight broadcast", shard),
        ("... 512 replicas, batch 8192", big),
        ("... 1024 rows per commit", big | dict(flush_rows=1024)),
        ("... 4096 replicas, batch 32768", big | dict(flush_rows=1024, replicas=4096, batch=32768)),
        ("30B, 4096 replicas, 100k-token trajectories, 512 trainer GPUs, batch 8192", long),
        ("... 2048 trainer GPUs", long | dict(trainer_gpus=2048)),
    ]
    if quick:
        rows = rows[:2]
    return [datacentre_scenario(name, **kwargs, steps=8 if quick else 14) for name, kwargs in rows]

