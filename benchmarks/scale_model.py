"""A discrete-event model of the pipeline, calibrated here, extrapolated to data-centre sizes.

Run with ``sao bench scale`` (``--quick`` for a smoke run; ``--validate`` also runs the real pipeline
at small configurations on this machine and compares). It writes ``docs/results/scale.json`` and the
``scale`` section of ``docs/RESULTS.md``; ``docs/SCALING.md`` discusses the predictions.

What is simulated (one heap of timed events; numpy only):

* **Rollout replicas.** The driver keeps up to ``max_in_flight`` trajectories running, spread over the
  replicas, and starts one only while the staleness gate allows (``(v + max_staleness + 1) * batch``
  started at trainer version ``v``, :mod:`sao.rollout.staleness`; one the trainer passes over as too
  stale gives its place back). A trajectory is ``turns`` turns; a
  turn is a generation segment, then (except after the last) a tool call. A replica decodes all its
  generating requests together: with ``b`` of them it makes ``rate(b)`` tokens/s in all (a measured
  concurrency curve), shared equally (processor sharing). Each turn first costs ``turn_overhead_s`` of
  the replica's time (prefill, agent loop, the call), shared equally among the replica's requests in
  that phase. The driver routes a new rollout to the least-loaded replica. A trajectory's policy
  version is its replica's at its first token. A tool call takes a log-normal time (heavy right tail).
* **Shared cores** (this machine only): replicas' engines, the trainer and the driver share
  ``shared_cores``; while ``n`` of them are busy each runs at ``min(1, cores / n)``. Every change of
  ``n`` re-times the work in progress.
* **The lake writer** (one, in the driver): flushes at ``flush_rows`` records or when the oldest is
  ``flush_seconds`` old; a commit takes ``commit_s + tokens * commit_s_per_token``; one at a time.
* **The trainer**: waits for ``batch`` committed, unconsumed trajectories within ``max_staleness``
  (older ones are skipped, never trained on), reads them (``read_s``: waiting on the lake, no core),
  updates (``step_s + tokens * step_s_per_token`` of a core), then publishes: the trainer is blocked
  for ``publish_put_s_per_param * params`` (here: the measured commit and gap between steps); replicas
  run the new version after ``broadcast_s`` more.

Aggregation: at data-centre sizes at most ``max_sim_replicas`` replicas are simulated, each finished
trajectory standing for ``replicas / simulated`` real ones (replicas are independent and identical;
the writer and the trainer see the aggregate stream). The prediction is trajectories trained per
second in the steady state (after ``warmup_steps`` steps), and the share of time each stage is the
limit: ``rollout`` (the trainer waited for data while replicas were full), ``publish`` (it waited while
replicas still ran weights more than ``max_staleness`` versions old, or on the put), ``gate`` (it waited while
replicas had room but the staleness gate admitted no new rollout: ``batch * (max_staleness + 1)`` bounds
the work in flight), ``trainer`` (data waited for the trainer), ``lake`` (the rows were there but not
yet committed). Replicas that receive weights more than ``max_staleness`` versions late make every
rollout stale until they catch up: each step then waits for the broadcast (bottleneck ``publish``).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Prediction", "Scenario", "simulate"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "results"


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
        max_sim_replicas: most replicas simulated individually (see the module docstring).
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


class _Sim:
    """The event loop and the state of one run of the model (see the module docstring)."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.rng = np.random.default_rng(sc.seed)
        self.now = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.sim_replicas = min(sc.replicas, sc.max_sim_replicas)
        self.weight = sc.replicas / self.sim_replicas  # real trajectories per simulated one
        self.sim_in_flight = max(1, round(sc.max_in_flight / self.weight))
        self.curve_c = np.array([c for c, _ in sc.rate_curve], dtype=float)
        self.curve_r = np.array([r for _, r in sc.rate_curve], dtype=float)
        # Replica state: requests generating on each (id -> remaining tokens), last re-time.
        self.generating: list[dict[int, float]] = [{} for _ in range(self.sim_replicas)]
        self.replica_epoch = [0] * self.sim_replicas
        self.replica_version = [0] * self.sim_replicas
        # Requests in their per-turn fixed cost on each replica (id -> remaining seconds of the replica's
        # time): served one replica-second per second, shared equally among them.
        self.preparing: list[dict[int, float]] = [{} for _ in range(self.sim_replicas)]
        self.turn_time, self.turns_done = 0.0, 0  # generation time per turn (fixed cost + decode)
        self.update_time, self.updates_done, self.update_started = 0.0, 0, 0.0
        self.in_flight = 0
        self.per_replica = [0] * self.sim_replicas  # trajectories in flight on each replica
        self.started = 0.0  # real trajectories started (the staleness gate counts real ones)
        self.next_id = 0
        self.traj: dict[int, dict[str, Any]] = {}
        # Writer, trainer.
        self.buffer: list[dict[str, Any]] = []
        self.buffer_since: float | None = None
        self.committing = False
        self.commit_queue: deque[list[dict[str, Any]]] = deque()
        self.committed: deque[dict[str, Any]] = deque()
        self.commits, self.committed_rows = 0, 0.0
        self.version = 0
        self.trainer_state = "waiting"  # waiting | reading | updating | publishing
        self.trainer_work = 0.0  # remaining seconds at full speed of the current trainer phase
        self.trainer_epoch = 0
        self.step_started: list[float] = []
        self.step_done: list[float] = []
        self.trained, self.skipped = 0.0, 0.0
        self.staleness_sum = 0.0
        self.time_in: dict[str, float] = {"rollout": 0.0, "gate": 0.0, "trainer": 0.0, "lake": 0.0, "publish": 0.0}
        self.last_speed_change = 0.0
        self.processed = 0

    # --- events -----------------------------------------------------------------------------------
    def push(self, at: float, kind: str, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, data))

    # --- shared cores -----------------------------------------------------------------------------
    def busy_units(self) -> float:
        active = sum(1 for g, n in zip(self.generating, self.preparing, strict=True) if g or n)
        return active + (1 if self.trainer_state == "updating" else 0) + (
            self.sc.driver_load if self.in_flight else 0.0)

    def speed(self) -> float:
        if self.sc.shared_cores is None:
            return 1.0
        busy = self.busy_units()
        return 1.0 if busy <= self.sc.shared_cores else self.sc.shared_cores / busy

    def rate(self, concurrency: int) -> float:
        return float(np.interp(concurrency, self.curve_c, self.curve_r))

    def per_request_rate(self, r: int) -> float:
        n = len(self.generating[r])
        return 0.0 if n == 0 else self.rate(n) / n * self.speed()

    def prep_rate(self, r: int) -> float:
        n = len(self.preparing[r])
        return 0.0 if n == 0 else self.speed() / n

    def advance(self) -> None:
        """Bring the work in progress up to ``now`` at the speeds that held since the last change."""
        dt = self.now - self.last_speed_change
        if dt <= 0:
            return
        speed = self.speed()
        for r in range(self.sim_replicas):
            per = self.per_request_rate(r)
            for tid in self.generating[r]:
                self.generating[r][tid] -= per * dt
            prep = self.prep_rate(r)
            for tid in self.preparing[r]:
                self.preparing[r][tid] -= prep * dt
        if self.trainer_state == "updating":
            self.trainer_work -= speed * dt
        self.last_speed_change = self.now

    def retime(self) -> None:
        """New completion events for all work in progress (old ones are invalidated by epoch)."""
        for r in range(self.sim_replicas):
            self.replica_epoch[r] += 1
            per = self.per_request_rate(r)
            if per > 0 and self.generating[r]:
                tid, left = min(self.generating[r].items(), key=lambda kv: kv[1])
                self.push(self.now + max(left, 0.0) / per, "segment_done", (r, tid, self.replica_epoch[r]))
            prep = self.prep_rate(r)
            if prep > 0:
                tid, left = min(self.preparing[r].items(), key=lambda kv: kv[1])
                self.push(self.now + max(left, 0.0) / prep, "prep_done", (r, tid, self.replica_epoch[r]))
        if self.trainer_state == "updating":
            self.trainer_epoch += 1
            self.push(self.now + max(self.trainer_work, 0.0) / self.speed(), "trainer_phase_done", self.trainer_epoch)

    def changed(self) -> None:
        self.retime()

    # --- rollouts ---------------------------------------------------------------------------------
    def gate_capacity(self) -> float:
        return (self.version + self.sc.max_staleness + 1) * self.sc.batch - self.started

    def fill(self) -> None:
        while self.in_flight < self.sim_in_flight and self.gate_capacity() >= self.weight:
            tid, self.next_id = self.next_id, self.next_id + 1
            r = min(range(self.sim_replicas), key=self.per_replica.__getitem__)  # least loaded, like Serve's router
            self.per_replica[r] += 1
            self.traj[tid] = {"replica": r, "turn": 0, "version": None}
            self.in_flight += 1
            self.started += self.weight
            self.start_turn(tid)

    def start_turn(self, tid: int) -> None:
        """The turn's fixed cost: ``turn_overhead_s`` of its replica's time, shared with the other
        requests in theirs (prefill, the agent loop and the request are work on the replica)."""
        t = self.traj[tid]
        t["turn_started"] = self.now
        self.advance()
        self.preparing[t["replica"]][tid] = self.sc.turn_overhead_s
        self.changed()

    def begin_generation(self, r: int, tid: int) -> None:
        t = self.traj[tid]
        if t["version"] is None:  # the oldest version that samples it: the replica's at its first token
            t["version"] = self.replica_version[r]
        tokens = self.rng.exponential(self.sc.tokens_per_turn)
        self.advance()
        del self.preparing[r][tid]
        self.generating[r][tid] = max(tokens, 1.0)
        self.changed()

    def segment_done(self, r: int, tid: int) -> None:
        self.advance()
        del self.generating[r][tid]
        self.changed()
        t = self.traj[tid]
        self.turn_time += self.now - t["turn_started"]
        self.turns_done += 1
        t["turn"] += 1
        if t["turn"] >= self.sc.turns:
            self.finish(tid)
        else:
            delay = self.sc.tool_median_s * math.exp(self.sc.tool_sigma * self.rng.standard_normal())
            self.push(self.now + delay, "tool_done", tid)

    def finish(self, tid: int) -> None:
        t = self.traj.pop(tid)
        self.in_flight -= 1
        self.per_replica[t["replica"]] -= 1
        self.buffer.append({"version": t["version"], "done": self.now})
        if self.buffer_since is None:
            self.buffer_since = self.now
            self.push(self.now + self.sc.flush_seconds, "flush_timer", self.now)
        if len(self.buffer) * self.weight >= self.sc.flush_rows:
            self.flush()
        self.fill()

    # --- lake writer --------------------------------------------------------------------------------
    def flush(self) -> None:
        if not self.buffer:
            return
        self.commit_queue.append(self.buffer)
        self.buffer, self.buffer_since = [], None
        self.start_commit()

    def start_commit(self) -> None:
        if self.committing or not self.commit_queue:
            return
        rows = self.commit_queue[0]
        tokens = len(rows) * self.weight * self.sc.context_tokens
        self.committing = True
        self.push(self.now + self.sc.commit_s + tokens * self.sc.commit_s_per_token, "commit_done")

    def commit_done(self) -> None:
        rows = self.commit_queue.popleft()
        self.committing = False
        self.commits += 1
        self.committed_rows += len(rows) * self.weight
        self.committed.extend(rows)
        self.start_commit()
        self.try_train()

    # --- trainer ----------------------------------------------------------------------------------
    def need(self) -> int:
        return max(1, round(self.sc.batch / self.weight))

    def try_train(self) -> None:
        if self.trainer_state != "waiting":
            return
        stale = [row for row in self.committed if self.version - row["version"] > self.sc.max_staleness]
        if stale:  # passed over for good; the driver's gate gets their places back (via the broker)
            passed = {id(row) for row in stale}
            self.committed = deque(row for row in self.committed if id(row) not in passed)
            self.skipped += self.weight * len(stale)
            self.started -= self.weight * len(stale)
            self.fill()
        eligible = list(self.committed)
        if len(eligible) < self.need():
            return
        batch = eligible[: self.need()]
        for row in batch:
            self.committed.remove(row)
        self.staleness_sum += sum(self.version - row["version"] for row in batch) * self.weight
        self.trained += len(batch) * self.weight
        self.step_started.append(self.now)
        self.trainer_state = "reading"  # waits on the lake: no core
        self.push(self.now + self.sc.read_s, "read_done")

    def read_done(self) -> None:
        self.advance()
        tokens = self.sc.batch * self.sc.context_tokens
        self.trainer_state, self.trainer_work = "updating", self.sc.step_s + tokens * self.sc.step_s_per_token
        self.update_started = self.now
        self.changed()

    def trainer_phase_done(self) -> None:
        self.advance()
        self.update_time += self.now - self.update_started
        self.updates_done += 1
        self.trainer_state = "publishing"
        self.changed()
        self.push(self.now + self.sc.params * self.sc.publish_put_s_per_param, "published")

    def published(self) -> None:
        self.version += 1
        self.step_done.append(self.now)
        self.push(self.now + self.sc.broadcast_s, "replicas_updated", self.version)
        self.advance()
        self.trainer_state = "waiting"
        self.changed()
        self.fill()
        self.try_train()

    # --- accounting of the limiting stage ------------------------------------------------------------
    def account(self, until: float) -> None:
        dt = until - self.now
        if dt <= 0 or len(self.step_done) < self.sc.warmup_steps:
            return
        if self.trainer_state == "publishing":
            self.time_in["publish"] += dt
        elif self.trainer_state != "waiting":
            self.time_in["trainer"] += dt
        elif len(self.committed) + sum(len(rows) for rows in self.commit_queue) >= self.need():
            self.time_in["lake"] += dt  # the rows are there, not yet committed
        elif self.version - min(self.replica_version) > self.sc.max_staleness:
            self.time_in["publish"] += dt  # replicas still run weights too old to train on
        elif self.in_flight < self.sim_in_flight and self.gate_capacity() < self.weight:
            self.time_in["gate"] += dt  # replicas idle: the staleness gate holds back new rollouts
        else:
            self.time_in["rollout"] += dt

    def run(self) -> Prediction:
        self.fill()
        handlers = {
            "tool_done": lambda d: self.start_turn(d),
            "flush_timer": lambda d: self.flush() if self.buffer_since == d else None,
            "commit_done": lambda d: self.commit_done(),
            "read_done": lambda d: self.read_done(),
            "published": lambda d: self.published(),
            "replicas_updated": lambda d: self.replica_version.__setitem__(slice(None), [d] * self.sim_replicas),
        }
        while self.events and len(self.step_done) < self.sc.steps:
            at, _, kind, data = heapq.heappop(self.events)
            self.account(at)
            self.now = at
            self.processed += 1
            if kind == "segment_done":
                r, tid, epoch = data
                if epoch == self.replica_epoch[r] and tid in self.generating[r]:
                    self.segment_done(r, tid)
            elif kind == "prep_done":
                r, tid, epoch = data
                if epoch == self.replica_epoch[r] and tid in self.preparing[r]:
                    self.begin_generation(r, tid)
            elif kind == "trainer_phase_done":
                if data == self.trainer_epoch:
                    self.trainer_phase_done()
            else:
                handlers[kind](data)
        if len(self.step_done) < self.sc.steps:
            return self.stalled()
        return self.prediction()

    def stalled(self) -> Prediction:
        """Nothing left to do before the last step: every started trajectory was consumed or went stale
        (its replica ran weights more than ``max_staleness`` versions old), and the gate admits no
        more."""
        return Prediction(
            name=self.sc.name, trajectories_per_s=0.0, tokens_per_s=0.0, step_s=math.inf,
            bottleneck="publish" if self.skipped else "gate", limit_shares={"stalled": 1.0},
            mean_staleness=self.staleness_sum / max(self.trained, 1.0),
            skipped_stale_frac=self.skipped / max(self.trained + self.skipped, 1.0),
            commits_per_s=self.commits / max(self.now, 1e-9),
            rows_per_commit=self.committed_rows / max(self.commits, 1), sim_events=self.processed)

    def prediction(self) -> Prediction:
        w = self.sc.warmup_steps
        span = self.step_done[-1] - self.step_done[w - 1]
        steps = len(self.step_done) - w
        per_s = steps * self.sc.batch / span
        total = sum(self.time_in.values()) or 1.0
        shares = {k: v / total for k, v in self.time_in.items()}
        return Prediction(
            name=self.sc.name, trajectories_per_s=per_s, tokens_per_s=per_s * self.sc.context_tokens,
            step_s=span / steps, bottleneck=max(shares, key=shares.get), limit_shares=shares,
            mean_staleness=self.staleness_sum / max(self.trained, 1.0),
            skipped_stale_frac=self.skipped / max(self.trained + self.skipped, 1.0),
            commits_per_s=self.commits / self.now, rows_per_commit=self.committed_rows / max(self.commits, 1),
            sim_events=self.processed)


