"""Benchmark: learning quality on math_tool, SAO against synchronous GRPO (and optionally GRPO + DIS and
asynchronous PPO clipping), from one SFT checkpoint, seed by seed, compared by the area under accuracy
against wall time and against trajectories, with paired bootstrap intervals.

    sao bench quality [--setting heavy|fast] [--seeds 0] [--steps 150] [--arms sao,grpo] [--lr ARM=LR,...]
                      [--quick]
    sao bench quality --merge [--setting heavy|fast]

Settings: ``heavy`` (the default, the regime the paper is about) gives every tool call the heavy-tailed
log-normal latency of ``sao bench speed`` (:data:`benchmarks._settings.HEAVY_TAIL`); ``fast`` has none.

The arms (same batch size in trajectories, same SFT version 0):

=============  ==========  ======  ==============  =================================================
arm            algorithm   group   staleness       rollouts
=============  ==========  ======  ==============  =================================================
``sao``        sao         1       ``--staleness`` asynchronous, critic GAE + DIS
``grpo``       grpo        8       0               synchronous: one batch per version, sampled by it
``grpo_dis``   grpo_dis    8       ``--staleness`` asynchronous (groups may be split across batches)
``ppo_async``  ppo_async   1       ``--ppo-staleness`` asynchronous, critic GAE + PPO clip, no DIS
=============  ==========  ======  ==============  =================================================

Every run goes through the real pipeline (Serve rollouts -> Delta -> trainer -> weights), with the trainer
in this process for all arms alike (``PipelineConfig.use_ray_train=False``). The critic arms start from a
critic fitted by value pretraining (:func:`sao.runs.pretrain_value`, ``--value-samples`` version-0
rollouts under the same tool latency), once per seed, and that cost is counted: its time (from its first
rollout's dispatch to the fitted critic) and its rollouts come before the critic arms' first step on
both axes.

Accuracy is held-out sampled accuracy (temperature 1, :func:`sao.runs.evaluate`) on the same
``--eval-tasks`` held-out tasks for every run, with the seed's sampler seed, every ``--eval-every``
versions. Areas: each run's curve over [0, H] (straight lines between evaluated versions, the last held
after the run ends), H the longest run's end, divided by H: the mean accuracy over the run's time
(:mod:`benchmarks.stats`). Differences are paired by task and seed; intervals resample seeds and
tasks (2,000 draws, 95%).

Learning rates: ``--lr ARM=LR`` sets an arm's; otherwise the arm's pick in the setting's tuning record
(``--tune-lrs``: each arm at each rate for ``--tune-steps`` steps, judged on ``--validation-tasks``
train-split tasks that no run of this benchmark trains on), else the demo config's ``algorithm.lr_policy``.

Each seed's runs are written as a part, ``quality-SETTING-seedS.json``, as soon as the seed is done; then
every part of the setting in the output folder whose design matches this invocation's (steps, batch,
rates, evaluation, latency, ...) is merged into ``quality-SETTING.json``, ``quality-SETTING.png`` and the
``quality-SETTING`` section of ``docs/RESULTS.md``. Seeds can so run in separate invocations (each of the
default size fits in 40 minutes on 2 cores) and accumulate; ``--merge`` only merges. ``--quick``
writes under ``--workdir`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._report import load_parts as seed_parts
from benchmarks._report import machine, parts_lines, save_figure, update_section, write_json
from benchmarks.stats import (
    area_weights,
    decode_rewards,
    encode_rewards,
    interval_text,
    paired_bootstrap,
    point_weights,
)

PREFIX = "quality"
SETTINGS = ("heavy", "fast")
KEPT_METRICS = ("batch/reward_mean", "batch/staleness_mean", "batch/staleness_max", "actor/kept_frac",
                "batch/flat_group_frac", "critic/explained_variance")
"""The step metrics a result file keeps of each step (the lake keeps them all)."""
MEASURES = {"auc_time": "area under accuracy vs wall time", "auc_trajectories": "area under accuracy vs trajectories",
            "final": "accuracy at equal trained trajectories (last version)", "at_t": "accuracy at equal wall time T"}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One compared method: an algorithm preset and how its rollouts are fed."""

    name: str
    algorithm: str
    group_size: int
    synchronous: bool
    max_staleness: int
    label: str

    @property
    def uses_critic(self) -> bool:
        return self.algorithm in ("sao", "ppo_async")


def arms(args: argparse.Namespace) -> tuple[Arm, ...]:
    return (
        Arm("sao", "sao", 1, False, args.staleness, f"SAO (async, staleness <= {args.staleness})"),
        Arm("grpo", "grpo", args.group, True, 0, f"GRPO, synchronous, {args.group} per prompt"),
        Arm("grpo_dis", "grpo_dis", args.group, False, args.staleness,
            f"GRPO + DIS (async, staleness <= {args.staleness})"),
        Arm("ppo_async", "ppo_async", 1, False, args.ppo_staleness,
            f"PPO clip, no DIS (async, staleness <= {args.ppo_staleness})"),
    )


