"""Benchmark: learning quality on math_tool, SAO against synchronous GRPO, GRPO + DIS and asynchronous
PPO clipping, from one SFT checkpoint, several seeds each, at equal trained trajectories and equal wall time.

    sao bench quality [--steps 40] [--batch 32] [--group 8] [--seeds 0,1,2] [--eval-every 10] [--quick]

The four arms (same batch size in trajectories, same policy learning rate, same SFT version 0):

=============  ==========  ======  ==============  =================================================
arm            algorithm   group   staleness       rollouts
=============  ==========  ======  ==============  =================================================
``sao``        sao         1       ``--staleness`` asynchronous, critic GAE + DIS
``grpo``       grpo        8       0               synchronous: one batch per version, sampled by it
``grpo_dis``   grpo_dis    8       ``--staleness`` asynchronous (groups may be split across batches)
``ppo_async``  ppo_async   1       ``--ppo-staleness`` asynchronous, critic GAE + PPO clip, no DIS
=============  ==========  ======  ==============  =================================================

Every run goes through the real pipeline (Serve rollouts -> Delta -> trainer -> weights), with the trainer
in this process for all arms alike (``PipelineConfig.use_ray_train=False``: no Ray Train start-up per run).
The critic arms (``sao``, ``ppo_async``) start from one pretrained critic: value pretraining
(:func:`sao.runs.pretrain_value`) runs once, on ``--value-samples`` version-0 rollouts of its own run, and
its critic is every critic run's version-0 critic (``TrainConfig.critic_path``); all arms share version 0.

Accuracy is held-out sampled accuracy (temperature 1, :func:`sao.runs.evaluate`, the same ``--eval-tasks``
tasks and sampler seed for every arm of a seed) every ``--eval-every`` versions. "Equal trajectories" is
the last version (every run trains ``--steps`` steps of ``--batch`` trajectories). "Equal wall time" is
the version each run had committed (``train_steps.finished_at``) by T, the shortest run's time to its last
step; a run's clock starts at its first rollout's dispatch (``timings.created_at``), so Serve start-up
(the same for every arm) is left out and reported apart. Runs go seed by seed, the four arms in turn, so
load from other jobs falls on every arm alike.

For the PPO arm, which records no ratio statistics of its own (its ``actor/kept_frac`` is 1 by
construction), each step's importance ratios rho = pi_v / pi_behave are recomputed from the checkpoint the
step started from and the rows it read (no gradient, no update): the share of action tokens outside PPO's
clip range and outside the DIS interval, by staleness.

Writes ``docs/results/quality.json``, ``docs/results/quality.png`` and the ``quality`` section of
``docs/RESULTS.md`` (``--quick``: under ``--workdir`` unless ``--out`` / ``--results-md`` are given).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, update_section, write_json

PREFIX = "quality"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One compared method: an algorithm preset and how its rollouts are fed."""

    name: str
    algorithm: str
    group_size: int
    synchronous: bool
    max_staleness: int
    label: str