def simulate(scenario: Scenario) -> Prediction:
    """Run the model on ``scenario`` (deterministic for its seed)."""
    return _Sim(scenario).run()


# --- calibration on this machine ---------------------------------------------------------------------

# Measured elsewhere on this machine and written down in docs/RESULTS.md ("Why the rollout target is
# still missed"): the calling process's Serve router and the replica's request handling keep about 0.4
# of a core busy while rollouts run.
DRIVER_LOAD_CORES = 0.4


@dataclasses.dataclass(frozen=True)
class RunMeasurement:
    """What one real pipeline run did, read from its lake (``measure_run``)."""

    run_id: str
    replicas: int
    batch: int
    max_in_flight: int
    trajectories_per_s: float
    step_s: float
    tokens_per_turn: float
    context_tokens: float
    turns: float
    generation_s_per_turn: float
    tool_median_s: float
    tool_sigma: float
    update_s: float
    commit_s: float
    publish_s: float
    steps: int
    trainer_gap_s: float = 0.0
    load_average: float = 0.0

    @property
    def wait_read_s(self) -> float:
        """The trainer's ``wait_read_s`` per step: the step's period less its update, commit and the
        gap after it (the rest of ``started_at`` -> ``finished_at``). It is the reader's polling
        (``TrainConfig.poll_s``) and snapshot reads on the loaded machine, and any wait for data, so as
        a cost it is an upper bound; at least the lake benchmark's warm read (30 ms)."""
        return max(0.03, self.step_s - self.update_s - self.commit_s - self.trainer_gap_s)


