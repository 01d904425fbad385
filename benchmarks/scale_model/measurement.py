"""What one real pipeline run did, read back from its lake: the figures the model is calibrated on and
validated against."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["RunMeasurement", "measure_run"]


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

