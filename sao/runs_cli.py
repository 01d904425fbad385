"""`sao train` and `sao demo`: run the Prefect flow ``train`` (a temporary local Prefect server when
none is configured), with progress in the terminal and a summary at the end.

Stopping and resuming: the same command resumes a run from wherever it stopped. The first Ctrl-C stops
the run cleanly and the second at once (:mod:`sao.interrupt`); either way the command exits with
status 130 and prints the command that resumes the run. A run that has reached its steps prints its
recorded summary and exits 0 (ask for more ``--steps`` to train on).
"""

from __future__ import annotations

import os
import shlex
import sys
import time

import typer

from sao.config import RunSettings
from sao.train.config import Algorithm

_DEFAULTS = RunSettings()

SQL_TO_TRY = (
    ("Why did trajectories end?",
     "SELECT termination_reason, count(*) AS n, avg(reward) AS reward FROM trajectories GROUP BY 1"),
    ("Which policy versions sampled one trajectory's tokens?",
     "SELECT trajectory_id, unnest(segments)['policy_version'] AS version FROM trajectories LIMIT 8"),
    ("What did DIS keep per step, and how stale was the data?",
     "SELECT step, metrics['actor/kept_frac'] AS kept, metrics['batch/staleness_mean'] AS staleness "
     "FROM train_steps ORDER BY step DESC LIMIT 5"),
)


def parse_resources(items: list[str] | None, option: str) -> dict[str, float]:
    """``["rollout=1", "big=0.5"]`` -> ``{"rollout": 1.0, "big": 0.5}``; a malformed item is a
    ``ValueError`` naming the option and the item."""
    resources: dict[str, float] = {}
    for item in items or []:
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = float("nan")
        if not sep or not name or not value > 0:
            raise ValueError(f"{option} {item!r}: expected NAME=AMOUNT with a positive amount, e.g. rollout=1")
        resources[name] = value
    return resources


