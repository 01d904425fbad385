"""Prefect flow ``train``: warm start, value pretraining, asynchronous SAO training, evaluation, report.

Each stage is a task calling a function of :mod:`sao.runs`. The flow's parameter is the run config
(:class:`sao.config.RunConfig`), so the Prefect UI's run form is generated from it: one group per
section, each field with its type, bounds, default and description. The run's start (or resume) is
recorded in the lake's ``runs`` table with the resolved config; a resume that changes a setting that
may not change (:data:`sao.config.RESUME_SAFE`) fails before any work. Re-running the flow with the same ``run_id`` resumes the run (every
stage is idempotent: the warm start is reused, training continues from the last committed step), and
so does retrying a crashed, failed or cancelled flow run from the UI (it runs again with the same
parameters). A run that has reached its steps returns its recorded result at once.

While training runs, the flow run shows a progress artifact (steps done) and a table artifact with the
metrics of every tenth step (and the last); at the end, a markdown artifact with accuracy before / after and the learning curve.
"""

from __future__ import annotations

import base64
import contextvars
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.states import Cancelled

from sao import interrupt, runs
from sao.config import RunConfig
from sao.progress import Progress
from sao.train.loop import StepReport
from sao.train.pretrain import PretrainReport


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = "".join(c if c.isalnum() else "-" for c in run_id.lower()).strip("-") or "run"
    return f"{slug}-{what}"


@task(name="warm-start")
def warm_start(settings: RunConfig) -> str:
    logger = get_run_logger()
    progress = Progress("SFT", settings.sft.max_steps, "steps", start=0)

    def show(point) -> None:  # one line per validation measurement
        logger.info("%s", progress.line(point.step, f"loss {point.loss:.3f}, held-out success {point.success:.3f}"))

    path = runs.warm_start(settings, on_log=show)
    logger.info("version-0 policy: %s", path)
    return str(path)


@task(name="evaluate", retries=1, retry_delay_seconds=5)  # reads a checkpoint only
def evaluate(settings: RunConfig, version: int) -> runs.Evaluation:
    result = runs.evaluate(settings, version)
    get_run_logger().info("version %d: held-out accuracy %.3f ± %.3f", version, result.accuracy, result.stderr)
    return result


class Stopped(dict):
    """What a stage returns when the run was stopped (a Ctrl-C: :mod:`sao.interrupt`); the flow then
    ends as Cancelled instead of failing with a traceback."""


@task(name="pretrain-value")  # writes the version-0 critic: not retried (a re-run of the flow resumes it)
def pretrain_value(settings: RunConfig, policy_path: str) -> dict | None:
    try:
        report = runs.pretrain_value(settings, policy_path, on_progress=get_run_logger().info)
    except interrupt.RunInterrupted as stopped:
        get_run_logger().warning("%s", stopped)
        return Stopped(reason=str(stopped))
    if report is None:
        get_run_logger().info("value pretraining: skipped (value_pretraining.samples 0, an algorithm without a "
                              "critic, done already, or the run has trained already)")
        return None
    show_pretrain_report(settings.run_id, report)
    return {"loss_before": report.loss_before, "loss_after": report.loss_after, "seconds": round(report.seconds, 1)}


def show_pretrain_report(run_id: str, report: PretrainReport) -> None:
    """Log value pretraining's figures and show them as the run's ``pretrain-value`` table artifact."""
    get_run_logger().info(
        "run %s: value pretraining on %d + %d version-0 trajectories of run %s, %d critic steps in %.0f s: "
        "held-out value loss %.4f -> %.4f, explained variance %s -> %s", run_id, report.num_train,
        report.num_heldout, report.data_run_id, report.optimizer_steps, report.seconds, report.loss_before,
        report.loss_after, _fmt(report.explained_variance_before), _fmt(report.explained_variance_after))
    rows = [{"figure": "held-out value loss", "before": round(report.loss_before, 5),
             "after": round(report.loss_after, 5)},
            {"figure": "explained variance", "before": report.explained_variance_before,
             "after": report.explained_variance_after}]
    create_table_artifact(rows, key=artifact_key(run_id, "pretrain-value"),
                          description=f"value pretraining of run {run_id}: {report.num_train} train / "
                                      f"{report.num_heldout} held-out trajectories of run {report.data_run_id}, "
                                      f"{report.optimizer_steps} critic steps")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


METRICS_SHOWN = ("batch/reward_mean", "actor/kept_frac", "batch/staleness_mean", "critic/loss",
                 "critic/value_mean", "actor/grad_norm")


