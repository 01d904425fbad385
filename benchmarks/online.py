"""Benchmark: online learning under preference shifts (SAO.md section 5). Three asynchronous runs on
style_preference from the same SFT warm start: SAO's critic against a running-mean baseline and a
group baseline, with the preferred style shifting during training.

    sao bench online [--steps 450] [--shifts 150,300] [--batch 8] [--quick]

The methods (same warm start, seed, batch size, steps, staleness bound and policy learning rate):

- ``sao``: critic + skip-observation GAE + DIS (``Algorithm.SAO``); the critic starts from the policy
  with a fresh value head (no value pretraining unless ``--value-samples``);
- ``running_mean``: advantage = reward - mean of the last 8 rewards, DIS (``Algorithm.RUNNING_MEAN``);
- ``grpo_dis``: group advantages over the rows of a batch that share a ``task_id``, DIS
  (``Algorithm.GRPO_DIS``), each task rolled out ``--group-size`` times in a row
  (``PipelineConfig.group_size``), still asynchronous: the rollouts of a group arrive in the lake one by
  one, so a group can be split across two batches (or lose a member to the staleness bound); a member
  alone in its batch gets advantage 0. The benchmark counts such splits.

Every run goes through the real pipeline (Serve rollouts -> Delta -> trainer in this process ->
weights). A replica builds each episode's environment at the version its engine runs (the number of
trainer steps done), so the judge prefers ``academic`` before the first shift, then ``cute``, then
``classical`` (more shifts cycle through the styles). A trajectory is rewarded by the preference at
the step it started at; a batch trained on at step s holds trajectories started at steps
s - max_staleness .. s.

Definitions (what the table reports):

- reward at step s: ``batch/reward_mean`` of the run's ``train_steps`` row for step s (the mean
  reward of the batch that update trained on);
- smoothed reward at step s: the trailing mean of the rewards of steps max(0, s - w + 1) .. s
  (``--smooth``, w = 10 by default);
- pre-shift reward of a shift at step S: the mean reward of steps S - 20 .. S - 1 (``--pre-window``);
- the threshold is 0.9 x the pre-shift reward (``--fraction``); after the shift the smoothed reward
  first falls below it (the dip: the new preference reaches the batches), and the run has
  **recovered** at the first step after the dip at which the smoothed reward is back at or above the
  threshold; **steps to recover** = that step - S. A run that does not get back before the next shift
  (or the end) has "not recovered"; one whose smoothed reward never dips is reported with 0 steps; a
  pre-shift reward below 0.1 (``--min-pre``: nothing left to recover to) makes the shift "n/a" for
  that run, counted as not recovered in the target;
- final reward: the mean reward of the last 20 steps.

Target (issue 8): SAO recovers in fewer steps than both baselines after every shift. Writes
``<out>/<name>.json``, ``<out>/<name>.png`` (reward curves with the shifts) and
``<out>/<name>-styles.png`` (the share of each style per policy version), and the ``<name>`` section of
``docs/RESULTS.md`` (``--name``, default ``online``). Run files and the lake go to
``<workdir>/<name>/`` (removed first: every invocation starts its runs afresh); the SFT warm start is
cached under ``<workdir>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, update_section, write_json
from sao.online import online_pipeline, recovery, smooth, style_warm_start
from sao.online import shift_options as schedule_options

METHODS: tuple[str, ...] = ("sao", "running_mean", "grpo_dis")
LABELS = {"sao": "SAO (critic + GAE + DIS)", "running_mean": "running mean (window 8) + DIS",
          "grpo_dis": "group baseline (GRPO + DIS)"}
TARGET_WALL_S = 20 * 60
COLORS = {"sao": "tab:blue", "running_mean": "tab:orange", "grpo_dis": "tab:green"}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench online", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--shifts", type=_ints, default=[150, 300], help="trainer steps of the preference shifts")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per update")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task of grpo_dis")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--lr-policy", type=float, default=3e-4)
    parser.add_argument("--max-tokens", type=int, default=64, help="completion budget of one reply")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-in-flight", type=int, default=16)
    parser.add_argument("--value-samples", type=int, default=0,
                        help="version-0 rollouts to pretrain SAO's critic on (0: none)")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smooth", type=int, default=10, help="trailing window of the smoothed reward (steps)")
    parser.add_argument("--pre-window", type=int, default=20, help="steps before a shift that set its pre-shift reward")
    parser.add_argument("--fraction", type=float, default=0.9, help="share of the pre-shift reward that counts as recovered")
    parser.add_argument("--min-pre", type=float, default=0.1, help="least pre-shift reward for a measurable recovery")
    parser.add_argument("--name", default="online",
                        help="names the JSON, the figures and the section of the results file")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/online"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the tests (16 steps, shifts at 6 and 11, batch 4, a short SFT)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.shifts, args.batch, args.sft_steps = 16, [6, 11], 4, 20
        args.group_size, args.smooth, args.pre_window, args.max_in_flight = 2, 2, 4, 8
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    if args.shifts != sorted(set(args.shifts)) or not all(0 < s < args.steps for s in args.shifts):
        parser.error(f"--shifts must be increasing steps inside (0, --steps={args.steps}), got {args.shifts}")
    if args.batch % args.group_size:
        parser.error(f"--batch {args.batch} must be a multiple of --group-size {args.group_size}")
    if not 0 < args.fraction <= 1 or args.smooth < 1 or args.pre_window < 1:
        parser.error("need 0 < --fraction <= 1, --smooth >= 1 and --pre-window >= 1")
    return args


# Metrics ----------------------------------------------------------------------------------------


def step_metrics(lake, run_id: str) -> list[dict[str, float]]:
    """The metrics of every committed step of ``run_id`` (from ``train_steps``), in step order, plus
    ``step`` and the step's wall seconds ``time/step_wall_s``."""
    from sao.lake.store import sql_literal

    rows = lake.read("train_steps", columns=["step", "metrics", "started_at", "finished_at"],
                     predicate=f"run_id = {sql_literal(run_id)}").to_pylist()
    out = []
    for row in sorted(rows, key=lambda r: r["step"]):
        metrics = dict(row["metrics"])
        metrics["step"] = float(row["step"])
        metrics["time/step_wall_s"] = (row["finished_at"] - row["started_at"]).total_seconds()
        out.append(metrics)
    if [int(m["step"]) for m in out] != list(range(len(out))):
        raise RuntimeError(f"run {run_id}: train_steps has gaps: {[int(m['step']) for m in out]}")
    return out


