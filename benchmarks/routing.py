"""Benchmark: MoE routing replay (R3) at high staleness. Two SAO runs on math_tool from the SFT
checkpoint, identical but for ``UpdateConfig.routing_replay``, report routing disagreement (per layer and
staleness), the DIS kept fraction with and without replay, and learning curves.

    sao bench routing [--steps 300] [--batch 16] [--staleness 8] [--sft PATH] [--quick]

Staleness is imposed, not left to timing: at trainer version v the torch engine serves the weights of
version ``max(0, v - staleness)``, so after the first ``staleness`` steps every batch was sampled
``staleness`` versions ago (the asynchronous worst case of ``max_staleness``, without Ray or the lake:
engine -> agent loop -> ``TrajectoryRecord.to_row()`` -> ``collate`` -> ``Learner.update``, the trainer's
own functions). Both arms see the same tasks and seeds; each step reports both kept fractions
(``routing/kept_frac_replay`` and ``routing/kept_frac_live``: one extra no-grad forward). The learning
curve is the mean reward of each step's batch (sampled by version v - staleness). Writes
``docs/results/routing.json``, ``docs/results/routing.png`` and the ``routing`` section of
``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, save_figure, update_section, write_json

DEFAULT_SFT = Path("runs/bench/bench-learning/sft")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench routing", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--staleness", type=int, default=8)
    parser.add_argument("--lr-policy", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", type=Path, default=None,
                        help=f"version-0 policy (default: {DEFAULT_SFT} if present, else an SFT warm start)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the tests (random policy, 3 steps; writes under --workdir only)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    return parser.parse_args(argv)


def _policy_dir(args: argparse.Namespace, workdir: Path) -> Path:
    from benchmarks._settings import bench_config
    from sao import runs
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    if args.quick:
        path = workdir / "random-policy"
        if not (path / "config.json").exists():
            save_policy(build_policy(seed=0), path, build_tokenizer())
        return path
    if args.sft is not None:
        return args.sft
    if (DEFAULT_SFT / "config.json").exists():
        return DEFAULT_SFT
    return runs.warm_start(bench_config(run_id="bench-routing", workdir=str(workdir)))


def run_arm(policy_dir: Path, replay: bool, args: argparse.Namespace) -> list[dict[str, float]]:
    """One run; the metrics of every step (``Learner.update``'s, plus ``step``)."""
    import torch

    from sao import runs
    from sao.envs import make_env
    from sao.envs.base import Split
    from sao.models.critic import Critic
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.rollout.agent import AgentConfig, AgentLoop
    from sao.rollout.torch_engine import TorchEngine
    from sao.train.batch import collate
    from sao.train.config import UpdateConfig
    from sao.train.step import Learner

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(policy_dir)
    policy = load_policy(policy_dir)
    learner = Learner(UpdateConfig(routing_replay=replay, routing_compare_every=1, lr_policy=args.lr_policy), policy,
                      Critic.from_policy(policy))
    history = {0: {k: v.detach().clone() for k, v in policy.state_dict().items()}}
    engine = TorchEngine(load_policy(policy_dir), version=0)
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env), AgentConfig(max_tokens=96, max_turns=4))
    tasks = runs.math_tasks(Split.TRAIN)
    steps: list[dict[str, float]] = []
    try:
        for step in range(args.steps):
            behaviour = max(0, step - args.staleness)
            if engine.version != behaviour:
                engine.load_weights(behaviour, history.pop(behaviour))
                engine.wait_for_version(behaviour)
            chosen = [tasks[(step * args.batch + i) % len(tasks)] for i in range(args.batch)]

            async def roll(chosen=chosen, step=step):
                return await asyncio.gather(*[loop.run(t, run_id="bench-routing", seed=step * 1000 + i)
                                              for i, t in enumerate(chosen)])

            rows = [r.to_row() for r in asyncio.run(roll())]
            metrics = learner.update(collate(rows, trainer_version=step))
            history[step + 1] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            steps.append({"step": float(step)} | metrics)
            print(f"[replay={replay}] step {step}: reward {metrics['batch/reward_mean']:.3f} "
                  f"disagree {metrics.get('routing/disagree_frac', float('nan')):.4f} "
                  f"kept replay {metrics.get('routing/kept_frac_replay', float('nan')):.3f} "
                  f"live {metrics.get('routing/kept_frac_live', float('nan')):.3f}", file=sys.stderr, flush=True)
    finally:
        engine.close()
        loop.close()
    return steps


def _mean(steps: list[dict[str, float]], key: str, since: int = 0) -> float:
    values = [s[key] for s in steps[since:] if key in s]
    return statistics.fmean(values) if values else float("nan")


def _by_prefix(steps: list[dict[str, float]], prefix: str, since: int) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s if k.startswith(prefix)}, key=lambda k: int(k.rsplit("_", 1)[1]))
    return {k.rsplit("_", 1)[1]: _mean(steps, k, since) for k in keys}