def arms(args: argparse.Namespace) -> tuple[Arm, ...]:
    return (
        Arm("sao", "sao", 1, False, args.staleness, f"SAO (async, staleness <= {args.staleness})"),
        Arm("grpo", "grpo", args.group, True, 0, f"GRPO, synchronous, {args.group} per prompt"),
        Arm("grpo_dis", "grpo_dis", args.group, False, args.staleness,
            f"GRPO + DIS (async, staleness <= {args.staleness})"),
        Arm("ppo_async", "ppo_async", 1, False, args.ppo_staleness,
            f"PPO clip, no DIS (async, staleness <= {args.ppo_staleness})"),
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="actor updates per run")
    parser.add_argument("--batch", type=int, default=32, help="trajectories per update (every arm)")
    parser.add_argument("--group", type=int, default=8, help="GRPO rollouts per prompt")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--staleness", type=int, default=2, help="max staleness of SAO and GRPO + DIS")
    parser.add_argument("--ppo-staleness", type=int, default=6, help="max staleness of asynchronous PPO")
    parser.add_argument("--lr-policy", type=float, default=None, help="default: the demo config's algorithm.lr_policy")
    parser.add_argument("--eval-every", type=int, default=10, help="versions between evaluations")
    parser.add_argument("--eval-tasks", type=int, default=300, help="held-out tasks per evaluation")
    parser.add_argument("--value-samples", type=int, default=256,
                        help="version-0 rollouts for value pretraining (0: none)")
    parser.add_argument("--arms", default="sao,grpo,grpo_dis,ppo_async", help="subset, for tuning")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="runs and the SFT warm start (default runs/bench/quality; --quick: runs/bench/quality-quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the tests (random policy, 2 steps of 4, one seed, groups of 2, "
                        "no value pretraining)")
    parser.add_argument("--out", type=Path, default=None, help="JSON and figure folder (default docs/results)")
    parser.add_argument("--results-md", type=Path, default=None, help="default docs/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.group, args.seeds = 2, 4, 2, "0"
        args.eval_every, args.eval_tasks, args.value_samples = 1, 8, 0
    args.workdir = args.workdir or Path("runs/bench/quality-quick" if args.quick else "runs/bench/quality")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    default_out = args.workdir if args.quick else Path("docs/results")
    args.out = args.out or default_out
    args.results_md = args.results_md or (args.workdir / "RESULTS.md" if args.quick else Path("docs/RESULTS.md"))
    if args.batch % args.group:
        parser.error(f"--batch {args.batch} must be a multiple of --group {args.group}")
    return args


# ----- the runs ------------------------------------------------------------------------------------


def _base_settings(args: argparse.Namespace):
    from benchmarks._settings import bench_config, with_settings

    base = bench_config()
    return with_settings(
        base, run_id=PREFIX, workdir=str(args.workdir), lake_root=str(args.workdir / "lake"), steps=args.steps,
        batch_size=args.batch, lr_policy=args.lr_policy or base.algorithm.lr_policy, eval_tasks=args.eval_tasks,
        value_samples=args.value_samples, num_replicas=1 if args.quick else base.rollout.num_replicas,
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


def _pretrained_critic(args: argparse.Namespace, base, sft: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """Value pretraining once, in run ``quality-critic``; its version-0 critic is every critic arm's."""
    from benchmarks._settings import with_settings
    from sao import runs
    from sao.train.checkpoint import checkpoint_dir

    if args.value_samples == 0:
        return None, None
    settings = with_settings(base, run_id=f"{PREFIX}-critic", algorithm="sao")
    report = runs.pretrain_value(settings, sft)
    path = checkpoint_dir(settings.checkpoint_root, 0) / "critic"
    return path.resolve(), None if report is None else dataclasses.asdict(report)


def run_arm(arm: Arm, seed: int, args: argparse.Namespace, base, sft: Path, critic: Path | None) -> dict[str, Any]:
    """One run of ``arm``; its timeline, step metrics and stats (evaluations come later)."""
    from benchmarks._settings import with_settings
    from sao import runs
    from sao.envs.base import Split
    from sao.pipeline import run_pipeline

    settings = with_settings(
        base, run_id=f"{PREFIX}-{arm.name.replace('_', '-')}-s{seed}", algorithm=arm.algorithm,
        group_size=arm.group_size, synchronous=arm.synchronous, max_staleness=arm.max_staleness, seed=seed)
    config = runs.pipeline_config(settings, sft)
    train = dataclasses.replace(config.train, critic_path=str(critic) if critic and settings.update().uses_critic
                                else None)
    config = dataclasses.replace(config, train=train, use_ray_train=False, app_name=f"{PREFIX}-rollout")

    def show(report) -> None:
        m = report.metrics
        print(f"[{arm.name} s{seed}] step {report.step}: reward {m.get('batch/reward_mean', 0):.3f} "
              f"staleness {m.get('batch/staleness_mean', 0):.2f} kept {m.get('actor/kept_frac', 0):.3f}",
              file=sys.stderr, flush=True)

    print(f"--- {arm.name}, seed {seed} ({settings.run_id})", file=sys.stderr, flush=True)
    started = time.time()
    result = run_pipeline(config, runs.math_tasks(Split.TRAIN, train.rollout.tasks_path), on_step=show)
    timeline = _timeline(settings, started)
    return {"arm": arm.name, "seed": seed, "run_id": settings.run_id, "settings": settings, "steps": result.steps,
            "pipeline_wall_s": result.wall_s, "train_s": result.train_s,
            "trajectories_generated": result.driver.records, **timeline}


def _timeline(settings, started: float) -> dict[str, Any]:
    """From the lake: when each version was committed (seconds since the run's first rollout was
    dispatched), each step's metrics and timings, and the run's trajectory counts."""
    from sao.lake.store import Lake, sql_literal

    lake = Lake.open(settings.lake_config())
    predicate = f"run_id = {sql_literal(settings.run_id)}"
    steps = sorted(lake.read("train_steps", predicate=predicate).to_pylist(), key=lambda r: r["step"])
    rollouts = lake.read("trajectories", columns=["timings", "min_policy_version"], predicate=predicate)
    dispatched = min(t["created_at"] for t in rollouts.column("timings").to_pylist()).timestamp()
    steps_out = []
    for row in steps:
        steps_out.append({
            "step": row["step"], "version_before": row["policy_version_before"],
            "version": row["policy_version_after"], "trajectories_version": row["trajectories_version"],
            "trajectory_ids": list(row["trajectory_ids"]),
            "elapsed_s": row["finished_at"].timestamp() - dispatched,
            "metrics": dict(row["metrics"]), "timings": dict(row["timings"])})
    return {"startup_s": dispatched - started, "wall_s": steps_out[-1]["elapsed_s"] if steps_out else 0.0,
            "trajectories_stored": rollouts.num_rows, "step_rows": steps_out}


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
            for index in split_by_token_budget(batch, update.token_budget):
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


# ----- evaluation and aggregation -----------------------------------------------------------------


def version_at(run: dict[str, Any], t: float) -> int:
    """The newest version ``run`` had committed ``t`` seconds after its first rollout (0 if none)."""
    done = [r["version"] for r in run["step_rows"] if r["elapsed_s"] <= t + 1e-9]
    return max(done, default=0)


def elapsed_of(run: dict[str, Any], version: int) -> float:
    """Seconds from the run's first rollout until ``version`` was committed (0 for version 0)."""
    return 0.0 if version == 0 else next(r["elapsed_s"] for r in run["step_rows"] if r["version"] == version)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    values = list(values)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def _evaluate(run: dict[str, Any], version: int, cache: dict[tuple[str, int], dict[str, float]]) -> dict[str, Any]:
    """Accuracy of ``version`` of ``run``; version 0 (the SFT policy, identical for every arm of a seed,
    evaluated with the same tasks and sampler seed) is evaluated once per seed."""
    from sao import runs

    key = ("version0", run["seed"]) if version == 0 else (run["run_id"], version)
    if key not in cache:
        e = runs.evaluate(run["settings"], version)
        cache[key] = {"accuracy": e.accuracy, "stderr": e.stderr, "num_tasks": e.num_tasks}
    return {"version": version, "trajectories": version * run["settings"].train.batch_size,
            "elapsed_s": elapsed_of(run, version), **cache[key]}


def _paired(runs_: list[dict[str, Any]], a: str, b: str, key: str) -> dict[str, float] | None:
    """Mean over seeds of (accuracy of arm a - accuracy of arm b) at ``key``, and the standard error of
    that mean from the evaluations' binomial errors (the seed-to-seed spread is reported apart)."""
    by = {(r["arm"], r["seed"]): r[key] for r in runs_}
    seeds = sorted({s for (arm, s) in by if arm == a} & {s for (arm, s) in by if arm == b})
    if not seeds:
        return None
    diffs = [by[a, s]["accuracy"] - by[b, s]["accuracy"] for s in seeds]
    var = sum(by[a, s]["stderr"] ** 2 + by[b, s]["stderr"] ** 2 for s in seeds) / len(seeds) ** 2
    return {"mean": statistics.fmean(diffs), "stderr": math.sqrt(var), "per_seed": diffs,
            "min": min(diffs), "max": max(diffs)}


def summarize(runs_: list[dict[str, Any]], arm_list: Sequence[Arm]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for arm in arm_list:
        mine = [r for r in runs_ if r["arm"] == arm.name]
        if not mine:
            continue
        staleness = [r["metrics"].get("batch/staleness_mean", 0.0) for run in mine for r in run["step_rows"]]
        kept = [r["metrics"].get("actor/kept_frac", 0.0) for run in mine for r in run["step_rows"]]
        summary[arm.name] = {
            "label": arm.label,
            "equal_trajectories": spread([r["final"]["accuracy"] for r in mine]),
            "equal_wall_time": spread([r["at_t"]["accuracy"] for r in mine]),
            "version_at_t": spread([r["at_t"]["version"] for r in mine]),
            "wall_s": spread([r["wall_s"] for r in mine]),
            "startup_s": spread([r["startup_s"] for r in mine]),
            "step_s": spread([r["wall_s"] / max(r["steps"], 1) for r in mine]),
            "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
            "kept_frac_mean": statistics.fmean(kept) if kept else 0.0,
            "reward_first5": statistics.fmean(r["metrics"]["batch/reward_mean"] for run in mine
                                              for r in run["step_rows"][:5]),
            "reward_last5": statistics.fmean(r["metrics"]["batch/reward_mean"] for run in mine
                                             for r in run["step_rows"][-5:]),
        }
    return summary


# ----- figure and report --------------------------------------------------------------------------


def plot(runs_: list[dict[str, Any]], arm_list: Sequence[Arm], t_equal: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm in arm_list:
        mine = [r for r in runs_ if r["arm"] == arm.name]
        if not mine:
            continue
        versions = sorted(set.intersection(*[{e["version"] for e in r["curve"]} for r in mine]))
        acc = [[next(e["accuracy"] for e in r["curve"] if e["version"] == v) for r in mine] for v in versions]
        secs = [[elapsed_of(r, v) for r in mine] for v in versions]
        mean = [statistics.fmean(a) for a in acc]
        low, high = [min(a) for a in acc], [max(a) for a in acc]
        x_traj = [v * mine[0]["settings"].train.batch_size for v in versions]
        (line,) = axes[0].plot(x_traj, mean, marker="o", label=arm.label)
        axes[0].fill_between(x_traj, low, high, color=line.get_color(), alpha=0.15)
        x_time = [statistics.fmean(s) for s in secs]
        axes[1].plot(x_time, mean, marker="o", color=line.get_color(), label=arm.label)
        axes[1].fill_between(x_time, low, high, color=line.get_color(), alpha=0.15)
        steps = min(len(r["step_rows"]) for r in mine)
        reward = [statistics.fmean(r["step_rows"][i]["metrics"]["batch/reward_mean"] for r in mine)
                  for i in range(steps)]
        smooth = [statistics.fmean(reward[max(0, i - 4): i + 1]) for i in range(steps)]
        axes[2].plot(range(steps), smooth, color=line.get_color(), label=arm.label)
    axes[1].axvline(t_equal, color="grey", linestyle="--", linewidth=1, label=f"T = {t_equal:.0f} s")
    axes[0].set(title="held-out accuracy vs trained trajectories", xlabel="trajectories trained on",
                ylabel="sampled accuracy (T=1)")
    axes[1].set(title="held-out accuracy vs wall time", xlabel="seconds since the first rollout",
                ylabel="sampled accuracy (T=1)")
    axes[2].set(title="training batch reward (mean over seeds, 5-step moving average)", xlabel="step", ylabel="mean reward")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    figure.suptitle("mean over seeds; shaded: min-max over seeds", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _fmt(s: dict[str, float], digits: int = 3) -> str:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def _verdict(record: dict[str, Any]) -> list[str]:
    """The targets, judged from the numbers (so the words cannot drift from them)."""
    lines = []
    eq_traj, eq_wall = record["paired"].get("sao-grpo@final"), record["paired"].get("sao-grpo@t")
    if eq_traj is not None:
        met = eq_traj["mean"] >= 0
        within = abs(eq_traj["mean"]) <= 2 * eq_traj["stderr"]
        lines.append(
            f"- SAO at least as accurate as synchronous GRPO at equal trajectories: **{'met' if met else 'missed'}**"
            f" (SAO - GRPO = {eq_traj['mean']:+.3f} ± {eq_traj['stderr']:.3f} evaluation s.e., per seed "
            f"{', '.join(f'{d:+.3f}' for d in eq_traj['per_seed'])}; "
            f"{'within' if within else 'outside'} two standard errors of evaluation noise).")
    if eq_wall is not None:
        clearly = eq_wall["min"] > 0 and eq_wall["mean"] > 2 * eq_wall["stderr"]
        lines.append(
            f"- SAO clearly ahead of synchronous GRPO at equal wall time: **{'met' if clearly else 'missed'}** "
            f"(SAO - GRPO = {eq_wall['mean']:+.3f} ± {eq_wall['stderr']:.3f}, per seed "
            f"{', '.join(f'{d:+.3f}' for d in eq_wall['per_seed'])}; 'clearly' means ahead on every seed and by "
            f"more than two standard errors).")
    return lines


def _ppo_lines(record: dict[str, Any]) -> list[str]:
    ppo = [r for r in record["runs"] if r["arm"] == "ppo_async" and r.get("ratios")]
    if not ppo:
        return []
    clip, dis = record["clip_range"], record["dis_interval"]
    by: dict[str, list[tuple[int, float, float]]] = {}
    for run in ppo:
        for step in run["ratios"]:
            for s, v in step["by_staleness"].items():
                by.setdefault(s, []).append((v["tokens"], v["outside_clip"], v["outside_dis"]))
    rows = []
    for s in sorted(by, key=int):
        tokens = sum(t for t, _, _ in by[s])
        rows.append(f"| {s} | {tokens} | {sum(t * c for t, c, _ in by[s]) / max(tokens, 1):.4f} | "
                    f"{sum(t * d for t, _, d in by[s]) / max(tokens, 1):.4f} |")
    curve = record["summary"].get("ppo_async")
    sao = record["summary"].get("sao")
    lines = [
        "", "**Asynchronous PPO without DIS.** Its trainer records no ratio statistics (PPO keeps every token, so "
        "its `actor/kept_frac` is 1), so the ratios rho = pi_v / pi_behave of every step were recomputed from "
        "the checkpoint the step started from and the rows it read (`ratio_stats`). Share of action tokens "
        f"with rho outside PPO's clip range ({clip[0]:g}, {clip[1]:g}) and outside the DIS interval "
        f"({dis[0]:g}, {dis[1]:g}), i.e. what DIS would have dropped, over all PPO runs, by staleness:", "",
        "| staleness | action tokens | outside clip range | outside DIS interval |", "|---:|---:|---:|---:|", *rows,
    ]
    if curve is not None:
        lines += ["", f"Mean staleness of its batches {curve['staleness_mean']:.2f} (SAO: "
                  f"{sao['staleness_mean']:.2f}, DIS kept fraction {sao['kept_frac_mean']:.4f}); batch reward "
                  f"first 5 steps {curve['reward_first5']:.3f}, last 5 {curve['reward_last5']:.3f} (SAO "
                  f"{sao['reward_first5']:.3f} -> {sao['reward_last5']:.3f})." if sao else ""]
    return lines


def _curve_table(record: dict[str, Any]) -> list[str]:
    """Accuracy by version (mean [min, max] over seeds) at the versions every run of an arm evaluated."""
    by_arm: dict[str, dict[int, list[float]]] = {}
    for run in record["runs"]:
        for e in run["curve"]:
            by_arm.setdefault(run["arm"], {}).setdefault(e["version"], []).append(e["accuracy"])
    seeds = len(record["args"]["seeds"])
    versions = sorted({v for curve in by_arm.values() for v, acc in curve.items() if len(acc) == seeds})
    lines = ["| arm | " + " | ".join(f"v{v}" for v in versions) + " |", "|---|" + "---:|" * len(versions)]
    for arm, curve in by_arm.items():
        cells = [f"{statistics.fmean(curve[v]):.3f} [{min(curve[v]):.2f}, {max(curve[v]):.2f}]"
                 if len(curve.get(v, [])) == seeds else "" for v in versions]
        lines.append(f"| {record['summary'][arm]['label']} | " + " | ".join(cells) + " |")
    return lines


def markdown(record: dict[str, Any], figure: Path) -> str:
    s = record["summary"]
    a = record["args"]
    rows = [f"| {v['label']} | {_fmt(v['equal_trajectories'])} | {_fmt(v['equal_wall_time'])} | "
            f"{v['version_at_t']['mean']:.1f} [{v['version_at_t']['min']:.0f}, {v['version_at_t']['max']:.0f}] | "
            f"{v['wall_s']['mean']:.0f} [{v['wall_s']['min']:.0f}, {v['wall_s']['max']:.0f}] | "
            f"{v['startup_s']['mean']:.0f} | {v['staleness_mean']:.2f} | {v['kept_frac_mean']:.3f} |"
            for v in s.values()]
    v0 = record["version0"]
    critic = record.get("value_pretraining")
    critic_line = (f"Value pretraining: once, {a['value_samples']} version-0 rollouts (the demo uses 256), "
                   f"held-out value loss {critic['loss_before']:.3f} -> {critic['loss_after']:.3f}, "
                   f"{critic['seconds']:.0f} s; the critic of every `sao` and `ppo_async` run."
                   if critic else "Value pretraining: none (critics start from the policy).")
    figure_ref = figure.relative_to(Path("docs")) if figure.is_relative_to("docs") else figure
    lines = [
        "## Learning quality: SAO vs GRPO, GRPO + DIS, async PPO (`sao bench quality`)", "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])}", "",
        f"Every run: math_tool, {a['steps']} steps of {a['batch']} trajectories (GRPO: {a['batch'] // a['group']} "
        f"prompts x {a['group']}), policy lr {record['lr_policy']:g}, Serve rollout replicas: "
        f"{record['num_replicas']}, the trainer in the benchmark's process for every arm (`use_ray_train=False`), from one SFT "
        f"checkpoint; seeds {', '.join(map(str, a['seeds']))}. {critic_line} Held-out sampled accuracy (T=1) "
        f"on {a['eval_tasks']} tasks every {a['eval_every']} versions; version 0 (SFT): "
        + ", ".join(f"{e['accuracy']:.3f}" for e in v0) + f" (seeds {', '.join(map(str, a['seeds']))}). "
        f"Equal wall time T = {record['t_equal']:.1f} s (the shortest run's time from its first rollout to its "
        f"last step). GRPO + DIS is asynchronous: a group's {a['group']} rollouts may land in different batches "
        f"(arrival order), and group advantages then see only the part of the group in the batch. Total "
        f"{record['wall_s'] / 60:.1f} min.", "",
        "Accuracy: mean ± std over seeds [min, max].", "",
        "| arm | accuracy, equal trajectories (last version) | accuracy at equal wall time T | version at T | "
        "wall s to last step | start-up s | mean staleness | kept fraction |",
        "|---|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        "Accuracy by version (mean [min, max] over seeds):", "", *_curve_table(record), "",
        *_verdict(record), *_ppo_lines(record), "",
        f"![accuracy vs trajectories and wall time]({figure_ref})",
    ]
    return "\n".join(lines)


# ----- main --------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    args = _parse(argv)
    chosen = [arm for arm in arms(args) if arm.name in args.arms]
    unknown = set(args.arms) - {arm.name for arm in arms(args)}
    if unknown:
        print(f"sao bench quality: unknown arms {sorted(unknown)}", file=sys.stderr)
        return 2
    started, machine_info = time.monotonic(), machine()  # the load average before the runs, not after
    args.workdir.mkdir(parents=True, exist_ok=True)
    _fresh_workdir(args.workdir)
    base = _base_settings(args)
    print("warm start ...", file=sys.stderr, flush=True)
    sft = _version_zero(args, base)
    needs_critic = any(arm.algorithm in ("sao", "ppo_async") for arm in chosen)
    critic, critic_report = _pretrained_critic(args, base, sft) if needs_critic else (None, None)
    runs_: list[dict[str, Any]] = []
    for seed in args.seeds:
        for arm in chosen:
            runs_.append(run_arm(arm, seed, args, base, sft, critic))
    t_equal = min(r["wall_s"] for r in runs_)
    cache: dict[tuple[str, int], dict[str, float]] = {}
    for run in runs_:
        versions = sorted({0, run["steps"], version_at(run, t_equal),
                           *range(args.eval_every, run["steps"], args.eval_every)})
        run["curve"] = [_evaluate(run, v, cache) for v in versions]
        run["final"] = _evaluate(run, run["steps"], cache)
        run["at_t"] = _evaluate(run, version_at(run, t_equal), cache)
        if run["arm"] == "ppo_async":
            run["ratios"] = ratio_stats(run, (0.8, 1.2), (0.7, 6.0))
    update = base.update()
    record: dict[str, Any] = {
        "machine": machine_info, "command": " ".join(["sao bench quality", *argv]),
        "args": {"steps": args.steps, "batch": args.batch, "group": args.group, "seeds": args.seeds,
                 "staleness": args.staleness, "ppo_staleness": args.ppo_staleness, "eval_every": args.eval_every,
                 "eval_tasks": args.eval_tasks, "value_samples": args.value_samples, "quick": args.quick},
        "lr_policy": base.algorithm.lr_policy, "num_replicas": base.rollout.num_replicas,
        "clip_range": [1 - update.clip_low, 1 + update.clip_high],
        "dis_interval": [1 - update.eps_low, 1 + update.eps_high],
        "value_pretraining": critic_report, "t_equal": t_equal,
        "version0": [cache["version0", seed] for seed in args.seeds if ("version0", seed) in cache],
    }
    record["summary"] = summarize(runs_, chosen)
    record["paired"] = {}
    for other in ("grpo", "grpo_dis", "ppo_async"):
        for key, tag in (("final", "final"), ("at_t", "t")):
            paired = _paired(runs_, "sao", other, key)
            if paired is not None:
                record["paired"][f"sao-{other}@{tag}"] = paired
    record["runs"] = [{k: v for k, v in r.items() if k != "settings"} | {"settings": r["settings"].public()}
                      for r in runs_]
    for run in record["runs"]:
        for row in run["step_rows"]:
            row.pop("trajectory_ids")
    record["wall_s"] = time.monotonic() - started
    name = "quality-quick" if args.quick else "quality"
    figure = plot(runs_, chosen, t_equal, args.out / f"{name}.png")
    text = markdown(record, figure)
    print(text)
    write_json(args.out / f"{name}.json", record)
    update_section(args.results_md, "quality", text)
    return 0
