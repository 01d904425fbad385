"""The wait a group-synchronous scheme imposes (the peer benchmark reports it per step).

A group-relative update (GRPO) needs every rollout of a group before it can compute the group's
advantages, so each finished rollout waits for the slowest one. For completion times [5, 8, 13, 40] s
the extra waits are [35, 32, 27, 0] s and their mean is 23.5 s. SAO trains on each rollout as it
arrives and removes this barrier (queues, batching and weight sync still add delays of their own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["group_waits", "mean_group_wait"]


def group_waits(completion_times: Sequence[float]) -> list[float]:
    """Extra wait of each rollout until the group's last one finishes: ``max(t) - t_i``."""
    if len(completion_times) == 0:
        raise ValueError("completion_times is empty: a group needs at least one rollout")
    bad = [t for t in completion_times if not math.isfinite(t) or t < 0]
    if bad:
        raise ValueError(f"completion_times must be finite and >= 0, got {bad[0]}")
    slowest = max(completion_times)
    return [slowest - t for t in completion_times]


def mean_group_wait(completion_times: Sequence[float]) -> float:
    """Mean extra wait over the group's rollouts (23.5 s for [5, 8, 13, 40])."""
    waits = group_waits(completion_times)
    return sum(waits) / len(waits)
