"""What the scaling model is given (:class:`Scenario`) and what it predicts (:class:`Prediction`)."""

from __future__ import annotations

import dataclasses

__all__ = ["Prediction", "Scenario"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Everything the model needs; each field is a measurement here or a stated assumption.

    Attributes:
        name: label in the tables.
        replicas, max_in_flight: rollout replicas and trajectories running at once over all of them.
        rate_curve: ``((concurrency, tokens/s), ...)`` of one replica, interpolated linearly (flat
            beyond the ends).
        turn_overhead_s: fixed cost of one generation call (prefill, agent loop, request).
        tokens_per_turn: generated tokens per turn (mean; exponential per turn).
        context_tokens: tokens per trajectory stored and trained on (prompt + completion).
        turns: turns per trajectory.
        tool_median_s, tool_sigma: log-normal tool-call latency.
        flush_rows, flush_seconds, commit_s, commit_s_per_token: the lake writer.
        batch, max_staleness: the trainer's batch and staleness bound.
        read_s: the trainer's read of one batch.
        step_s, step_s_per_token: one update (actor + critic), fixed and per trained token.
        params: policy parameters (weight publication).
        publish_put_s_per_param: time the trainer is blocked per parameter published.
        broadcast_s: further time until replicas run the new version.
        shared_cores: cores shared by replicas, trainer and driver (None: dedicated hardware).
        driver_load: cores' worth of work the driver and Serve machinery keep busy while rollouts run.
        max_sim_replicas: most replicas simulated individually (see :mod:`.simulator`).
        steps, warmup_steps: trainer steps simulated; those ignored at the start.
        seed: random seed.
    """

    name: str
    replicas: int
    max_in_flight: int
    rate_curve: tuple[tuple[float, float], ...]
    turn_overhead_s: float
    tokens_per_turn: float
    context_tokens: float
    turns: int
    tool_median_s: float
    tool_sigma: float
    flush_rows: int
    flush_seconds: float
    commit_s: float
    commit_s_per_token: float
    batch: int
    max_staleness: int
    read_s: float
    step_s: float
    step_s_per_token: float
    params: float
    publish_put_s_per_param: float
    broadcast_s: float
    shared_cores: float | None = None
    driver_load: float = 0.0
    max_sim_replicas: int = 32
    steps: int = 40
    warmup_steps: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_in_flight < 1 or self.batch < 1 or self.turns < 1:
            raise ValueError(f"scenario {self.name!r}: replicas, max_in_flight, batch and turns must be >= 1")
        if self.steps <= self.warmup_steps:
            raise ValueError(f"scenario {self.name!r}: steps ({self.steps}) must exceed warmup_steps "
                             f"({self.warmup_steps})")
        if len(self.rate_curve) < 1 or any(c <= 0 or r <= 0 for c, r in self.rate_curve):
            raise ValueError(f"scenario {self.name!r}: rate_curve needs positive (concurrency, tokens/s) points")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the model predicts for one scenario (steady state, after the warm-up steps)."""

    name: str
    trajectories_per_s: float
    tokens_per_s: float
    step_s: float
    bottleneck: str
    limit_shares: dict[str, float]
    mean_staleness: float
    skipped_stale_frac: float
    commits_per_s: float
    rows_per_commit: float
    sim_events: int