def group_splits(lake, run_id: str, group_size: int) -> dict[str, Any]:
    """How the groups of a grouped run met the batches: per step, the rows of each ``task_id``; a group
    is split when a batch holds fewer (or more) than ``group_size`` of its rollouts."""
    from sao.lake.store import sql_literal

    predicate = f"run_id = {sql_literal(run_id)}"
    tasks = dict(zip(*lake.read("trajectories", columns=["trajectory_id", "task_id"], predicate=predicate)
                     .to_pydict().values(), strict=True))
    steps = lake.read("train_steps", columns=["trajectory_ids"], predicate=predicate).column(0).to_pylist()
    sizes: Counter[int] = Counter()
    split_batches = 0
    for ids in steps:
        counts = Counter(tasks[i] for i in ids)
        sizes.update(counts.values())
        split_batches += any(c != group_size for c in counts.values())
    rows = sum(size * n for size, n in sizes.items())
    partial = sum(size * n for size, n in sizes.items() if size != group_size)
    return {"group_size": group_size, "batches": len(steps), "batches_with_a_split_group": split_batches,
            "rows": rows, "rows_in_split_groups": partial, "rows_alone": sizes.get(1, 0),
            "group_sizes_in_batches": {str(k): v for k, v in sorted(sizes.items())}}


def style_counts(lake, run_id: str, tokenizer) -> dict[int, Counter[str]]:
    """Per policy version (the trajectory's ``min_policy_version``), how many of the run's trajectories
    were written in each style (by their markers: ``none`` for no or tied markers)."""
    from sao.envs.style_preference import classify_style
    from sao.lake.store import sql_literal

    rows = lake.read("trajectories", columns=["completion_ids", "action_mask", "min_policy_version"],
                     predicate=f"run_id = {sql_literal(run_id)}").to_pylist()
    counts: dict[int, Counter[str]] = {}
    for row in rows:
        ids = [t for t, m in zip(row["completion_ids"], row["action_mask"], strict=True) if m]
        style = classify_style(tokenizer.decode(ids, skip_special_tokens=True))
        counts.setdefault(int(row["min_policy_version"]), Counter())[str(style or "none")] += 1
    return counts