def measure_run(lake, run_id: str, replicas: int, max_in_flight: int, warmup_steps: int = 3) -> RunMeasurement:
    """Trajectory shape, stage timings and steady-state throughput of a finished run, from its lake:
    throughput is ``batch`` trajectories per step over the steps after ``warmup_steps`` (start-up of
    Ray Train and the replicas excluded)."""
    from sao.lake.store import sql_literal

    where = f"run_id = {sql_literal(run_id)}"
    steps = sorted(lake.read("train_steps", predicate=where).to_pylist(), key=lambda r: r["step"])
    if len(steps) <= warmup_steps + 1:
        raise ValueError(f"run {run_id!r} has {len(steps)} steps; need more than {warmup_steps + 1} to measure")
    rows = lake.read("trajectories", predicate=where,
                     columns=["num_action_tokens", "num_turns", "prompt_ids", "completion_ids", "timings"]).to_pylist()
    batch = steps[0]["num_trajectories"]
    done = [s["finished_at"].timestamp() for s in steps]
    span = done[-1] - done[warmup_steps - 1]
    turns = np.array([max(r["num_turns"], 1) for r in rows], dtype=float)
    tool_calls = np.maximum(turns - 1, 0)
    per_call = np.array([r["timings"]["tool_s"] for r in rows])[tool_calls > 0] / tool_calls[tool_calls > 0]
    per_call = per_call[per_call > 0]
    logs = np.log(per_call) if per_call.size else np.array([0.0])
    late = steps[warmup_steps:]
    timing = lambda key: float(np.mean([dict(s["timings"])[key] for s in late]))  # noqa: E731
    return RunMeasurement(
        run_id=run_id, replicas=replicas, batch=batch, max_in_flight=max_in_flight,
        trajectories_per_s=(len(steps) - warmup_steps) * batch / span, step_s=span / (len(steps) - warmup_steps),
        tokens_per_turn=float(np.mean([r["num_action_tokens"] for r in rows]) / turns.mean()),
        context_tokens=float(np.mean([len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows])),
        turns=float(turns.mean()),
        generation_s_per_turn=float(np.mean([r["timings"]["generation_s"] for r in rows]) / turns.mean()),
        tool_median_s=float(math.exp(np.median(logs))), tool_sigma=float(np.std(logs)),
        update_s=timing("update_s"), commit_s=timing("commit_s"),
        publish_s=float(np.mean([dict(s["metrics"]).get("time/publish_s", 0.0) for s in late])),
        steps=len(steps),
        # From one step's row to the next step's start: publication, the Ray Train report, the loop.
        trainer_gap_s=float(np.mean([b["started_at"].timestamp() - a["finished_at"].timestamp()
                                     for a, b in zip(late, late[1:], strict=False)])))


