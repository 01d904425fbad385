"""Benchmark: SFT warm start of the tiny policy on math_tool, then its held-out sampled accuracy.

    sao bench sft [--seeds 0,1,2] [--eval-tasks 1000] [--out runs/bench/sft_warmstart]

For each seed: :func:`sao.train.sft.sft_warm_start` with the default :class:`~sao.train.sft.SFTConfig`
(timed end to end: tokenizer, policy, demonstrations, training, saving), then
:func:`sao.train.evaluate.evaluate_math` on the held-out split at temperature 1 (the policy's own
distribution, the figure the issue asks for) and near-greedy (temperature 1e-4, what sharpening could
reach). Results go to ``<out>/results.json`` and a markdown table on stdout.

Targets (exit status 1 if a seed misses one): SFT under 240 s, sampled accuracy in [0.2, 0.7].
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

TARGET_WALL_S = 240.0
TARGET_ACCURACY = (0.2, 0.7)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench sft", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0", help="comma-separated SFT seeds (default: 0)")
    parser.add_argument("--eval-tasks", type=int, default=1000, help="held-out tasks evaluated (default: 1000)")
    parser.add_argument("--out", default="runs/bench/sft_warmstart", help="output directory")
    parser.add_argument("--target-success", type=float, default=None, help="override SFTConfig.target_success")
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds or args.eval_tasks < 1:
        parser.error("need at least one seed and --eval-tasks >= 1")
    return args


def main(argv: list[str]) -> int:
    start = time.monotonic()
    args = _parse(argv)
    import dataclasses

    import torch
    import transformers

    from sao.envs.base import Split
    from sao.envs.math_tool import ensure_dataset, generate_tasks
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.train.evaluate import EvalConfig, evaluate_math
    from sao.train.sft import SFTConfig, sft_warm_start

    transformers.utils.logging.disable_progress_bar()
    import_s = time.monotonic() - start
    out = Path(args.out)
    dataset = out / "math_tool.jsonl"  # the task file the rollout side reads (default config, all seeds)
    ensure_dataset(SFTConfig().math, dataset)
    rows = []
    for seed in args.seeds:
        config = SFTConfig(seed=seed)
        if args.target_success is not None:
            config = dataclasses.replace(config, target_success=args.target_success)
        load_before = os.getloadavg()[0]
        result = sft_warm_start(config, out / f"seed{seed}" / "policy")
        heldout = [t for t in generate_tasks(config.math) if t.split is Split.HELDOUT]
        model, tokenizer = load_policy(result.path), load_tokenizer(result.path)
        sampled = evaluate_math(model, tokenizer, heldout, EvalConfig(num_tasks=args.eval_tasks, temperature=1.0, seed=seed))
        greedy = evaluate_math(model, tokenizer, heldout, EvalConfig(num_tasks=args.eval_tasks, temperature=1e-4, seed=seed))
        row = {
            "seed": seed,
            "sft_wall_s": round(result.wall_s, 1),
            "sft_train_s": round(result.train_s, 1),
            "steps": result.steps,
            "reached_target": result.reached_target,
            "validation_success": round(result.success, 3),
            "tokens_per_s": round(result.tokens / result.train_s),
            "heldout_tasks": sampled.num_tasks,
            "accuracy_t1": round(sampled.accuracy, 3),
            "accuracy_t1_stderr": round(sampled.stderr, 3),
            "accuracy_greedy": round(greedy.accuracy, 3),
            "mean_tool_calls_t1": round(sampled.mean_tool_calls, 3),
            "terminations_t1": sampled.terminations,
            "eval_wall_s": round(sampled.wall_s, 1),
            "loadavg_1m_before": round(load_before, 2),
            "path": str(result.path),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "benchmark": "sft_warmstart",
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "import_s": round(import_s, 1),
        "dataset": str(dataset),
        "total_s": round(time.monotonic() - start, 1),
        "config": {"target_success": SFTConfig().target_success if args.target_success is None else args.target_success},
        "runs": rows,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n| seed | SFT wall (s) | steps | val. success | held-out acc. T=1 (± s.e.) | near-greedy acc. | tool calls |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['sft_wall_s']} | {r['steps']} | {r['validation_success']} | "
              f"{r['accuracy_t1']} ± {r['accuracy_t1_stderr']} | {r['accuracy_greedy']} | {r['mean_tool_calls_t1']} |")
    misses = [r["seed"] for r in rows
              if r["sft_wall_s"] > TARGET_WALL_S or not TARGET_ACCURACY[0] <= r["accuracy_t1"] <= TARGET_ACCURACY[1]]  # fmt: skip
    if misses:
        print(f"\nmissed a target (SFT <= {TARGET_WALL_S:g} s, accuracy in {list(TARGET_ACCURACY)}) for seeds {misses}")
        return 1
    print(f"\nall seeds within targets; results in {out / 'results.json'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main(sys.argv[1:]))
