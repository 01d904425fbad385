"""``sao replay``: re-run recorded steps, or re-check a recorded trajectory (registered by ``sao.cli``).

    sao replay --run R --step N             one step, bit for bit on CPU
    sao replay --run R --steps N:M          steps N to M, both included, continuing in memory
    sao replay --trajectory ID [--run R]    log-probabilities per segment, observations, reward, end
    sao replay --run R --steps N:M --set algorithm.eps_high=4.0 [--as NEW]
                                            what-if: the same frozen data, changed update settings,
                                            recorded and re-run metrics side by side (recorded in the
                                            lake's runs table as run NEW)

Exit codes: 0 everything matches; 1 a mismatch (the report says which step, metric or segment);
2 a usage error (unknown run, step or trajectory, missing run configuration, bad arguments).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from sao.cli_common import fail, open_lake
from sao.lake.cli import DEFAULT_ROOT, LakeOption, StorageOption

__all__ = ["replay"]


def _parse_range(text: str) -> tuple[int, int]:

    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = int(first), int(last)
    except ValueError:
        raise fail(f"--steps needs N:M (two step numbers, both included), got {text!r}") from None
    if bounds[0] < 0 or bounds[1] < bounds[0]:
        raise fail(f"--steps {text}: need 0 <= N <= M")
    return bounds


def _short(digest: str | None) -> str:
    return "-" if digest is None else digest[:12]


def _print_steps(report) -> None:  # report: StepReplayReport
    typer.echo(f"run {report.run_id}: replay of steps {report.first}..{report.last} from the checkpoint of version "
               f"{report.start_version} (rows via {report.source}, loaded in {report.load_s:.2f} s)")
    if not report.start_ok:
        typer.echo(f"  MISMATCH start checkpoint v{report.start_version}: weights hash "
                   f"{_short(report.start_hash_loaded)}, recorded {_short(report.start_hash_recorded)}")
    for step in report.steps:
        verdict = "match" if step.ok else "MISMATCH"
        note = " (lead-in: replayed to reach the requested steps)" if step.lead_in else ""
        typer.echo(f"  step {step.step} v{step.policy_version_before}->v{step.policy_version_after} "
                   f"{step.num_trajectories} trajectories, snapshot {step.trajectories_version}: {verdict}{note}; "
                   f"weights {_short(step.replayed_hash)} (recorded {_short(step.recorded_hash)}), "
                   f"{step.metrics_compared - len(step.metric_mismatches)}/{step.metrics_compared} metrics equal, "
                   f"{step.seconds:.2f} s")
        for mismatch in step.metric_mismatches:
            typer.echo(f"    {mismatch.name}: recorded {mismatch.recorded!r}, replayed {mismatch.replayed!r}")
        if step.recorded_world_size > 1:
            typer.echo(f"    note: recorded with {step.recorded_world_size} workers; a one-process replay "
                       "matches within float tolerance only (try --metric-tolerance)")


def _print_what_if(report, run_id: str, overrides: dict[str, object]) -> None:  # report: WhatIfReport
    from sao.train.replay import WHAT_IF_METRICS

    changes = ", ".join(f"{key}={value!r}" for key, value in overrides.items())
    typer.echo(f"what-if replay of run {report.run_id} steps {report.first}..{report.last} with {changes}, as run "
               f"{run_id} (from the checkpoint of version {report.start_version}, loaded in {report.load_s:.2f} s)")
    for step in report.steps:
        typer.echo(f"  step {step.step} v{step.policy_version_before}->v{step.policy_version_after}, "
                   f"{step.num_trajectories} trajectories of snapshot {step.trajectories_version}: re-run weights "
                   f"{step.weight_distance:.3g} from the recorded ones (the recorded update moved them "
                   f"{step.recorded_update_norm:.3g})")
        typer.echo(f"    {'metric':<22}{'recorded':>14}{'re-run':>14}")
        for name in WHAT_IF_METRICS:
            if name in step.recorded or name in step.rerun:
                recorded, rerun = step.recorded.get(name), step.rerun.get(name)
                typer.echo(f"    {name:<22}{_figure(recorded):>14}{_figure(rerun):>14}")


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _what_if_overrides(items: list[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` items -> dotted keys and values."""
    from sao.config import ConfigError, parse_set

    overrides = {}
    for item in items:
        try:
            key, value = parse_set(item)
        except ConfigError as error:
            raise fail(str(error)) from None
        overrides[key] = value
    return overrides


def _print_trajectory(report) -> None:  # report: TrajectoryReplay
    typer.echo(f"trajectory {report.trajectory_id} of run {report.run_id}, task {report.task_id}, "
               f"ended by {report.termination_reason}: {'match' if report.ok else 'MISMATCH'}")
    for segment in report.segments:
        verdict = "ok" if segment.ok else "MISMATCH"
        if segment.kind == "action":
            typer.echo(f"  segment {segment.index} action [{segment.start}, {segment.end}) v{segment.policy_version}: "
                       f"max |diff| {segment.max_abs_diff:.2e} (atol {report.atol:g}) {verdict} {segment.detail}")
        else:
            typer.echo(f"  segment {segment.index} observation [{segment.start}, {segment.end}): {verdict} "
                       f"{segment.detail}")
    for check in report.checks:
        verdict = {True: "ok", False: "MISMATCH", None: "not checkable"}[check.ok]
        typer.echo(f"  {check.name}: {verdict} {check.detail}".rstrip())
    typer.echo(f"  reward: recorded {report.reward_recorded}, re-scored {report.reward_rescored}")


