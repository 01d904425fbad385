"""Prefect flow ``online_shift``: the style-preference experiment of SAO.md section 5, one run.

The policy writes one sentence per task; a simulated judge rewards the currently preferred style, and
the preference shifts at the given trainer steps (academic, then cute, then classical, ...). The flow
warm-starts a style policy (SFT on demonstrations in every style, cached under the run's folder),
trains with ``algorithm`` through the asynchronous pipeline (Serve rollouts -> Delta -> trainer), and
reports the reward curve with the shifts and the steps each shift took to recover
(:func:`sao.online.recovery`) as artifacts. ``sao bench online`` compares methods side by side.
A re-run with the same run id resumes the training.
"""

from __future__ import annotations

import contextvars
import dataclasses

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows.train import artifact_key
from sao import online
from sao.config import RunConfig
from sao.lake.store import Lake, sql_literal
from sao.train.config import Algorithm

__all__ = ["online_shift"]

_DEFAULTS = RunConfig()


@task(name="style-warm-start", retries=1, retry_delay_seconds=5)
def warm_start(settings: RunConfig, sft_steps: int) -> str:
    """The style policy of version 0 (idempotent: reused when present)."""
    return str(online.style_warm_start(settings.sft_dir, seed=settings.sft.seed, steps=sft_steps))


@task(name="train-with-shifts")
def train(settings: RunConfig, policy_path: str, shifts: list[int], max_tokens: int) -> list[float]:
    """The run's steps; returns the batch reward of every committed step (from ``train_steps``)."""
    from sao.pipeline import run_pipeline

    logger = get_run_logger()
    tasks, tasks_file = online.style_tasks(settings.run_dir / "style_preference.jsonl")
    config = online.online_pipeline(settings, policy_path, shifts, tasks_file, max_tokens=max_tokens)
    config = dataclasses.replace(config, app_name=f"online-{settings.run_id}")
    progress = create_progress_artifact(0.0, key=artifact_key(settings.run_id, "progress"),
                                        description=f"actor updates of run {settings.run_id}")
    context = contextvars.copy_context()

    def publish(report) -> None:
        update_progress_artifact(progress, min(100.0, 100.0 * (report.step + 1) / max(settings.train.steps, 1)))
        if report.step % 10 == 0:
            logger.info("step %d: reward %.3f", report.step, report.metrics.get("batch/reward_mean", 0.0))

    run_pipeline(config, tasks, on_step=lambda report: context.run(publish, report))
    rows = Lake.open(settings.lake_config()).read("train_steps", columns=["step", "metrics"],
                                          predicate=f"run_id = {sql_literal(settings.run_id)}").to_pylist()
    return [dict(r["metrics"]).get("batch/reward_mean", 0.0) for r in sorted(rows, key=lambda r: r["step"])]


@task(name="report-recovery")
def report(settings: RunConfig, rewards: list[float], shifts: list[int], smooth_window: int,
           pre_window: int, fraction: float) -> list[dict]:
    """Recovery per shift as a table artifact, the reward curve as a markdown artifact."""
    ends = [*shifts[1:], len(rewards)]
    table = [online.recovery(rewards, smooth_window, shift, end, pre_window, fraction)
             for shift, end in zip(shifts, ends, strict=True) if shift < len(rewards)]
    create_table_artifact(
        [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in table],
        key=artifact_key(settings.run_id, "recovery"),
        description=f"run {settings.run_id}: steps to recover {fraction:.0%} of the pre-shift reward")
    smoothed = online.smooth(rewards, smooth_window)
    lines = [f"# Run {settings.run_id}: {settings.algorithm.name.value} under preference shifts at {shifts}", "",
             "| step | batch reward | smoothed |", "|---:|---:|---:|"]
    lines += [f"| {s} | {rewards[s]:.3f} | {smoothed[s]:.3f} |" for s in range(0, len(rewards), 10)]
    create_markdown_artifact("\n".join(lines), key=artifact_key(settings.run_id, "reward-curve"),
                             description=f"run {settings.run_id}: reward every 10 steps")
    return table


@flow(name="online_shift", log_prints=True)
def online_shift(
    run_id: str = "online",
    algorithm: Algorithm = Algorithm.SAO,
    steps: int = 450,
    shifts: list[int] = [150, 300],  # noqa: B006 (Prefect shows the default in the form; never mutated)
    batch_size: int = 8,
    max_staleness: int = 1,
    group_size: int = 1,
    lr_policy: float = _DEFAULTS.algorithm.lr_policy,
    num_replicas: int = 1,
    max_in_flight: int = 16,
    max_tokens: int = 64,
    sft_steps: int = 120,
    smooth_window: int = 10,
    pre_window: int = 20,
    fraction: float = 0.9,
    workdir: str = _DEFAULTS.workdir,
    lake_root: str = _DEFAULTS.lake.root,
    seed: int = _DEFAULTS.seed,
) -> dict:
    """Train on style_preference while the preferred style shifts at ``shifts``; report the steps to
    recover ``fraction`` of the pre-shift reward after each shift."""
    if any(not 0 < s < steps for s in shifts):
        raise ValueError(f"shifts {shifts} must lie inside (0, steps={steps})")
    settings = RunConfig(run_id=run_id, workdir=workdir, seed=seed, lake={"root": lake_root},
                         algorithm={"name": algorithm, "lr_policy": lr_policy},
                         train={"steps": steps, "batch_size": batch_size, "max_staleness": max_staleness},
                         rollout={"group_size": group_size, "num_replicas": num_replicas,
                                  "max_in_flight": max_in_flight},
                         value_pretraining={"samples": 0})
    online.shift_options(shifts)  # checks the shifts before any work
    policy_path = warm_start(settings, sft_steps)
    rewards = train(settings, policy_path, list(shifts), max_tokens)
    table = report(settings, rewards, list(shifts), smooth_window, pre_window, fraction)
    return {"run_id": run_id, "steps": len(rewards), "recovery": table, "settings": settings.public()}
