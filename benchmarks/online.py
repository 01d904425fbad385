"""Benchmark: online learning under preference shifts (SAO.md section 5). Asynchronous runs on
style_preference from one SFT warm start, seed by seed: SAO's critic against a running-mean baseline
and a group baseline, with each reader's preferred style shifting at its own step.

    sao bench online [--seeds 0] [--steps 450] [--shifts Ada:150:cute,Basil:225:classical,Cleo:300:cute]
                     [--entropy-coef 0] [--lr-critic RATE] [--whiten]
                     [--quick]
    sao bench online --merge

The setting (defaults; each can be changed): every prompt names one of three readers (personas), and
each reader has a schedule of its own (``--shifts PERSONA:STEP[:STYLE],...``): the i-th reader starts
with the i-th style (academic, cute, classical, chuunibyou) and moves, at each of its shifts, to the
style named or else to the next one, so the readers want different styles from the start and change at
different steps; a policy must read the prompt to please each, and a critic has per-reader values to
follow. By default Ada moves from academic to cute at step 150, Basil from cute to classical at 225 and
Cleo from classical to cute at 300: each reader moves to a style another reader wants at that moment,
one the policy should still write. (A shift to a style no reader has wanted for a while, such as Cleo's
chuunibyou at 300 when every reader moves to the next style in order, gave no method a signal: by then
no policy wrote that style, and no reply earned more than the floor.) ``--shifts 150,300`` (steps
without names) is the single-reader setting of the earlier design. The warm start (SFT on a reply in
every style for every prompt) adds ``--warm-start-bias`` more in the style the prompt's reader first
prefers (default 4 with readers: 5 of 8 demonstrations), so that the policy tells the readers apart.
(Without it, every policy wrote one style for every reader within 150 steps, and a shift to that style
earned full reward at once, with nothing tracked; with 1, 2 of 5 demonstrations, the policies still
drifted onto one style. With 4, every method pleased every reader before each shift, 5 seeds:
``docs/RESULTS.md``.) The policy learning rate, the same for every method, defaults to 1e-4: at 3e-4
with that warm start SAO's replies ran on past the token budget after a shift, one seed. The reward is graded (``--graded``: a finished
reply scores at least 0.2, each marker of the preferred style adds, so a shift does not zero every
reply) and replies end on ``</answer>`` (``--answer-tag``: the warm start's demonstrations are written
so, and a reply that never closes scores 0). ``--entropy-coef`` adds an entropy bonus to every method's
actor loss alike (``algorithm.entropy_coef``; default 0, none). A reply that runs out of tokens is
scored as it stands and not bootstrapped (:func:`sao.online.online_settings`), for every method.
``--lr-critic`` and ``--whiten`` change SAO's run alone (:func:`sao_settings`): its critic's learning
rate, and its advantages whitened over the batch. Neither helped SAO on a validation schedule, so the
run config's critic stays the default (``docs/RESULTS.md``, the notes after the section ``val-whiten``).

The methods (same warm start, seed, batch size, steps, staleness bound, policy learning rate):

- ``sao``: critic + skip-observation GAE + DIS (``Algorithm.SAO``); the critic starts from the policy
  with a fresh value head (no value pretraining unless ``--value-samples``);
- ``running_mean``: advantage = reward - mean of the last 8 rewards, DIS (``Algorithm.RUNNING_MEAN``);
- ``grpo_dis``: group advantages over the rows of a batch that share a ``task_id``, DIS
  (``Algorithm.GRPO_DIS``), each task rolled out ``--group-size`` times in a row, still asynchronous: a
  group can be split across two batches (a member alone in its batch gets advantage 0); the benchmark
  counts such splits.

Every run goes through the real pipeline (Serve rollouts -> Delta -> trainer in this process ->
weights). A trajectory is rewarded by the preference at the step it started at.

The measure (per shift of a reader at step S, until that reader's next shift or the run's end E):
**the area under the reward curve after the shift**, the mean reward of that reader's trajectories
trained at steps S .. E - 1 (each step's batch rows, from ``train_steps.trajectory_ids`` and the
``trajectories`` rows); over all shifts, every shifted reader's trajectories after its shift, pooled.
SAO minus each baseline, per seed, with a 95% bootstrap interval that resamples seeds and, within a
seed, each run's trajectories (:func:`benchmarks.stats.two_sample_bootstrap`). Beside it: the reader's
mean reward over the ``--pre-window`` steps before the shift, and the share of the new and the old style
in its replies over the last ``--pre-window`` steps before E.

Target (issue 24): SAO's area after the shifts above both baselines', each interval above zero.

Each seed's runs are a part, ``<name>-seedS.json`` in ``--out``, written when the seed is done; every part
of the same design there is then merged into ``<name>.json``, ``<name>.png`` and the ``<name>`` section
of ``docs/RESULTS.md`` (``--name``, default ``online``), so seeds can run in separate invocations (each
fits in 40 minutes on 2 cores at the default size) and accumulate. ``--merge`` only merges. Run files
and the lake go to ``<workdir>/<name>/`` (removed first); the SFT warm start is cached under ``<workdir>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._report import load_parts as seed_parts
from benchmarks._report import machine, parts_lines, save_figure, update_section, write_json
from benchmarks.stats import interval_text, two_sample_bootstrap
from sao.online import (
    online_pipeline,
    shift_options,
    shift_steps,
    smooth,
    style_config,
    style_warm_start,
)

METHODS: tuple[str, ...] = ("sao", "running_mean", "grpo_dis")
LABELS = {"sao": "SAO (critic + GAE + DIS)", "running_mean": "running mean (window 8) + DIS",
          "grpo_dis": "group baseline (GRPO + DIS)"}
COLORS = {"sao": "tab:blue", "running_mean": "tab:orange", "grpo_dis": "tab:green"}
DEFAULT_SHIFTS = "Ada:150:cute,Basil:225:classical,Cleo:300:cute"


def parse_shifts(text: str) -> list[int] | dict[str, list[int | tuple[int, str]]]:
    """``150,300`` (every reader) or ``Ada:150:cute,Basil:225,Ada:300`` (per reader: a step, with the
    style the reader moves to or, without one, the next style in the default order; a reader named with
    no step, ``Cleo:``, keeps its first style throughout)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not any(":" in item for item in items):
        return [int(item) for item in items]
    if not all(":" in item for item in items):
        raise ValueError(f"--shifts: name a reader for every step or for none, got {text!r}")
    schedule: dict[str, list[int | tuple[int, str]]] = {}
    for item in items:
        name, _, shift = item.partition(":")
        step, _, style = shift.partition(":")
        schedule.setdefault(name.strip(), [])
        if step.strip():
            schedule[name.strip()].append((int(step), style.strip()) if style.strip() else int(step))
    return schedule


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench online", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--shifts", default=DEFAULT_SHIFTS, help="READER:STEP[:STYLE],... per reader, or STEP,... for all")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--seeds", default="0", help="seeds of this invocation (parts of other seeds are merged)")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per update")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task of grpo_dis")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--lr-policy", type=float, default=1e-4, help="policy learning rate of every method")
    parser.add_argument("--lr-critic", type=float, default=None,
                        help="SAO's critic learning rate (the baselines have no critic; default: algorithm.lr_critic's)")
    parser.add_argument("--whiten", action="store_true",
                        help="SAO's advantages whitened over its batch's action tokens (algorithm.whiten_advantages; "
                             "the group baseline's are scaled by each group's std already)")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus of every method (0: none)")
    parser.add_argument("--graded", action=argparse.BooleanOptionalAction, default=True,
                        help="the graded reward (a finished reply scores at least 0.2)")
    parser.add_argument("--answer-tag", action=argparse.BooleanOptionalAction, default=True,
                        help="replies end on </answer>; one that does not close scores 0")
    parser.add_argument("--warm-start-bias", type=int, default=None,
                        help="warm-start demonstrations per prompt in its reader's first style, beside one in every "
                             "style (default 4 with readers, 0 without)")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion budget of one reply")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-in-flight", type=int, default=16)
    parser.add_argument("--value-samples", type=int, default=0,
                        help="version-0 rollouts to pretrain SAO's critic on (0: none)")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--smooth", type=int, default=10, help="trailing window of the figure's curves (steps)")
    parser.add_argument("--pre-window", type=int, default=20,
                        help="steps before a shift (its pre-shift reward) and before a phase's end (style shares)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap draws of each interval")
    parser.add_argument("--merge", action="store_true", help="merge the parts in --out only, run nothing")
    parser.add_argument("--name", default="online", help="names the JSON, the figure and the results section")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/online"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the tests (16 steps, two readers shifting at 6 and 11, batch 4, short SFT)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.shifts, args.batch, args.sft_steps = 16, "Ada:6,Basil:11", 4, 20
        args.group_size, args.smooth, args.pre_window, args.max_in_flight, args.bootstrap = 2, 2, 4, 8, 200
    try:
        args.schedule = parse_shifts(args.shifts)
        if args.warm_start_bias is None:
            args.warm_start_bias = 4 if isinstance(args.schedule, dict) else 0
        options(args)
    except ValueError as error:
        parser.error(f"--shifts {args.shifts!r}: {error}")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    steps = shift_steps(args.schedule)
    if not steps or not all(0 < s < args.steps for s in steps):
        parser.error(f"--shifts must hold at least one step, each inside (0, --steps={args.steps}), got {args.shifts}")
    if args.batch % args.group_size:
        parser.error(f"--batch {args.batch} must be a multiple of --group-size {args.group_size}")
    if args.lr_critic is not None and not args.lr_critic > 0:
        parser.error(f"--lr-critic must be > 0, got {args.lr_critic}")
    if args.entropy_coef < 0 or args.smooth < 1 or args.pre_window < 1 or args.warm_start_bias < 0:
        parser.error("need --entropy-coef >= 0, --smooth >= 1, --pre-window >= 1 and --warm-start-bias >= 0")
    return args


