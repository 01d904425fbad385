"""Run configs for the benchmarks: the demo's (configs/demo.yaml, what the benchmarks were measured
with) with a few settings changed, named by the flat keywords the benchmarks take on their command
lines. Each keyword is one run-config key (:data:`KEYS`)."""

from __future__ import annotations

from typing import Any

from sao.config import RunConfig, demo_config

__all__ = ["HEAVY_TAIL", "KEYS", "bench_config", "with_settings"]

HEAVY_TAIL: dict[str, float] = {"median_s": 1.0, "sigma": 1.0, "max_s": 30.0}
"""The heavy-tailed tool latency of ``sao bench speed`` and ``sao bench quality`` (log-normal per tool
call, :class:`sao.envs.latency.LatencyConfig` fields): p50 about 1 s, p99 about 10 s of a rollout."""

KEYS: dict[str, str] = {
    "run_id": "run_id", "workdir": "workdir", "seed": "seed", "lake_root": "lake.root", "ray_address": "ray.address",
    "algorithm": "algorithm.name", "lr_policy": "algorithm.lr_policy", "steps": "train.steps",
    "batch_size": "train.batch_size", "max_staleness": "train.max_staleness", "synchronous": "train.synchronous",
    "trainer_workers": "train.workers", "num_replicas": "rollout.num_replicas",
    "max_in_flight": "rollout.max_in_flight", "group_size": "rollout.group_size", "eval_tasks": "eval.tasks",
    "value_samples": "value_pretraining.samples", "sft_seed": "sft.seed",
}


def with_settings(config: RunConfig, **settings: Any) -> RunConfig:
    """``config`` with the :data:`KEYS` given changed (validated)."""
    unknown = sorted(set(settings) - set(KEYS))
    if unknown:
        raise TypeError(f"unknown settings {unknown}; known: {sorted(KEYS)}")
    return config.with_values({KEYS[name]: value for name, value in settings.items()})


def bench_config(**settings: Any) -> RunConfig:
    """The demo's run config with the :data:`KEYS` given changed."""
    return with_settings(demo_config(), **settings)