def _floats(text: str, flag: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated numbers, got {text!r}")
        raise


def _parse(argv: list[str]) -> argparse.Namespace:
    from benchmarks._settings import HEAVY_TAIL

    parser = argparse.ArgumentParser(prog="sao bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=SETTINGS, default="heavy",
                        help="heavy: the heavy-tailed tool latency of sao bench speed; fast: none")
    parser.add_argument("--tool-median-s", type=float, default=HEAVY_TAIL["median_s"])
    parser.add_argument("--tool-sigma", type=float, default=HEAVY_TAIL["sigma"])
    parser.add_argument("--tool-max-s", type=float, default=HEAVY_TAIL["max_s"])
    parser.add_argument("--steps", type=int, default=150, help="actor updates per run (the demo's plateau)")
    parser.add_argument("--batch", type=int, default=32, help="trajectories per update (every arm)")
    parser.add_argument("--group", type=int, default=8, help="GRPO rollouts per prompt")
    parser.add_argument("--seeds", default="0", help="seeds of this invocation (parts of other seeds are merged)")
    parser.add_argument("--staleness", type=int, default=2, help="max staleness of SAO and GRPO + DIS")
    parser.add_argument("--ppo-staleness", type=int, default=6, help="max staleness of asynchronous PPO")
    parser.add_argument("--lr", default="", help="ARM=LR,...: an arm's policy learning rate (else the tuned one)")
    parser.add_argument("--tune-lrs", default="", help="tune instead: each arm at each of these rates, "
                        "judged on the validation tasks; writes quality-SETTING-lr.json")
    parser.add_argument("--tune-steps", type=int, default=60, help="steps of each tuning run")
    parser.add_argument("--validation-tasks", type=int, default=500,
                        help="the last N train-split tasks: the tuning's judge, never trained on")
    parser.add_argument("--eval-every", type=int, default=25, help="versions between evaluations")
    parser.add_argument("--eval-tasks", type=int, default=1000, help="held-out tasks per evaluation")
    parser.add_argument("--value-samples", type=int, default=256,
                        help="version-0 rollouts for value pretraining (0: none)")
    parser.add_argument("--arms", default="sao,grpo", help="of sao, grpo, grpo_dis, ppo_async")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap draws of each interval")
    parser.add_argument("--merge", action="store_true", help="merge the parts in --out only, run nothing")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="runs and the SFT warm start (default runs/bench/quality; --quick: runs/bench/quality-quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the tests (random policy, 2 steps of 4, groups of 2, 8 tasks)")
    parser.add_argument("--out", type=Path, default=None, help="JSON and figure folder (default docs/results)")
    parser.add_argument("--results-md", type=Path, default=None, help="default docs/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.group, args.tune_steps = 2, 4, 2, 1
        args.eval_every, args.eval_tasks, args.value_samples, args.validation_tasks = 1, 8, 8, 8
        args.tool_median_s, args.tool_max_s, args.bootstrap = 0.02, 0.2, 200
    args.workdir = args.workdir or Path("runs/bench/quality-quick" if args.quick else "runs/bench/quality")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arms) - {arm.name for arm in arms(args)}
    if unknown:
        parser.error(f"--arms: unknown {sorted(unknown)}; known: sao, grpo, grpo_dis, ppo_async")
    args.lr_given = {}
    for item in (x for x in args.lr.split(",") if x.strip()):
        name, _, value = item.partition("=")
        if name.strip() not in {arm.name for arm in arms(args)} or not value:
            parser.error(f"--lr: expected ARM=LR with ARM one of sao, grpo, grpo_dis, ppo_async; got {item!r}")
        args.lr_given[name.strip()] = _floats(value, "--lr", parser)[0]
    args.tune_lrs = _floats(args.tune_lrs, "--tune-lrs", parser)
    args.out = args.out or (args.workdir if args.quick else Path("docs/results"))
    args.results_md = args.results_md or (args.workdir / "RESULTS.md" if args.quick else Path("docs/RESULTS.md"))
    if args.batch % args.group:
        parser.error(f"--batch {args.batch} must be a multiple of --group {args.group}")
    if args.steps < 1 or args.eval_every < 1 or args.eval_tasks < 1:
        parser.error("--steps, --eval-every and --eval-tasks must be at least 1")
    return args


def name_of(args: argparse.Namespace) -> str:
    """The files' and the results section's name: ``quality-heavy``, ``quality-fast`` (``--quick``:
    ``quality-quick-heavy``, ...)."""
    return f"{PREFIX}-{'quick-' if args.quick else ''}{args.setting}"


def design(args: argparse.Namespace) -> dict[str, Any]:
    """What parts must share to be merged (the seeds, arms and learning rates are checked apart)."""
    return {"setting": args.setting, "latency": _latency(args), "steps": args.steps, "batch": args.batch,
            "group": args.group, "staleness": args.staleness, "ppo_staleness": args.ppo_staleness,
            "eval_every": args.eval_every, "eval_tasks": args.eval_tasks, "value_samples": args.value_samples,
            "validation_tasks": args.validation_tasks, "quick": args.quick}