def options(args: argparse.Namespace) -> dict[str, Any]:
    return shift_options(args.schedule, graded=args.graded, answer_tag=args.answer_tag,
                         warm_start_bias=args.warm_start_bias)


SAO_OPTIONS = (("lr_critic", "algorithm.lr_critic"), ("whiten", "algorithm.whiten_advantages"))
"""SAO's own options of this benchmark (its critic's learning rate, whitening) and the run-config key
each sets: the baselines have no critic, and the group baseline's advantages are scaled by each
group's std already."""


def design(args: argparse.Namespace) -> dict[str, Any]:
    """What parts must share to be merged."""
    keys = ("steps", "shifts", "batch", "group_size", "max_staleness", "lr_policy", "entropy_coef", "graded",
            "answer_tag", "warm_start_bias", "max_tokens", "replicas", "max_in_flight", "value_samples", "sft_steps", "pre_window",
            "quick")
    # SAO's own options are named only when set, so parts run before the options existed (at the run
    # config's settings) still merge with those run without them.
    return {key: getattr(args, key) for key in keys} | {
        name: getattr(args, name) for name, _ in SAO_OPTIONS if getattr(args, name)}


def sao_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run-config settings of SAO's run alone (:data:`SAO_OPTIONS` that are set)."""
    return {key: getattr(args, name) for name, key in SAO_OPTIONS if getattr(args, name)}


