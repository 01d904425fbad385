"""The scaling model's discrete-event simulation of the pipeline (one heap of timed events; numpy
and the product's staleness gate, nothing else).

What is simulated:

* **Rollout replicas.** The driver keeps up to ``max_in_flight`` trajectories running, spread over the
  replicas, and starts one only while the staleness gate allows (``(v + max_staleness + 1) * batch``
  started at trainer version ``v``: the product's :class:`~sao.rollout.staleness.StalenessGate`; one the
  trainer passes over as too stale gives its place back). A trajectory is ``turns`` turns; a
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

The staleness gate counts simulated trajectories, and its batch is the simulated trainer's,
``round(batch / (replicas / simulated))``: the same rule as counting real ones whenever the batch is a
multiple of the real trajectories each simulated one stands for (every scenario of ``sao bench scale``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

import numpy as np

from benchmarks.scale_model.scenario import Prediction, Scenario
from sao.rollout.staleness import StalenessGate

__all__ = ["Simulation", "simulate"]


class Simulation:
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
        # The driver's staleness gate (the product's), counting simulated trajectories; its batch is the
        # simulated trainer's, need(). It admits exactly what a gate of real ones, (v + max_staleness + 1)
        # * batch, would whenever batch is a multiple of weight (every scenario of sao bench scale).
        # Otherwise need() * weight != batch and a gate of real ones drifts from the trainer: ahead of
        # it, or behind it until the run stalls (48 replicas as 32, batch 16, max_staleness 0: 10
        # admitted per version, 11 needed).
        self.gate = StalenessGate(batch_size=self.need(), max_staleness=sc.max_staleness)
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
    def fill(self) -> None:
        while self.in_flight < self.sim_in_flight and self.gate.capacity(self.version) > 0:
            tid, self.next_id = self.next_id, self.next_id + 1
            r = min(range(self.sim_replicas), key=self.per_replica.__getitem__)  # least loaded, like Serve's router
            self.per_replica[r] += 1
            self.traj[tid] = {"replica": r, "turn": 0, "version": None}
            self.in_flight += 1
            self.gate.start()
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
            self.gate.release(len(stale))
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
        elif self.in_flight < self.sim_in_flight and self.gate.capacity(self.version) == 0:
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
    return Simulation(scenario).run()

