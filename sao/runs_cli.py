"""`sao train` and `sao demo`: run the Prefect flow ``train`` (a temporary local Prefect server when
none is configured), with progress in the terminal and a summary at the end.

Settings: :mod:`sao.config` (``--config``, ``--set``, flags as shorthands); ``sao config show``
and ``sao config schema`` print them.

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
from typing import TYPE_CHECKING

import typer

from sao.cli_common import HELP_MARKUP, fail, require_flows
from sao.train.algorithm import Algorithm

if TYPE_CHECKING:  # the run config imports the training stack (torch): each command imports it when it runs
    from sao.config import RunConfig

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


def run_flow(config: RunConfig, sources: dict[str, str] | None = None) -> dict:
    """Run the ``train`` flow for ``config`` in this process, against the configured Prefect server
    or a temporary local one (Ctrl-C handling: :func:`run_or_resume`)."""
    _prefect_environment()
    from flows.train import train as train_flow
    from sao.prefect_server import temporary_server

    config.run_dir.mkdir(parents=True, exist_ok=True)
    with temporary_server(config.run_dir / "prefect-server.log"):
        return train_flow(config=config, sources=sources or {})


def run_or_resume(config: RunConfig, sources: dict[str, str] | None = None) -> None:
    """Run (or resume) ``config`` with the run's Ctrl-C handling and print the summary; a finished
    run prints its recorded summary instead. Exits 130 when stopped; a resume with changed settings
    that may not change is refused (exit 2) before anything starts."""
    require_flows("sao train")
    from sao import interrupt, runs
    from sao.config import ConfigError
    from sao.data import DataError
    from sao.envs.verifiers_env import VerifiersError
    from sao.models.policy import ModelDirectoryError
    from sao.prefect_server import PrefectServerError
    from sao.rewards import RewardImportError
    from sao.rollout.user_agent import AgentImportError
    from sao.rollout.vllm_engine import VLLMEnvironmentError

    try:
        runs.check_resume(config)  # first: a refused start writes nothing, the run's task file included
        runs.prepare_inputs(config)
    except (ConfigError, DataError, RewardImportError, AgentImportError, VerifiersError, ModelDirectoryError,
            VLLMEnvironmentError) as error:
        raise fail(str(error)) from None
    done = runs.finished(config)
    if done is not None:
        typer.echo(f"run {config.run_id!r} finished already: {done['steps']} steps, policy version "
                   f"{done['version']} (ask for more --steps to train on). Its summary:")
        _print_summary(done, config, None)
        return
    from prefect.exceptions import CancelledRun

    started = time.monotonic()
    hint = resume_command()
    with interrupt.handle_ctrl_c(hint, echo=lambda line: typer.echo(line, err=True)):
        try:
            result = run_flow(config, sources)
        except (interrupt.RunInterrupted, CancelledRun, KeyboardInterrupt):  # the flow logged where it stopped
            typer.echo(f"\nrun {config.run_id!r} stopped. Resume with: {hint}", err=True)
            raise typer.Exit(130) from None
        except PrefectServerError as error:
            raise fail(f"could not start a temporary Prefect server: {error}") from None
    _print_summary(result, config, time.monotonic() - started)


def _print_summary(result: dict, config: RunConfig, wall_s: float | None) -> None:
    typer.echo("")
    typer.echo(result["summary"])
    took = "" if wall_s is None else f"; {wall_s / 60:.1f} min in all"
    typer.echo(f"\nAccuracy on held-out tasks: {result['accuracy_before']:.3f} (version 0) -> "
               f"{result['accuracy_after']:.3f} (version {result['version']}){took}.")
    typer.echo("\nSQL to try:")
    for question, query in SQL_TO_TRY:
        typer.echo(f"  # {question}\n  sao sql --lake {config.lake.root} \"{query}\"")
    typer.echo(f"\nReplay a step on its frozen data:  sao replay --lake {config.lake.root} "
               f"--run {config.run_id} --step 0")


SHORTHANDS: dict[str, str] = {
    "run_id": "run_id", "steps": "train.steps", "algorithm": "algorithm.name", "batch_size": "train.batch_size",
    "max_staleness": "train.max_staleness", "group_size": "rollout.group_size", "synchronous": "train.synchronous",
    "lr_policy": "algorithm.lr_policy", "num_replicas": "rollout.num_replicas", "trainer_workers": "train.workers",
    "replica_resource": "rollout.resources", "trainer_resource": "train.resources", "eval_tasks": "eval.tasks",
    "value_samples": "value_pretraining.samples", "workdir": "workdir", "lake": "lake.root",
    "ray_address": "ray.address", "seed": "seed",
}
"""``sao train``'s flags, each a shorthand of one config key (``--steps 10`` is ``--set train.steps=10``)."""

_CONFIG_HELP = "Run config file (YAML or JSON); `sao config show` prints the resolved config."
_SET_HELP = "SECTION.KEY=VALUE: set one config key (repeatable; after --config, before the flags)."