def _rollout_curve() -> tuple[tuple[float, float], ...]:
    data = json.loads((RESULTS_DIR / "rollout.json").read_text())
    return tuple(sorted((float(c), float(v["tokens_s"])) for c, v in data["serve"].items()))


def _lake_commit() -> tuple[float, float]:
    """(fixed seconds, seconds per stored token) of one writer commit, fitted to ``sao bench lake``."""
    data = json.loads((RESULTS_DIR / "lake.json").read_text())
    tokens = data["tokens"] + data["prompt_tokens"]
    x = np.array([row["batch"] * tokens for row in data["ingest"]], dtype=float)
    y = np.array([row["ms_per_commit"] / 1000 for row in data["ingest"]])
    slope, intercept = np.polyfit(x, y, 1)
    return float(max(intercept, 1e-3)), float(max(slope, 0.0))


def _publish_per_param() -> float:
    data = json.loads((RESULTS_DIR / "rollout.json").read_text())["publish"]
    return data["put_and_announce_s_median"] / data["parameters"]


def here_scenario(calibration: RunMeasurement, replicas: int, batch: int, max_in_flight: int, *,
                  turn_overhead_s: float, update_full_s: float, steps: int = 40, name: str | None = None
                  ) -> Scenario:
    """This machine (2 shared cores): component figures from the benchmark results and from the
    calibration run's trajectories (shape, tool latency); full-speed costs from :func:`calibrate`."""
    commit_s, commit_per_token = _lake_commit()
    per_token = update_full_s / (calibration.batch * calibration.context_tokens)
    return Scenario(
        name=name or f"here-r{replicas}-b{batch}", replicas=replicas, max_in_flight=max_in_flight,
        rate_curve=_rollout_curve(), turn_overhead_s=turn_overhead_s, tokens_per_turn=calibration.tokens_per_turn,
        context_tokens=calibration.context_tokens, turns=max(1, round(calibration.turns)),
        tool_median_s=calibration.tool_median_s, tool_sigma=calibration.tool_sigma,
        flush_rows=16, flush_seconds=0.25, commit_s=commit_s, commit_s_per_token=commit_per_token,
        batch=batch, max_staleness=2, read_s=calibration.wait_read_s, step_s=0.0, step_s_per_token=per_token,
        # The trainer is blocked, without using a core, for the step's commit (checkpoint, rows) and what
        # follows it (publication, the Ray Train report): measured per step in the calibration run.
        params=625_408, publish_put_s_per_param=(calibration.commit_s + calibration.trainer_gap_s) / 625_408,
        broadcast_s=0.03,
        shared_cores=2.0, driver_load=DRIVER_LOAD_CORES, steps=steps, warmup_steps=5,
    )


