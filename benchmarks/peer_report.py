"""The text of ``sao bench peer``'s report: the ``peer`` section of ``docs/RESULTS.md`` (and
``peer-quick.md`` with ``--quick``), from a record as ``benchmarks/peer.py`` builds it or as it reads back
from ``docs/results/peer.json``.

    markdown(record, figure) -> str

``record`` is plain data: ``{"machine", "command", "warmup", "tag", "target_reward", "summary", "arms"}``,
where ``summary[name]`` is ``benchmarks.peer.summarize``'s dict and ``arms[name]`` an arm's record
(``benchmarks.peer.run_arm``), both of the last round; with ``"runs"`` and ``"over_runs"``
(``benchmarks.peer.over_runs``) the ratios over every round are reported too. Nothing here measures or imports the benchmark: the names a record is keyed
by (:data:`ARMS`, :data:`SPLIT_PARTS`) live in this module and the benchmark imports them from here, so the
layers point one way (``peer`` -> ``peer_report`` -> ``_report``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks._report import machine_line, spread_text

__all__ = ["ARMS", "COMPONENTS", "CPU_TARGET", "RATIOS", "SPLIT_PARTS", "THREAD_GROUPS", "markdown"]

ARMS = ("trl-single", "grpo-single", "sao-single", "sao-single-raytrain", "grpo-multi", "sao-multi")
"""Every arm of the benchmark (``benchmarks.peer.arms`` builds them), in the order they run and are reported."""

SPLIT_PARTS = ("generation", "training", "lake", "other")
"""The parts a step's time is split into (``benchmarks.peer._trl_step`` and ``_split_ours``)."""

COMPONENTS = ("TRL process", "driver + trainer process", "rollout replicas", "Serve controller", "Ray system",
              "other Ray workers", "Ray Train")
"""Columns of the CPU table: the components of an arm's process tree (``benchmarks/_proctree.py``)."""

RATIOS = {  # label -> (numerator arm, denominator arm, target)
    "grpo-single / trl-single": ("grpo-single", "trl-single", 1.0),
    "sao-single / trl-single": ("sao-single", "trl-single", 0.75),
    "sao-single-raytrain / trl-single": ("sao-single-raytrain", "trl-single", 0.75),
    "sao-multi / grpo-multi": ("sao-multi", "grpo-multi", 3.0),
}
"""The ratios of trained completions/s the targets are judged on (issue 25), each taken within a round."""

CPU_TARGET = 1.5
"""CPU milliseconds per trained completion: at most this many times TRL's."""

THREAD_GROUPS = ("main thread", "trainer thread", "rollout driver", "lake writer", "other Python threads",
                 "native threads")
"""Columns of the thread table: what ``benchmarks.peer.thread_group`` names the threads of an arm's process."""


