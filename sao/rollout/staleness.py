"""Back-pressure on staleness: how many trajectories may be started at a given trainer version.

Staleness of a trajectory at trainer version v is ``v - (oldest version that sampled it)``. If the
trainer consumes ``batch_size`` trajectories per version and at most ``max_staleness`` is allowed, a
trajectory started now (at version v) must be consumed by version ``v + max_staleness``. So the total
number of trajectories started may not exceed ``(v + max_staleness + 1) * batch_size`` (the rule of
AReaL's staleness manager). Generation never runs further ahead than the trainer can absorb; with
``max_staleness = 0`` it degenerates to synchronous batches.

A trajectory that will never be trained on does not hold its place: one the trainer passed over (it
was more than ``max_staleness`` versions behind when the trainer reached it, a long-tail rollout; it
has no action token, an error; or the driver cancelled it in flight once it could no longer be trained
on, :class:`~sao.rollout.driver.DriverConfig` ``cancel_stale``) is
:meth:`released <StalenessGate.release>` (AReaL's manager likewise counts only accepted and running
rollouts). Without this, every such trajectory would shrink the window for good, and under
heavy-tailed rollout times the number in flight would fall step after step.
"""

from __future__ import annotations

import dataclasses

__all__ = ["StalenessGate"]


@dataclasses.dataclass
class StalenessGate:
    """Counts started trajectories and says how many more may start.

    Attributes:
        batch_size: trajectories the trainer consumes per policy version.
        max_staleness: versions a trajectory may lag when it is consumed.
        initial_version: the version counting starts from (a resumed run starts at its version).
        started: trajectories started so far that were or may still be consumed (a resumed run starts
            with the rows it stored that its trainer has yet to consume or pass over).
    """

    batch_size: int
    max_staleness: int
    initial_version: int = 0
    started: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def capacity(self, trainer_version: int) -> int:
        """How many more trajectories may start now."""
        steps = trainer_version - self.initial_version + self.max_staleness + 1
        return max(0, steps * self.batch_size - self.started)

    def start(self, count: int = 1) -> None:
        self.started += count

    def release(self, count: int = 1) -> None:
        """``count`` started trajectories will never be consumed: their places open again."""
        if count > self.started:
            raise ValueError(f"cannot release {count} of {self.started} started trajectories")
        self.started -= count