def calibrate(calibration: RunMeasurement, iterations: int = 6) -> dict[str, float]:
    """Full-speed costs from the calibration run's in-situ stage timings, which ran on shared cores:
    the per-turn fixed cost and the update's work are scaled until the model, run at the calibration
    run's configuration, reproduces its mean generation time per turn and its mean update time. The
    run's throughput is not used."""
    overhead, update = 0.5 * calibration.generation_s_per_turn, calibration.update_s
    for _ in range(iterations):
        sim = _Sim(here_scenario(calibration, calibration.replicas, calibration.batch, calibration.max_in_flight,
                                 turn_overhead_s=overhead, update_full_s=update, steps=25))
        sim.run()
        overhead *= calibration.generation_s_per_turn / (sim.turn_time / max(sim.turns_done, 1))
        update *= calibration.update_s / (sim.update_time / max(sim.updates_done, 1))
    return {"turn_overhead_s": overhead, "update_full_s": update}


# --- validation runs on this machine ------------------------------------------------------------------

VALIDATION_CONFIGS: tuple[tuple[int, int], ...] = ((2, 16), (1, 16), (2, 32))  # (replicas, batch); first = calibration
WARMUP_CONFIG = (1, 8)  # run first, not measured: Ray's worker pool, Serve and the first torch calls warm up
MAX_IN_FLIGHT = 64


def _policy_dir(workdir: Path) -> Path:
    """The SFT policy of the learning benchmark when it is on disk (the trajectories of a trained
    policy), else a random tiny policy."""
    sft = ROOT / "runs" / "bench" / "bench-learning" / "sft"
    if (sft / "config.json").exists():
        return sft
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    return save_policy(build_policy(seed=0), workdir / "policy", build_tokenizer())


def run_validation(workdir: Path, configs: Sequence[tuple[int, int]], steps: int) -> list[RunMeasurement]:
    """The real pipeline (Serve replicas, lake writer, Ray Train trainer) at each ``(replicas, batch)``,
    one after the other in one local Ray instance; each measured from its lake."""
    from sao.lake.config import LakeConfig
    from sao.lake.store import Lake
    from sao.pipeline import PipelineConfig, run_pipeline
    from sao.rollout.agent import AgentConfig
    from sao.runs import math_tasks
    from sao.runtime import RayConfig, init_ray, shutdown_ray
    from sao.train.loop import TrainConfig

    policy = _policy_dir(workdir)
    lake_config = LakeConfig(root=str(workdir / "lake"))
    tasks = math_tasks("train")
    init_ray(RayConfig())
    measured: list[RunMeasurement] = []
    try:
        for index, (replicas, batch) in enumerate([WARMUP_CONFIG, *configs]):
            warmup = index == 0
            run_id = f"scale-warmup-r{replicas}-b{batch}" if warmup else f"scale-r{replicas}-b{batch}"
            run_steps = 6 if warmup else steps
            print(f"validation run {run_id}: {run_steps} steps ...", file=sys.stderr)
            train = TrainConfig(run_id=run_id, lake=lake_config, checkpoint_root=str(workdir / run_id / "ckpt"),
                                policy_path=str(policy), batch_size=batch, max_staleness=2, total_steps=run_steps)
            run_pipeline(PipelineConfig(train=train, num_replicas=replicas,
                                        agent=AgentConfig(max_tokens=96, max_turns=4), max_in_flight=MAX_IN_FLIGHT,
                                        app_name=f"rollout-{run_id}"), tasks)
            if warmup:
                continue
            load = os.getloadavg()[0]  # the machine's 1-minute load at the end of the run (other jobs too)
            measured.append(dataclasses.replace(measure_run(Lake.open(lake_config), run_id, replicas, MAX_IN_FLIGHT),
                                                load_average=load))
    finally:
        shutdown_ray()
    return measured