def style_shares(counts: dict[int, Counter[str]], first: int, stop: int) -> dict[str, float]:
    """Share of each style among the trajectories of versions ``first`` .. ``stop - 1``."""
    total: Counter[str] = Counter()
    for version in range(first, stop):
        total.update(counts.get(version, Counter()))
    n = sum(total.values())
    return {style: k / n for style, k in sorted(total.items())} if n else {}


def style_mix(counts: dict[int, Counter[str]], bucket: int, shifts: Sequence[int], styles: Sequence[str],
              window: int) -> dict[str, Any]:
    """Style shares per bucket of ``bucket`` versions (the figure), and per shift the shares of the
    old and the new preferred style over the ``window`` versions before the shift and the ``window``
    versions before the next shift (or the last version)."""
    last = max(counts, default=0) + 1
    buckets = list(range(0, last, bucket))
    phases = []
    for index, shift in enumerate(shifts):
        end = shifts[index + 1] if index + 1 < len(shifts) else last
        before, after = style_shares(counts, max(0, shift - window), shift), style_shares(counts, max(shift, end - window), end)
        old, new = styles[index], styles[index + 1]
        phases.append({"shift": shift, "old_style": old, "new_style": new,
                       "before": {"old": before.get(old, 0.0), "new": before.get(new, 0.0)},
                       "phase_end": {"old": after.get(old, 0.0), "new": after.get(new, 0.0)}})
    return {"bucket": bucket, "versions": buckets,
            "shares": {v: style_shares(counts, v, v + bucket) for v in buckets}, "phases": phases}


# Runs -------------------------------------------------------------------------------------------


def warm_start(args: argparse.Namespace) -> tuple[Path, float | None]:
    """The version-0 policy (style_preference SFT, cached per seed and step count) and the seconds its
    SFT took (None: cached)."""
    path = args.workdir / f"sft-style-seed{args.seed}-steps{args.sft_steps}"
    cached = (path / "config.json").exists()
    started = time.monotonic()
    style_warm_start(path, seed=args.seed, steps=args.sft_steps)
    return path, None if cached else time.monotonic() - started


def _pretrain_critic(config, tasks, samples: int) -> None:
    """Value pretraining of SAO's critic on ``samples`` version-0 rollouts (as :func:`sao.runs.pretrain_value`
    does for math_tool), stored as run ``<run>-v0``."""
    from sao.pipeline import collect_rollouts
    from sao.train.loop import prepare_run
    from sao.train.pretrain import PretrainConfig, pretrain_value

    train = config.train
    prepare_run(train)
    data = dataclasses.replace(train, run_id=f"{train.run_id}-v0",
                               checkpoint_root=str(Path(train.checkpoint_root).parent / "v0-data-checkpoints"))
    prepare_run(data)
    collect_rollouts(dataclasses.replace(config, train=data), tasks, data.run_id, samples)
    pretrain_value(train, PretrainConfig(num_samples=samples, data_run_id=data.run_id))