def _latency(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.setting == "fast":
        return None
    return {"kind": "lognormal", "median_s": args.tool_median_s, "sigma": args.tool_sigma, "max_s": args.tool_max_s}


def _env_options(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    latency = _latency(args)
    return {} if latency is None else {"math_tool": {"latency": latency | {"seed": seed}}}


def learning_rates(args: argparse.Namespace, base) -> dict[str, dict[str, Any]]:
    """Each arm's policy learning rate and where it came from: ``--lr``, the setting's tuning record,
    or the run config."""
    tuned_path = args.out / f"{name_of(args)}-lr.json"
    tuned = json.loads(tuned_path.read_text())["picked"] if tuned_path.exists() else {}
    out = {}
    for arm in args.arms:
        if arm in args.lr_given:
            out[arm] = {"lr": args.lr_given[arm], "source": "--lr"}
        elif arm in tuned:
            out[arm] = {"lr": tuned[arm], "source": f"tuned on the validation tasks ({tuned_path.name})"}
        else:
            out[arm] = {"lr": base.algorithm.lr_policy, "source": "the demo config's algorithm.lr_policy"}
    return out


# ----- the runs ------------------------------------------------------------------------------------


def _base_settings(args: argparse.Namespace):
    from benchmarks._settings import bench_config, with_settings

    base = bench_config()
    return with_settings(
        base, run_id=PREFIX, workdir=str(args.workdir), lake_root=str(args.workdir / "lake"), steps=args.steps,
        batch_size=args.batch, eval_tasks=args.eval_tasks, value_samples=args.value_samples,
        num_replicas=1 if args.quick else base.rollout.num_replicas,
        max_in_flight=8 if args.quick else base.rollout.max_in_flight)


def _fresh_workdir(workdir: Path) -> None:
    """Remove what an earlier invocation left (the lake, run folders), keeping the SFT warm start:
    a run id that exists would be resumed, not re-run."""
    if (workdir / "lake").exists():
        shutil.rmtree(workdir / "lake")
    for path in workdir.glob(f"{PREFIX}-*"):
        if path.is_dir():
            shutil.rmtree(path)


def _version_zero(args: argparse.Namespace, base) -> Path:
    from sao import runs
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    if args.quick and not base.sft_dir.exists():
        save_policy(build_policy(seed=0), base.sft_dir, build_tokenizer())
    return runs.warm_start(base)


def split_tasks(args: argparse.Namespace, base) -> tuple[list, list]:
    """(the training pool, the validation tasks): the train split's last ``--validation-tasks`` tasks
    are kept out of every run's training pool."""
    from sao import runs
    from sao.envs.base import Split

    train = runs.math_tasks(Split.TRAIN, runs.tasks_path(base))
    if not 0 < args.validation_tasks < len(train):
        raise SystemExit(f"sao bench quality: --validation-tasks {args.validation_tasks} must be between 1 and "
                         f"{len(train) - 1} (the train split has {len(train)} tasks)")
    return train[: -args.validation_tasks], train[-args.validation_tasks:]


def _first_dispatch(settings, run_id: str) -> float:
    """When run ``run_id``'s first rollout was dispatched (epoch seconds), from the lake."""
    from sao.lake.store import Lake

    lake = Lake.open(settings.lake_config())
    rows = lake.read_run("trajectories", run_id, ["timings"])
    return min(t["created_at"] for t in rows.column("timings").to_pylist()).timestamp()


def pretrained_critic(args: argparse.Namespace, base, sft: Path, seed: int) -> dict[str, Any] | None:
    """Value pretraining for seed ``seed`` (run ``quality-critic-sS``) under the setting's latency: its
    critic, report and cost (seconds from its first rollout's dispatch to the fitted critic; rollouts)."""
    from benchmarks._settings import with_settings
    from sao import runs
    from sao.train.checkpoint import checkpoint_dir

    if args.value_samples == 0:
        return None
    settings = with_settings(base, run_id=f"{PREFIX}-critic-s{seed}", algorithm="sao", seed=seed)
    print(f"--- value pretraining, seed {seed}: {args.value_samples} rollouts", file=sys.stderr, flush=True)
    report = runs.pretrain_value(settings, sft, env_options=_env_options(args, seed))
    done = time.time()
    return {"path": str((checkpoint_dir(settings.checkpoint_root, 0) / "critic").resolve()),
            "report": None if report is None else dataclasses.asdict(report),
            "seconds": done - _first_dispatch(settings, runs.value_data_run(settings)),
            "trajectories": args.value_samples}


def run_arm(arm: Arm, seed: int, args: argparse.Namespace, base, sft: Path, critic: dict[str, Any] | None,
            lr: float, tasks: list, *, steps: int | None = None, tag: str = "") -> dict[str, Any]:
    """One run of ``arm``; its timeline and step metrics (evaluations come later)."""
    from benchmarks._settings import with_settings
    from sao import runs
    from sao.pipeline import run_pipeline

    settings = with_settings(
        base, run_id=f"{PREFIX}-{tag}{arm.name.replace('_', '-')}-s{seed}", algorithm=arm.algorithm,
        group_size=arm.group_size, synchronous=arm.synchronous, max_staleness=arm.max_staleness, seed=seed,
        lr_policy=lr, steps=steps or args.steps)
    config = runs.pipeline_config(settings, sft)
    counted = critic if critic is not None and settings.update().uses_critic else None
    train = dataclasses.replace(config.train, critic_path=counted["path"] if counted else None)
    config = dataclasses.replace(config, train=train, use_ray_train=False, app_name=f"{PREFIX}-rollout",
                                 env_options=_env_options(args, seed))

    def show(report) -> None:
        m = report.metrics
        print(f"[{arm.name} s{seed}] step {report.step}: reward {m.get('batch/reward_mean', 0):.3f} "
              f"staleness {m.get('batch/staleness_mean', 0):.2f} kept {m.get('actor/kept_frac', 0):.3f}",
              file=sys.stderr, flush=True)

    print(f"--- {arm.name}, seed {seed}, lr {lr:g} ({settings.run_id})", file=sys.stderr, flush=True)
    started = time.time()
    result = run_pipeline(config, tasks, on_step=show)
    return {"arm": arm.name, "seed": seed, "run_id": settings.run_id, "settings": settings, "lr_policy": lr,
            "steps": result.steps, "pipeline_wall_s": result.wall_s, "train_s": result.train_s,
            "trajectories_generated": result.driver.records,
            "critic_path": train.critic_path, "offset_s": counted["seconds"] if counted else 0.0,
            "offset_trajectories": counted["trajectories"] if counted else 0, **_timeline(settings, started)}


def _timeline(settings, started: float) -> dict[str, Any]:
    """From the lake: when each version was committed (seconds since the run's first rollout was
    dispatched), each step's metrics, and the run's trajectory counts."""
    from sao.lake.store import Lake

    lake = Lake.open(settings.lake_config())
    steps = sorted(lake.read_run("train_steps", settings.run_id).to_pylist(), key=lambda r: r["step"])
    timings = lake.read_run("trajectories", settings.run_id, ["timings"]).column("timings").to_pylist()
    stored, dispatched = len(timings), min(t["created_at"] for t in timings).timestamp()
    steps_out = [{"step": row["step"], "version_before": row["policy_version_before"],
                  "version": row["policy_version_after"], "trajectories_version": row["trajectories_version"],
                  "trajectory_ids": list(row["trajectory_ids"]),
                  "elapsed_s": row["finished_at"].timestamp() - dispatched,
                  "metrics": {k: v for k, v in dict(row["metrics"]).items() if k in KEPT_METRICS}}
                 for row in steps]
    return {"startup_s": dispatched - started, "wall_s": steps_out[-1]["elapsed_s"] if steps_out else 0.0,
            "trajectories_stored": stored, "step_rows": steps_out}


# ----- ratios of the PPO arm, recomputed ---------------------------------------------------------


def ratio_stats(run: dict[str, Any], clip: tuple[float, float], dis: tuple[float, float]) -> list[dict[str, Any]]:
    """Per step: of the action tokens it trained on, the share whose rho = pi_v / pi_behave (v: the
    version the step started from) lies outside PPO's clip range and outside the DIS interval (what DIS
    would have masked), overall and by staleness, and the mean |log rho|."""
    import torch

    from sao.lake.reader import read_trajectories
    from sao.lake.store import Lake
    from sao.train.batch import collate, split_by_token_budget
    from sao.train.checkpoint import load_checkpoint
    from sao.train.loop import TRAIN_COLUMNS
    from sao.train.step import policy_logprobs

    settings = run["settings"]
    lake = Lake.open(settings.lake_config())
    update = settings.update()
    out = []
    for row in run["step_rows"]:
        version = row["version_before"]
        policy = load_checkpoint(settings.checkpoint_root, version, with_critic=False, with_state=False).policy
        policy.eval()
        rows = read_trajectories(lake, version=row["trajectories_version"], run_id=settings.run_id,
                                 trajectory_ids=row["trajectory_ids"], columns=TRAIN_COLUMNS).to_pylist()
        batch = collate(rows, trainer_version=version, bootstrap_reasons=update.bootstrap_reasons)
        log_rho = torch.zeros(batch.action_mask.shape)
        with torch.no_grad():
            for index in split_by_token_budget(batch, update.micro_batch_tokens(torch.get_num_threads())):
                micro = batch.select(index)
                logp = policy_logprobs(policy, micro)
                log_rho[index, : logp.shape[1]] = torch.where(micro.action_mask, logp - micro.logp_rollout, 0.0)
        action = batch.action_mask
        rho = log_rho.exp()
        outside_clip = action & ((rho < clip[0]) | (rho > clip[1]))
        outside_dis = action & ((rho <= dis[0]) | (rho >= dis[1]))
        stats: dict[str, Any] = {"step": row["step"], "tokens": int(action.sum()),
                                 "outside_clip": float(outside_clip.sum() / action.sum().clamp(min=1)),
                                 "outside_dis": float(outside_dis.sum() / action.sum().clamp(min=1)),
                                 "abs_log_rho": float(log_rho.abs()[action].mean()) if action.any() else 0.0,
                                 "by_staleness": {}}
        for staleness in sorted(set(batch.staleness.tolist())):
            rows_s = (batch.staleness == staleness).unsqueeze(-1) & action
            count = rows_s.sum().clamp(min=1)
            stats["by_staleness"][str(staleness)] = {
                "tokens": int(rows_s.sum()), "outside_clip": float((outside_clip & rows_s).sum() / count),
                "outside_dis": float((outside_dis & rows_s).sum() / count)}
        out.append(stats)
    return out


# ----- evaluation ------------------------------------------------------------------------------------


def elapsed_of(run: dict[str, Any], version: int) -> float:
    """Seconds from the run's first rollout until ``version`` was committed (0 for version 0)."""
    return 0.0 if version == 0 else next(r["elapsed_s"] for r in run["step_rows"] if r["version"] == version)


def _evaluate(run: dict[str, Any], version: int, cache: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Accuracy and per-task rewards of ``version`` of ``run``; version 0 (the SFT policy, the same for
    every arm of a seed, evaluated with the same tasks and sampler seed) is evaluated once per seed."""
    from sao import runs

    key = ("version0", run["seed"]) if version == 0 else (run["run_id"], version)
    if key not in cache:
        e = runs.evaluate(run["settings"], version)
        cache[key] = {"accuracy": e.accuracy, "stderr": e.stderr, "num_tasks": e.num_tasks,
                      "failures": e.failures, "rewards": encode_rewards(e.rewards)}
    return {"version": version, "elapsed_s": elapsed_of(run, version), **cache[key]}


def evaluated_versions(steps: int, every: int) -> list[int]:
    return sorted({0, steps, *range(every, steps, every)})


def knots(run: dict[str, Any], axis: str) -> tuple[list[float], list[int]]:
    """The run's accuracy curve on ``axis`` (``time``: seconds, ``trajectories``): the x of each knot and
    the index in ``run["curve"]`` of the evaluation it carries. Value pretraining's cost comes first:
    version 0 holds from 0 to its end."""
    batch = run["settings"]["train"]["batch_size"]
    offset = run["offset_s"] if axis == "time" else run["offset_trajectories"]
    xs, index = [0.0], [0]
    if offset > 0:
        xs.append(float(offset))
        index.append(0)
    for i, e in enumerate(run["curve"]):
        if e["version"] > 0:
            xs.append(offset + (e["elapsed_s"] if axis == "time" else e["version"] * batch))
            index.append(i)
    return xs, index


def task_shares(run: dict[str, Any], axis: str, weights_of) -> np.ndarray:
    """Per task, ``weights_of(xs)`` applied to its rewards at the run's knots on ``axis``."""
    xs, index = knots(run, axis)
    rewards = np.stack([decode_rewards(run["curve"][i]["rewards"]) for i in index])
    return weights_of(xs) @ rewards


# ----- merging the seeds' parts ------------------------------------------------------------------------


def load_parts(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The setting's parts in ``args.out`` whose design matches this invocation's, by seed; and a note
    for each part left out."""
    return seed_parts(args.out, name_of(args), design(args))


def _check_rates(parts: list[dict[str, Any]]) -> None:
    by: dict[str, set[float]] = {}
    for part in parts:
        for run in part["runs"]:
            by.setdefault(run["arm"], set()).add(run["lr_policy"])
    mixed = {arm: sorted(rates) for arm, rates in by.items() if len(rates) > 1}
    if mixed:
        raise SystemExit(f"sao bench quality: the parts train an arm at different learning rates {mixed}; "
                         "rerun those seeds with one rate, or move the other parts away")


def _spread(values: Sequence[float]) -> dict[str, float]:
    values = list(values)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def _mean_metric(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [s["metrics"][key] for s in rows if key in s["metrics"]]
    return statistics.fmean(values) if values else None


def merge(parts: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """The record of all ``parts``: horizons, each run's measures, per-arm summaries and paired
    comparisons of SAO against every other arm."""
    _check_rates(parts)
    runs_ = [run for part in parts for run in part["runs"]]
    horizon_time = max(knots(r, "time")[0][-1] for r in runs_)
    horizon_traj = max(knots(r, "trajectories")[0][-1] for r in runs_)
    t_equal = min(r["offset_s"] + r["wall_s"] for r in runs_)
    weights = {"auc_time": ("time", lambda xs: area_weights(xs, horizon_time)),
               "auc_trajectories": ("trajectories", lambda xs: area_weights(xs, horizon_traj)),
               "at_t": ("time", lambda xs: point_weights(xs, t_equal)),
               "final": ("trajectories", lambda xs: point_weights(xs, xs[-1]))}
    shares: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for run in runs_:
        shares[run["arm"], run["seed"]] = {m: task_shares(run, axis, fn) for m, (axis, fn) in weights.items()}
        run["measures"] = {m: float(v.mean()) for m, v in shares[run["arm"], run["seed"]].items()}
    arm_names = list(dict.fromkeys(r["arm"] for r in runs_))
    summary = {}
    for arm in arm_names:
        mine = [r for r in runs_ if r["arm"] == arm]
        steps = [s for r in mine for s in r["step_rows"]]

        final_failures: dict[str, float] = {}
        for r in mine:
            for kind, count in r["curve"][-1]["failures"].items():
                final_failures[kind] = final_failures.get(kind, 0.0) + count / r["curve"][-1]["num_tasks"] / len(mine)
        summary[arm] = {
            "label": mine[0]["label"], "lr_policy": mine[0]["lr_policy"], "lr_source": mine[0]["lr_source"],
            **{m: _spread(r["measures"][m] for r in mine) for m in MEASURES},
            "version0": _spread(r["curve"][0]["accuracy"] for r in mine),
            "wall_s": _spread(r["offset_s"] + r["wall_s"] for r in mine),
            "offset_s": _spread(r["offset_s"] for r in mine), "startup_s": _spread(r["startup_s"] for r in mine),
            "step_s": _spread(r["wall_s"] / max(r["steps"], 1) for r in mine),
            "staleness_mean": _mean_metric(steps, "batch/staleness_mean"),
            "kept_frac_mean": _mean_metric(steps, "actor/kept_frac"),
            "flat_group_frac": _mean_metric(steps, "batch/flat_group_frac"),
            "reward_first10": _mean_metric([s for r in mine for s in r["step_rows"][:10]], "batch/reward_mean"),
            "reward_last10": _mean_metric([s for r in mine for s in r["step_rows"][-10:]], "batch/reward_mean"),
            "final_failures": final_failures, "seeds": sorted(r["seed"] for r in mine),
        }
    comparisons = {}
    for other in arm_names:
        if other == "sao" or "sao" not in arm_names:
            continue
        seeds = sorted({s for a, s in shares if a == "sao"} & {s for a, s in shares if a == other})
        comparisons[f"sao-{other}"] = {
            m: paired_bootstrap([shares["sao", s][m] - shares[other, s][m] for s in seeds], samples=samples)
            for m in MEASURES} if seeds else {}
    return {"horizon_time_s": horizon_time, "horizon_trajectories": horizon_traj, "t_equal": t_equal,
            "summary": summary, "comparisons": comparisons, "seeds": sorted({r["seed"] for r in runs_}),
            "runs": runs_}


# ----- figure and report --------------------------------------------------------------------------


def plot(record: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = {}
    for run in record["runs"]:
        label = record["summary"][run["arm"]]["label"] if run["arm"] not in colours else None
        colour = colours.setdefault(run["arm"], f"C{len(colours)}")
        for ax, axis in ((axes[0], "time"), (axes[1], "trajectories")):
            xs, index = knots(run, axis)
            ax.plot(xs, [run["curve"][i]["accuracy"] for i in index], marker="o", markersize=3, color=colour,
                    alpha=0.8, label=label)
        rewards = [s["metrics"]["batch/reward_mean"] for s in run["step_rows"]]
        smooth = [statistics.fmean(rewards[max(0, i - 9): i + 1]) for i in range(len(rewards))]
        axes[2].plot(range(len(smooth)), smooth, color=colour, alpha=0.6, label=label)
    axes[0].axvline(record["t_equal"], color="grey", linestyle="--", linewidth=1,
                    label=f"T = {record['t_equal']:.0f} s")
    axes[0].set(title="accuracy vs wall time (value pretraining counted)",
                xlabel="seconds since the first rollout", ylabel="held-out sampled accuracy (T=1)")
    axes[1].set(title="accuracy vs trajectories (pretraining's counted)",
                xlabel="trajectories rolled out for training", ylabel="held-out sampled accuracy (T=1)")
    axes[2].set(title="batch reward (10-step trailing mean)", xlabel="step", ylabel="mean reward")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    figure.suptitle("one line per run (seed)", fontsize=9)
    return save_figure(figure, path)


def _fmt(s: dict[str, float], digits: int = 3) -> str:
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def verdict(record: dict[str, Any]) -> list[str]:
    """The targets, judged from the numbers (so the words cannot drift from them)."""
    c = record["comparisons"].get("sao-grpo")
    if not c:
        return ["- No SAO and synchronous GRPO runs of the same seed: nothing to judge."]
    ahead = c["auc_time"]["low"] > 0
    not_behind = c["final"]["high"] >= 0 and c["auc_trajectories"]["high"] >= 0
    seeds = c["auc_time"]["seeds"]
    caveat = "" if seeds >= 5 else f" Only {seeds} seed(s) of the 5 the target asks for."
    return [
        f"- SAO ahead of synchronous GRPO in area under accuracy vs wall time, 95% interval above zero: "
        f"**{'met' if ahead else 'missed'}** (SAO - GRPO = {interval_text(c['auc_time'])}).{caveat}",
        f"- SAO not behind synchronous GRPO at equal trajectories (neither interval wholly below zero): "
        f"**{'met' if not_behind else 'missed'}** (final accuracy {interval_text(c['final'])}; area under accuracy "
        f"vs trajectories {interval_text(c['auc_trajectories'])}).",
    ]


def _curve_table(record: dict[str, Any]) -> list[str]:
    by_arm: dict[str, dict[int, list[float]]] = {}
    for run in record["runs"]:
        for e in run["curve"]:
            by_arm.setdefault(run["arm"], {}).setdefault(e["version"], []).append(e["accuracy"])
    versions = sorted({v for curve in by_arm.values() for v in curve})
    lines = ["| arm | " + " | ".join(f"v{v}" for v in versions) + " |", "|---|" + "---:|" * len(versions)]
    for arm, curve in by_arm.items():
        cells = [f"{statistics.fmean(curve[v]):.3f}" if v in curve else "" for v in versions]
        lines.append(f"| {record['summary'][arm]['label']} | " + " | ".join(cells) + " |")
    return lines


def tuning_lines(record: dict[str, Any]) -> list[str]:
    """The learning-rate tuning behind the runs (if a record of it is there), and whether each arm ran
    at its pick."""
    tuning = record.get("tuning")
    if tuning is None:
        return ["No learning-rate tuning record (`--tune-lrs`): each arm ran at the rate named above.", ""]
    scores = "; ".join(f"{arm}: " + ", ".join(f"{lr} -> {acc:.3f}" for lr, acc in by.items())
                       for arm, by in tuning["validation_accuracy"].items())
    ran = {arm: v["lr_policy"] for arm, v in record["summary"].items()}
    differ = sorted(arm for arm, lr in ran.items() if arm in tuning["picked"] and tuning["picked"][arm] != lr)
    untuned = sorted(arm for arm in ran if arm not in tuning["picked"])
    verdict = ("every arm ran at its pick" if not differ and not untuned else
               "; ".join(filter(None, [differ and f"{', '.join(differ)} ran at another rate than its pick",
                                       untuned and f"{', '.join(untuned)} not tuned"])))
    return [f"Learning-rate tuning (`{tuning['command']}`, `{tuning['file']}`, commit {tuning['machine']['commit']}): "
            f"each arm {tuning['tune_steps']} steps at each rate, seed {tuning['seed']}, judged by the last "
            f"version's sampled accuracy on the {tuning['design']['validation_tasks']} validation tasks: {scores}. "
            f"Picks: " + ", ".join(f"{arm} {lr:g}" for arm, lr in tuning["picked"].items()) + f"; {verdict}.", ""]


def markdown(record: dict[str, Any], figure: Path) -> str:
    s, d = record["summary"], record["design"]
    latency = (f"log-normal tool latency per call (median {d['latency']['median_s']:g} s, sigma "
               f"{d['latency']['sigma']:g}, cap {d['latency']['max_s']:g} s; `sao bench speed`'s)"
               if d["latency"] else "no tool latency")
    rows = [f"| {v['label']} | {v['lr_policy']:g} | {_fmt(v['auc_time'])} | {_fmt(v['auc_trajectories'])} | "
            f"{_fmt(v['final'])} | {_fmt(v['at_t'])} | {v['wall_s']['mean']:.0f} [{v['wall_s']['min']:.0f}, "
            f"{v['wall_s']['max']:.0f}] | {v['offset_s']['mean']:.0f} | {v['startup_s']['mean']:.0f} | "
            f"{v['staleness_mean']:.2f} | "
            + ("" if v["flat_group_frac"] is None else f"{v['flat_group_frac']:.2f}") + " |" for v in s.values()]
    comparison_rows = [f"| {pair} | {MEASURES[m]} | {interval_text(c)} |" for pair, by in record["comparisons"].items()
                       for m, c in by.items()]
    classes = sorted({k for v in s.values() for k in v["final_failures"]})
    failure_rows = [f"| {v['label']} | " + " | ".join(f"{v['final_failures'].get(k, 0.0):.3f}" for k in classes)
                    + " |" for v in s.values()]
    rates = "; ".join(f"{arm}: {v['lr_policy']:g} ({v['lr_source']})" for arm, v in s.items())
    figure_ref = figure.relative_to(Path("docs")) if figure.is_relative_to("docs") else figure
    lines = [
        f"## Learning quality, {d['setting']} setting: SAO vs synchronous GRPO (`sao bench quality`)", "",
        *parts_lines(record["commands"], record["parts"]), "",
        f"Every run: math_tool with {latency}; {d['steps']} steps of {d['batch']} trajectories (GRPO: "
        f"{d['batch'] // d['group']} prompts x {d['group']}), the trainer in the benchmark's process for every arm "
        f"(`use_ray_train=False`), one SFT checkpoint as version 0; {d['validation_tasks']} train-split tasks "
        f"kept out of training as the validation split. Learning rates: {rates}. Critic arms: value "
        f"pretraining on {d['value_samples']} version-0 rollouts per seed, its time and rollouts counted before "
        f"the first step. Held-out sampled accuracy (T=1) on {d['eval_tasks']} tasks (the same for every run, "
        f"the seed's sampler seed) every {d['eval_every']} versions. Seeds: {', '.join(map(str, record['seeds']))}.",
        "",
        *tuning_lines(record), f"Areas are the mean accuracy over [0, H] (straight lines between evaluated versions, the last held "
        f"after a run ends): H = {record['horizon_time_s']:.0f} s of wall time and "
        f"{record['horizon_trajectories']:.0f} trajectories (the longest run's). Equal wall time T = "
        f"{record['t_equal']:.0f} s (the shortest run's end, value pretraining counted), its accuracy read off "
        "the same lines. Per arm: mean ± std over seeds [min, max].", "",
        "| arm | policy lr | area vs wall time | area vs trajectories | accuracy, equal trajectories | "
        "accuracy at T | wall s (value pretraining counted) | value pretraining s | start-up s | mean staleness | "
        "flat groups |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        "Paired differences, SAO minus the other arm: mean over seeds of the per-task difference, 95% bootstrap "
        f"interval (seeds, then tasks within each seed resampled; {record['bootstrap']} draws):", "",
        "| pair | measure | SAO - other [95% interval] |", "|---|---|---|", *comparison_rows, "",
        *verdict(record), "",
        "Accuracy by version (mean over seeds):", "", *_curve_table(record), "",
        "Failures at the last version, share of evaluated tasks by class (`sao.envs.math_tool.failure_class`):",
        "", "| arm | " + " | ".join(classes) + " |", "|---|" + "---:|" * len(classes), *failure_rows, "",
        "Flat groups: the share of GRPO groups whose rollouts all had the same reward (no signal), mean over "
        "steps. " + " ".join(f"Batch reward, {v['label']}: {v['reward_first10']:.3f} (first 10 steps) -> "
                             f"{v['reward_last10']:.3f} (last 10)." for v in s.values()),
        *([""] + [f"- {n}" for n in record["notes"]] if record["notes"] else []), "",
        f"![accuracy vs wall time and trajectories]({figure_ref})",
    ]
    return "\n".join(lines)


def publish_merged(args: argparse.Namespace) -> int:
    parts, notes = load_parts(args)
    record = merge(parts, args.bootstrap)
    tuned = args.out / f"{name_of(args)}-lr.json"
    record["tuning"] = json.loads(tuned.read_text()) | {"file": tuned.name} if tuned.exists() else None
    record |= {"design": parts[0]["design"], "bootstrap": args.bootstrap, "notes": notes,
               "commands": [p["command"] for p in parts],
               "parts": [{"seed": p["seed"], "machine": p["machine"], "wall_s": p["wall_s"]} for p in parts]}
    name = name_of(args)
    figure = plot(record, args.out / f"{name}.png")
    text = markdown(record, figure)
    print(text)
    # the parts keep each run's steps and per-task rewards; the merged record keeps what it derived
    record["runs"] = [{k: v for k, v in run.items() if k != "step_rows"}
                      | {"curve": [{k: v for k, v in e.items() if k != "rewards"} for e in run["curve"]]}
                      for run in record["runs"]]
    write_json(args.out / f"{name}.json", record)
    update_section(args.results_md, name, text)
    return 0


# ----- learning-rate tuning ---------------------------------------------------------------------------


def _validation_accuracy(settings, version: int, tasks: list) -> float:
    """Sampled accuracy of ``version`` on the validation ``tasks`` (never trained on)."""
    from sao import runs
    from sao.envs import make_env
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.train.evaluate import EvalConfig, evaluate_math

    path = runs.policy_dir(settings, version)
    result = evaluate_math(load_policy(path), load_tokenizer(path), tasks,
                           EvalConfig(num_tasks=len(tasks), seed=settings.eval_seed,
                                      max_tokens=settings.rollout.max_tokens, max_turns=settings.rollout.max_turns),
                           env_factory=lambda task: make_env(task.env))
    return result.accuracy


def tune(args: argparse.Namespace, argv: list[str], base, sft: Path, pool: list, validation: list) -> int:
    """Each arm at each ``--tune-lrs`` rate for ``--tune-steps`` steps (the first seed), judged by the
    last version's accuracy on the validation tasks; the best rate per arm is the arm's pick."""
    seed = args.seeds[0]
    critic = pretrained_critic(args, base, sft, seed) if any(a.uses_critic for a in arms(args)
                                                            if a.name in args.arms) else None
    results: dict[str, dict[str, float]] = {}
    for arm in (a for a in arms(args) if a.name in args.arms):
        for lr in args.tune_lrs:
            run = run_arm(arm, seed, args, base, sft, critic, lr, pool, steps=args.tune_steps,
                          tag=f"tune-lr{lr:g}-")
            results.setdefault(arm.name, {})[f"{lr:g}"] = _validation_accuracy(run["settings"], run["steps"],
                                                                                validation)
            print(f"[tune] {arm.name} lr {lr:g}: validation accuracy {results[arm.name][f'{lr:g}']:.3f}",
                  file=sys.stderr, flush=True)
    picked = {arm: float(max(by, key=by.get)) for arm, by in results.items()}
    record = {"design": design(args), "seed": seed, "tune_steps": args.tune_steps, "rates": args.tune_lrs,
              "validation_accuracy": results, "picked": picked, "machine": machine(),
              "command": " ".join(["sao bench quality", *argv])}
    write_json(args.out / f"{name_of(args)}-lr.json", record)
    print(json.dumps({"picked": picked, "validation_accuracy": results}, indent=2))
    return 0


# ----- main --------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.merge:
        return publish_merged(args)
    started, machine_info = time.monotonic(), machine()  # the load average before the runs, not after
    args.workdir.mkdir(parents=True, exist_ok=True)
    _fresh_workdir(args.workdir)
    base = _base_settings(args)
    print("warm start ...", file=sys.stderr, flush=True)
    sft = _version_zero(args, base)
    pool, validation = split_tasks(args, base)
    if args.tune_lrs:
        return tune(args, argv, base, sft, pool, validation)
    rates = learning_rates(args, base)
    chosen = [arm for arm in arms(args) if arm.name in args.arms]
    for seed in args.seeds:
        seed_started, seed_machine = time.monotonic(), machine_info if seed == args.seeds[0] else machine()
        critic = pretrained_critic(args, base, sft, seed) if any(a.uses_critic for a in chosen) else None
        runs_ = [run_arm(arm, seed, args, base, sft, critic, rates[arm.name]["lr"], pool) for arm in chosen]
        cache: dict[tuple[str, int], dict[str, Any]] = {}
        for run, arm in zip(runs_, chosen, strict=True):
            print(f"--- evaluating {run['run_id']}", file=sys.stderr, flush=True)
            run["curve"] = [_evaluate(run, v, cache) for v in evaluated_versions(run["steps"], args.eval_every)]
            if arm.name == "ppo_async":
                run["ratios"] = ratio_stats(run, (0.8, 1.2), (0.7, 6.0))
            run |= {"label": arm.label, "lr_source": rates[arm.name]["source"], "settings": run["settings"].public()}
            for row in run["step_rows"]:
                row.pop("trajectory_ids")
        part = {"design": design(args), "seed": seed, "machine": seed_machine,
                "command": " ".join(["sao bench quality", *argv]), "wall_s": time.monotonic() - seed_started,
                "value_pretraining": critic, "runs": runs_}
        write_json(args.out / f"{name_of(args)}-seed{seed}.json", part)
    print(f"total {(time.monotonic() - started) / 60:.1f} min", file=sys.stderr)
    return publish_merged(args)
