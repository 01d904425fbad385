"""Benchmark: the laptop demo as a newcomer runs it, timed, with its accuracy before and after.

    sao bench demo [--runs 3 | --seeds 0,1,2 [--against FILE]] [--workdir DIR] [--set KEY=VALUE ...] [--tag NAME]
                   [--quick]
    sao bench demo --reread RECORD.json [--workdir DIR] [--against FILE]
    sao bench demo --compare ARM.json [ARM.json ...] --against BASE.json --tag NAME

Runs ``sao demo`` (``configs/demo.yaml``: SFT warm start, evaluation, value pretraining, SAO with Serve
rollouts into a local Delta lake and Ray Train updates, evaluation again) as a child process in an empty
working folder, ``--runs`` times one after another, each in a folder of its own, so nothing of an
earlier run is resumed, and reads each run's recorded result (``runs/demo/result.json``). With ``--set`` the same run goes through ``sao train --config
configs/demo.yaml --set ...`` instead (a variant of the demo; its settings are recorded). The wall time
is the command's, from start to exit, in an installed environment (a fresh clone adds the
environment's creation, which ``make demo`` does first).

``--runs`` repeats the demo with its one seed (the spread is the system's: asynchronous timing). With
``--seeds`` each run has a seed of its own instead, for the warm start and the run alike (``seed`` and
``sft.seed``), and every run is evaluated with the same sampling seed (``eval.seed``,
:data:`EVAL_SEED`), so two variants run with the same seeds compare seed by seed: ``--against FILE``
(another seeded run's result file) adds each seed's difference in held-out accuracy after training,
their mean and its standard error over the seeds.

Beside each run: its value pretraining (rollouts, the critic's explained variance on held-out ones);
the critic's explained variance on its targets in training, early and late (with
``algorithm.oracle_values``, the oracle's beside it); and how the critic's value moves at the first
token where a failed rollout leaves its task's demonstration (the first wrong digit of a copy error),
where a critic that places the error drops and the oracle's falls to 0 (:func:`critic_off_path`); and
the mean surprise ``-log p`` of the action tokens the run trained on, early and late, an estimate of the
policy's entropy per token when it samples at temperature 1, as the demo does (:func:`sampled_surprise`);
and what the trainer's step took early and late, its period and its wait for a batch (:func:`step_cost`):
whether the run's steps get dearer as its lake grows (issue 25's flat-cost windows).
``--reread RECORD.json --workdir DIR`` adds these to a record written before they were recorded, from
the folders its runs ran in; ``--reread RECORD.json --against FILE`` pairs a seeded record's runs with
another base (a default run again at the same code, say), in place of the one it was written against.
``--compare`` runs nothing: it sets arms' records side by side, each paired with ``--against``, in one
table and one figure (:mod:`benchmarks.demo_compare`).

Target (issue 24): held-out sampled accuracy above 0.8, a rise of at least +0.25, in under 10 minutes.
Writes ``docs/results/demo.json`` and the ``demo`` section of ``docs/RESULTS.md`` (``--tag T``:
``demo-T.json`` and section ``demo-T``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._report import (
    add_output_arguments,
    machine,
    machine_line,
    median_spread,
    publish,
    run_echoed,
    spread_text,
)

TARGET_ACCURACY, TARGET_RISE, TARGET_WALL_S = 0.8, 0.25, 600.0
DEFAULT_JSON, DEFAULT_RESULTS = Path("docs/results/demo.json"), Path("docs/RESULTS.md")
EVAL_SEED = 0
"""The evaluation's sampling seed of every run of ``--seeds``."""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="the empty folder the demo runs in (default: a new temporary folder)")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="KEY=VALUE: a variant of the demo config (repeatable)")
    parser.add_argument("--tag", default="", help="names a variant: demo-TAG.json and section demo-TAG")
    parser.add_argument("--runs", type=int, default=3, help="runs of the demo, one after another (median, min, max)")
    parser.add_argument("--seeds", default=None,
                        help="0,1,2: one run per seed instead of --runs repeats (seed and sft.seed; eval.seed fixed)")
    parser.add_argument("--against", type=Path, default=None,
                        help="a result file of the same seeds (e.g. docs/results/demo-seeds.json): seed-by-seed differences")
    parser.add_argument("--reread", type=Path, default=None,
                        help="RECORD.json: add what its runs' folders (--workdir) hold to a record written without it")
    parser.add_argument("--compare", type=Path, nargs="+", default=None, metavar="ARM.json",
                        help="run nothing: these seeded records side by side, each paired with --against (one "
                             "table, one figure; --tag names them)")
    parser.add_argument("--quick", action="store_true",
                        help="two steps, few evaluation tasks and value samples (the test suite's)")
    add_output_arguments(parser, DEFAULT_JSON, DEFAULT_RESULTS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.seeds is not None:
        try:
            args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--seeds takes integers separated by commas (0,1,2), got {args.seeds!r}")
        if not args.seeds:
            parser.error("--seeds names no seed")
        if len(set(args.seeds)) != len(args.seeds):
            parser.error(f"--seeds must differ, got {args.seeds}")
        seeded = [s for s in args.sets if s.partition("=")[0].strip() in SEED_KEYS]
        if seeded:
            parser.error(f"--seeds sets {', '.join(SEED_KEYS)} itself; drop {seeded}")
    if args.compare is not None:
        if args.against is None or not args.tag:
            parser.error("--compare needs --against (the base every arm pairs with) and --tag (names the table)")
        if args.reread is not None or args.seeds is not None or args.sets:
            parser.error("--compare runs nothing: it takes no --reread, --seeds or --set")
        for path in (*args.compare, args.against):
            if not path.is_file():
                parser.error(f"--compare: no such record {path}")
        return args
    if args.reread is not None:
        if not args.reread.is_file():
            parser.error(f"--reread {args.reread}: no such record")
        if args.workdir is None and args.against is None:
            parser.error("--reread RECORD.json needs --workdir (the folder its runs ran in) or --against (a base "
                         "to pair its runs with)")
    if args.against is not None:
        seeds = args.seeds
        if args.reread is not None:
            seeds = [run.get("seed") for run in json.loads(args.reread.read_text())["runs"]]
            if None in seeds:
                parser.error(f"--against compares seed by seed: {args.reread} has runs without a seed")
        elif seeds is None:
            parser.error("--against compares seed by seed: give --seeds")
        if not args.against.is_file():
            parser.error(f"--against {args.against}: no such file")
        args.base = json.loads(args.against.read_text())
        recorded = {run.get("seed") for run in args.base["runs"]}
        if missing := sorted(set(seeds) - recorded):
            parser.error(f"--against {args.against} has no run of seed(s) {missing}")
    if args.quick:
        args.runs = 1
        args.seeds = args.seeds[:1] if args.seeds else None
        args.sets = ["train.steps=2", "train.batch_size=8", "eval.tasks=8", "value_pretraining.samples=8",
                     "sft.max_steps=4", *args.sets]
    return args


SEED_KEYS = ("seed", "sft.seed", "eval.seed")


def run_sets(sets: list[str], seed: int | str | None) -> list[str]:
    """The ``--set`` values of one run: the variant's, and with ``seed`` the run's seeds."""
    if seed is None:
        return list(sets)
    return [*sets, f"seed={seed}", f"sft.seed={seed}", f"eval.seed={EVAL_SEED}"]


def _demo_run(workdir: Path):
    """Where the demo config's run (run id ``demo``, folder ``runs``) keeps its files in ``workdir``."""
    from sao.config import RunConfig

    return RunConfig(run_id="demo", workdir=str(workdir / "runs"))


def run_demo(workdir: Path, sets: list[str]) -> tuple[dict[str, Any], float]:
    """``sao demo`` (or, with ``sets``, ``sao train`` on the demo config with them) in ``workdir``; its
    recorded result and wall seconds. Raises RuntimeError, with the output's tail, when it fails."""
    from sao.config import DEMO_CONFIG

    sao = str(Path(sys.executable).with_name("sao"))
    command = [sao, "demo"] if not sets else [
        sao, "train", "--config", str(DEMO_CONFIG), *[part for value in sets for part in ("--set", value)]]
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise RuntimeError(f"{workdir} is not empty: the demo must start from nothing")
    wall_s = run_echoed(command, workdir)  # the demo's own progress, passed on as it comes
    return demo_result(workdir), wall_s


def demo_result(workdir: Path) -> dict[str, Any]:
    """The result the demo run of ``workdir`` recorded (``runs/demo/result.json``)."""
    return json.loads((_demo_run(workdir).run_dir / "result.json").read_text())


PRETRAINING_KEYS = ("num_train", "num_heldout", "optimizer_steps", "explained_variance_before",
                    "explained_variance_after", "loss_before", "loss_after", "seconds")


def value_pretraining(workdir: Path) -> dict[str, Any] | None:
    """What value pretraining reported in the run of ``workdir`` (its rollouts, the critic's explained
    variance on held-out ones before and after, the seconds it took); None: the run had none."""
    from sao.train.checkpoint import critic_dir
    from sao.train.pretrain import REPORT_FILE

    path = critic_dir(_demo_run(workdir).checkpoint_root, 0) / REPORT_FILE
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    return {key: report[key] for key in PRETRAINING_KEYS}


FIT_METRICS = ("critic/explained_variance", "oracle/explained_variance")
FIT_STEPS = 25
"""The critic's fit is the mean of each of :data:`FIT_METRICS` over a run's first and last this many steps."""


def _steps(workdir: Path, columns: list[str]) -> list[dict[str, Any]]:
    """The demo run's rows of ``train_steps`` in ``workdir``'s lake (``step`` and ``columns``), in step order."""
    from sao.lake.store import Lake

    rows = Lake.open(str(workdir / "lake")).read_run("train_steps", _demo_run(workdir).run_id, ["step", *columns])
    return sorted(rows.to_pylist(), key=lambda row: row["step"])


def critic_fit(workdir: Path) -> dict[str, dict[str, float]]:
    """Of the run of ``workdir`` (its lake's ``train_steps``), each of :data:`FIT_METRICS` it recorded:
    the mean over the first and the last :data:`FIT_STEPS` steps that have it (``{"first", "last"}``)."""
    metrics = [dict(row["metrics"]) for row in _steps(workdir, ["metrics"])]
    fit = {}
    for name in FIT_METRICS:
        values = [m[name] for m in metrics if name in m]
        if values:
            fit[name] = {"first": statistics.fmean(values[:FIT_STEPS]), "last": statistics.fmean(values[-FIT_STEPS:])}
    return fit


CURVE_PARTS = 10
""":func:`reward_curve` cuts a run's steps into this many consecutive parts."""


def reward_curve(workdir: Path) -> list[dict[str, Any]] | None:
    """The demo run of ``workdir``'s learning curve on its training tasks, from its lake's ``train_steps``:
    the mean of the batches' mean reward (``batch/reward_mean``: the demo's reward is 1 for a right
    answer, so the share its trained rollouts solved, sampled at T=1 by policies at most
    ``max_staleness`` versions behind) over each of :data:`CURVE_PARTS` consecutive parts of its steps,
    as ``{"steps": [first, last + 1], "reward": mean}``. None: no step recorded it."""
    rewards = [(row["step"], dict(row["metrics"]).get("batch/reward_mean")) for row in _steps(workdir, ["metrics"])]
    rewards = [(step, reward) for step, reward in rewards if reward is not None]
    if not rewards:
        return None
    bounds = [round(part * len(rewards) / CURVE_PARTS) for part in range(CURVE_PARTS + 1)]
    return [{"steps": [rewards[lo][0], rewards[hi - 1][0] + 1], "reward": statistics.fmean(r for _, r in rewards[lo:hi])}
            for lo, hi in itertools.pairwise(bounds) if hi > lo]


COST_TIMINGS = ("wait_read_s", "update_s")
"""The parts of a step (``train_steps.timings``) that :func:`step_cost` averages beside its period: the
wait for its batch (rollouts to arrive, then the lake's commit and read) and the update."""


def step_cost(workdir: Path) -> dict[str, Any] | None:
    """What a step of the demo run of ``workdir`` took, early and late, from its lake's ``train_steps``:

    - ``"first"`` and ``"last"``: the mean period (from the step before's end to the step's end) and the
      mean of each of :data:`COST_TIMINGS`, over the first and the last :data:`FIT_STEPS` steps that have
      a step before them (the first step's wait holds the start-up: steps 1-25 against the last 25 of 150);
    - ``"flat"``: the mean period over the flat-cost target's windows
      (:func:`benchmarks.long_run.flat_windows`: steps 50-149 against 900-999 of 1,000), each window's
      ``steps`` and ``period_s``, and ``ratio``, late over early.

    None: the run trained fewer than two steps."""
    from benchmarks.long_run import flat_windows

    rows = _steps(workdir, ["finished_at", "timings"])
    if len(rows) < 2:
        return None
    steps = [{"period_s": (row["finished_at"] - before["finished_at"]).total_seconds(),
              **{key: dict(row["timings"])[key] for key in COST_TIMINGS}} for before, row in itertools.pairwise(rows)]
    cost: dict[str, Any] = {
        label: {key: statistics.fmean(step[key] for step in chosen) for key in ("period_s", *COST_TIMINGS)}
        for label, chosen in _windows(steps)}
    flat: dict[str, Any] = {}
    for name, (lo, hi) in flat_windows(len(rows)).items():
        lo = min(max(lo, 1), len(steps))  # steps[i] is step i + 1's: step 0 has no step before it
        hi = min(max(hi, lo + 1), len(rows))  # at least one step, in a short run too
        flat[name] = {"steps": [lo, hi], "period_s": statistics.fmean(step["period_s"] for step in steps[lo - 1:hi - 1])}
    cost["flat"] = {**flat, "ratio": flat["late"]["period_s"] / flat["early"]["period_s"]}
    return cost


TRAINED_COLUMNS = ("trajectory_id", "task_id", "prompt_ids", "completion_ids", "action_mask", "logprobs", "reward",
                   "termination_reason", "min_policy_version", "logprob_kind", "sampling")
"""The columns of the trained rollouts that :func:`sampled_surprise` and :func:`critic_off_path` read."""


@dataclasses.dataclass(frozen=True)
class TrainedWindows:
    """A demo run's rollouts trained in its first and its last :data:`FIT_STEPS` steps, read once from its
    lake (:data:`TRAINED_COLUMNS`) for the figures that look at them."""

    run: Any
    """The demo run (:func:`_demo_run`)."""
    last_version: int
    """The policy version the run's last step made (0: it trained no step)."""
    rows: dict[str, list[dict[str, Any]]]
    """``"first"`` and ``"last"``: the rows of each window; empty when the run trained no step."""


def _windows(steps: list[dict[str, Any]]) -> tuple[tuple[str, list[dict[str, Any]]], ...]:
    """``steps`` (in step order) cut into the windows of :class:`TrainedWindows`: none when there are none."""
    return (("first", steps[:FIT_STEPS]), ("last", steps[-FIT_STEPS:])) if steps else ()


def trained_windows(workdir: Path) -> TrainedWindows:
    """The trained rollouts of the demo run of ``workdir``, early and late (:class:`TrainedWindows`)."""
    from sao.lake.reader import read_trajectories
    from sao.lake.store import Lake

    run = _demo_run(workdir)
    lake = Lake.open(str(workdir / "lake"))
    steps = _steps(workdir, ["trajectory_ids"])
    rows = {}
    for label, chosen in _windows(steps):
        ids = [tid for step in chosen for tid in step["trajectory_ids"]]
        rows[label] = read_trajectories(lake, run_id=run.run_id, columns=TRAINED_COLUMNS,
                                        trajectory_ids=ids).to_pylist()
    return TrainedWindows(run, steps[-1]["step"] + 1 if steps else 0, rows)


def _succeeded(row: dict[str, Any]) -> bool:
    """Whether a demo rollout solved its task: the demo's reward is 1 for a right answer."""
    return row["reward"] >= 1.0


def sampled_surprise(windows: TrainedWindows) -> dict[str, dict[str, Any]] | None:
    """The mean of ``-log p`` over the action tokens of the rollouts trained in the run's first and last
    :data:`FIT_STEPS` steps (``first``, ``last``), p being the probability the engine recorded for the
    token it sampled: over every such token (``all``) and over the successful and the failed rollouts'
    apart. Sampled at temperature 1 from the policy itself (``logprob_kind`` "sampling" at T=1, as the
    demo samples), it estimates the policy's entropy per token where it went: what sampling at T=1 risks
    at each token, a wrong digit among it. None: the run trained no step, or sampled otherwise."""
    if not windows.rows:
        return None
    out = {}
    for label, rows in windows.rows.items():
        if any(row["logprob_kind"] != "sampling" or row["sampling"]["temperature"] != 1.0 for row in rows):
            return None
        sums = {"all": [0.0, 0], "succeeded": [0.0, 0], "failed": [0.0, 0]}
        for row in rows:
            taken = [-lp for lp, act in zip(row["logprobs"], row["action_mask"], strict=True) if act]
            for key in ("all", "succeeded" if _succeeded(row) else "failed"):
                sums[key][0] += sum(taken)
                sums[key][1] += len(taken)
        out[label] = {key: (total / count if count else None) for key, (total, count) in sums.items()}
        out[label]["rollouts"] = len(rows)
    return out


def critic_off_path(windows: TrainedWindows) -> dict[str, dict[str, Any]] | None:
    """How the critic's value moves where the run's failed rollouts leave their demonstration's path
    (for a digit copied wrongly, at that digit; :func:`sao.train.oracle.value_steps_off_path`), early
    and late: ``first``, the critic of version 0 (after value pretraining) on the failed rollouts
    trained in the first :data:`FIT_STEPS` steps; ``last``, the run's last critic on those of its last
    :data:`FIT_STEPS`. Beside the critic's, the demonstration oracle's figures under the policy of the
    same version (:class:`sao.train.oracle.DemonstrationOracle`): the step a critic that places the
    error would take. None: the run trained no step, or kept no critic (an algorithm without one)."""
    from sao.models.critic import load_critic
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.train.checkpoint import critic_dir, policy_dir
    from sao.train.oracle import DemonstrationOracle, value_steps_off_path

    root = windows.run.checkpoint_root
    versions = {"first": 0, "last": windows.last_version}
    if not windows.rows or not all(critic_dir(root, version).is_dir() for version in versions.values()):
        return None
    tokenizer = load_tokenizer(policy_dir(root, 0))
    out = {}
    for label, rows in windows.rows.items():
        version = versions[label]
        failed = [row for row in rows if not _succeeded(row)]
        oracle = DemonstrationOracle(load_policy(policy_dir(root, version)), tokenizer)
        out[label] = {"version": version, **value_steps_off_path(load_critic(critic_dir(root, version)), oracle,
                                                                 failed, oracle_too=True)}
    return out


def _off_path(run: dict[str, Any], critic: bool = True) -> str:
    """The critic's value step at the first token off the path, and on the path before it, early / late."""
    if not critic:
        return "no critic"
    steps = run.get("critic_off_path")
    if not steps:
        return "not recorded"

    def part(key: str, prefix: str = "") -> str:
        off, on = steps[key].get(f"{prefix}step_off_path"), steps[key].get(f"{prefix}step_on_path")
        return "-" if off is None else f"{off:+.3f} ({'-' if on is None else f'{on:+.3f}'})"

    text = f"{part('first')} / {part('last')}"
    if "oracle_step_off_path" in steps["last"]:
        text += f" (oracle's {part('first', 'oracle_')} / {part('last', 'oracle_')})"
    return text


def _surprise(run: dict[str, Any]) -> str:
    """The sampled tokens' mean surprise early / late, and late by outcome (:func:`sampled_surprise`)."""
    figures = run.get("sampled_surprise")
    if not figures:
        return "not recorded"

    def value(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    last = figures["last"]
    return (f"{value(figures['first']['all'])} / {value(last['all'])} "
            f"({value(last['succeeded'])} / {value(last['failed'])})")


def _algorithm(record: dict[str, Any]) -> str:
    """The algorithm the record's runs trained with: the demo config's unless a ``--set`` names another."""
    from sao.config import demo_config, parse_set

    names = [value for key, value in map(parse_set, record["sets"]) if key == "algorithm.name"]
    return str(names[-1]) if names else demo_config().algorithm.name.value


def _fit(run: dict[str, Any], critic: bool = True) -> str:
    """The critic's fit, and the oracle's beside it; "not recorded" for a run whose steps did not report it."""
    fit = run.get("critic_fit") or {}
    if not critic:
        return "no critic"
    if "critic/explained_variance" not in fit:
        return "not recorded"
    text = "{first:.2f} / {last:.2f}".format(**fit["critic/explained_variance"])
    if "oracle/explained_variance" in fit:
        text += " (oracle's {first:.2f} / {last:.2f})".format(**fit["oracle/explained_variance"])
    return text


def _pretraining(run: dict[str, Any]) -> str:
    report = run.get("value_pretraining")
    if not report:
        return "none"
    explained = report["explained_variance_after"]
    return f"{report['num_train'] + report['num_heldout']} / {'-' if explained is None else f'{explained:.3f}'}"


def _markdown(record: dict[str, Any], name: str) -> str:
    runs, summary = record["runs"], record["summary"]
    first = runs[0]["result"]
    tag = f" ({record['tag']})" if record.get("tag") else ""
    met = {"accuracy": summary["accuracy_after"]["median"] > TARGET_ACCURACY,
           "rise": summary["rise"]["median"] >= TARGET_RISE, "wall": summary["wall_s"]["median"] < TARGET_WALL_S}
    sets = " with " + ", ".join(f"`{s}`" for s in record["sets"]) if record["sets"] else ""
    from sao.train.config import UpdateConfig

    algorithm = _algorithm(record)
    critic = UpdateConfig(algorithm=algorithm).uses_critic
    lines = [
        f"## The demo (`sao bench demo`){tag}",
        "",
        f"Command: `{record['command']}` (runs `{record['demo_command']}` in an empty folder each time). "
        f"{machine_line(record['machine'])} Raw data: `{DEFAULT_JSON.with_name(name + '.json')}`.",
        "",
        f"{len(runs)} run(s) of the demo config{sets}{_seeds_text(record)}, one after another: {first['steps']} "
        f"{algorithm} steps each; held-out "
        f"sampled accuracy (T=1) on {first['eval_tasks']} tasks, with its standard error. The wall time is the "
        "command's, in an installed environment (`make demo` on a fresh clone creates the environment first). "
        "Targets (issue 24) judged on the median over the runs.",
        "",
        f"| run | version 0 | after training | rise | wall time (min) | of which {algorithm} training (min) | trajectories "
        "| failed after training: tool call / answer / structure | value pretraining: rollouts / held-out explained "
        f"variance | critic's explained variance in training, first / last {FIT_STEPS} steps | critic's value step "
        f"at a failed rollout's first token off the demonstration's path (on the path before it), first / last "
        f"{FIT_STEPS} steps | mean -log p of a sampled action token, first / last {FIT_STEPS} steps (of the "
        "successful / failed rollouts, last) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for index, run in enumerate(runs):
        r = run["result"]
        label = index + 1 if run.get("seed") is None else f"seed {run['seed']}"
        lines.append(f"| {label} | {r['accuracy_before']:.3f} ± {r['stderr_before']:.3f} | "
                     f"{r['accuracy_after']:.3f} ± {r['stderr_after']:.3f} | "
                     f"{r['accuracy_after'] - r['accuracy_before']:+.3f} | {run['wall_s'] / 60:.1f} | "
                     f"{r['train_wall_s'] / 60:.1f} | {r['trajectories']} | {_failures(r)} | {_pretraining(run)} | {_fit(run, critic)} | "
                     f"{_off_path(run, critic)} | {_surprise(run)} |")
    lines += [
        "",
        "| target | median (min-max) | met |",
        "|---|---:|---|",
        f"| held-out accuracy after training > {TARGET_ACCURACY} | {spread_text(summary['accuracy_after'], '.3f', sep=' to ')} | "
        f"{'yes' if met['accuracy'] else 'NO'} |",
        f"| rise >= +{TARGET_RISE} | {spread_text(summary['rise'], '+.3f', sep=' to ')} | {'yes' if met['rise'] else 'NO'} |",
        f"| wall time < {TARGET_WALL_S / 60:.0f} min | {spread_text({k: v / 60 for k, v in summary['wall_s'].items()}, '.1f', sep=' to ')} min | "
        f"{'yes' if met['wall'] else 'NO'} |",
    ]
    for text in (_step_cost_text(runs), _reward_curve_text(runs)):
        if text:
            lines += ["", text]
    if record.get("against"):
        against = record["against"]
        error = "" if against["stderr"] is None else f" ± {against['stderr']:.3f} (standard error over the seeds)"
        lines += [
            "",
            f"Against `{against['file']}`, seed by seed (held-out accuracy after training, the same tasks and "
            f"evaluation seed): " + ", ".join(f"seed {p['seed']} {p['arm']:.3f} vs {p['base']:.3f} ({p['diff']:+.3f})"
                                              for p in against["pairs"])
            + f"; mean difference {against['mean_diff']:+.3f}{error}.",
        ]
    if record.get("reread"):
        again = record["reread"]
        lines += ["", f"Read again with `{again['command']}` (commit `{again['machine'].get('commit')}`): the runs are "
                  "as recorded; what it added or paired anew is above."]
    return "\n".join(lines)


def _step_cost_text(runs: list[dict[str, Any]]) -> str:
    """The trainer's step early and late (:func:`step_cost`), medians over the runs that recorded it."""
    costs = [run["step_cost"] for run in runs if run.get("step_cost")]
    if not costs:
        return ""

    def shown(key: str) -> str:
        first, last = (statistics.median(cost[label][key] for cost in costs) for label in ("first", "last"))
        return f"{first:.2f} s -> {last:.2f} s"

    ratios = [cost["last"]["period_s"] / cost["first"]["period_s"] for cost in costs]
    text = (f"The trainer's step, steps 1-{FIT_STEPS} -> the last {FIT_STEPS} (medians over "
            f"{len(costs)} run(s)): period {shown('period_s')} (late over early "
            f"{spread_text(median_spread(ratios), '.2f', sep=' to ')}); waiting for its batch (`wait_read_s`: "
            f"rollouts to arrive, then the lake's commit and read) {shown('wait_read_s')}; update {shown('update_s')}.")
    flats = [cost["flat"] for cost in costs if "flat" in cost]  # a record from before it was recorded has none
    if len(flats) == len(costs):
        from benchmarks.long_run import TARGET_RATIO

        (early_lo, early_hi), (late_lo, late_hi) = (flats[0][name]["steps"] for name in ("early", "late"))
        text += (f" Over the flat-cost target's windows (`sao bench longrun`'s: steps {early_lo}-{early_hi - 1} "
                 f"against {late_lo}-{late_hi - 1}), the period late over early: "
                 f"{spread_text(median_spread([flat['ratio'] for flat in flats]), '.3f', sep=' to ')} (target at "
                 f"most {TARGET_RATIO:.2f}).")
    return text


def _reward_curve_text(runs: list[dict[str, Any]]) -> str:
    """Each run's learning curve on its training tasks (:func:`reward_curve`), part by part."""
    curves = [(index, run) for index, run in enumerate(runs) if run.get("reward_curve")]
    if not curves:
        return ""

    def label(index: int, run: dict[str, Any]) -> str:
        return f"run {index + 1}" if run.get("seed") is None else f"seed {run['seed']}"

    shown = "; ".join(f"{label(index, run)}: " + ", ".join(
        f"{part['reward']:.2f} ({part['steps'][0]}-{part['steps'][1] - 1})" for part in run["reward_curve"])
        for index, run in curves)
    return (f"The share of its training batches' rollouts that solved their task (sampled at T=1, policies at most "
            f"`max_staleness` versions behind; the mean of `batch/reward_mean`), over each of {CURVE_PARTS} "
            f"consecutive parts of the run's steps (steps in brackets): {shown}.")


def _seeds_text(record: dict[str, Any]) -> str:
    if not record.get("seeds"):
        return " (repeats of one seed)"
    return (f", one per seed ({', '.join(map(str, record['seeds']))}: `seed` and `sft.seed`; every run evaluated "
            f"with `eval.seed={EVAL_SEED}`)")


def _failures(result: dict[str, Any]) -> str:
    """The failed held-out episodes after training by class (:func:`sao.envs.math_tool.failure_class`),
    as a share of the tasks; a run recorded before they were counted has none."""
    failures = result.get("failures_after") or {}
    if not failures:
        return "not recorded"
    return " / ".join(f"{failures[kind] / result['eval_tasks']:.1%}" for kind in ("tool_call", "answer", "structure"))


def paired(base: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seed by seed, the held-out accuracy after training of ``runs`` minus that of the same seed in
    ``base`` (another record of seeded runs, evaluated with the same ``eval.seed``): the differences,
    their mean and the standard error of the mean over the seeds (None below two seeds).

    Raises:
        ValueError: ``base`` has no run of some seed of ``runs``, or its runs were evaluated on other
            tasks or with another evaluation seed.
    """
    by_seed = {run.get("seed"): run["result"] for run in base["runs"]}
    pairs = []
    for run in runs:
        seed, ours = run["seed"], run["result"]
        theirs = by_seed.get(seed)
        if seed is None or theirs is None:
            raise ValueError(f"the base record has no run of seed {seed} (its seeds: {sorted(map(str, by_seed))})")
        evaluated = [(r["eval_tasks"], r["settings"]["eval"].get("seed")) for r in (theirs, ours)]
        if evaluated[0] != evaluated[1]:
            raise ValueError(f"seed {seed}: evaluated as (tasks, eval.seed) {evaluated[1]} here but {evaluated[0]} "
                             "in the base record: the accuracies do not pair")
        pairs.append({"seed": seed, "base": theirs["accuracy_after"], "arm": ours["accuracy_after"],
                      "diff": ours["accuracy_after"] - theirs["accuracy_after"]})
    diffs = [pair["diff"] for pair in pairs]
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {"pairs": pairs, "mean_diff": statistics.fmean(diffs), "stderr": stderr}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max over the runs of the accuracy after training, the rise and the wall time."""
    return {
        "accuracy_after": median_spread([run["result"]["accuracy_after"] for run in runs]),
        "rise": median_spread([run["result"]["accuracy_after"] - run["result"]["accuracy_before"] for run in runs]),
        "wall_s": median_spread([run["wall_s"] for run in runs]),
    }


def reread(record_path: Path, workdir: Path | None, argv: list[str]) -> dict[str, Any]:
    """``record_path``'s record with what its runs' folders under ``workdir`` (``run-1``, ...) hold added
    where it is missing (value pretraining, the critic's fit and its step off the path, the sampled
    tokens' surprise, the step's cost early and late, the learning curve on the training tasks), for a record
    written before they were; ``workdir`` None: the record as it is (only paired again)."""
    record = json.loads(record_path.read_text())
    for index, run in enumerate(record["runs"] if workdir is not None else ()):
        folder = workdir / f"run-{index + 1}"
        if not (folder / "runs").is_dir():
            raise FileNotFoundError(f"{folder} holds no run: --reread needs the folder the record's runs ran in")
        if run.get("value_pretraining") is None:
            run["value_pretraining"] = value_pretraining(folder)
        if run.get("critic_fit") is None:
            run["critic_fit"] = critic_fit(folder)
        if run.get("step_cost") is None or "flat" not in run["step_cost"]:
            cost = step_cost(folder)  # what the record lacks added, what it holds kept
            run["step_cost"] = None if cost is None else {**cost, **(run.get("step_cost") or {})}
        if run.get("reward_curve") is None:
            run["reward_curve"] = reward_curve(folder)
        if run.get("critic_off_path") is None or run.get("sampled_surprise") is None:
            windows = trained_windows(folder)
            if run.get("critic_off_path") is None:
                run["critic_off_path"] = critic_off_path(windows)
            if run.get("sampled_surprise") is None:
                run["sampled_surprise"] = sampled_surprise(windows)
    record["reread"] = {"command": " ".join(["sao bench demo", *argv]), "machine": machine()}
    return record


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.compare is not None:
        from benchmarks import demo_compare

        return demo_compare.main(args.against, args.compare, f"demo-{args.tag}", argv, out=args.out_json,
                                 results_md=args.results_md)
    if args.reread is not None:
        record = reread(args.reread, args.workdir, argv)
        if args.against is not None:
            record["against"] = {"file": str(args.against), **paired(args.base, record["runs"])}
        name = f"demo-{record['tag']}" if record.get("tag") else "demo"
        publish(name, record, _markdown(record, name), out=args.out_json, results_md=args.results_md, quick=False,
                default_json=args.reread, default_results=DEFAULT_RESULTS)
        return 0
    machine_info = machine()  # the commit and the load before the run, not after it
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sao-bench-demo-"))
    seeds = args.seeds or [None] * args.runs
    runs = []
    for index, seed in enumerate(seeds):
        folder = workdir / f"run-{index + 1}"
        print(f"sao bench demo: run {index + 1} of {len(seeds)}{'' if seed is None else f' (seed {seed})'} in "
              f"{folder} (about 6-10 minutes on 2 cores) ...", file=sys.stderr)
        result, wall_s = run_demo(folder, run_sets(args.sets, seed))
        result.pop("summary", None)
        windows = trained_windows(folder)
        runs.append({"wall_s": wall_s, "seed": seed, "result": result, "value_pretraining": value_pretraining(folder),
                     "critic_fit": critic_fit(folder), "critic_off_path": critic_off_path(windows),
                     "sampled_surprise": sampled_surprise(windows), "step_cost": step_cost(folder),
                     "reward_curve": reward_curve(folder)})
    name = f"demo-{args.tag}" if args.tag else "demo"
    shown = run_sets(args.sets, None if args.seeds is None else "S")
    record = {"machine": machine_info, "command": " ".join(["sao bench demo", *argv]), "tag": args.tag,
              "demo_command": "sao demo" if not shown else "sao train --config configs/demo.yaml "
              + " ".join(f"--set {s}" for s in shown), "sets": args.sets, "seeds": args.seeds, "runs": runs,
              "summary": summarise(runs)}
    if args.against is not None:
        record["against"] = {"file": str(args.against), **paired(args.base, runs)}
    publish(name, record, _markdown(record, name), out=args.out_json, results_md=args.results_md, quick=args.quick,
            default_json=DEFAULT_JSON.with_name(f"{name}.json"), default_results=DEFAULT_RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