def _unused_options(trajectory: bool, what_if: bool, **given: bool) -> str | None:
    """The options given that the chosen replay would not use, as a usage error (None: none)."""
    used_by = {"tasks": "--trajectory", "atol": "--trajectory", "metric_tolerance": "a replay of steps without --set",
               "ray": "a replay of steps without --set"}
    mode = "--trajectory" if trajectory else "a what-if replay (--set)" if what_if else "a replay of steps"
    unused = [name for name, on in given.items() if on and (
        used_by[name] != "--trajectory" if trajectory else used_by[name] == "--trajectory" or what_if)]
    if not unused:
        return None
    flags = ", ".join("--" + name.replace("_", "-") for name in unused)
    return f"{flags} {'does' if len(unused) == 1 else 'do'} nothing in {mode}: " + "; ".join(
        f"--{name.replace('_', '-')} is for {used_by[name]}" for name in unused)


def replay(
    run: Annotated[str | None, typer.Option("--run", help="Run id (needed with --step / --steps).")] = None,
    step: Annotated[int | None, typer.Option("--step", help="Replay this recorded step.")] = None,
    steps: Annotated[str | None, typer.Option("--steps", help="Replay steps N:M, both included.")] = None,
    trajectory: Annotated[str | None, typer.Option("--trajectory", help="Replay this trajectory id.")] = None,
    lake: LakeOption = DEFAULT_ROOT,
    storage_option: StorageOption = None,
    checkpoints: Annotated[str | None, typer.Option(
        "--checkpoints", help="The run's checkpoint root (default: where policy_versions says).")] = None,
    tasks: Annotated[str | None, typer.Option(
        "--tasks", help="Task file for --trajectory (default: the one the run configuration records).")] = None,
    atol: Annotated[float | None, typer.Option(
        "--atol", help="Log-probability agreement threshold of --trajectory (default: its own, "
        "sao.train.trajectory_replay.DEFAULT_ATOL).")] = None,
    metric_tolerance: Annotated[float, typer.Option(
        "--metric-tolerance", help="Relative/absolute metric tolerance of a replay of steps (0: exactly equal).")] = 0.0,
    use_ray: Annotated[bool, typer.Option(
        "--ray", help="Read the snapshot of a replay of steps with Ray Data on a local Ray instance.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="What-if: algorithm.KEY=VALUE, an update setting to change (repeatable).")] = None,
    as_run: Annotated[str | None, typer.Option(
        "--as", help="What-if: the run id it is recorded under (default: the run id, `-whatif-` and a hash of the request).")] = None,
) -> None:
    """Replay recorded training steps (bit for bit on CPU), re-check one recorded trajectory, or re-run
    steps on their frozen data with changed update settings (--set: what-if)."""
    from sao.train.replay import ReplayError, RowSource, replay_steps
    from sao.train.trajectory_replay import replay_trajectory

    modes = [name for name, value in (("--step", step), ("--steps", steps), ("--trajectory", trajectory))
             if value is not None]
    if len(modes) != 1:
        raise fail("give exactly one of --step N, --steps N:M or --trajectory ID"
                   + (f" (got {', '.join(modes)})" if modes else ""))
    if trajectory is None and run is None:
        raise fail(f"{modes[0]} needs --run")
    if (set_ or as_run) and trajectory is not None:
        raise fail("--set and --as go with --step / --steps (a what-if replay of steps)")
    if as_run and not set_:
        raise fail("--as names the run a what-if replay is recorded under: it goes with --set")
    unused = _unused_options(trajectory is not None, bool(set_), tasks=tasks is not None, atol=atol is not None,
                             metric_tolerance=metric_tolerance != 0.0, ray=use_ray)
    if unused:
        raise fail(unused)
    opened = open_lake(lake, storage_option)
    if set_:
        _what_if(opened, run, (step, step) if step is not None else _parse_range(steps), set_, as_run, checkpoints,
                 as_json)
        return
    try:
        if trajectory is not None:
            report = replay_trajectory(opened, trajectory, run_id=run, checkpoint_root=checkpoints, tasks_path=tasks,
                                       **({} if atol is None else {"atol": atol}))
            printer = _print_trajectory
        else:
            first, last = (step, step) if step is not None else _parse_range(steps)
            if use_ray:
                from sao.runtime import init_ray

                init_ray()
            report = replay_steps(opened, run, first, last, checkpoint_root=checkpoints,
                                  source=RowSource.RAY_DATA if use_ray else RowSource.LAKE,
                                  metric_tolerance=metric_tolerance)
            printer = _print_steps
    except ReplayError as error:
        raise fail(str(error)) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        printer(report)
    raise typer.Exit(0 if report.ok else 1)


def _what_if(lake, run: str, bounds: tuple[int, int], items: list[str], as_run: str | None,
             checkpoints: str | None, as_json: bool) -> None:
    from sao import runs
    from sao.config import ConfigError
    from sao.train.replay import ReplayError

    overrides = _what_if_overrides(items)
    try:
        report, new_run = runs.what_if(lake, run, *bounds, overrides, as_run=as_run, checkpoint_root=checkpoints)
    except (ConfigError, ReplayError) as error:
        raise fail(str(error)) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict() | {"as_run": new_run}, indent=2, default=str))
    else:
        _print_what_if(report, new_run, overrides)