def plot(arms: dict[str, list[dict[str, float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for label, steps in arms.items():
        x = [s["step"] for s in steps]
        axes[0].plot(x, [s["batch/reward_mean"] for s in steps], label=label)
        axes[1].plot(x, [s.get("routing/disagree_frac", float("nan")) for s in steps], label=label)
        axes[2].plot(x, [s.get("actor/kept_frac", float("nan")) for s in steps], label=f"{label} (the update's)")
    axes[0].set(title="batch reward (sampled at v - staleness)", xlabel="step")
    axes[1].set(title="routing disagreement (recomputed vs recorded)", xlabel="step")
    axes[2].set(title="DIS kept fraction", xlabel="step")
    for ax in axes:
        ax.legend(fontsize=8)
    return save_figure(figure, path)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    if args.quick:
        args.steps, args.batch, args.staleness = 3, 2, 1
    workdir = args.workdir
    started = time.monotonic()
    policy_dir = _policy_dir(args, workdir)
    arms = {"replay": run_arm(policy_dir, True, args), "live routing": run_arm(policy_dir, False, args)}
    since = min(args.staleness, args.steps - 1)  # from the first step at full staleness
    summary: dict[str, Any] = {}
    for label, steps in arms.items():
        summary[label] = {
            "disagree_frac": _mean(steps, "routing/disagree_frac", since),
            "disagree_by_layer": _by_prefix(steps, "routing/disagree_frac/layer_", since),
            "disagree_by_staleness": _by_prefix(steps, "routing/disagree_frac/staleness_", 0),
            "kept_frac_replay": _mean(steps, "routing/kept_frac_replay", since),
            "kept_frac_live": _mean(steps, "routing/kept_frac_live", since),
            "kept_frac_update": _mean(steps, "actor/kept_frac", since),
            "reward_mean": _mean(steps, "batch/reward_mean", since),
            "reward_first10": _mean(steps[:10], "batch/reward_mean"),
            "reward_last10": _mean(steps[-10:], "batch/reward_mean"),
        }
    figure = plot(arms, workdir / "routing-quick.png" if args.quick else args.out / "routing.png")
    record = {"machine": machine_info, "command": " ".join(["sao bench routing", *argv]), "policy": str(policy_dir),
              "steps": args.steps, "batch": args.batch, "staleness": args.staleness, "lr_policy": args.lr_policy,
              "wall_s": time.monotonic() - started, "summary": summary, "arms": arms}
    markdown = _markdown(record, figure)
    print(markdown)
    if args.quick:
        write_json(workdir / "routing-quick.json", record)
    else:
        write_json(args.out / "routing.json", record)
        update_section(args.results_md, "routing", markdown)
    return 0


def _reading(rep: dict[str, Any], live: dict[str, Any]) -> str:
    """Plain sentences on what the numbers show (computed, so they cannot drift from them)."""
    kept_gain = rep["kept_frac_replay"] - rep["kept_frac_live"]
    reward_gap = rep["reward_mean"] - live["reward_mean"]
    verdict = "changes what DIS keeps" if abs(kept_gain) > 0.01 else "does not measurably change what DIS keeps"
    return (f"Reading: at this scale replay {verdict}: within the replay run the kept fraction is "
            f"{rep['kept_frac_replay']:.4f} with routing replayed and {rep['kept_frac_live']:.4f} recomputed live "
            f"({kept_gain:+.4f}), although {rep['disagree_frac']:.1%} of recorded token-layer routings differ from "
            f"the recomputed ones. What DIS masks comes from the policy's change over the staleness window. The "
            f"mean batch reward over the full-staleness steps differs by {reward_gap:+.3f} between the runs "
            f"({rep['reward_mean']:.3f} vs {live['reward_mean']:.3f}); that is one seed per arm, not evidence "
            f"either way.")


def _markdown(record: dict[str, Any], figure: Path) -> str:
    s = record["summary"]
    rep, live = s["replay"], s["live routing"]
    layers = ", ".join(f"layer {k} {v:.4f}" for k, v in rep["disagree_by_layer"].items())
    staleness = ", ".join(f"{k}: {v:.4f}" for k, v in rep["disagree_by_staleness"].items())
    lines = [
        "## MoE routing replay at high staleness (`sao bench routing`)", "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])}", "",
        f"Two SAO runs from `{record['policy']}`, {record['steps']} steps of {record['batch']} math_tool "
        f"trajectories, every batch sampled {record['staleness']} versions behind the trainer (imposed), policy "
        f"lr {record['lr_policy']:g}; identical but for `routing_replay`. Wall {record['wall_s']:.0f} s. Means "
        f"over the steps at full staleness.", "",
        "| | replay on | replay off (live routing) |", "|---|---:|---:|",
        f"| routing disagreement (recomputed top-k != recorded) | {rep['disagree_frac']:.4f} | "
        f"{live['disagree_frac']:.4f} |",
        f"| DIS kept fraction, routing replayed | {rep['kept_frac_replay']:.4f} | {live['kept_frac_replay']:.4f} |",
        f"| DIS kept fraction, routing live | {rep['kept_frac_live']:.4f} | {live['kept_frac_live']:.4f} |",
        f"| DIS kept fraction of the update | {rep['kept_frac_update']:.4f} | {live['kept_frac_update']:.4f} |",
        f"| batch reward, mean over the full-staleness steps | {rep['reward_mean']:.3f} | {live['reward_mean']:.3f} |",
        f"| batch reward, first 10 steps | {rep['reward_first10']:.3f} | {live['reward_first10']:.3f} |",
        f"| batch reward, last 10 steps | {rep['reward_last10']:.3f} | {live['reward_last10']:.3f} |", "",
        f"Disagreement by layer (replay arm): {layers}. By staleness (replay arm, all steps): {staleness}.", "",
        _reading(rep, live), "",
        f"![routing replay]({figure.relative_to(Path('docs')) if figure.is_relative_to('docs') else figure})",
    ]
    return "\n".join(lines)