def markdown(record: dict[str, Any], figure: Path) -> str:
    """The ``peer`` section: settings, the steady-state table, the multi-turn paragraph, CPU by component
    and by thread, the reading against the targets, and a link to ``figure``."""
    order = [name for name in ARMS if name in record["summary"]]  # a record read back from JSON has sorted keys
    record = {**record, "arms": {n: record["arms"][n] for n in order}, "summary": {n: record["summary"][n] for n in order}}
    records, s = record["arms"], record["summary"]
    arm0 = next(iter(records.values()))["arm"]
    multi = next((r["arm"] for r in records.values() if r["arm"]["shape"] == "multi"), None)
    single = next((r["arm"] for r in records.values() if r["arm"]["shape"] == "single"), None)
    versions = next((r["versions"] for r in records.values() if r["trainer"] == "trl"), {})
    tag = f" ({record['tag']})" if record.get("tag") else ""
    raw = f"peer-{record['tag']}.json" if record.get("tag") else "peer.json"
    lines = [
        f"## Side by side with TRL's GRPOTrainer (`sao bench peer`){tag}", "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])} trl {versions.get('trl', 'not run')}, "
        f"transformers {versions.get('transformers', record['machine'].get('transformers'))}. Raw data: "
        f"`docs/results/{raw}`.", "",
        f"Same tiny Qwen3-MoE, tokenizer and math_tool tasks for every arm; {arm0['prompts']} prompts x "
        f"{arm0['generations']} generations = {arm0['prompts'] * arm0['generations']} completions per step (SAO: "
        f"that many single rollouts), policy lr {arm0['lr']:g} constant, fp32, gradient checkpointing off, no KL. "
        f"Our trainer ran in the arm's process (`use_ray_train=False`) except in `sao-single-raytrain` (one Ray "
        f"Train worker), with {arm0['num_replicas']} Serve rollout replicas. Torch threads: " + _threads_words(records)
        + " "
        + (f"Single-turn: the prompts answered without the tool, a random-initialised policy, completions up to "
           f"{single['max_tokens']} tokens, {single['steps']} steps. " if single is not None else "") +
        "Figures over the steady state (after the first "
        f"{record['warmup']} steps); the step split is generation / training / lake / other (how each is measured: "
        "`benchmarks/peer.py`, `_trl_step` and `_split_ours`); memory is the peak of the arm's process tree "
        "(sum of RSS / sum of PSS).", "",
        "| arm | trained completions/s | generated tokens/s | s per step | split gen / train / lake / other | "
        "peak memory GiB (RSS / PSS) | setup s |",
        "|---|---:|---:|---:|---|---:|---:|",
        *[_row(name, records[name], s[name]) for name in s],
        *_over_runs(record),
    ]
    if multi is not None:
        lines += ["", _multi_turn_paragraph(record, multi)]
    lines += ["", "CPU milliseconds per trained completion in the steady state, by component (the arm's process "
              "tree sampled every 0.5 s; on 2 cores at most 2,000 CPU-ms pass per second), and the CPU other "
              "processes used on the machine meanwhile (its busy time less the tree's, steal included):", "",
              *_cpu_table(s), *_contention(s), "",
              "The arm's own process by thread (CPU ms per trained completion; main thread: TRL's whole loop (ours "
              "waits for the run there); trainer thread: our in-process trainer (the work of its second torch "
              "thread, if any, is under native threads); rollout driver: the asyncio driver and its Serve handle calls; lake writer: the "
              "commits of trajectories and issued tasks; native: Ray's core worker and gRPC threads, torch's "
              "OpenMP workers):", "", *_thread_table(s), "",
              "Native threads of the arm's process by the kernel's name for them (the four busiest, CPU ms per "
              "trained completion): " + "; ".join(
                  f"{name}: " + ", ".join(f"`{k}` {v:.1f}" for k, v in list(v["native_threads_ms_per_completion"].items())[:4])
                  for name, v in s.items()) + ".", "",
              *_reading(records, s, record.get("over_runs")), "",
              f"![peer]({figure.relative_to(Path('docs')) if figure.is_relative_to('docs') else figure})"]
    return "\n".join(lines)


def _threads_words(records: dict[str, dict[str, Any]]) -> str:
    """The torch threads each arm trained with: TRL's process's, our trainer's (recorded from the run
    config since 2026-12-03; before, the record held the main thread's, which is not the trainer's)."""
    ours = [(name, r.get("trainer_threads")) for name, r in records.items() if r["trainer"] == "ours"]
    trl = [(name, r.get("torch_threads")) for name, r in records.items() if r["trainer"] == "trl"]
    words = ", ".join(f"{name} {threads}" for name, threads in trl + ours if threads is not None)
    rule = ("our trainer's are the run config's default, `train.threads`: one in an asynchronous run, whose "
            "replicas generate while it updates, every core in a synchronous one")
    return (f"{words} ({rule}; TRL's, torch's default: one per core)." if words else f"{rule}.")


def _over_runs(record: dict[str, Any]) -> list[str]:
    """The ratios the targets are judged on, over the rounds (median, min-max), when the record has them."""
    over = record.get("over_runs")
    if not over:
        return []
    runs = record["runs"]
    lines = ["", f"The table above is the last of {runs} rounds (each round runs every arm once, one after another). "
             f"Over the {runs} rounds, median (min-max):", "",
             "| arm | trained completions/s | CPU ms per trained completion |", "|---|---:|---:|"]
    for name in [n for n in ARMS if n in over["trained_per_s"]]:  # (a record read back has sorted keys)
        v, cpu = over["trained_per_s"][name], over["cpu_ms_per_completion"][name]
        lines.append(f"| {name} | {spread_text(v, '.1f')} | {spread_text(cpu, '.1f')} |")
    if over["ratios"]:
        lines += ["", "| ratio (within each round) | measured | target | met |", "|---|---:|---:|---|"]
        labels = [label for label in RATIOS if label in over["ratios"]]
        for label in labels + sorted(set(over["ratios"]) - set(labels)):
            v = over["ratios"][label]
            bound = "<=" if v.get("at_most") else ">="
            met = v["median"] <= v["target"] if v.get("at_most") else v["median"] >= v["target"]
            lines.append(f"| {label} | {spread_text(v, '.2f')} | {bound} {v['target']:g} | {'yes' if met else '**no**'} |")
    return lines




