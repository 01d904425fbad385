"""Plots and summaries of a run, drawn from the lake (the record), never from in-memory state.

:func:`step_frame` reads a run's ``train_steps`` (one row per actor update with its metrics and times);
:func:`plot_run` draws:

* ``learning_curve.png``: batch reward (and held-out accuracy where evaluated) against step and wall time;
* ``staleness.png``: how many trajectories each staleness contributed to training;
* ``dis_kept.png``: the DIS kept fraction by staleness and by action-token length bucket;
* ``values.png``: critic value mean and the fraction of values outside the reward range, with the loss.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sao.lake.store import Lake, is_valid_run_id  # noqa: E402

__all__ = ["plot_run", "step_frame"]


def step_frame(lake: Lake, run_id: str) -> list[dict]:
    """The run's steps in order: ``step``, ``version``, ``wall_s`` (since the run's first step started)
    and every metric."""
    if not is_valid_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} is not a valid run id")
    rows = lake.read("train_steps", predicate=f"run_id = '{run_id}'").to_pylist()
    rows.sort(key=lambda r: r["step"])
    if not rows:
        return []
    start = rows[0]["started_at"]
    frame = []
    for row in rows:
        entry = {"step": row["step"], "version": row["policy_version_after"],
                 "wall_s": (row["finished_at"] - start).total_seconds(), "trajectories": row["num_trajectories"]}
        entry.update(dict(row["metrics"]))
        frame.append(entry)
    return frame


def _smooth(values: Sequence[float], window: int = 8) -> list[float]:
    out, recent = [], collections.deque(maxlen=window)
    for value in values:
        recent.append(value)
        out.append(sum(recent) / len(recent))
    return out


def _weighted_by_suffix(frame: Sequence[Mapping], prefix: str, weight_prefix: str | None = None) -> dict[str, float]:
    """Average of every metric ``prefix<suffix>`` over steps (weighted by ``weight_prefix<suffix>``)."""
    sums: dict[str, float] = collections.defaultdict(float)
    weights: dict[str, float] = collections.defaultdict(float)
    for row in frame:
        for key, value in row.items():
            if key.startswith(prefix):
                suffix = key[len(prefix):]
                weight = row.get(f"{weight_prefix}{suffix}", 1.0) if weight_prefix else 1.0
                sums[suffix] += value * weight
                weights[suffix] += weight
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


def plot_run(lake: Lake, run_id: str, out_dir: str | Path,
             evaluations: Sequence[tuple[int, float]] = ()) -> list[Path]:
    """Draw the run's figures into ``out_dir``; ``evaluations`` are (version, held-out accuracy) points.
    Returns the PNG paths (none when the run has no step yet)."""
    frame = step_frame(lake, run_id)
    if not frame:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in frame]
    walls = [r["wall_s"] for r in frame]
    rewards = [r.get("batch/reward_mean", 0.0) for r in frame]
    paths = []

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for axis, x, label in ((by_step, steps, "actor update (step)"), (by_time, walls, "wall time (s)")):
        axis.plot(x, rewards, alpha=0.3, color="C0", label="batch reward")
        axis.plot(x, _smooth(rewards), color="C0", label="batch reward (mean of 8)")
        axis.set_xlabel(label)
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    if evaluations:
        by_version = {r["version"]: r for r in frame}
        eval_steps = [v for v, _ in evaluations]
        eval_acc = [a for _, a in evaluations]
        by_step.plot(eval_steps, eval_acc, "o-", color="C3", label="held-out accuracy")
        eval_walls = [by_version[v]["wall_s"] if v in by_version else 0.0 for v in eval_steps]
        by_time.plot(eval_walls, eval_acc, "o-", color="C3", label="held-out accuracy")
    by_step.set_ylabel("reward / accuracy")
    by_step.legend(loc="lower right")
    fig.suptitle(f"run {run_id}: learning curve")
    paths.append(_save(fig, out / "learning_curve.png"))

    counts = _weighted_by_suffix(frame, "batch/staleness_count/")
    totals = {k: v * len(frame) for k, v in counts.items()}
    fig, axis = plt.subplots(figsize=(6, 4))
    keys = sorted(totals, key=int)
    axis.bar([int(k) for k in keys], [totals[k] for k in keys], color="C1")
    axis.set_xlabel("staleness at training (versions)")
    axis.set_ylabel("trajectories trained on")
    axis.set_title(f"run {run_id}: staleness of trained trajectories")
    paths.append(_save(fig, out / "staleness.png"))

    kept_staleness = _weighted_by_suffix(frame, "actor/kept_frac/staleness_", "batch/staleness_count/")
    kept_length = _weighted_by_suffix(frame, "actor/kept_frac/length_")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted(kept_staleness, key=int)
    left.bar([int(k) for k in keys], [kept_staleness[k] for k in keys], color="C2")
    left.set_xlabel("staleness (versions)")
    left.set_ylabel("DIS kept fraction of action tokens")
    left.set_ylim(0, 1.05)
    order = sorted(kept_length, key=lambda k: (k.startswith("gt"), int(k.split("_")[1])))
    right.bar(range(len(order)), [kept_length[k] for k in order], color="C2")
    right.set_xticks(range(len(order)), [k.replace("le_", "<=").replace("gt_", ">") for k in order])
    right.set_xlabel("action tokens per trajectory")
    right.set_ylim(0, 1.05)
    fig.suptitle(f"run {run_id}: what DIS kept")
    paths.append(_save(fig, out / "dis_kept.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [r.get("critic/value_mean_before", 0.0) for r in frame], label="value mean (before update)")
    left.plot(steps, [r.get("critic/frac_outside_reward_range", 0.0) for r in frame], label="fraction outside reward_range")
    left.set_xlabel("step")
    left.legend()
    right.plot(steps, [r.get("critic/loss", 0.0) for r in frame], color="C4")
    right.set_xlabel("step")
    right.set_ylabel("critic loss (last of K updates)")
    fig.suptitle(f"run {run_id}: critic")
    paths.append(_save(fig, out / "values.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