def run_method(method: str, args: argparse.Namespace, policy: Path, tasks, tasks_file: Path,
               runs_dir: Path) -> dict[str, Any]:
    """One run of ``method``; its step metrics, timings and (grouped runs) group splits."""
    from benchmarks._settings import bench_config
    from sao.lake.store import Lake
    from sao.pipeline import run_pipeline

    group = args.group_size if method == "grpo_dis" else 1
    settings = bench_config(
        run_id=f"online-{method}", workdir=str(runs_dir), lake_root=str(runs_dir / "lake"), algorithm=method,
        steps=args.steps, batch_size=args.batch, max_staleness=args.max_staleness, lr_policy=args.lr_policy,
        num_replicas=args.replicas, max_in_flight=args.max_in_flight, group_size=group,
        value_samples=args.value_samples, seed=args.seed)
    config = dataclasses.replace(online_pipeline(settings, policy, args.shifts, tasks_file, args.max_tokens),
                                 use_ray_train=False, app_name="online")
    started = time.monotonic()
    if args.value_samples and config.train.update.uses_critic:
        _pretrain_critic(config, tasks, args.value_samples)
    pretrain_s = time.monotonic() - started

    def show(report) -> None:
        if report.step % 10 == 0 or report.step + 1 == args.steps:
            m = report.metrics
            print(f"[{method}] step {report.step}: reward {m.get('batch/reward_mean', 0):.3f} "
                  f"kept {m.get('actor/kept_frac', 0):.3f} staleness {m.get('batch/staleness_mean', 0):.2f} "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    result = run_pipeline(config, tasks, on_step=show)
    lake = Lake.open(settings.lake_config())
    steps = step_metrics(lake, settings.run_id)
    record: dict[str, Any] = {
        "algorithm": method, "group_size": group, "wall_s": time.monotonic() - started, "pretrain_s": pretrain_s,
        "pipeline_wall_s": result.wall_s, "train_s": result.train_s, "steps": len(steps),
        "trajectories_generated": result.driver.records, "step_wall_s_mean": statistics.fmean(
            m["time/step_wall_s"] for m in steps) if steps else None,
        "metrics": steps,
    }
    if group > 1:
        record["groups"] = group_splits(lake, settings.run_id, group)
    return record


# Report -----------------------------------------------------------------------------------------


def analyse(record: dict[str, Any], args: argparse.Namespace) -> None:
    """Add the reward curve, its smoothing, the recovery per shift and the final reward to ``record``."""
    rewards = [m["batch/reward_mean"] for m in record["metrics"]]
    record["rewards"] = rewards
    record["smoothed"] = smooth(rewards, args.smooth)
    ends = [*args.shifts[1:], len(rewards)]
    record["recovery"] = [measurable(recovery(rewards, args.smooth, shift, end, args.pre_window, args.fraction),
                                     args.min_pre) for shift, end in zip(args.shifts, ends, strict=True)]
    record["final_reward"] = statistics.fmean(rewards[-args.pre_window:])


def measurable(row: dict[str, Any], min_pre: float) -> dict[str, Any]:
    """``row`` (a :func:`sao.online.recovery` result) marked ``measurable``: a pre-shift reward below
    ``min_pre`` leaves nothing to recover to, and its recovery is None (not a trivial 0 steps)."""
    ok = row["pre_shift_reward"] >= min_pre
    return row | {"measurable": ok} if ok else row | {"measurable": False, "recovered_step": None,
                                                        "steps_to_recover": None}


def target_met(results: dict[str, dict[str, Any]]) -> bool | None:
    """SAO recovers in fewer steps than every other method after every shift (None: SAO or no
    baseline was run). Not recovering counts as infinitely many steps."""
    if "sao" not in results or len(results) < 2:
        return None

    def steps(method: str, index: int) -> float:
        value = results[method]["recovery"][index]["steps_to_recover"]
        return math.inf if value is None else value

    shifts = len(results["sao"]["recovery"])
    return all(steps("sao", i) < math.inf and all(steps("sao", i) < steps(m, i) for m in results if m != "sao")
               for i in range(shifts))


def plot(results: dict[str, dict[str, Any]], args: argparse.Namespace, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(10, 4.2))
    for method, record in results.items():
        x = range(len(record["rewards"]))
        ax.plot(x, record["rewards"], color=COLORS[method], alpha=0.18, linewidth=0.8)
        ax.plot(x, record["smoothed"], color=COLORS[method], linewidth=1.8, label=LABELS[method])
        for rec in record["recovery"]:
            if rec["recovered_step"] is not None:
                ax.plot(rec["recovered_step"], record["smoothed"][rec["recovered_step"]], "o", color=COLORS[method])
    for shift in args.shifts:
        ax.axvline(shift, color="black", linestyle="--", linewidth=1)
    ax.set(xlabel="trainer step", ylabel="batch reward", ylim=(-0.02, 1.02),
           title=f"style_preference, shifts at {', '.join(map(str, args.shifts))}: batch reward (faint) and "
                 f"trailing mean over {args.smooth} steps; dots: recovered to {args.fraction:g} x pre-shift")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_styles(results: dict[str, dict[str, Any]], args: argparse.Namespace, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sao.envs.style_preference import Style

    styles = [str(s) for s in Style] + ["none"]
    figure, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, (method, record) in zip(axes[0], results.items(), strict=True):
        mix = record["styles"]
        versions = mix["versions"]
        shares = [[mix["shares"][v].get(s, 0.0) for v in versions] for s in styles]
        ax.stackplot([v + mix["bucket"] / 2 for v in versions], shares, labels=styles)
        for shift in args.shifts:
            ax.axvline(shift, color="black", linestyle="--", linewidth=1)
        ax.set(title=LABELS[method], xlabel="policy version (min of the trajectory)", ylim=(0, 1))
        ax.title.set_fontsize(9)
    axes[0][0].set_ylabel("share of trajectories")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _fmt_steps(rec: dict[str, Any]) -> str:
    if not rec["measurable"]:
        return "n/a (nothing to recover)"
    return "not recovered" if rec["steps_to_recover"] is None else str(rec["steps_to_recover"])


def markdown(record: dict[str, Any], args: argparse.Namespace) -> str:
    results = {m: record["methods"][m] for m in METHODS if m in record["methods"]}
    shifts = args.shifts
    head = "| method | " + " | ".join(f"pre-shift reward (step {s}) | steps to recover (shift at {s})" for s in shifts)
    head += f" | final reward (last {args.pre_window} steps) | run wall (s) | trainer wall / step (s) |"
    lines = [
        "## Online learning under preference shifts (`sao bench online`)", "",
        f"Command: `{record['command'].strip()}`. {machine_line(record['machine'])}", "",
        f"Three asynchronous runs on style_preference from one SFT warm start ({args.sft_steps} steps on replies "
        f"in all four styles), same seed {args.seed}, batch {args.batch}, {args.steps} steps, max staleness "
        f"{args.max_staleness}, policy lr {args.lr_policy:g}, {args.replicas} rollout replica(s), reply budget "
        f"{args.max_tokens} tokens. The judge prefers "
        + ", then ".join(schedule_options(shifts)["style_preference"]["judge"]["schedule"]["styles"])
        + f", shifting at steps {', '.join(map(str, shifts))}. SAO: critic + GAE + DIS, "
        + ("no value pretraining (the critic starts from the policy with a fresh value head and has the steps "
           "before the first shift to learn)" if not args.value_samples else
           f"critic pretrained on {args.value_samples} version-0 rollouts")
        + f"; running mean: window 8, DIS; group baseline: GRPO + DIS, groups of {args.group_size}.", "",
        f"Reward = `batch/reward_mean` of each `train_steps` row, smoothed by a trailing mean over {args.smooth} steps; "
        f"pre-shift reward = mean reward of the {args.pre_window} steps before the shift; recovered = first step, "
        f"after the smoothed reward has dipped below {args.fraction:g} x pre-shift, at which it is back at or above it "
        "(definitions in `benchmarks/online.py`).", "",
        head, "|---|" + "---:|" * (2 * len(shifts) + 3),
    ]
    for method, res in results.items():
        cells = [f"{r['pre_shift_reward']:.3f} | {_fmt_steps(r)}" for r in res["recovery"]]
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells)
                     + f" | {res['final_reward']:.3f} | {res['wall_s']:.0f} | {res['train_s'] / res['steps']:.2f} |")
    lines += ["", f"Style shares (by markers; versions = the trajectory's oldest policy version) over the "
              f"{args.pre_window} versions before each shift and the last {args.pre_window} versions of the phase "
              "after it:", "",
              "| method | shift | new style | its share before | its share at phase end | old style's share at phase end |",
              "|---|---:|---|---:|---:|---:|"]
    for method, res in results.items():
        for phase in res["styles"]["phases"]:
            lines.append(f"| {LABELS[method]} | {phase['shift']} | {phase['new_style']} | {phase['before']['new']:.3f} | "
                         f"{phase['phase_end']['new']:.3f} | {phase['phase_end']['old']:.3f} |")
    verdict = {True: "**met**.", False: "**missed**.", None: "not decided (SAO or a baseline was not run)."}
    lines += ["", "Target (SAO recovers in fewer steps than both baselines after every shift): "
              + verdict[record["target_met"]]]
    if "grpo_dis" in results and "groups" in results["grpo_dis"]:
        g = results["grpo_dis"]["groups"]
        lines += ["", f"Groups of the group baseline in the batches: {g['batches_with_a_split_group']} of {g['batches']} "
                  f"batches held a split group (fewer or more than {g['group_size']} rollouts of one task); "
                  f"{g['rows_in_split_groups']} of {g['rows']} rows were in split groups, {g['rows_alone']} alone "
                  f"(advantage 0). Group sizes seen in batches (size: count): "
                  + ", ".join(f"{k}: {v}" for k, v in g["group_sizes_in_batches"].items()) + "."]
    sft = "cached" if record["sft_s"] is None else f"{record['sft_s']:.0f} s"
    end_load = record.get("load_average_1m_end")
    lines += ["", f"Wall time of the runs: {record['runs_wall_s']:.0f} s; of the benchmark {record['wall_s']:.0f} s "
              f"(SFT warm start: {sft}; target at the default size: under {TARGET_WALL_S / 60:.0f} min, "
              + ("**met**" if record["wall_s"] < TARGET_WALL_S else "**missed**") + "). A step's `train_steps` row "
              f"spans {min(r['step_wall_s_mean'] for r in results.values()):.2f}-"
              f"{max(r['step_wall_s_mean'] for r in results.values()):.2f} s on average (waiting for the batch, the "
              "update, the checkpoint, the row); the rest of the trainer wall per step comes after the row (the "
              "`policy_versions` row and the weight publication, not timed separately)."
              + ("" if end_load is None else f" 1-minute load average at the end: {end_load}."), "",
              f"![reward curves]({record['figures'][0]})", "", f"![style shares]({record['figures'][1]})"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from sao.envs.base import Split, write_tasks
    from sao.envs.style_preference import generate_tasks
    from sao.lake.config import LakeConfig
    from sao.lake.store import Lake
    from sao.models.tokenizer import load_tokenizer
    from sao.runtime import init_ray

    started = time.monotonic()
    info = machine()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print("warm start ...", file=sys.stderr)
    policy, sft_s = warm_start(args)
    runs_dir = args.workdir / args.name
    shutil.rmtree(runs_dir, ignore_errors=True)  # every invocation starts its runs afresh
    lake_root = runs_dir / "lake"
    tasks_file = write_tasks(runs_dir / "style_preference.jsonl", generate_tasks())
    tasks = [t for t in generate_tasks() if t.split is Split.TRAIN]
    init_ray()
    tokenizer = load_tokenizer(policy)
    styles = schedule_options(args.shifts)["style_preference"]["judge"]["schedule"]["styles"]
    results: dict[str, dict[str, Any]] = {}
    runs_started = time.monotonic()
    for method in args.methods:
        results[method] = run_method(method, args, policy, tasks, tasks_file, runs_dir)
        analyse(results[method], args)
        counts = style_counts(Lake.open(LakeConfig(root=str(lake_root.resolve()))), f"online-{method}", tokenizer)
        results[method]["styles"] = style_mix(counts, args.smooth, args.shifts, styles, args.pre_window)
    runs_wall_s = time.monotonic() - runs_started
    args.out.mkdir(parents=True, exist_ok=True)
    figures = [plot(results, args, args.out / f"{args.name}.png"),
               plot_styles(results, args, args.out / f"{args.name}-styles.png")]
    record: dict[str, Any] = {
        "machine": info, "command": " ".join(["sao bench online", *argv]), "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sft_s": sft_s, "runs_wall_s": runs_wall_s, "wall_s": time.monotonic() - started,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "methods": results, "target_met": target_met(results),
        "figures": [str(_relative(f, args.results_md.parent)) for f in figures],
    }
    write_json(args.out / f"{args.name}.json", record)
    text = markdown(record, args)
    print(text)
    update_section(args.results_md, args.name, text)
    return 0


def _relative(path: Path, start: Path) -> Path:
    """``path`` relative to ``start`` where it lies below it (figure links in the results file)."""
    try:
        return path.resolve().relative_to(start.resolve())
    except ValueError:
        return path.resolve()