def _row(name: str, r: dict[str, Any], s: dict[str, Any]) -> str:
    f = s["split_frac"]
    return (f"| {name} | {s['trained_per_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['step_s']:.2f} | "
            f"{f['generation']:.0%} / {f['training']:.0%} / {f['lake']:.0%} / {f['other']:.0%} | "
            f"{s['peak_rss_gib']:.2f} / {s['peak_pss_gib']:.2f} | {r['setup_s']:.0f} |")


def _multi_turn_paragraph(record: dict[str, Any], multi: dict[str, Any]) -> str:
    records, s = record["arms"], record["summary"]
    names = [n for n in s if records[n]["arm"]["shape"] == "multi"]
    lat = multi["latency"]
    durations = records.get("sao-multi", records[names[0]])["rollout_s"]
    rewards = "; ".join(f"{n} {s[n]['reward_first3']:.3f} -> {s[n]['reward_last3']:.3f}" for n in names)
    reach = "; ".join(f"{n} " + ("not reached" if s[n]["time_to_target_s"] is None else
                                 f"{s[n]['time_to_target_s']:.0f} s (step {s[n]['target_step']})") for n in names)
    pretrain = records.get("sao-multi", {}).get("pretrain_s", 0.0)
    samples = records.get("sao-multi", {}).get("arm", {}).get("value_samples", 0)
    return (
        f"Multi-turn: the SFT warm start with the tool (up to {multi['max_tokens']} tokens, {multi['max_turns']} "
        f"turns), {multi['steps']} steps; each tool call delayed by a log-normal draw, median {lat['median_s']:g} s, "
        f"sigma {lat['sigma']:g}, capped at {lat['max_s']:g} s (rollout wall time p50 / p99 / max: "
        f"{durations.get('p50', math.nan):.1f} / {durations.get('p99', math.nan):.1f} / "
        f"{durations.get('max', math.nan):.1f} s). Batch reward, first 3 steps -> last 3: {rewards}. Time to a "
        f"mean batch reward of {record['target_reward']:g} over 3 steps, from the first step's start: {reach}. "
        f"SAO's value pretraining ({samples} rollouts) took "
        f"{pretrain:.0f} s before that. TRL has no arm here: its GRPOTrainer runs tools only through a chat "
        "template with a JSON tool schema and a response parser (`tools=` / `environment_factory`, experimental), "
        "which this tokenizer's free-form `<tool_call>code</tool_call>` turns do not fit; and that loop is "
        "synchronous too: a round of tool calls starts once the whole batch has generated, calls synchronous tools "
        "one completion after another, and the next turn is generated when every call of the round has returned.")


# --- tables ---------------------------------------------------------------------------------------------


def _cpu_table(s: dict[str, dict[str, Any]]) -> list[str]:
    """CPU milliseconds per trained completion in the steady state, by component (benchmarks/_proctree.py),
    and how many cores' worth of other processes ran on the machine meanwhile."""
    present = [c for c in COMPONENTS if any(v["cpu_ms_per_completion"].get(c, 0.0) > 0 for v in s.values())]
    rows = ["| arm | total | " + " | ".join(present) + " | other processes on the machine (cores) |",
            "|---|---:|" + "---:|" * (len(present) + 1)]
    for name, v in s.items():
        cpu = v["cpu_ms_per_completion"]
        rows.append(f"| {name} | {sum(cpu.values()):.1f} | " + " | ".join(f"{cpu.get(c, 0.0):.1f}" for c in present)
                    + f" | {v['outside_cpu_s_per_s']:.2f} |")
    return rows


