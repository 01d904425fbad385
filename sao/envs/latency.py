"""Heavy-tailed tool latency, off by default: reproduces the long-tail rollout times of real agent tasks.

Each tool call gets a delay drawn from a log-normal or a Pareto distribution, capped at ``max_s``. The
draw depends only on ``(seed, key, call_index)`` (``key`` is usually the task id), never on timing or
scheduling order, so the same trajectory is delayed the same way on every run.

    log-normal: delay = median_s * exp(sigma * z),  z ~ N(0, 1)     (median = median_s)
    Pareto:     delay = scale_s * u^(-1 / alpha),   u ~ U(0, 1]     (P(delay > x) = (scale_s / x)^alpha)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
import time

__all__ = ["LatencyConfig", "LatencyKind", "LatencyModel"]


class LatencyKind(enum.StrEnum):
    NONE = "none"
    LOGNORMAL = "lognormal"
    PARETO = "pareto"


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
    """Per-tool-call delay.

    Attributes:
        kind: ``none`` (default: no delay), ``lognormal`` or ``pareto``.
        median_s: log-normal median delay in seconds.
        sigma: log-normal shape; 1.0 already gives a p99 about 10x the median.
        pareto_alpha: Pareto tail index (smaller = heavier; the mean is infinite for alpha <= 1).
        pareto_scale_s: Pareto minimum delay in seconds.
        max_s: cap on any single delay.
        seed: seeds every draw (combined with the key and the call index).
    """

    kind: LatencyKind = LatencyKind.NONE
    median_s: float = 0.05
    sigma: float = 1.0
    pareto_alpha: float = 1.5
    pareto_scale_s: float = 0.02
    max_s: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LatencyKind(self.kind))
        for name in ("median_s", "pareto_alpha", "pareto_scale_s", "max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LatencyConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.sigma < 0:
            raise ValueError(f"LatencyConfig.sigma must be >= 0, got {self.sigma}")


class LatencyModel:
    """Draws (and optionally sleeps) the delay of each tool call."""

    def __init__(self, config: LatencyConfig | None = None) -> None:
        self.config = config or LatencyConfig()

    def delay_s(self, key: str, call_index: int) -> float:
        """The delay in seconds of call ``call_index`` of episode ``key``; 0.0 when off."""
        config = self.config
        if config.kind is LatencyKind.NONE:
            return 0.0
        rng = random.Random(f"{config.seed}:{key}:{call_index}")  # str seeds hash with SHA-512: stable
        if config.kind is LatencyKind.LOGNORMAL:
            delay = config.median_s * math.exp(config.sigma * rng.gauss(0.0, 1.0))
        else:
            u = 1.0 - rng.random()  # (0, 1]
            delay = config.pareto_scale_s * u ** (-1.0 / config.pareto_alpha)
        return min(delay, config.max_s)

    def sleep(self, key: str, call_index: int) -> float:
        """Sleep for :meth:`delay_s` and return it."""
        delay = self.delay_s(key, call_index)
        if delay > 0:
            time.sleep(delay)
        return delay