def events(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every shift: its reader ("" when every reader shifts), step, the end of the phase it starts (the
    reader's next shift or the run's end), and the old and new preferred styles."""
    judge = options(args)["style_preference"]["judge"]
    if isinstance(args.schedule, list):
        schedules = {"": judge["schedule"]}
    else:
        schedules = judge["persona_schedules"]
    out = []
    for persona, schedule in schedules.items():
        steps = schedule["shift_steps"]
        for index, shift in enumerate(steps):
            end = steps[index + 1] if index + 1 < len(steps) else args.steps
            out.append({"persona": persona, "shift": shift, "end": end, "old_style": schedule["styles"][index],
                        "new_style": schedule["styles"][index + 1]})
    return sorted(out, key=lambda e: (e["shift"], e["persona"]))


# ----- what a run did, from the lake -----------------------------------------------------------------


def step_metrics(lake, run_id: str) -> list[dict[str, Any]]:
    """Every committed step of ``run_id`` (``train_steps``) in step order: its metrics, wall seconds and
    trajectory ids."""
    rows = lake.read_run("train_steps", run_id,
                         ["step", "metrics", "started_at", "finished_at", "trajectory_ids"]).to_pylist()
    rows = sorted(rows, key=lambda r: r["step"])
    if [r["step"] for r in rows] != list(range(len(rows))):
        raise RuntimeError(f"run {run_id}: train_steps has gaps: {[r['step'] for r in rows]}")
    return [{"step": r["step"], "metrics": dict(r["metrics"]), "trajectory_ids": list(r["trajectory_ids"]),
             "wall_s": (r["finished_at"] - r["started_at"]).total_seconds()} for r in rows]


def trajectories(lake, run_id: str, tokenizer, persona_of_task: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each trajectory of ``run_id`` by id: its reader, reward, end and style (by markers, ``none`` for
    no or tied markers)."""
    from sao.envs.style_preference import classify_style

    rows = lake.read_run("trajectories", run_id, ["trajectory_id", "task_id", "reward", "termination_reason",
                                                  "completion_ids", "action_mask"]).to_pylist()
    out = {}
    for row in rows:
        ids = [t for t, m in zip(row["completion_ids"], row["action_mask"], strict=True) if m]
        out[row["trajectory_id"]] = {
            "persona": persona_of_task[row["task_id"]], "task_id": row["task_id"],
            "reward": None if row["reward"] is None else float(row["reward"]),  # None: an end never trained on
            "end": row["termination_reason"],
            "style": str(classify_style(tokenizer.decode(ids, skip_special_tokens=True)) or "none")}
    return out


def group_splits(steps: list[dict[str, Any]], rows: dict[str, dict[str, Any]], group_size: int) -> dict[str, Any]:
    """How the groups of a grouped run met the batches: a group is split when a batch holds fewer (or
    more) than ``group_size`` of its rollouts."""
    sizes: Counter[int] = Counter()
    split_batches = 0
    for step in steps:
        counts = Counter(rows[i]["task_id"] for i in step["trajectory_ids"])
        sizes.update(counts.values())
        split_batches += any(c != group_size for c in counts.values())
    total = sum(size * n for size, n in sizes.items())
    partial = sum(size * n for size, n in sizes.items() if size != group_size)
    return {"group_size": group_size, "batches": len(steps), "batches_with_a_split_group": split_batches,
            "rows": total, "rows_in_split_groups": partial, "rows_alone": sizes.get(1, 0),
            "group_sizes_in_batches": {str(k): v for k, v in sorted(sizes.items())}}


def _rows_of(steps, rows, persona: str, first: int, stop: int) -> list[dict[str, Any]]:
    """The trajectories of ``persona`` ("": every reader) trained at steps ``first`` .. ``stop - 1``."""
    return [rows[i] for step in steps[max(0, first):stop] for i in step["trajectory_ids"]
            if not persona or rows[i]["persona"] == persona]


def analyse(steps, rows, shifts: list[dict[str, Any]], pre_window: int) -> dict[str, Any]:
    """Per shift: the reader's rewards after it (the measure), its reward before, its style shares at the
    phase's end; per reader: the mean reward of each step's rows of that reader (the figure)."""
    out_events = []
    for event in shifts:
        persona, shift, end = event["persona"], event["shift"], event["end"]
        after = [r["reward"] for r in _rows_of(steps, rows, persona, shift, end)]
        before = [r["reward"] for r in _rows_of(steps, rows, persona, shift - pre_window, shift)]
        late = Counter(r["style"] for r in _rows_of(steps, rows, persona, end - pre_window, end))
        n = sum(late.values()) or 1
        out_events.append(event | {
            "after": statistics.fmean(after) if after else None, "trajectories_after": len(after),
            "after_rewards": " ".join(f"{r:.4g}" for r in after),
            "before": statistics.fmean(before) if before else None,
            "new_share_at_end": late[event["new_style"]] / n, "old_share_at_end": late[event["old_style"]] / n})
    personas = sorted({r["persona"] for r in rows.values()})
    curves = {}
    for persona in personas:
        curve = []
        for step in steps:
            mine = [rows[i]["reward"] for i in step["trajectory_ids"] if rows[i]["persona"] == persona]
            curve.append(round(statistics.fmean(mine), 4) if mine else None)
        curves[persona] = curve
    return {"events": out_events, "persona_rewards": curves}


# ----- runs ------------------------------------------------------------------------------------------


def warm_start(args: argparse.Namespace) -> tuple[Path, float | None]:
    """The version-0 policy (style_preference SFT on the setting's prompts and reply format, cached by
    seed 0, step count, readers and format) and the seconds its SFT took (None: cached)."""
    readers = "-".join(args.schedule) if isinstance(args.schedule, dict) else "all"
    bias = f"-bias{args.warm_start_bias}" if args.warm_start_bias else ""
    path = args.workdir / f"sft-style-steps{args.sft_steps}-{readers}{'-tag' if args.answer_tag else ''}{bias}"
    cached = (path / "config.json").exists()
    started = time.monotonic()
    style_warm_start(path, seed=0, steps=args.sft_steps, style=style_config(options(args)))
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


def run_method(method: str, seed: int, args: argparse.Namespace, policy: Path, tasks, tasks_file: Path,
               runs_dir: Path, tokenizer) -> dict[str, Any]:
    """One run of ``method``: its rewards, per-reader curves, shifts and timings."""
    from benchmarks._settings import bench_config
    from sao.envs.style_preference import persona_of
    from sao.lake.store import Lake
    from sao.pipeline import run_pipeline

    group = args.group_size if method == "grpo_dis" else 1
    settings = bench_config(
        run_id=f"{args.name}-{method.replace('_', '-')}-s{seed}", workdir=str(runs_dir),
        lake_root=str(runs_dir / "lake"), algorithm=method, steps=args.steps, batch_size=args.batch,
        max_staleness=args.max_staleness, lr_policy=args.lr_policy, num_replicas=args.replicas,
        max_in_flight=args.max_in_flight, group_size=group, value_samples=args.value_samples, seed=seed,
    ).with_values({"algorithm.entropy_coef": args.entropy_coef} | (sao_settings(args) if method == "sao" else {}))
    config = dataclasses.replace(
        online_pipeline(settings, policy, args.schedule, tasks_file, args.max_tokens, graded=args.graded,
                        answer_tag=args.answer_tag, warm_start_bias=args.warm_start_bias),
        use_ray_train=False, app_name=args.name)
    started = time.monotonic()
    if args.value_samples and config.train.update.uses_critic:
        _pretrain_critic(config, tasks, args.value_samples)
    pretrain_s = time.monotonic() - started

    def show(report) -> None:
        if report.step % 10 == 0 or report.step + 1 == args.steps:
            m = report.metrics
            print(f"[{method} s{seed}] step {report.step}: reward {m.get('batch/reward_mean', 0):.3f} "
                  f"kept {m.get('actor/kept_frac', 0):.3f} staleness {m.get('batch/staleness_mean', 0):.2f} "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    result = run_pipeline(config, tasks, on_step=show)
    lake = Lake.open(settings.lake_config())
    steps = step_metrics(lake, settings.run_id)
    rows = trajectories(lake, settings.run_id, tokenizer, {t.task_id: persona_of(t) or "" for t in tasks})
    trained = [rows[i] for step in steps for i in step["trajectory_ids"]]
    record: dict[str, Any] = {
        "method": method, "seed": seed, "run_id": settings.run_id, "group_size": group,
        "wall_s": time.monotonic() - started, "pretrain_s": pretrain_s, "pipeline_wall_s": result.wall_s,
        "train_s": result.train_s, "steps": len(steps), "trajectories_generated": result.driver.records,
        "step_wall_s_mean": statistics.fmean(s["wall_s"] for s in steps) if steps else None,
        "rewards": [s["metrics"]["batch/reward_mean"] for s in steps],
        "entropy": [s["metrics"].get("actor/entropy") for s in steps] if args.entropy_coef else None,
        "critic_lr": steps[-1]["metrics"].get("critic/lr") if steps else None,  # after the warm-up: the rate set
        "length_end_share": sum(r["end"] == "length" for r in trained) / max(len(trained), 1),
        **analyse(steps, rows, events(args), args.pre_window),
    }
    if group > 1:
        record["groups"] = group_splits(steps, rows, group)
    return record


# ----- merging the seeds' parts -------------------------------------------------------------------------


def load_parts(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The parts of ``--name`` in ``--out`` with this invocation's design, by seed; a note for each left out."""
    return seed_parts(args.out, args.name, design(args))


def _after(run: dict[str, Any], index: int | None) -> np.ndarray:
    """The rewards after shift ``index`` (None: after every shift, pooled)."""
    chosen = run["events"] if index is None else [run["events"][index]]
    return np.array([float(x) for e in chosen for x in e["after_rewards"].split()])


def merge(parts: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Per method, the area after each shift (and pooled) over seeds; SAO minus each baseline with intervals."""
    methods = [m for m in METHODS if any(m in p["runs"] for p in parts)]
    shifts = parts[0]["runs"][methods[0]]["events"]
    summary: dict[str, Any] = {}
    for method in methods:
        runs_ = [p["runs"][method] for p in parts if method in p["runs"]]
        pooled = [float(_after(r, None).mean()) for r in runs_]
        summary[method] = {
            "after_pooled": pooled, "seeds": [r["seed"] for r in runs_],
            "after": [[e["after"] for e in r["events"]] for r in runs_],
            "before": [[e["before"] for e in r["events"]] for r in runs_],
            "new_share_at_end": [[e["new_share_at_end"] for e in r["events"]] for r in runs_],
            "old_share_at_end": [[e["old_share_at_end"] for e in r["events"]] for r in runs_],
            "final_reward": [statistics.fmean(r["rewards"][-20:]) for r in runs_],
            "length_end_share": [r["length_end_share"] for r in runs_], "wall_s": [r["wall_s"] for r in runs_]}
    comparisons: dict[str, Any] = {}
    for other in methods:
        if other == "sao" or "sao" not in methods:
            continue
        both = [p for p in parts if "sao" in p["runs"] and other in p["runs"]]
        if not both:
            continue
        comparisons[f"sao-{other}"] = {
            "pooled": two_sample_bootstrap([(_after(p["runs"]["sao"], None), _after(p["runs"][other], None))
                                            for p in both], samples=samples),
            "by_shift": [two_sample_bootstrap([(_after(p["runs"]["sao"], i), _after(p["runs"][other], i))
                                               for p in both], samples=samples) for i in range(len(shifts))]}
    return {"methods": methods, "shifts": [{k: e[k] for k in ("persona", "shift", "end", "old_style", "new_style")}
                                           for e in shifts],
            "summary": summary, "comparisons": comparisons, "seeds": [p["seed"] for p in parts]}


# ----- report ----------------------------------------------------------------------------------------


def plot(parts: list[dict[str, Any]], record: dict[str, Any], smooth_window: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    personas = sorted({e["persona"] for e in record["shifts"]} | set(
        parts[0]["runs"][record["methods"][0]]["persona_rewards"]))
    figure, axes = plt.subplots(1, len(personas), figsize=(5 * len(personas), 3.8), squeeze=False, sharey=True)
    for ax, persona in zip(axes[0], personas, strict=True):
        for method in record["methods"]:
            curves = [p["runs"][method]["persona_rewards"].get(persona) for p in parts if method in p["runs"]]
            curves = [c for c in curves if c]
            if not curves:
                continue
            filled, last = [], 0.0
            for i in range(min(len(c) for c in curves)):  # a step without the reader's rows keeps the last mean
                values = [c[i] for c in curves if c[i] is not None]
                last = statistics.fmean(values) if values else last
                filled.append(last)
            ax.plot(range(len(filled)), smooth(filled, smooth_window), color=COLORS[method], label=LABELS[method])
        for event in record["shifts"]:
            if event["persona"] == persona:
                ax.axvline(event["shift"], color="black", linestyle="--", linewidth=1)
                ax.text(event["shift"], 1.01, f" -> {event['new_style']}", fontsize=7)
        ax.set(title=f"reader {persona or '(every reader)'}", xlabel="trainer step", ylim=(-0.02, 1.08))
        ax.title.set_fontsize(9)
    axes[0][0].set_ylabel(f"reward of the reader's rows (trailing mean over {smooth_window} steps)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    figure.suptitle(f"mean over seeds {', '.join(map(str, record['seeds']))}; dashed: the reader's shift", fontsize=9)
    return save_figure(figure, path)


def _mean(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.fmean(values):.3f}" if values else "n/a"


def verdict(record: dict[str, Any]) -> str:
    needed = [f"sao-{m}" for m in ("running_mean", "grpo_dis")]
    if not all(k in record["comparisons"] for k in needed):
        return "not decided (SAO and both baselines were not all run)"
    met = all(record["comparisons"][k]["pooled"]["low"] > 0 for k in needed)
    seeds = len(record["seeds"])
    return f"**{'met' if met else 'missed'}**" + ("" if seeds >= 5 else f" ({seeds} seed(s) of the 5 the target asks for)")


def markdown(record: dict[str, Any]) -> str:
    d, s = record["design"], record["summary"]
    schedule = ", ".join(f"{e['persona'] or 'every reader'} {e['old_style']} -> {e['new_style']} at step {e['shift']}"
                         for e in record["shifts"])
    rows = []
    for method in record["methods"]:
        v = s[method]
        cells = [f"{_mean(a[i] for a in v['before'])} / {_mean(a[i] for a in v['after'])}"
                 for i in range(len(record["shifts"]))]
        rows.append(f"| {LABELS[method]} | " + " | ".join(cells) + f" | {_mean(v['after_pooled'])} | "
                    f"{_mean(v['final_reward'])} | {_mean(v['length_end_share'])} | {statistics.fmean(v['wall_s']):.0f} |")
    comparison_rows = []
    for pair, c in record["comparisons"].items():
        comparison_rows.append(f"| {pair} | all shifts, pooled | {interval_text(c['pooled'])} |")
        comparison_rows += [f"| {pair} | {e['persona'] or 'every reader'} at {e['shift']} | {interval_text(b)} |"
                            for e, b in zip(record["shifts"], c["by_shift"], strict=True)]
    share_rows = [f"| {LABELS[m]} | {e['persona'] or 'every reader'} at {e['shift']} | {e['new_style']} | "
                  f"{_mean(a[i] for a in s[m]['new_share_at_end'])} | {_mean(a[i] for a in s[m]['old_share_at_end'])} |"
                  for m in record["methods"] for i, e in enumerate(record["shifts"])]
    head = " | ".join(f"{e['persona'] or 'all'} at {e['shift']}: before / after" for e in record["shifts"])
    lines = [
        "## Online learning under preference shifts (`sao bench online`)", "",
        *parts_lines(record["commands"], record["parts"]), "",
        f"Asynchronous runs on style_preference from one SFT warm start ({d['sft_steps']} steps on replies in all "
        f"four styles{', each closed by </answer>' if d['answer_tag'] else ''}), batch {d['batch']}, {d['steps']} "
        f"steps, max staleness {d['max_staleness']}, policy lr {d['lr_policy']:g}, entropy bonus "
        f"{d['entropy_coef']:g}, {d['replicas']} rollout replica(s), reply budget {d['max_tokens']} tokens; "
        f"{'graded' if d['graded'] else 'all-or-nothing'} reward. Shifts: {schedule}. SAO: critic + GAE + DIS"
        + (f" (critic lr {d['lr_critic']:g})" if d.get("lr_critic") else "")
        + (", advantages whitened over the batch" if d.get("whiten") else "")
        + (f", critic pretrained on {d['value_samples']} version-0 rollouts" if d["value_samples"] else
           ", no value pretraining") + f"; running mean: window 8, DIS; group baseline: GRPO + DIS, groups of "
        f"{d['group_size']}. Seeds: {', '.join(map(str, record['seeds']))}.", "",
        "Mean reward of the shifted reader's rows: over the "
        f"{d['pre_window']} steps before its shift / from the shift to its next shift or the end (the area "
        "after the shift); pooled: every shifted reader's rows after its shift; mean over seeds. Length ends: "
        "share of trained replies that ran to the token budget.", "",
        f"| method | {head} | after, pooled | final reward (last 20 steps) | length ends | run wall (s) |",
        "|---|" + "---:|" * (len(record["shifts"]) + 4), *rows, "",
        "SAO minus each baseline, area after the shifts: mean over seeds, 95% bootstrap interval (seeds, then each "
        f"run's trajectories resampled; {record['bootstrap']} draws):", "",
        "| pair | shift | SAO - baseline [95% interval] |", "|---|---|---|", *comparison_rows, "",
        f"Target (SAO's area after the shifts above both baselines', intervals above zero): {verdict(record)}.", "",
        f"Style shares of the shifted reader's replies over the last {d['pre_window']} steps of the phase (by markers):",
        "", "| method | shift | new style | new style's share | old style's share |", "|---|---|---|---:|---:|",
        *share_rows,
        *([""] + [f"- {n}" for n in record["notes"]] if record["notes"] else []), "",
        f"![reward per reader]({record['figure']})",
    ]
    return "\n".join(lines)


def publish_merged(args: argparse.Namespace) -> int:
    parts, notes = load_parts(args)
    record = merge(parts, args.bootstrap) | {
        "design": parts[0]["design"], "bootstrap": args.bootstrap, "notes": notes,
        "commands": [p["command"] for p in parts],
        "parts": [{"seed": p["seed"], "machine": p["machine"], "wall_s": p["wall_s"], "sft_s": p["sft_s"]}
                  for p in parts]}
    figure = plot(parts, record, args.smooth, args.out / f"{args.name}.png")
    record["figure"] = str(_relative(figure, args.results_md.parent))
    text = markdown(record)
    print(text)
    write_json(args.out / f"{args.name}.json", record)
    update_section(args.results_md, args.name, text)
    return 0


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.merge:
        return publish_merged(args)
    from sao.envs.base import Split, write_tasks
    from sao.envs.style_preference import generate_tasks
    from sao.models.tokenizer import load_tokenizer
    from sao.runtime import init_ray

    info = machine()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print("warm start ...", file=sys.stderr)
    policy, sft_s = warm_start(args)
    config = style_config(options(args))
    init_ray()
    tokenizer = load_tokenizer(policy)
    for seed in args.seeds:
        seed_started, seed_machine = time.monotonic(), info if seed == args.seeds[0] else machine()
        runs_dir = args.workdir / args.name
        shutil.rmtree(runs_dir, ignore_errors=True)  # every seed starts its runs afresh
        every_task = generate_tasks(config)
        tasks_file = write_tasks(runs_dir / "style_preference.jsonl", every_task)
        tasks = [t for t in every_task if t.split is Split.TRAIN]
        runs = {m: run_method(m, seed, args, policy, tasks, tasks_file, runs_dir, tokenizer) for m in args.methods}
        part = {"design": design(args), "seed": seed, "machine": seed_machine, "sft_s": sft_s,
                "command": " ".join(["sao bench online", *argv]), "wall_s": time.monotonic() - seed_started,
                "runs": runs}
        write_json(args.out / f"{args.name}-seed{seed}.json", part)
        sft_s = None  # one warm start per invocation
    return publish_merged(args)


def _relative(path: Path, start: Path) -> Path:
    """``path`` relative to ``start`` where it lies below it (figure links in the results file)."""
    try:
        return path.resolve().relative_to(start.resolve())
    except ValueError:
        return path.resolve()