def _contention(s: dict[str, dict[str, Any]], limit: float = 0.2) -> list[str]:
    """A warning naming the arms during which other processes took more than ``limit`` cores."""
    loaded = [f"{name} ({v['outside_cpu_s_per_s']:.2f} cores)" for name, v in s.items() if v["outside_cpu_s_per_s"] > limit]
    if not loaded:
        return []
    return ["", f"**Contention**: other processes on the machine took more than {limit:g} of a core during "
            + ", ".join(loaded) + "; those arms' rates are lower than on a quiet machine (TRL, at two threads, "
            "suffers most: its OpenMP team waits for its slowest thread)."]


def _thread_table(s: dict[str, dict[str, Any]]) -> list[str]:
    """The arm's own process by thread, CPU milliseconds per trained completion in the steady state."""
    rows = ["| arm | " + " | ".join(THREAD_GROUPS) + " |", "|---|" + "---:|" * len(THREAD_GROUPS)]
    for name, v in s.items():
        threads = v["root_threads_ms_per_completion"]
        rows.append(f"| {name} | " + " | ".join(f"{threads.get(g, 0.0):.1f}" for g in THREAD_GROUPS) + " |")
    return rows


# --- the reading: targets and where the time goes -------------------------------------------------------


def _judged(over: dict[str, Any] | None, label: str, last: float) -> tuple[str, bool]:
    """The words for a target's ratio (the median over the rounds where the record has them, else the
    one round's) and whether it is met."""
    top, bottom, target = RATIOS[label]
    spread = (over or {}).get("ratios", {}).get(label)
    value = spread["median"] if spread else last
    words = (f"{value:.2f}x, the median of {len(spread['runs'])} rounds ({spread['min']:.2f}-{spread['max']:.2f}; "
             f"this round {last:.2f}x)" if spread else f"{value:.2f}x")
    return words + f" (target {target:g}x: {'met' if value >= target else '**missed**'})", value >= target


def _reading(records: dict[str, dict[str, Any]], s: dict[str, dict[str, Any]],
             over: dict[str, Any] | None = None) -> list[str]:
    """The targets (judged on the median over the rounds when there are several) and, where one is
    missed, the measured parts that cost the time (from the last round)."""
    lines = []
    if {"trl-single", "grpo-single"} <= set(s):
        trl, grpo = s["trl-single"], s["grpo-single"]
        words, _ = _judged(over, "grpo-single / trl-single", _ratio(grpo["trained_per_s"], trl["trained_per_s"]))
        lines.append(f"- **Same algorithm**: our synchronous GRPO trains {grpo['trained_per_s']:.1f} completions/s "
                     f"against TRL's {trl['trained_per_s']:.1f}: {words}.")
    if {"trl-single", "sao-single"} <= set(s):
        trl, sao = s["trl-single"], s["sao-single"]
        words, met = _judged(over, "sao-single / trl-single", _ratio(sao["trained_per_s"], trl["trained_per_s"]))
        lines.append(f"- **Single-turn**: our asynchronous SAO trains {sao['trained_per_s']:.1f} completions/s "
                     f"against TRL's {trl['trained_per_s']:.1f}: {words}.")
        if not met:
            lines += ["  " + line for line in _single_turn_cost(s)]
    if {"grpo-multi", "sao-multi"} <= set(s):
        grpo, sao = s["grpo-multi"], s["sao-multi"]
        words, met = _judged(over, "sao-multi / grpo-multi", _ratio(sao["trained_per_s"], grpo["trained_per_s"]))
        lines.append(
            f"- **Multi-turn, heavy-tailed tool latency**: our asynchronous SAO trains {sao['trained_per_s']:.1f} "
            f"completions/s against our synchronous GRPO's {grpo['trained_per_s']:.1f}: {words}. "
            f"Synchronous step: {_split_words(grpo)}; a rollout waited "
            f"{_mean_group_wait(records['grpo-multi']):.1f} s on average for the slowest of its batch. "
            f"Asynchronous trainer step: {_split_words(sao)}.")
        if not met:
            part = max(SPLIT_PARTS, key=lambda p: sao["split_s"][p])
            detail = (f" (actor step {sao['update_s']['actor_s']:.2f} s, K=2 critic updates, the first of which "
                      f"also gives GAE its values, {sao['update_s']['critic_s']:.2f} s)" if part == "training" else "")
            lines.append(f"  What bounds the asynchronous run: {part}, {sao['split_s'][part]:.2f} s of its "
                         f"{sao['step_s']:.2f} s step{detail}; the synchronous step's generation (up to the batch's "
                         f"slowest rollout) is {grpo['split_s']['generation']:.2f} s. Asynchrony removes the wait for "
                         "the slowest rollout, but the step cannot get shorter than the update.")
    return lines


