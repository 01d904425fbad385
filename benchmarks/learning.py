"""Benchmark: does asynchronous training raise held-out accuracy? One run on math_tool from an SFT
checkpoint, with held-out sampled accuracy (temperature 1) at chosen policy versions.

    sao bench learning [--steps 250] [--evals 100,150,200] [--lr-policy 2e-4] [--batch 32] [--quick]

The run goes through the real pipeline (Serve rollouts -> Delta -> trainer -> weights; the trainer in
this process unless --ray-train). The SFT warm start is made once per seed under --workdir and reused.
Writes ``docs/results/learning-<run>.json`` and the ``learning`` section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, update_section, write_json


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench learning", description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", default="bench-learning")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--evals", default="100,150,200", help="versions evaluated besides 0 and the last")
    parser.add_argument("--lr-policy", type=float, default=None, help="default: the demo config's algorithm.lr_policy")
    parser.add_argument("--batch", type=int, default=None, help="default: the demo config's train.batch_size")
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--aggregation", choices=["token", "sequence"], default="token")
    parser.add_argument("--eval-tasks", type=int, default=300)
    parser.add_argument("--workdir", default="runs/bench")
    parser.add_argument("--ray-train", action="store_true", help="train on Ray Train workers")
    parser.add_argument("--quick", action="store_true", help="tiny run for the tests (random policy, 2 steps)")
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    args = parser.parse_args(argv)
    args.evals = [int(v) for v in args.evals.split(",") if v.strip()]
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    from benchmarks._settings import bench_config, with_settings
    from sao import runs
    from sao.envs.base import Split
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer
    from sao.pipeline import run_pipeline
    from sao.train.config import UpdateConfig

    base = bench_config()
    settings = with_settings(
        base, run_id=args.run_id, workdir=args.workdir, lake_root=str(Path(args.workdir) / args.run_id / "lake"),
        steps=2 if args.quick else args.steps, batch_size=4 if args.quick else (args.batch or base.train.batch_size),
        lr_policy=args.lr_policy or base.algorithm.lr_policy, eval_tasks=4 if args.quick else args.eval_tasks,
        max_staleness=base.train.max_staleness if args.max_staleness is None else args.max_staleness,
        num_replicas=1 if args.quick else base.rollout.num_replicas, max_in_flight=8 if args.quick else base.rollout.max_in_flight)
    started = time.monotonic()
    if args.quick and not settings.sft_dir.exists():
        save_policy(build_policy(seed=0), settings.sft_dir, build_tokenizer())
    print("warm start ...", file=sys.stderr)
    policy = runs.warm_start(settings)
    sft_s = time.monotonic() - started
    config = runs.pipeline_config(settings, policy)
    update: UpdateConfig = dataclasses.replace(config.train.update, aggregation=args.aggregation)
    config = dataclasses.replace(config, use_ray_train=args.ray_train,
                                 train=dataclasses.replace(config.train, update=update))

    def show(report) -> None:
        m = report.metrics
        print(f"step {report.step}: reward {m.get('batch/reward_mean', 0):.3f} kept {m.get('actor/kept_frac', 0):.3f} "
              f"staleness {m.get('batch/staleness_mean', 0):.2f}", file=sys.stderr, flush=True)

    result = run_pipeline(config, runs.math_tasks(Split.TRAIN), on_step=show)
    versions = sorted({0, result.version, *[v for v in args.evals if 0 < v < result.version]})
    evaluations = [runs.evaluate(settings, v) for v in versions]
    plots, _ = runs.summarize(settings, evaluations)
    record: dict[str, Any] = {
        "machine": machine_info, "command": " ".join(["sao bench learning", *argv]),
        "settings": settings.public(), "aggregation": args.aggregation,
        "sft_s": sft_s, "train_s": result.train_s, "wall_s": time.monotonic() - started,
        "trajectories_generated": result.driver.records, "steps": result.steps,
        "evaluations": [dataclasses.asdict(e) for e in evaluations], "plots": [str(p) for p in plots],
    }
    lines = [
        "## Learning on math_tool (`sao bench learning`)", "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])}", "",
        f"Settings: {settings.algorithm.name.value}, batch {settings.train.batch_size}, max staleness {settings.train.max_staleness}, "
        f"policy lr {settings.algorithm.lr_policy:g}, loss aggregation {args.aggregation}, {settings.rollout.num_replicas} rollout "
        f"replicas, {result.steps} steps; {result.driver.records} trajectories generated, trainer wall "
        f"{result.train_s:.0f} s.", "",
        "| policy version | held-out sampled accuracy (T=1) |", "|---:|---:|",
        *[f"| {e.version} | {e.accuracy:.3f} ± {e.stderr:.3f} |" for e in evaluations],
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if not args.quick:
        write_json(Path("docs/results") / f"learning-{args.run_id}.json", record)
        update_section(args.results_md, f"learning-{args.run_id}", markdown)
    return 0
