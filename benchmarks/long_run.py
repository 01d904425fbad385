"""Flat cost over long runs: the trainer's step period as the run's tables grow.

Run with ``sao bench longrun`` (``--quick`` for a smoke run). The real training loop
(:func:`sao.train.loop.run_training`: one worker in this process, the tiny policy built from code, the
run config's update and checkpoint-retention defaults) trains ``--steps`` steps on a local lake while a
producer process stores trajectories through :class:`sao.lake.TrajectoryWriter`,
``--commits-per-step`` commits per step as the pipeline's writer makes them (it flushes every 2 s: the
demo's ``trajectories`` had 385 files after 150 steps). The producer keeps two batches ahead of the
trainer, so the trainer never waits for rollouts:
every part of its step period is its own work (finding and reading the batch, the update, the
checkpoint, the ledger's commits, compaction). No Ray and no Serve: what grows with a run's length is the
lake's part, and that is what this isolates.

The figure is the ratio of the mean step period over the last 10% of the steps to that over steps
5-15% of the run (steps 50-150 of 1,000), per run, with the median, min and max over ``--runs`` runs.
Target: at most 1.10. Each timed part of the step is given over both windows, so a growth names its part.
The update reads nothing from the lake, so its own late/early ratio, given beside, shows how far the
machine's speed drifted between the windows.

Writes ``docs/results/long_run.json`` and the long-run section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, median_spread, update_section, write_json
from sao.config import demo_config
from sao.lake import Lake, LakeConfig, TrajectoryWriter, WriterConfig
from sao.lake.synthetic import make_trajectories
from sao.models.policy import build_policy, save_policy
from sao.models.tokenizer import build_tokenizer
from sao.train.config import TrainConfig
from sao.train.loop import StepReport, prepare_run, run_training
from schemas import train_steps, trajectories

RUN = "longrun"
TARGET_RATIO = 1.10
"""The flat-cost target: the late window's mean step period at most this times the early one's."""
SECTION = "long_run"
PARTS = ("wait_read_s", "read_s", "update_s", "commit_s")
"""The step's timed parts (the ``timings`` of its ``train_steps`` row); the rest of the period is the
version's row, retention, compaction and the loop itself."""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench longrun", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps, one run (a smoke run for tests).")
    parser.add_argument("--steps", type=int, default=1000, help="Steps per run.")
    parser.add_argument("--runs", type=int, default=3, help="Runs (the ratio's median, min and max).")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="Trajectories per step (small, so that the lake's share of the step is large).")
    parser.add_argument("--commits-per-step", type=int, default=4,
                        help="The producer's commits to `trajectories` per step (files per step).")
    parser.add_argument("--tokens", type=int, default=48, help="Completion tokens per trajectory.")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("docs/results/long_run.json"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.runs = 60, 1
    if args.steps < 20:
        parser.error("--steps must be at least 20 (two windows of 10% each)")
    if args.batch_size % args.commits_per_step:
        parser.error("--batch-size must be a multiple of --commits-per-step")
    return args


def _produce(lake_config: LakeConfig, batch: int, rows: int, tokens: int, prompt_tokens: int, ahead: int,
             steps_done, halt, commits) -> None:
    """The producer process: stores trajectories of the trainer's current version (``steps_done``),
    ``ahead`` batches ahead of it, in commits of ``rows`` (what the rollout driver's writer does, with
    the model's time taken out); each commit's seconds go to ``commits``."""
    lake = Lake.open(lake_config)
    produced = chunk = 0
    with TrajectoryWriter(lake, WriterConfig(flush_rows=rows, background_flush=False)) as writer:
        while not halt.is_set():
            done = steps_done.value
            if produced >= (done + ahead) * batch:
                time.sleep(0.002)
                continue
            records = make_trajectories(rows, seed=chunk, run_id=RUN, num_tokens=tokens,
                                        prompt_tokens=prompt_tokens, policy_versions=(done,))
            t0 = time.perf_counter()
            writer.add_many(records)
            commits.put(time.perf_counter() - t0)
            produced += rows
            chunk += 1
    commits.put(None)  # the end: the run drains the queue up to here before it joins this process


def run_once(root: Path, args: argparse.Namespace, index: int) -> dict[str, Any]:
    """One run in ``root``: per step, its period and timed parts."""
    policy_dir = root / "policy"
    tokenizer = build_tokenizer()
    save_policy(build_policy(seed=0), policy_dir, tokenizer, policy_version=0)
    demo = demo_config()
    cfg = TrainConfig(run_id=RUN, lake=LakeConfig(root=str(root / "lake")), checkpoint_root=str(root / "ckpt"),
                      policy_path=str(policy_dir), update=demo.update(), batch_size=args.batch_size,
                      max_staleness=demo.train.max_staleness, total_steps=args.steps, seed=index,
                      retention=demo.retention_config(), app_name=None, device="cpu", wait_timeout_s=120)
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    context = multiprocessing.get_context("spawn")
    steps_done, halt, commits = context.Value("i", 0), context.Event(), context.Queue()
    producer = context.Process(target=_produce, name="producer", daemon=True, args=(
        cfg.lake, args.batch_size, args.batch_size // args.commits_per_step, args.tokens, args.prompt_tokens, 2,
        steps_done, halt, commits))
    ends: list[float] = []
    started = time.perf_counter()

    def on_step(report: StepReport) -> None:
        ends.append(time.perf_counter())
        steps_done.value = report.step + 1
        if (report.step + 1) % max(1, args.steps // 10) == 0:
            recent = ends[-10:]
            period = (recent[-1] - recent[0]) / max(1, len(recent) - 1)
            print(f"  run {index}: step {report.step + 1}/{args.steps}, period {period:.3f} s "
                  f"(mean of the last 10)", flush=True)

    producer.start()
    commit_s: list[float] = []
    try:
        run_training(cfg, on_step=on_step)
        halt.set()
        # Drained before the join: a process exits only once what it put on a queue was read.
        while (seconds := commits.get(timeout=120)) is not None:
            commit_s.append(seconds)
    finally:
        halt.set()
        producer.join(timeout=60)
        if producer.is_alive():
            producer.kill()
    if producer.exitcode not in (0, None):
        raise RuntimeError(f"the producer process failed (exit {producer.exitcode}); see its output above")
    rows = sorted(lake.read(train_steps.NAME, columns=["step", "timings"],
                            predicate=f"run_id = '{RUN}'").to_pylist(), key=lambda r: r["step"])
    periods = [ends[0] - started] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
    files = len(lake.table(trajectories.NAME).file_uris(file_pruning_predicate=[("run_id", "=", RUN)]))
    return {"periods": periods, "timings": [dict(r["timings"] or {}) for r in rows], "writer_commit_s": commit_s,
            "commits_per_step": args.commits_per_step,
            "trajectories_files": files, "trajectories_versions": lake.version(trajectories.NAME) + 1,
            "train_steps_versions": lake.version(train_steps.NAME) + 1}


def flat_windows(steps: int) -> dict[str, tuple[int, int]]:
    """Steps [start, end) of the early window (5-15% of the run) and the late one (the last 10%): the
    flat-cost target's windows (steps 50-150 and 900-1000 of 1,000), which ``sao bench demo`` uses too."""
    return {"early": (steps * 5 // 100, steps * 15 // 100), "late": (steps - steps // 10, steps)}


def summarise(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """Mean period and parts over both windows, and the late/early ratio."""
    out: dict[str, Any] = {}
    for name, (lo, hi) in flat_windows(steps).items():
        window = {"steps": [lo, hi], "period_s": statistics.fmean(run["periods"][lo:hi])}
        for part in PARTS:
            window[part] = statistics.fmean(t.get(part, 0.0) for t in run["timings"][lo:hi])
        window["rest_s"] = window["period_s"] - sum(window[p] for p in PARTS)
        commits = run["writer_commit_s"][lo * run["commits_per_step"]:hi * run["commits_per_step"]]
        window["writer_commit_s"] = statistics.fmean(commits) if commits else None
        out[name] = window
    out["ratio"] = out["late"]["period_s"] / out["early"]["period_s"]
    out["update_ratio"] = out["late"]["update_s"] / out["early"]["update_s"] if out["early"]["update_s"] else None
    out["trajectories_files"] = run["trajectories_files"]
    out["trajectories_versions"] = run["trajectories_versions"]
    out["train_steps_versions"] = run["train_steps_versions"]
    return out


def _update_line(update: dict[str, float] | None) -> list[str]:
    """The update's own late/early ratio: it reads nothing from the lake, so it shows how far the
    machine's speed drifted between the windows."""
    if update is None:
        return []
    return [f"The update alone (no lake work in it; the machine's drift between the windows): late/early "
            f"{update['median']:.3f} (median; min {update['min']:.3f}, max {update['max']:.3f}).", ""]


def _markdown(result: dict[str, Any]) -> str:
    ratio = result["ratio"]
    verdict = "met" if ratio["median"] <= TARGET_RATIO else "**missed**"
    lines = [
        "## Flat cost over long runs (`sao bench longrun`)",
        "",
        f"Command: `{result['command']}`. {machine_line(result['machine'])}",
        "",
        f"The training loop in one process ({result['steps']} steps of {result['batch_size']} synthetic "
        f"trajectories, {result['commits_per_step']} commits to `trajectories` per step, a producer two "
        "batches ahead so the trainer never waits): the mean step period of the last 10% of the steps "
        f"over that of steps 5-15%: **{ratio['median']:.3f}** (median of {len(result['runs'])} runs; "
        f"min {ratio['min']:.3f}, max {ratio['max']:.3f}). Target at most {TARGET_RATIO:.2f}: {verdict}.",
        "",
        *_update_line(result.get("update_ratio")),
        "| run | window | steps | period (s) | " + " | ".join(PARTS) + " | rest (s) | files at the end |",
        "|---|---|---|---|" + "---|" * len(PARTS) + "---|---|",
    ]
    for index, run in enumerate(result["runs"]):
        for name in ("early", "late"):
            w = run[name]
            lines.append(f"| {index} | {name} | {w['steps'][0]}-{w['steps'][1] - 1} | {w['period_s']:.3f} | "
                         + " | ".join(f"{w[p]:.3f}" for p in PARTS)
                         + f" | {w['rest_s']:.3f} | {run['trajectories_files'] if name == 'late' else ''} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    info = machine()
    runs = []
    for index in range(args.runs):
        root = Path(tempfile.mkdtemp(prefix="sao-bench-longrun-"))
        try:
            print(f"run {index}: {args.steps} steps in {root}", flush=True)
            runs.append(summarise(run_once(root, args, index), args.steps))
            print(f"run {index}: late/early step period {runs[-1]['ratio']:.3f}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    ratios = [r["ratio"] for r in runs]
    updates = [r["update_ratio"] for r in runs if r["update_ratio"] is not None]
    result = {
        "command": "sao bench longrun" + (" " + " ".join(argv) if argv else ""),
        "machine": info,
        **{k: v for k, v in vars(args).items() if k not in ("out", "results_md", "quick")},
        "runs": runs,
        "ratio": median_spread(ratios),
        "update_ratio": median_spread(updates) if updates else None,
    }
    write_json(args.out, result)
    section = _markdown(result)
    update_section(args.results_md, SECTION, section)
    print(section)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