def _single_turn_cost(s: dict[str, dict[str, Any]]) -> list[str]:
    """Where SAO's single-turn time goes against TRL's, from the step splits and CPU per completion."""
    trl, sao = s["trl-single"], s["sao-single"]
    out = [f"Where the time goes, measured: SAO's trainer updates for {sao['split_s']['training']:.2f} s of each "
           f"{sao['step_s']:.2f} s step and waits {sao['split_s']['generation']:.2f} s for rollouts, so it is "
           f"bound by its update: the actor step {sao['update_s']['actor_s']:.2f} s and K=2 critic updates (the "
           f"first of which also gives GAE its values) {sao['update_s']['critic_s']:.2f} s, against "
           f"{trl['split_s']['training']:.2f} s for TRL's whole update"
           + (f" and {s['grpo-single']['update_s']['actor_s']:.2f} s for our GRPO actor step on the same shape."
              if "grpo-single" in s else ".")]
    if "grpo-single" in s:
        grpo = s["grpo-single"]
        out.append(f"The cost of Ray, Serve and the lake on the same algorithm and schedule: our synchronous GRPO "
                   f"trains {grpo['trained_per_s']:.1f} completions/s "
                   f"({_ratio(grpo['trained_per_s'], trl['trained_per_s']):.2f}x TRL); its step {_split_words(grpo)}, "
                   f"against TRL's {_split_words(trl)}.")
    if "sao-single-raytrain" in s:
        out.append(f"With the trainer on a Ray Train worker SAO trains "
                   f"{s['sao-single-raytrain']['trained_per_s']:.1f} completions/s (in process: "
                   f"{sao['trained_per_s']:.1f}).")
    cpu, trl_cpu = sao["cpu_ms_per_completion"], trl["cpu_ms_per_completion"]
    infra = sum(v for k, v in cpu.items() if k in ("Serve controller", "Ray system", "other Ray workers"))
    out.append(f"CPU per trained completion: SAO's tree {sum(cpu.values()):.0f} ms (rollout replicas "
               f"{cpu.get('rollout replicas', 0.0):.0f}, driver + trainer process "
               f"{cpu.get('driver + trainer process', 0.0):.0f}, Serve and Ray's own processes {infra:.0f}) against "
               f"TRL's {sum(trl_cpu.values()):.0f} ms. On 2 cores generation and training share the CPUs, so "
               "overlapping them hides neither: the CPU each completion costs sets the rate.")
    for name in ("grpo-single", "sao-single"):
        if name in s:
            out.append(_process_words(name, s[name]))
    return out


def _process_words(name: str, v: dict[str, Any]) -> str:
    """Where the arm's own process (driver + in-process trainer) spends its CPU, by thread."""
    threads = v["root_threads_ms_per_completion"]
    update_ms = 1000 * v["split_s"]["training"] / (v["trained_per_s"] * v["step_s"])
    return (f"{name}'s own process, {v['cpu_ms_per_completion'].get('driver + trainer process', 0.0):.0f} ms per "
            f"completion: trainer thread {threads.get('trainer thread', 0.0):.0f} (the update's wall time is "
            f"{update_ms:.0f} ms per completion; beside it the thread polls the lake for the batch, reads it, "
            f"writes the checkpoint and the step's rows and publishes the weights), rollout driver {threads.get('rollout driver', 0.0):.0f}, lake "
            f"writer {threads.get('lake writer', 0.0):.0f}, Ray's and Serve's Python threads "
            f"{threads.get('other Python threads', 0.0):.0f}, native threads {threads.get('native threads', 0.0):.0f}.")


def _split_words(s: dict[str, Any]) -> str:
    f, t = s["split_frac"], s["split_s"]
    return ", ".join(f"{part} {t[part]:.2f} s ({f[part]:.0%})" for part in SPLIT_PARTS)


def _mean_group_wait(record: dict[str, Any]) -> float:
    return statistics.fmean(s["group_wait_s"] for s in record["steps"])


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")
