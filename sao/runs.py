"""The stages of a training run, as plain functions: the Prefect flows and the CLI call these.

    warm_start      SFT on math_tool demonstrations -> the run's version-0 policy (skipped if present)
    pretrain_value  version-0 rollouts into the lake, then the version-0 critic fitted on them
    train_async     the asynchronous pipeline (:func:`sao.pipeline.run_pipeline`) for the run's steps
    evaluate        sampled accuracy (temperature 1) of a version on held-out tasks
    summarize       plots from the lake and a short text summary

Every stage is idempotent for a run id: re-running a run resumes it, from wherever it stopped (a
Ctrl-C, a crash, a kill). The warm start and each evaluation write their result atomically (a stage
stopped half-way leaves nothing that a resume would mistake for its result); value pretraining and
training resume from what the lake and the checkpoints hold. A run that reached its steps records its
result (:func:`record_finished`); running it again with no more steps prints that result
(:func:`finished`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from sao import interrupt
from sao.config import RunSettings
from sao.envs.base import Split, Task
from sao.envs.math_tool import MathToolConfig, ensure_dataset, generate_tasks
from sao.lake.config import LakeConfig
from sao.lake.store import Lake, sql_literal
from sao.pipeline import PipelineConfig, PipelineResult, run_pipeline
from sao.runtime import init_ray
from sao.train.checkpoint import checkpoint_dir
from sao.train.loop import StepReport, TrainConfig, prepare_run
from sao.train.pretrain import PretrainReport
from sao.train.retention import RetentionConfig
from sao.train.run_config import RolloutSettings

__all__ = ["Evaluation", "evaluate", "finished", "math_tasks", "pipeline_config", "policy_dir", "pretrain_value",
           "record_finished", "summarize", "train_async", "value_data_run", "warm_start"]

RESULT_FILE = "result.json"
"""Under the run's folder: the result of a run that reached its steps (:func:`record_finished`)."""

log = logging.getLogger(__name__)


def math_tasks(split: Split | str, path: str | Path | None = None) -> list[Task]:
    """The math_tool tasks of one split (default config, the one the SFT warm start used); with
    ``path``, from that task file, which is written first if missing (and checked if present)."""
    tasks = generate_tasks(MathToolConfig()) if path is None else ensure_dataset(MathToolConfig(), path)
    return [t for t in tasks if t.split is Split(split)]


def tasks_path(settings: RunSettings) -> Path:
    """The run's task file (JSON Lines): what the rollouts draw from and trajectory replay re-scores."""
    return settings.run_dir / "math_tool.jsonl"


def warm_start(settings: RunSettings, on_log: Callable | None = None) -> Path:
    """The run's version-0 policy directory: SFT warm start unless it already exists."""
    from sao.models.policy import read_policy_metadata
    from sao.train.sft import SFTConfig, sft_warm_start

    path = settings.sft_dir
    if (path / "config.json").exists() and read_policy_metadata(path) is not None:
        log.info("warm start: reusing %s", path)
        return path
    # Written beside, then renamed: a warm start stopped half-way leaves no directory that looks done.
    partial = path.with_name(path.name + ".partial")
    for leftover in (partial, path):
        if leftover.exists():
            shutil.rmtree(leftover)
    sft_warm_start(SFTConfig(seed=settings.sft_seed), partial, on_log=on_log)
    partial.rename(path)
    return path


def _write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _absolute_lake(lake: LakeConfig) -> LakeConfig:
    return lake if "://" in lake.root else dataclasses.replace(lake, root=str(Path(lake.root).resolve()))


def pipeline_config(settings: RunSettings, policy_path: str | Path) -> PipelineConfig:
    """The pipeline of ``settings``. Local paths are made absolute here: Ray Train workers run in
    their own working directory, where ``runs/...`` or ``lake`` would name nothing.

    Checkpoints are pruned as the run goes (:class:`~sao.train.retention.RetentionConfig`'s defaults):
    every version keeps its policy weights (trajectory replay, evaluation), and the full state
    (critic, optimisers) stays for version 0, the newest versions and every ``keep_every``-th, which
    is what step replay and resume start from. Kept whole, a 150-step demo's checkpoints took about
    2 GB."""
    train = TrainConfig(
        run_id=settings.run_id, lake=_absolute_lake(settings.lake()),
        checkpoint_root=str(settings.checkpoint_root.resolve()),
        policy_path=str(Path(policy_path).resolve()), update=settings.update(), batch_size=settings.batch_size,
        max_staleness=settings.max_staleness, total_steps=settings.steps, seed=settings.seed,
        num_workers=settings.trainer_workers, resources_per_worker=dict(settings.trainer_resources),
        rollout=RolloutSettings(tasks_path=str(tasks_path(settings).resolve()), max_turns=settings.agent().max_turns),
        retention=RetentionConfig(),
    )
    return PipelineConfig(train=train, ray=settings.ray(), num_replicas=settings.num_replicas,
                          resources_per_replica=dict(settings.replica_resources),
                          agent=settings.agent(), max_in_flight=settings.max_in_flight, seed=settings.seed,
                          group_size=settings.group_size, synchronous=settings.synchronous)


def value_data_run(settings: RunSettings) -> str:
    """The run that holds the version-0 rollouts value pretraining fits the critic on."""
    return f"{settings.run_id}-v0"