@task(name="train-async")
def train_async(settings: RunConfig, policy_path: str) -> dict:
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, key=artifact_key(settings.run_id, "progress"),
                                        description=f"actor updates of run {settings.run_id}")
    context = contextvars.copy_context()  # the step watcher runs in its own thread
    steps = Progress("training", settings.train.steps, "steps")  # timed from the first step: not Ray's start

    def publish(report: StepReport) -> None:
        done = 100.0 * (report.step + 1) / max(settings.train.steps, 1)
        update_progress_artifact(progress, min(done, 100.0))
        # "step S -> version V:" first: the run's own output is matched on it (tests/reliability)
        logger.info("step %d -> version %d: reward %.3f, kept %.3f, staleness %.2f; %s", report.step, report.version,
                    report.metrics.get("batch/reward_mean", 0.0), report.metrics.get("actor/kept_frac", 0.0),
                    report.metrics.get("batch/staleness_mean", 0.0), steps.line(report.step + 1))
        if report.step % 10 == 0 or report.step + 1 == settings.train.steps:
            rows = [{"metric": k, "value": round(report.metrics[k], 4)} for k in METRICS_SHOWN if k in report.metrics]
            create_table_artifact(rows, key=artifact_key(settings.run_id, "metrics"),
                                  description=f"metrics of step {report.step} (policy version {report.version})")

    try:
        result = runs.train_async(settings, policy_path, on_step=lambda report: context.run(publish, report))
    except interrupt.RunInterrupted as stopped:
        get_run_logger().warning("%s", stopped)
        return Stopped(reason=str(stopped))
    return {"steps": result.steps, "version": result.version, "trajectories": result.driver.records,
            "wall_s": round(result.wall_s, 1)}


@task(name="report")
def report(settings: RunConfig, evaluations: list[runs.Evaluation], trained: dict) -> str:
    plots, summary = runs.summarize(settings, evaluations)
    images = "\n".join(_inline_png(p) for p in plots if p.name == "learning_curve.png")
    markdown = f"{summary}\n\nTrained {trained['steps']} steps in {trained['wall_s']} s.\n\n{images}"
    create_markdown_artifact(markdown, key=artifact_key(settings.run_id, "report"),
                             description=f"run {settings.run_id}: accuracy and learning curve")
    return summary


def _inline_png(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f"![{path.stem}](data:image/png;base64,{data})"


@flow(name="train", log_prints=True)
def train(config: RunConfig = RunConfig(), sources: dict[str, str] | None = None) -> dict:  # noqa: B008
    """Warm-start, pretrain the critic on version-0 rollouts, train asynchronously with SAO (or a
    baseline), evaluate before and after, report. ``sources``: where each setting not at its default
    came from (recorded with the config in the lake's ``runs`` table)."""
    settings = config
    run_id = config.run_id
    runs.check_resume(config)  # settings that may not change are refused before anything is written (as `sao train`)
    runs.prepare_inputs(config)  # the user's model, tasks and reward functions, checked before anything starts
    done = runs.finished(settings)
    if done is not None:
        get_run_logger().info("run %s finished already (%d steps, version %d); nothing to do",
                              run_id, done["steps"], done["version"])
        return done
    event = runs.record_start(config, sources, notes=runs.model_notes(config), warn=get_run_logger().warning)
    get_run_logger().info("run %s: %s (config recorded in the lake's runs table)", run_id, event)
    policy_path = warm_start(settings)
    before = evaluate(settings, 0)
    pretrained = pretrain_value(settings, policy_path)
    trained = pretrained if isinstance(pretrained, Stopped) else train_async(settings, policy_path)
    if isinstance(trained, Stopped):  # a Ctrl-C: the run is resumable (sao.interrupt)
        return Cancelled(message=f"{trained['reason']}. Run the flow again with the same run id to resume.")
    after = evaluate(settings, trained["version"])
    summary = report(settings, [before, after], trained)
    result = {"run_id": run_id, "accuracy_before": before.accuracy, "accuracy_after": after.accuracy,
              "stderr_before": before.stderr, "stderr_after": after.stderr, "eval_tasks": after.num_tasks,
              "failures_before": before.failures, "failures_after": after.failures,
              "steps": trained["steps"], "version": trained["version"], "trajectories": trained["trajectories"],
              "train_wall_s": trained["wall_s"], "summary": summary, "settings": settings.public()}
    runs.record_finished(settings, result)
    return result