def _predict_here(calibration: RunMeasurement, run: RunMeasurement) -> Prediction:
    fitted = calibrate(calibration)
    return simulate(here_scenario(calibration, run.replicas, run.batch, run.max_in_flight, **fitted, steps=40))


def validate(measured: Sequence[RunMeasurement]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Calibrate on the first run's stage timings, predict every run's throughput. The first run's own
    prediction reproduces it nearly by construction (its read-and-wait stage is derived from its step
    period); the others are the test: other replica counts and batch sizes."""
    calibration = measured[0]
    fitted = calibrate(calibration)
    rows = []
    for run in measured:
        predicted = _predict_here(calibration, run)
        rows.append({"run_id": run.run_id, "replicas": run.replicas, "batch": run.batch,
                     "measured_trajectories_per_s": run.trajectories_per_s,
                     "predicted_trajectories_per_s": predicted.trajectories_per_s,
                     "error": predicted.trajectories_per_s / run.trajectories_per_s - 1.0,
                     "predicted_bottleneck": predicted.bottleneck, "calibration_run": run is calibration,
                     "measured": dataclasses.asdict(run) | {"wait_read_s": run.wait_read_s}})
    return fitted, rows


# --- data-centre sizes: assumptions, stated once ---------------------------------------------------------

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


def datacentre_scenario(name: str, *, params: float, replicas: int, trainer_gpus: int, trajectory_tokens: float,
                        batch: int = 1024, max_staleness: int = 2, flush_rows: int = 16,
                        broadcast: str = "naive", hw: Hardware = Hardware(), steps: int = 14) -> Scenario:
    """A data-centre deployment: ``replicas`` rollout replicas (each :func:`replica_gpus` GPUs), a
    trainer on ``trainer_gpus`` GPUs, trajectories of ``trajectory_tokens`` (half generated, half tool
    observations, in turns of 2k tokens), weights published ``naive`` (one source serves every
    replica) or ``sharded`` (each trainer node sends its shard; replicas relay along a tree). The
    driver keeps as many rollouts in flight as the staleness gate admits, ``batch * (max_staleness +
    1)``, at most what the replicas' KV memory holds."""
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


# --- command line ----------------------------------------------------------------------------------

def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two data-centre scenarios, short runs (a smoke test)")
    parser.add_argument("--validate", action="store_true",
                        help="run the real pipeline here at (replicas, batch) = " + ", ".join(
                            f"({r}, {b})" for r, b in VALIDATION_CONFIGS) + " and compare (about 4-6 minutes)")
    parser.add_argument("--steps", type=int, default=16, help="trainer steps of each validation run")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where scale.json goes")
    parser.add_argument("--results-md", type=Path, default=ROOT / "docs" / "RESULTS.md",
                        help="the results file whose `scale` section is replaced")
    parser.add_argument("--scaling-md", type=Path, default=ROOT / "docs" / "SCALING.md",
                        help="the document whose predictions section is replaced")
    return parser.parse_args(list(argv))


def _prediction_row(sc: Scenario, p: Prediction) -> dict[str, Any]:
    return {"scenario": sc.name, "params": sc.params, "replicas": sc.replicas, "batch": sc.batch,
            "context_tokens": sc.context_tokens, "max_in_flight": sc.max_in_flight, "flush_rows": sc.flush_rows,
            "broadcast_s": sc.broadcast_s, **dataclasses.asdict(p)}


def _previous_validation(path: Path) -> tuple[list[RunMeasurement], str] | None:
    """The runs a previous ``--validate`` measured, and its command (the model is re-run on them)."""
    if not path.exists():
        return None
    stored = json.loads(path.read_text()).get("validation", {})
    if not stored.get("rows"):
        return None
    fields = {f.name for f in dataclasses.fields(RunMeasurement)}
    runs = [RunMeasurement(**{k: v for k, v in row["measured"].items() if k in fields}) for row in stored["rows"]]
    return runs, stored.get("measured_by", "sao bench scale --validate")


def _markdown(data: dict[str, Any]) -> str:
    from benchmarks._report import machine_line

    lines = ["## Scaling model: predicted against measured throughput (`sao bench scale`)", "",
             f"Command: `{data['command']}`. {machine_line(data['machine'])} Raw data: `docs/results/scale.json`; "
             "the model and its data-centre predictions: `docs/SCALING.md`.", ""]
    validation = data.get("validation")
    if validation:
        fitted = validation["calibration"]
        first = validation["rows"][0]
        lines += [f"Real pipeline runs here (`{validation['measured_by']}`: Serve replicas, lake writer, Ray Train "
                  f"trainer; tiny policy, math_tool, max staleness 2, {first['measured']['max_in_flight']} in "
                  "flight, a local lake), after an unmeasured warm-up run. Throughput: trajectories trained per "
                  "second after the first 3 steps (from `train_steps.finished_at`). The model is calibrated on "
                  f"`{first['run_id']}`'s stage timings only: generation time per turn (-> "
                  f"{fitted['turn_overhead_s'] * 1000:.0f} ms of replica time per turn at full speed), update "
                  f"(-> {fitted['update_full_s']:.2f} s per {first['batch']}-trajectory update at full speed), "
                  "the trainer's read-and-wait, commit and the gap between steps, tool latency; plus the rollout "
                  "and lake benchmarks (`rollout.json`, `lake.json`) and the Serve overhead of 0.4 core. The "
                  "other runs are predictions for another replica count and another batch size on the same 2 "
                  "shared cores.", "",
                  "| run | replicas | batch | load avg after | measured traj/s | predicted traj/s | error | "
                  "predicted limit |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for row in validation["rows"]:
            tag = " (calibration: by construction)" if row["calibration_run"] else ""
            lines.append(f"| `{row['run_id']}`{tag} | {row['replicas']} | {row['batch']} | "
                         f"{row['measured'].get('load_average', 0.0):.1f} | "
                         f"{row['measured_trajectories_per_s']:.2f} | {row['predicted_trajectories_per_s']:.2f} | "
                         f"{row['error'] * 100:+.0f}% | {row['predicted_bottleneck']} |")
        worst = max(abs(r["error"]) for r in validation["rows"] if not r["calibration_run"])
        lines += ["", f"Largest error on the predicted runs: {worst * 100:.0f}% (target: within 20%): "
                  + ("**met**." if worst <= 0.2 else "**missed**.") + " The load average is the machine's (other "
                  "jobs shared the 2 cores); the model knows only the pipeline's own processes.", ""]
    else:
        lines += ["No validation runs (run `sao bench scale --validate`).", ""]
    lines += ["Data-centre predictions (assumptions in `docs/SCALING.md`):", "",
              "| scenario | trajectories/s | tokens/s | step s | first bottleneck | stale skipped |",
              "|---|---:|---:|---:|---|---:|"]
    for row in data["datacentre"]:
        lines.append(f"| {row['scenario']} | {row['trajectories_per_s']:,.1f} | {row['tokens_per_s']:,.0f} | "
                     f"{row['step_s']:,.0f} | {row['bottleneck']} | {row['skipped_stale_frac'] * 100:.0f}% |")
    return "\n".join(lines)


REMEDIES = {
    "trainer": "more trainer GPUs (data parallel; the step is compute-bound), a cheaper critic (frozen "
               "attention, a smaller critic), fewer critic epochs",
    "lake": "more rows per commit (`WriterConfig.flush_rows`; a commit costs ~0.25 s on an object store "
            "whatever its size), one writer per driver shard (appends never conflict), table partitioning "
            "by run and hour so a commit and the trainer's scan touch one partition",
    "publish": "sharded weight broadcast: each trainer node sends its shard, replicas relay along a tree "
               "(one source serving every replica grows linearly with replicas); or a larger max_staleness",
    "gate": "let the staleness gate admit what the replicas can run: `batch * (max_staleness + 1)` at "
            "least the replicas' in-flight capacity; if rollouts go stale (weights arrive late), shard "
            "the weight broadcast",
    "rollout": "more replicas, or more requests per replica (KV memory: fp8 KV cache, more GPUs per "
               "replica); shorter tool latency tails",
}


def _scaling_markdown(data: dict[str, Any]) -> str:
    """The predictions section of docs/SCALING.md (between its markers), from the same data."""
    hw = data["hardware_assumed"]
    lines = [
        "## Which part saturates first: the scaling model", "",
        "`benchmarks/scale_model.py` (`sao bench scale`) is a discrete-event simulation of the pipeline (one "
        "heap of timed events, numpy only): rollout replicas that decode their running requests together at "
        "a measured tokens/s-per-concurrency curve plus a fixed cost per turn, with log-normal (heavy-tailed) "
        "tool latency between turns; the driver's staleness gate; one lake writer that commits every "
        "`flush_rows` records or `flush_seconds`, at a measured fixed cost plus a cost per stored token; the "
        "trainer's read, update and weight publication; weights reaching replicas `broadcast_s` later, so "
        "trajectories sampled by weights more than `max_staleness` versions old are skipped. On this machine "
        "the replicas, the trainer and the Serve machinery share two cores. The module docstring has the details.",
        "",
        "**Validation here.** Calibrated on one real run's stage timings and the component benchmarks, it "
        "predicts the end-to-end throughput of real runs at other replica counts and batch sizes; the table, "
        "the errors and the command are in `docs/RESULTS.md` (section \"Scaling model\").",
        "",
        "**Assumptions at data-centre sizes** (none of these is measured here; `Hardware` in the module):",
        "",
        f"- GPU: {hw['gpu_flops'] / 1e12:.0f} TFLOP/s bf16, {hw['gpu_hbm_bytes_s'] / 1e12:.2f} TB/s HBM, "
        f"{hw['gpu_memory_bytes'] / 1e9:.0f} GB (H100-class); training at {hw['train_mfu']:.0%} MFU; a training "
        "token costs 14 x parameters FLOPs (actor forward + backward, a critic of the same size, the "
        "recomputed log-probabilities).",
        f"- Rollout replica: tensor-parallel over enough GPUs that bf16 weights fill at most half their memory "
        f"(7B: 1 GPU, 30B: 2); a decode step reads the weights and each running request's KV cache "
        f"({hw['kv_bytes_per_token_per_param'] * 1e6:.1f} bytes per context token per million parameters; "
        "half the trajectory on average), or is compute-bound, whichever is slower; requests per replica are "
        "capped by KV memory (30B, 100k tokens: 6).",
        "- Trajectories: turns of 2,000 tokens, half generated, half tool observations (prefilled); tool "
        f"latency log-normal, median {hw['tool_median_s']:.0f} s, sigma {hw['tool_sigma']} (p99 about 16x the "
        "median).",
        f"- Network: {hw['nic_bytes_s'] / 1e9:.0f} GB/s per node. Weight publication `naive`: one source "
        "serves every replica (`replicas x 2 bytes x parameters / bandwidth`); `sharded`: each trainer node "
        "sends its shard and replicas relay along a tree (`weights / (bandwidth x trainer nodes)` + 50 ms per "
        "tree level).",
        f"- Lake on an object store: {hw['commit_s']:.2f} s per commit (conditional put and log read), plus "
        f"68 ns per stored token (measured here: Arrow conversion and validation) and {hw['bytes_per_token']:.0f} "
        f"bytes per token at {hw['writer_bytes_s'] / 1e9:.0f} GB/s per writer; the trainer reads a batch at the "
        "same rate per trainer node.",
        "- The driver keeps `batch x (max_staleness + 1)` rollouts in flight (the staleness gate's bound; "
        "max_staleness 2), at most what the replicas' KV memory holds.",
        "",
        "Each row changes one thing from the row above (\"...\"), usually the remedy for the row above's "
        "bottleneck. \"stale skipped\": trajectories sampled by weights too old when the trainer reached them "
        "(the heavy tool-latency tail makes some rollouts outlive `max_staleness` steps).",
        "",
        "| scenario | trajectories/s | tokens/s | step s | first bottleneck | stale skipped | what to do next |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for row in data["datacentre"]:
        step = "stalls" if not math.isfinite(row["step_s"]) else f"{row['step_s']:,.0f}"
        lines.append(f"| {row['scenario']} | {row['trajectories_per_s']:,.1f} | {row['tokens_per_s']:,.0f} | {step} | "
                     f"{row['bottleneck']} | {row['skipped_stale_frac'] * 100:.0f}% | {REMEDIES[row['bottleneck']]} |")
    lines += ["", "Reading the table (the figures are the model's; the sentences were written from this run of it):",
              "",
              "- **The trainer** is the first limit of a modest deployment: a 7B policy with a critic of the same "
              "size trains 8k-token trajectories on 64 GPUs at about 19 per second.",
              "- **The staleness gate, fed by late weights** comes next: with 8x the trainer GPUs a step is only "
              "twice the time a one-source broadcast needs to reach 64 replicas (18 s), so rollouts started in "
              "that time sample the older weights, more go stale, and the gate (which counts them as started) "
              "holds the rest back. "
              "Sharded broadcast (0.3 s) gains half again; the rest is the gate's bound on work in flight, "
              "`batch x (max_staleness + 1)`: grow the batch with the replicas.",
              "- **The lake writer** at the pipeline's default of 16 rows per commit (kept small so a laptop's "
              "trainer is fed quickly) caps a 512-replica deployment; about a hundred rows per commit or more "
              "(`WriterConfig.flush_rows` 1024 with the age flush) doubles it and hands the limit back to the "
              "trainer.",
              "- **More replicas do not help a trainer-bound run**: 4096 replicas with a 4x batch train no "
              "faster than 512.",
              "- **30B and 100k-token trajectories** are trainer-bound on 512 GPUs (a step of 28 minutes); with "
              "2048 GPUs the gate binds again because each rollout runs for many minutes and few (6 per "
              "replica, by KV memory) fit in flight."]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    from benchmarks._report import machine, update_section, write_json

    args = _parse(argv)
    info = machine()
    json_path = args.results_dir / "scale.json"
    data: dict[str, Any] = {"command": " ".join(["sao bench scale", *argv]), "machine": info,
                            "hardware_assumed": dataclasses.asdict(Hardware())}
    measured: list[RunMeasurement] | None = None
    measured_by = data["command"]
    if args.validate:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="sao-bench-scale-") as workdir:
            measured = run_validation(Path(workdir), VALIDATION_CONFIGS, args.steps)
    elif previous := _previous_validation(json_path) or _previous_validation(RESULTS_DIR / "scale.json"):
        measured, measured_by = previous
    if measured:
        fitted, rows = validate(measured)
        data["validation"] = {"calibration": fitted, "rows": rows, "measured_by": measured_by}
        for row in rows:
            print(f"{row['run_id']}: measured {row['measured_trajectories_per_s']:.2f} traj/s, predicted "
                  f"{row['predicted_trajectories_per_s']:.2f} ({row['error'] * 100:+.0f}%)", file=sys.stderr)
    data["datacentre"] = []
    for sc in datacentre_grid(quick=args.quick):
        prediction = simulate(sc)
        data["datacentre"].append(_prediction_row(sc, prediction))
        print(f"{sc.name}: {prediction.trajectories_per_s:,.1f} traj/s, bottleneck {prediction.bottleneck}",
              file=sys.stderr)
    write_json(json_path, data)
    update_section(args.results_md, "scale", _markdown(data))
    if args.scaling_md.exists():
        update_section(args.scaling_md, "scaling-predictions", _scaling_markdown(data))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
