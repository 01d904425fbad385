"""Prefect flow ``evaluate``: held-out accuracy of one policy version of a run.

Calls :func:`sao.runs.evaluate` (sampled accuracy on the run's held-out tasks: at temperature 1 in the
built-in loop, or its agent's own episodes) and shows the result as a table artifact. The run's
settings (its tasks, model, reward and budgets) are those the lake at ``lake_root`` recorded for it; a
run the lake does not know is evaluated as a run of the built-in task (refused when its folder holds a
task file of its own). Version 0 is the run's warm start; version N its checkpoint
after N actor updates. Evaluation only reads the checkpoint, so its task may be retried.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact

from flows.train import artifact_key
from sao import runs
from sao.config import RunConfig

_DEFAULTS = RunConfig()


@task(name="evaluate-version", retries=1, retry_delay_seconds=5)
def evaluate_version(settings: RunConfig, version: int) -> runs.Evaluation:
    """Sampled accuracy of ``version`` (reads the checkpoint only: safe to retry)."""
    return runs.evaluate(settings, version)


@flow(name="evaluate", log_prints=True)
def evaluate(
    run_id: str = _DEFAULTS.run_id,
    version: int = 0,
    eval_tasks: int | None = None,
    workdir: str | None = None,
    seed: int | None = None,
    lake_root: str = _DEFAULTS.lake.root,
) -> dict:
    """Held-out accuracy of policy ``version`` of run ``run_id``, with the settings the lake at
    ``lake_root`` recorded for the run; ``eval_tasks``, ``workdir`` and ``seed`` replace the recorded
    ones where given (a run the lake does not know: the defaults'). A run the lake does not know whose
    folder holds a task file of its own is refused: evaluated as a run of the built-in task, it would be
    scored on other tasks."""
    values = {key: value for key, value in (("eval.tasks", eval_tasks), ("workdir", workdir), ("seed", seed))
              if value is not None}
    settings = runs.recorded_settings(run_id, lake_root, **values)
    if settings is None:
        settings = RunConfig(run_id=run_id).with_values(values)
        own = runs.tasks_path(settings.with_values({"data.train": "tasks.jsonl"}))
        if own.exists():
            raise ValueError(f"run {run_id!r} has tasks of its own ({own}), and the lake at {lake_root} records no "
                             "settings for it: give lake_root, the lake the run trained with")
    path = runs.policy_dir(settings, version)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"run {run_id!r} has no policy version {version} at {path}: version 0 is the warm start "
            f"({settings.initial_policy_dir}), version N the checkpoint after N steps ({settings.checkpoint_root}); "
            "check run_id, version and workdir")
    result = evaluate_version(settings, version)
    get_run_logger().info("run %s version %d: held-out accuracy %.3f ± %.3f on %d tasks", run_id, version,
                          result.accuracy, result.stderr, result.num_tasks)
    row = {"run_id": run_id, "version": version, "accuracy": round(result.accuracy, 4),
           "stderr": round(result.stderr, 4), "tasks": result.num_tasks}
    create_table_artifact([row], key=artifact_key(run_id, f"eval-v{version}"),
                          description=f"held-out accuracy of version {version} of run {run_id}")
    return row