def pretrain_value(settings: RunSettings, policy_path: str | Path,
                   on_record: Callable[[object], None] | None = None) -> PretrainReport | None:
    """Value pretraining before the first step (SAO.md section 3), when ``settings.value_samples`` > 0:
    roll out ``value_samples`` tasks with the version-0 policy into the lake as run
    :func:`value_data_run` (its own run: auditable, never trained on), then fit the run's version-0
    critic on them (:func:`sao.train.pretrain.pretrain_value`). Skipped (None) when the run has
    pretrained or trained already, so a resumed run does not redo it."""
    from sao.pipeline import collect_rollouts
    from sao.train.pretrain import REPORT_FILE, PretrainConfig
    from sao.train.pretrain import pretrain_value as fit_critic

    config = pipeline_config(settings, policy_path)
    train = config.train
    if settings.value_samples == 0 or not train.update.uses_critic:
        return None
    if (checkpoint_dir(train.checkpoint_root, 0) / "critic" / REPORT_FILE).exists():
        log.info("value pretraining: done already for run %s", settings.run_id)
        return None
    init_ray(config.ray)
    if prepare_run(train) != 0:
        log.info("value pretraining: run %s has trained already", settings.run_id)
        return None
    data = dataclasses.replace(train, run_id=value_data_run(settings),
                               checkpoint_root=str(Path(train.checkpoint_root).parent / "v0-data-checkpoints"))
    prepare_run(data)  # the data run's version 0: the same weights, registered under its own id
    collect_rollouts(dataclasses.replace(config, train=data), math_tasks(Split.TRAIN, train.rollout.tasks_path),
                     data.run_id, settings.value_samples, on_record=on_record)
    return fit_critic(train, PretrainConfig(num_samples=settings.value_samples, data_run_id=data.run_id))


def train_async(settings: RunSettings, policy_path: str | Path,
                on_step: Callable[[StepReport], None] | None = None) -> PipelineResult:
    """Run (or resume) the asynchronous training of ``settings`` from ``policy_path`` (version 0)."""
    config = pipeline_config(settings, policy_path)
    result = run_pipeline(config, math_tasks(Split.TRAIN, config.train.rollout.tasks_path), on_step=on_step)
    if result.interrupted:
        raise interrupt.RunInterrupted(f"run {settings.run_id}: stopped after {result.steps} of {settings.steps} "
                                       f"steps (policy version {result.version})")
    return result


@dataclasses.dataclass(frozen=True)
class Evaluation:
    version: int
    accuracy: float
    stderr: float
    num_tasks: int


def policy_dir(settings: RunSettings, version: int) -> Path:
    """Where version ``version`` of the run's policy lives (version 0: the warm start, until the
    run's first checkpoint exists)."""
    path = checkpoint_dir(settings.checkpoint_root, version) / "policy"
    if version == 0 and not path.exists():
        return settings.sft_dir
    return path


def evaluate(settings: RunSettings, version: int) -> Evaluation:
    """Sampled accuracy (temperature 1, the policy's own distribution) of ``version`` on held-out tasks.
    Kept under the run's folder, so a resumed run does not evaluate a version again (the evaluation is
    seeded: the same version, tasks and seed give the same figure)."""
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.train.evaluate import EvalConfig, evaluate_math

    kept = settings.run_dir / "evaluations" / f"v{version:06d}-tasks{settings.eval_tasks}-seed{settings.seed}.json"
    if kept.exists():
        return Evaluation(**json.loads(kept.read_text()))
    path = policy_dir(settings, version)
    result = evaluate_math(load_policy(path), load_tokenizer(path), math_tasks(Split.HELDOUT),
                           EvalConfig(num_tasks=settings.eval_tasks, seed=settings.seed))
    evaluation = Evaluation(version, result.accuracy, result.stderr, result.num_tasks)
    _write_json(kept, dataclasses.asdict(evaluation))
    return evaluation


def finished(settings: RunSettings) -> dict | None:
    """The recorded result of run ``settings.run_id`` if it has reached ``settings.steps`` steps
    (None: it has not, or never ran)."""
    path = settings.run_dir / RESULT_FILE
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("steps", -1) >= settings.steps else None


def record_finished(settings: RunSettings, result: dict) -> None:
    """Record the result of a run that reached its steps (what :func:`finished` returns)."""
    _write_json(settings.run_dir / RESULT_FILE, result)


def summarize(settings: RunSettings, evaluations: list[Evaluation]) -> tuple[list[Path], str]:
    """Plots of the run (from the lake) and a markdown summary."""
    from sao.report import plot_run

    lake = Lake.open(settings.lake())
    plots = plot_run(lake, settings.run_id, settings.plots_dir, [(e.version, e.accuracy) for e in evaluations])
    counts = lake.read("trajectories", columns=["termination_reason"],
                       predicate=f"run_id = {sql_literal(settings.run_id)}").column(0).to_pylist()
    lines = [f"# Run `{settings.run_id}` ({settings.algorithm.value})", "",
             "| policy version | held-out accuracy (T=1) |", "|---:|---:|"]
    lines += [f"| {e.version} | {e.accuracy:.3f} ± {e.stderr:.3f} ({e.num_tasks} tasks) |" for e in evaluations]
    lines += ["", f"Trajectories stored: {len(counts)} "
              + "(" + ", ".join(f"{r}: {counts.count(r)}" for r in sorted(set(counts))) + ")",
              f"Lake: `{settings.lake_root}`; plots: `{settings.plots_dir}`."]
    return plots, "\n".join(lines)
