"""Benchmark: what DIS masks, and the task mix that reaches the gradient, in an asynchronous SAO run at
high staleness.

    sao bench bias [--steps 120] [--batch 16] [--max-staleness 8] [--in-flight 96] [--quick]

One SAO run on math_tool from the SFT warm start (that of ``sao bench learning``, made if missing),
through the real pipeline (Serve rollouts -> Delta -> trainer in this process), with heavy-tailed tool
latency so that long trajectories (more turns, more tool calls) take longer and arrive staler: the
seed's warning. Everything is read back from the lake afterwards:

* DIS kept fraction of action tokens by staleness and by length bucket (``actor/kept_frac/...`` of every
  step, weighted by the tokens they cover);
* staleness at training by length bucket (from ``train_steps.trajectory_ids`` and
  ``policy_version_before`` joined with ``trajectories.min_policy_version``);
* the task mix at three points: trajectories generated, trajectories trained on, and action tokens
  DIS kept (what reaches the gradient), by length bucket and by number of turns; the shift is the
  difference between the generated share and the gradient share;
* trajectories generated but never trained on, by length (too stale when the trainer got to them, or
  still queued at the end).

Writes ``docs/results/bias.json``, ``docs/results/bias.png`` and the ``bias`` section of
``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, save_figure, update_section, write_json
from benchmarks.speed import DEFAULT_SFT, policy_dir


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench bias", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-staleness", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=96)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--lr-policy", type=float, default=4e-4,
                        help="higher than the demo's so the policy moves within the staleness window")
    parser.add_argument("--tool-median-s", type=float, default=0.5)
    parser.add_argument("--tool-sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", type=Path, default=None,
                        help=f"version-0 policy (default: {DEFAULT_SFT} if present, else an SFT warm start)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/bias"))
    parser.add_argument("--quick", action="store_true", help="tiny run for the tests (random policy, 3 steps)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.in_flight, args.replicas, args.max_staleness = 3, 4, 12, 1, 2
        args.tool_median_s = 0.02
    return args


def length_label(tokens: int) -> str:
    """The trainer's length bucket of a trajectory with ``tokens`` action tokens (the suffix of its
    ``actor/kept_frac/length_...`` metric)."""
    from sao.train.step import LENGTH_BUCKETS

    for edge in LENGTH_BUCKETS:
        if tokens <= edge:
            return f"le_{edge}"
    return f"gt_{LENGTH_BUCKETS[-1]}"


def _label_order(label: str) -> tuple[bool, int]:
    return label.startswith("gt"), int(label.split("_")[1])


def analyse(trajectories: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The bias figures from a run's ``trajectories`` rows (trajectory_id, num_action_tokens, num_turns,
    min_policy_version) and ``train_steps`` rows (trajectory_ids, policy_version_before, metrics)."""
    by_id = {t["trajectory_id"]: t for t in trajectories}
    generated_len: collections.Counter = collections.Counter()
    generated_turns: collections.Counter = collections.Counter()
    for t in trajectories:
        generated_len[length_label(t["num_action_tokens"])] += 1
        generated_turns[t["num_turns"]] += 1
    trained_len: collections.Counter = collections.Counter()
    trained_turns: collections.Counter = collections.Counter()
    tokens_len: collections.Counter = collections.Counter()
    kept_len: collections.Counter = collections.Counter()
    kept_turns: collections.Counter = collections.Counter()
    stale_sum: collections.Counter = collections.Counter()
    by_staleness_tokens: collections.Counter = collections.Counter()
    by_staleness_kept: collections.Counter = collections.Counter()
    consumed: set[str] = set()
    for step in steps:
        metrics = dict(step["metrics"])
        rows = [by_id[i] for i in step["trajectory_ids"] if i in by_id]
        consumed.update(step["trajectory_ids"])
        for row in rows:
            label = length_label(row["num_action_tokens"])
            staleness = step["policy_version_before"] - row["min_policy_version"] if row["min_policy_version"] is not None else 0
            kept = metrics.get(f"actor/kept_frac/length_{label}", 1.0)
            trained_len[label] += 1
            trained_turns[row["num_turns"]] += 1
            tokens_len[label] += row["num_action_tokens"]
            # the step's kept fraction of the row's length bucket, spread over its rows' tokens
            kept_len[label] += kept * row["num_action_tokens"]
            kept_turns[row["num_turns"]] += kept * row["num_action_tokens"]
            stale_sum[label] += staleness
            by_staleness_tokens[staleness] += row["num_action_tokens"]
            by_staleness_kept[staleness] += metrics.get(f"actor/kept_frac/staleness_{staleness}", 1.0) * row["num_action_tokens"]
    never_len: collections.Counter = collections.Counter(
        length_label(t["num_action_tokens"]) for t in trajectories if t["trajectory_id"] not in consumed)

    def share(counter: collections.Counter) -> dict[str, float]:
        total = sum(counter.values()) or 1
        return {str(k): v / total for k, v in counter.items()}

    labels = sorted(set(generated_len) | set(trained_len), key=_label_order)
    gen_tokens = collections.Counter()
    for t in trajectories:
        gen_tokens[length_label(t["num_action_tokens"])] += t["num_action_tokens"]
    return {
        "length_labels": labels,
        "generated_by_length": dict(generated_len), "trained_by_length": dict(trained_len),
        "never_trained_by_length": dict(never_len),
        "generated_tokens_share_by_length": share(gen_tokens),
        "trained_tokens_share_by_length": share(tokens_len),
        "gradient_tokens_share_by_length": share(kept_len),
        "kept_frac_by_length": {k: kept_len[k] / tokens_len[k] for k in tokens_len if tokens_len[k]},
        "staleness_mean_by_length": {k: stale_sum[k] / trained_len[k] for k in trained_len},
        "kept_frac_by_staleness": {str(s): by_staleness_kept[s] / by_staleness_tokens[s]
                                   for s in sorted(by_staleness_tokens) if by_staleness_tokens[s]},
        "tokens_by_staleness": {str(s): by_staleness_tokens[s] for s in sorted(by_staleness_tokens)},
        "generated_share_by_turns": share(generated_turns), "trained_share_by_turns": share(trained_turns),
        "gradient_share_by_turns": share(kept_turns),
        "generated": len(trajectories), "trained": len(consumed & set(by_id)),
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = result["length_labels"]
    ticks = [label.replace("le_", "<=").replace("gt_", ">") for label in labels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    staleness = sorted(result["kept_frac_by_staleness"], key=int)
    axes[0].bar([int(s) for s in staleness], [result["kept_frac_by_staleness"][s] for s in staleness], color="C2")
    axes[0].set_xlabel("staleness at training (versions)")
    axes[0].set_ylabel("DIS kept fraction of action tokens")
    axes[0].set_ylim(min(0.9, *result["kept_frac_by_staleness"].values()) - 0.02, 1.0)
    axes[1].bar(range(len(labels)), [result["staleness_mean_by_length"].get(k, 0) for k in labels], color="C1")
    axes[1].set_xticks(range(len(labels)), ticks)
    axes[1].set_xlabel("action tokens per trajectory")
    axes[1].set_ylabel("mean staleness at training")
    width = 0.27
    for i, (key, name) in enumerate((("generated_tokens_share_by_length", "generated"),
                                     ("trained_tokens_share_by_length", "trained"),
                                     ("gradient_tokens_share_by_length", "kept by DIS (gradient)"))):
        axes[2].bar([x + (i - 1) * width for x in range(len(labels))], [result[key].get(k, 0) for k in labels],
                    width=width, label=name)
    axes[2].set_xticks(range(len(labels)), ticks)
    axes[2].set_xlabel("action tokens per trajectory")
    axes[2].set_ylabel("share of action tokens")
    axes[2].legend()
    save_figure(fig, path)


def _markdown(record: dict[str, Any], plot: Path | None) -> str:
    r = record["result"]
    labels = r["length_labels"]
    lines = [
        "## What DIS masks (`sao bench bias`)", "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])} Wall time {record['wall_s']:.0f} s.", "",
        f"One asynchronous SAO run: {record['steps']} steps of {record['batch']}, max staleness "
        f"{record['max_staleness']}, {record['in_flight']} rollouts in flight on {record['replicas']} replicas, "
        f"policy lr {record['lr_policy']:g}, DIS interval ({record['dis_interval'][0]:g}, {record['dis_interval'][1]:g}); "
        f"log-normal tool latency (median {record['tool_median_s']} s, sigma {record['tool_sigma']}). "
        f"{r['generated']} trajectories generated, {r['trained']} trained on.", "",
        "| staleness | action tokens trained | DIS kept fraction |", "|---:|---:|---:|",
        *[f"| {s} | {r['tokens_by_staleness'][s]} | {r['kept_frac_by_staleness'][s]:.4f} |"
          for s in sorted(r["kept_frac_by_staleness"], key=int)],
        "",
        "| action tokens | generated | trained | never trained | mean staleness | kept fraction | token share: "
        "generated | trained | gradient |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in labels:
        lines.append(
            f"| {k.replace('le_', '<=').replace('gt_', '>')} | {r['generated_by_length'].get(k, 0)} | "
            f"{r['trained_by_length'].get(k, 0)} | {r['never_trained_by_length'].get(k, 0)} | "
            f"{r['staleness_mean_by_length'].get(k, float('nan')):.2f} | {r['kept_frac_by_length'].get(k, float('nan')):.4f} | "
            f"{r['generated_tokens_share_by_length'].get(k, 0):.3f} | {r['trained_tokens_share_by_length'].get(k, 0):.3f} | "
            f"{r['gradient_tokens_share_by_length'].get(k, 0):.3f} |")
    lines += ["", *record["findings"]]
    if plot is not None:
        lines += ["", f"![bias]({plot.as_posix().removeprefix('docs/')})"]
    return "\n".join(lines)


def _findings(r: dict[str, Any]) -> list[str]:
    """Plain statements read off the figures (no claim the numbers do not carry)."""
    labels = [k for k in r["length_labels"] if r["trained_by_length"].get(k, 0) >= 5]
    out = []
    if len(labels) >= 2:
        short, long = labels[0], labels[-1]
        out.append(f"Staleness grows with length: trajectories of {short.replace('le_', '<=')} action tokens were "
                   f"trained at mean staleness {r['staleness_mean_by_length'][short]:.2f}, those of "
                   f"{long.replace('le_', '<=').replace('gt_', '>')} at {r['staleness_mean_by_length'][long]:.2f}."
                   if r["staleness_mean_by_length"][long] > r["staleness_mean_by_length"][short] else
                   f"Staleness did not grow with length here ({r['staleness_mean_by_length'][short]:.2f} for the "
                   f"shortest bucket, {r['staleness_mean_by_length'][long]:.2f} for the longest).")
    shift = {k: r["gradient_tokens_share_by_length"].get(k, 0) - r["generated_tokens_share_by_length"].get(k, 0)
             for k in r["length_labels"]}
    biggest = max(shift, key=lambda k: abs(shift[k]))
    out.append(f"Largest shift of the task mix between what was generated and what reached the gradient: "
               f"{biggest.replace('le_', '<=').replace('gt_', '>')} action tokens, {shift[biggest]:+.3f} of the token "
               f"share (staleness at training and DIS masking together).")
    masked = 1 - min(r["kept_frac_by_staleness"].values()) if r["kept_frac_by_staleness"] else 0.0
    out.append(f"DIS masked at most {masked:.2%} of the action tokens at any staleness: at this model size and "
               "learning rate the policy moves little within the staleness window, so masking changes the mix "
               "little." if masked < 0.05 else
               f"DIS masked up to {masked:.2%} of the action tokens at the highest staleness.")
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    from benchmarks._settings import bench_config
    from sao import runs
    from sao.lake.store import Lake, sql_literal
    from sao.pipeline import run_pipeline
    from schemas import train_steps

    started = time.monotonic()
    policy = policy_dir(args)
    run_id = "bias"
    import shutil

    for path in (args.workdir / "lake", args.workdir / run_id):
        if path.exists():
            shutil.rmtree(path)
    settings = bench_config(run_id=run_id, workdir=str(args.workdir), lake_root=str(args.workdir / "lake"),
                           steps=args.steps, batch_size=args.batch, max_staleness=args.max_staleness,
                           lr_policy=args.lr_policy, num_replicas=args.replicas, max_in_flight=args.in_flight,
                           value_samples=0, seed=args.seed)
    config = runs.pipeline_config(settings, policy)
    latency = {"kind": "lognormal", "median_s": args.tool_median_s, "sigma": args.tool_sigma, "seed": args.seed}
    config = dataclasses.replace(config, use_ray_train=False, env_options={"math_tool": {"latency": latency}},
                                 app_name="bias")

    def show(report) -> None:
        m = report.metrics
        print(f"step {report.step}: reward {m.get('batch/reward_mean', 0):.3f} kept {m.get('actor/kept_frac', 0):.4f} "
              f"staleness {m.get('batch/staleness_mean', 0):.2f}", file=sys.stderr, flush=True)

    run_pipeline(config, runs.math_tasks("train"), on_step=show)
    lake = Lake.open(settings.lake_config())
    where = f"run_id = {sql_literal(run_id)}"
    trajectories = lake.read("trajectories", columns=["trajectory_id", "num_action_tokens", "num_turns",
                                                      "min_policy_version"], predicate=where).to_pylist()
    steps = lake.read(train_steps.NAME, columns=["step", "trajectory_ids", "policy_version_before", "metrics"],
                      predicate=where).to_pylist()
    result = analyse(trajectories, sorted(steps, key=lambda s: s["step"]))
    update = config.train.update
    record: dict[str, Any] = {
        "machine": machine_info, "command": " ".join(["sao bench bias", *argv]), "wall_s": time.monotonic() - started,
        "steps": args.steps, "batch": args.batch, "max_staleness": args.max_staleness, "in_flight": args.in_flight,
        "replicas": args.replicas, "lr_policy": args.lr_policy, "tool_median_s": args.tool_median_s,
        "tool_sigma": args.tool_sigma, "dis_interval": [1 - update.eps_low, 1 + update.eps_high], "result": result,
    }
    record["findings"] = _findings(result)
    plot = args.out / "bias.png"
    _plot(result, plot)
    markdown = _markdown(record, plot)
    print(markdown)
    write_json(args.out / "bias.json", record)
    if not args.quick:
        update_section(args.results_md, "bias", markdown)
    return 0