def config_from_cli(config_file: str | None, sets: list[str] | None, flags: dict[str, object]
                    ) -> tuple[RunConfig, dict[str, str]]:
    """The run config of a command line (defaults < ``--config`` < ``--set`` < flags); a bad value
    exits 2 naming each dotted key, the value and where it came from."""
    from sao.config import ConfigError, resolve

    given = {}
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):  # a repeatable NAME=AMOUNT option; not given: []
            try:
                value = parse_resources(value, flag) or None
            except ValueError as error:
                raise fail(str(error)) from None
        given[SHORTHANDS[name]] = (flag, value)
    try:
        return resolve(config_file, sets or (), given)
    except ConfigError as error:
        problems = str(error)
        raise fail(f"invalid run config{':' + chr(10) if chr(10) in problems else ': '}{problems}") from None


def train(
    config: str | None = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
    set_: list[str] | None = typer.Option(None, "--set", help=_SET_HELP),  # noqa: B008
    run_id: str | None = typer.Option(None, help="Run id; an existing run resumes. [run_id]"),
    steps: int | None = typer.Option(None, help="Actor updates in all. [train.steps]"),
    algorithm: Algorithm | None = typer.Option(None, help="sao or a baseline. [algorithm.name]"),  # noqa: B008
    batch_size: int | None = typer.Option(None, help="Trajectories per update. [train.batch_size]"),
    max_staleness: int | None = typer.Option(None, help="Most versions a trajectory may lag. [train.max_staleness]"),
    group_size: int | None = typer.Option(None, help="Rollouts per task (GRPO's groups; 1 for SAO). [rollout.group_size]"),
    synchronous: bool | None = typer.Option(None, "--synchronous/--asynchronous",
                                            help="Synchronous RL (needs --max-staleness 0). [train.synchronous]"),
    lr_policy: float | None = typer.Option(None, help="Policy learning rate. [algorithm.lr_policy]"),
    num_replicas: int | None = typer.Option(None, help="Serve rollout replicas. [rollout.num_replicas]"),
    trainer_workers: int | None = typer.Option(None, help="Ray Train workers. [train.workers]"),
    replica_resource: list[str] | None = typer.Option(  # noqa: B008
        None, help="NAME=AMOUNT: a custom Ray resource each rollout replica needs (repeatable). [rollout.resources]"),
    trainer_resource: list[str] | None = typer.Option(  # noqa: B008
        None, help="NAME=AMOUNT: a custom Ray resource each trainer worker needs (repeatable). [train.resources]"),
    eval_tasks: int | None = typer.Option(None, help="Held-out tasks evaluated before/after. [eval.tasks]"),
    value_samples: int | None = typer.Option(None, help="Version-0 rollouts the critic is pretrained on "
                                                        "(0: no value pretraining). [value_pretraining.samples]"),
    workdir: str | None = typer.Option(None, help="Run files go to WORKDIR/RUN_ID. [workdir]"),
    lake: str | None = typer.Option(None, help="Lake root: a folder or s3://bucket/prefix. [lake.root]"),
    ray_address: str | None = typer.Option(None, help="Join a Ray cluster (auto or ray://host:10001). [ray.address]"),
    seed: int | None = typer.Option(None, help="Seed of the run. [seed]"),
) -> None:
    """Train with SAO (or a baseline): warm start, asynchronous rollouts into the lake, Ray Train updates.

    Settings come from the defaults, then --config, then --set, then the flags (each flag names the
    config key it sets); `sao config show` prints the result and `sao config schema` every key."""
    flags = {name: value for name, value in locals().items() if name in SHORTHANDS}
    run_config, sources = config_from_cli(config, set_, flags)
    run_or_resume(run_config, sources)


def demo() -> None:
    """The end-to-end demo (configs/demo.yaml): SFT warm start, value pretraining, SAO with Ray Serve
    rollouts into a local Delta lake and Ray Train updates read from it, accuracy before and after, SQL
    to try."""
    from sao.config import DEMO_CONFIG, ConfigError, resolve

    try:
        config, sources = resolve(DEMO_CONFIG)
    except ConfigError as error:
        raise fail(str(error)) from None
    typer.echo(f"sao demo: run '{config.run_id}' in {config.run_dir}, lake at ./{config.lake.root} "
               f"({config.train.steps} SAO steps of {config.train.batch_size} trajectories; about 6-10 minutes "
               f"on 2 cores; settings: {DEMO_CONFIG.relative_to(DEMO_CONFIG.parents[1])})")
    run_or_resume(config, sources)


config_app = typer.Typer(help="The run config: its resolved values and its schema.", no_args_is_help=True,
                         rich_markup_mode=HELP_MARKUP)


@config_app.command("show")
def config_show(
    config: str | None = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
    set_: list[str] | None = typer.Option(None, "--set", help=_SET_HELP),  # noqa: B008
) -> None:
    """Print the resolved run config as YAML, each key not at its default marked with where it came from."""
    from sao.config import show

    run_config, sources = config_from_cli(config, set_, {})
    typer.echo(show(run_config, sources))


@config_app.command("schema")
def config_schema() -> None:
    """Print the run config's JSON schema (every key, its type, default, bounds and description)."""
    import json

    from sao.config import RunConfig

    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2))