def _prefect_environment() -> None:
    """Quiet, patient defaults for Prefect's ephemeral mode on a small machine."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")


def resume_command() -> str:
    """The command line of this process as a user would type it again (``sao train ...``)."""
    return shlex.join(["sao", *sys.argv[1:]])


def run_flow(settings: RunSettings) -> dict:
    """Run the ``train`` flow for ``settings`` in this process, against the configured Prefect server
    or a temporary local one (Ctrl-C handling: :func:`run_or_resume`)."""
    _prefect_environment()
    from flows.train import train as train_flow
    from sao.prefect_server import temporary_server

    settings.run_dir.mkdir(parents=True, exist_ok=True)
    with temporary_server(settings.run_dir / "prefect-server.log"):
        return train_flow(run_id=settings.run_id, steps=settings.steps, algorithm=settings.algorithm,
                      batch_size=settings.batch_size, max_staleness=settings.max_staleness,
                      group_size=settings.group_size, synchronous=settings.synchronous,
                      lr_policy=settings.lr_policy, num_replicas=settings.num_replicas,
                      trainer_workers=settings.trainer_workers, eval_tasks=settings.eval_tasks,
                      replica_resources=settings.replica_resources, trainer_resources=settings.trainer_resources,
                      value_samples=settings.value_samples, workdir=settings.workdir,
                      lake_root=settings.lake_root, ray_address=settings.ray_address,
                      seed=settings.seed)


def run_or_resume(settings: RunSettings) -> None:
    """Run (or resume) ``settings`` with the run's Ctrl-C handling and print the summary; a finished
    run prints its recorded summary instead. Exits 130 when stopped."""
    from sao import interrupt, runs
    from sao.prefect_server import PrefectServerError

    done = runs.finished(settings)
    if done is not None:
        typer.echo(f"run {settings.run_id!r} finished already: {done['steps']} steps, policy version "
                   f"{done['version']} (ask for more --steps to train on). Its summary:")
        _print_summary(done, settings, None)
        return
    from prefect.exceptions import CancelledRun

    started = time.monotonic()
    hint = resume_command()
    with interrupt.handle_ctrl_c(hint, echo=lambda line: typer.echo(line, err=True)):
        try:
            result = run_flow(settings)
        except (interrupt.RunInterrupted, CancelledRun, KeyboardInterrupt):  # the flow logged where it stopped
            typer.echo(f"\nrun {settings.run_id!r} stopped. Resume with: {hint}", err=True)
            raise typer.Exit(130) from None
        except PrefectServerError as error:
            from sao.cli import fail

            raise fail(f"could not start a temporary Prefect server: {error}") from None
    _print_summary(result, settings, time.monotonic() - started)


def _print_summary(result: dict, settings: RunSettings, wall_s: float | None) -> None:
    typer.echo("")
    typer.echo(result["summary"])
    took = "" if wall_s is None else f"; {wall_s / 60:.1f} min in all"
    typer.echo(f"\nAccuracy on held-out tasks: {result['accuracy_before']:.3f} (version 0) -> "
               f"{result['accuracy_after']:.3f} (version {result['version']}){took}.")
    typer.echo("\nSQL to try:")
    for question, query in SQL_TO_TRY:
        typer.echo(f"  # {question}\n  sao sql --lake {settings.lake_root} \"{query}\"")
    typer.echo(f"\nReplay a step on its frozen data:  sao replay --lake {settings.lake_root} "
               f"--run {settings.run_id} --step 0")


def train(
    run_id: str = typer.Option(_DEFAULTS.run_id, help="Run id; an existing run resumes."),
    steps: int = typer.Option(_DEFAULTS.steps, min=0, help="Actor updates in all."),
    algorithm: Algorithm = typer.Option(_DEFAULTS.algorithm.value, help="sao or a baseline."),  # noqa: B008
    batch_size: int = typer.Option(_DEFAULTS.batch_size, min=1, help="Trajectories per update."),
    max_staleness: int = typer.Option(_DEFAULTS.max_staleness, min=0, help="Most versions a trajectory may lag."),
    group_size: int = typer.Option(_DEFAULTS.group_size, min=1,
                                   help="Rollouts per task, launched together (GRPO's groups; 1 for SAO)."),
    synchronous: bool = typer.Option(_DEFAULTS.synchronous, "--synchronous/--asynchronous",
                                     help="Synchronous RL, one batch per version (needs --max-staleness 0)."),
    lr_policy: float = typer.Option(_DEFAULTS.lr_policy, min=0.0, help="Policy learning rate."),
    num_replicas: int = typer.Option(_DEFAULTS.num_replicas, min=1, help="Serve rollout replicas."),
    trainer_workers: int = typer.Option(_DEFAULTS.trainer_workers, min=1, help="Ray Train workers."),
    replica_resource: list[str] | None = typer.Option(  # noqa: B008
        None, help="NAME=AMOUNT: a custom Ray resource each rollout replica needs (repeatable)."),
    trainer_resource: list[str] | None = typer.Option(  # noqa: B008
        None, help="NAME=AMOUNT: a custom Ray resource each trainer worker needs (repeatable)."),
    eval_tasks: int = typer.Option(_DEFAULTS.eval_tasks, min=1, help="Held-out tasks evaluated before/after."),
    value_samples: int = typer.Option(_DEFAULTS.value_samples, min=0,
                                      help="Version-0 rollouts the critic is pretrained on (0: no value pretraining)."),
    workdir: str = typer.Option(_DEFAULTS.workdir, help="Run files go to WORKDIR/RUN_ID."),
    lake: str = typer.Option(_DEFAULTS.lake_root, help="Lake root: a folder or s3://bucket/prefix."),
    ray_address: str | None = typer.Option(None, help="Join a Ray cluster (auto or ray://host:10001)."),
    seed: int = typer.Option(_DEFAULTS.seed, help="Seed of the run."),
) -> None:
    """Train with SAO (or a baseline): warm start, asynchronous rollouts into the lake, Ray Train updates."""
    from sao.cli import fail
    from sao.lake.store import is_valid_run_id

    if not is_valid_run_id(run_id):
        raise fail(f"--run-id {run_id!r} is not a valid run id (letters, digits, '.', '_', '-'; at most 128)")
    try:
        settings = RunSettings(run_id=run_id, steps=steps, algorithm=algorithm, batch_size=batch_size,
                               max_staleness=max_staleness, group_size=group_size, synchronous=synchronous,
                               lr_policy=lr_policy, num_replicas=num_replicas,
                               trainer_workers=trainer_workers, eval_tasks=eval_tasks,
                               replica_resources=parse_resources(replica_resource, "--replica-resource"),
                               trainer_resources=parse_resources(trainer_resource, "--trainer-resource"),
                               value_samples=value_samples, workdir=workdir, lake_root=lake,
                               ray_address=ray_address, seed=seed)
    except ValueError as error:
        raise fail(str(error)) from None
    run_or_resume(settings)


def demo() -> None:
    """The end-to-end demo on embedded defaults: SFT warm start, value pretraining, SAO with Ray Serve
    rollouts into a local Delta lake and Ray Train updates read from it, accuracy before and after, SQL
    to try."""
    settings = RunSettings()
    typer.echo(f"sao demo: run '{settings.run_id}' in {settings.run_dir}, lake at ./{settings.lake_root} "
               f"({settings.steps} SAO steps of {settings.batch_size} trajectories; about 6-10 minutes on 2 cores)")
    run_or_resume(settings)
