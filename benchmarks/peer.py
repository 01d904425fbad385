"""Benchmark: side by side with the trainer users would pick instead, TRL's ``GRPOTrainer``, on the same
machine, model, tokenizer and tasks.

    sao bench peer [--steps 30] [--multi-steps 20] [--latency-median 0.5] [--latency-sigma 1.0] [--quick]

Six arms, one after another, each in a child process of this one (one run, one process tree):

    trl-single            TRL GRPOTrainer (``model.generate`` on this CPU; TRL's asynchronous trainer
                          needs CUDA and vLLM), single-turn math_tool
    grpo-single           our synchronous GRPO: Serve rollouts -> Delta lake -> trainer -> weights
    sao-single            our asynchronous SAO, same shape
    sao-single-raytrain   the same on a Ray Train worker (the others train in the arm's process)
    grpo-multi            our synchronous GRPO on multi-turn math_tool with heavy-tailed tool latency
    sao-multi             our asynchronous SAO on the same (TRL has no arm here: see the results)

Single-turn shape: the math_tool train prompts answered without the tool
(``MathToolConfig(max_tool_calls=0)``: reward 1 for a correct ``<answer>``, else 0), scored by the same
``MathToolEnv.step`` for TRL (its reward function, on the completion decoded with special tokens kept,
as our agent loop decodes) and for ours. Policy: the tiny Qwen3-MoE freshly initialised
(``build_policy(seed=0)``, fp32), the same directory for every arm. 16 prompts x 8 generations = 128
completions per step (TRL: ``per_device_train_batch_size=128, num_generations=8``; our GRPO: groups of
8, batches of 128; SAO: 128 single rollouts per step), completions of at most 64 tokens, temperature 1
(no top-k / top-p), policy learning rate 2e-4 constant, AdamW, gradient clipping 1.0, gradient
checkpointing off, no KL term, no router auxiliary loss, the same number of steps. A random policy
earns no reward, so the single-turn arms measure throughput only (no time to an accuracy).

Multi-turn shape: the SFT warm start on math_tool with the Python tool (up to 96 tokens, 4 turns), each
tool call delayed by a log-normal draw (``--latency-median``, ``--latency-sigma``, capped at
``--latency-max``; ``sao.envs.latency``), 128 trajectories per step. SAO first fits its critic on 256
version-0 rollouts (value pretraining, timed and reported apart). Time to a fixed accuracy: the first
step at which the mean batch reward of the last three steps (the sampled accuracy, T=1, of the policy
that generated them, over 384 trajectories) reaches ``--target-reward``, in seconds from the first
step's start.

Measured per arm over the steady state (from the end of step ``--warmup - 1`` to the end of the last
step): trained completions per second; generated tokens per second (every action token sampled in the
window, trained or not); the split of a step's time between generation, training, the lake and the
rest (``_trl_step`` and ``_split_ours`` say how each is measured); peak memory of the arm's process
tree and CPU milliseconds per trained completion by component (``benchmarks/_proctree.py``: TRL's
process; our driver + trainer process, rollout replicas with their engines, Serve's controller, Ray's
own processes, Ray Train).

``--runs`` rounds (default 3) run every arm once each, round after round; the ratios the targets are
judged on (:data:`RATIOS`, and CPU per completion against TRL's) are taken within each round and
reported as the median over the rounds with min and max. The tables describe the last round.

Writes ``docs/results/peer.json``, ``docs/results/peer.png`` and the ``peer`` section of
``docs/RESULTS.md`` (with ``--quick``: a tiny run whose files go under ``--workdir`` only). This module
measures; the section's text is written by ``benchmarks/peer_report.py`` from the record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._proctree import TreeSampler
from benchmarks._report import machine, median_spread, save_figure, update_section, write_json
from benchmarks.peer_report import ARMS, CPU_TARGET, RATIOS, SPLIT_PARTS, markdown
from sao.algos.waits import mean_group_wait

DEFAULT_SFT = Path("runs/bench/bench-learning/sft")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: who trains, on which shape, how.

    Attributes:
        name: one of :data:`ARMS` (also the run id and the folder under ``workdir``).
        trainer: ``trl`` or ``ours`` (the pipeline).
        shape: ``single`` (no tool, random policy) or ``multi`` (tool with latency, SFT policy).
        algorithm: ``grpo`` or ``sao``.
        synchronous: our synchronous mode (one batch per version, staleness 0).
        steps: optimiser steps (each on ``prompts * generations`` completions).
        policy_dir: version-0 policy directory.
        workdir: where run files and the lakes go.
        prompts, generations: per step; SAO rolls ``prompts * generations`` tasks out once each.
        max_tokens, max_turns: completion budget and turns (TRL: ``max_completion_length``).
        lr: policy learning rate.
        max_staleness: versions a trajectory may lag (0 for the synchronous runs).
        latency: math_tool tool latency options (``LatencyConfig`` fields); empty: none.
        max_tool_calls: math_tool tool calls per episode (0: single-turn, no tool).
        num_replicas: our rollout replicas.
        ray_train: our trainer on Ray Train workers (False: in the arm's process).
        value_samples: version-0 rollouts the SAO critic is fitted on first (0: none).
        seed: seeds sampling, task order and torch.
    """

    name: str
    trainer: str
    shape: str
    algorithm: str
    synchronous: bool
    steps: int
    policy_dir: str
    workdir: str
    prompts: int = 16
    generations: int = 8
    max_tokens: int = 64
    max_turns: int = 1
    lr: float = 2e-4
    max_staleness: int = 0
    latency: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_tool_calls: int = 0
    num_replicas: int = 2
    ray_train: bool = False
    value_samples: int = 0
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.prompts * self.generations

    @property
    def group_size(self) -> int:
        return self.generations if self.algorithm == "grpo" else 1


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench peer", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each single-turn arm")
    parser.add_argument("--multi-steps", type=int, default=20, help="steps of each multi-turn arm")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady-state window")
    parser.add_argument("--runs", type=int, default=3,
                        help="rounds of every arm (run one after another, round by round); each ratio is the median "
                             "over the rounds with min and max (1 with --quick)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--latency-median", type=float, default=0.5, help="median tool delay, seconds")
    parser.add_argument("--latency-sigma", type=float, default=1.0, help="log-normal shape of the tool delay")
    parser.add_argument("--latency-max", type=float, default=10.0, help="cap on one tool delay, seconds")
    parser.add_argument("--target-reward", type=float, default=0.6,
                        help="multi-turn: the mean batch reward over 3 steps that counts as reached")
    parser.add_argument("--value-samples", type=int, default=None,
                        help="SAO multi-turn value pretraining rollouts (default 256; 0 with --quick)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--sft", type=Path, default=None,
                        help=f"multi-turn version-0 policy (default: {DEFAULT_SFT} if present, else an SFT warm start)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/peer"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the tests (2 prompts x 4, 3 steps, 24 tokens; writes under --workdir only)")
    parser.add_argument("--tag", default="", help="names a variant run: peer-TAG.json/png and section peer-TAG")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: write the section again from --out's peer[-TAG].json (after a change "
                             "of the report's text)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 1
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    return args


# --- the arms (each runs in a child process) ---------------------------------------------------------


def trl_settings(arm: Arm) -> dict[str, Any]:
    """The keyword arguments of TRL's ``GRPOConfig`` for ``arm`` (torch's threads are left at its default)."""
    return dict(
        output_dir=str(Path(arm.workdir) / arm.name), per_device_train_batch_size=arm.batch,
        gradient_accumulation_steps=1, num_generations=arm.generations, max_completion_length=arm.max_tokens,
        learning_rate=arm.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, router_aux_loss_coef=0.0, gradient_checkpointing=False,
        bf16=False, use_cpu=True, max_steps=arm.steps, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=arm.seed, data_seed=arm.seed,
    )


def our_config(arm: Arm):
    """``(run settings, pipeline config)`` of one of our arms, as :func:`_run_ours` runs it."""
    from benchmarks._settings import bench_config
    from sao import runs
    from sao.rollout.agent import AgentConfig

    run_dir = Path(arm.workdir) / arm.name
    settings = bench_config(
        run_id=arm.name, workdir=arm.workdir, lake_root=str(run_dir / "lake"), algorithm=arm.algorithm,
        steps=arm.steps, batch_size=arm.batch, max_staleness=arm.max_staleness, lr_policy=arm.lr,
        num_replicas=arm.num_replicas, max_in_flight=arm.batch, group_size=arm.group_size,
        synchronous=arm.synchronous, value_samples=arm.value_samples, seed=arm.seed)
    env_options = {"math_tool": {"max_tool_calls": arm.max_tool_calls, "latency": dict(arm.latency)}}
    agent = AgentConfig(max_tokens=arm.max_tokens, max_turns=arm.max_turns)
    config = runs.pipeline_config(settings, arm.policy_dir)
    rollout = dataclasses.replace(config.train.rollout, env_options=env_options, max_turns=agent.max_turns)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, rollout=rollout), agent=agent,
                                 env_options=env_options, use_ray_train=arm.ray_train, app_name=f"peer-{arm.name}")
    return settings, config


def _run_trl(arm: Arm) -> dict[str, Any]:
    """TRL's GRPOTrainer on the single-turn shape; per step: wall-clock bounds, the time in
    ``_generate`` (tokenise, ``model.generate``, decode) and in the rest of
    ``_generate_and_score_completions`` (rewards, advantages), tokens generated, mean reward."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sao import runs
    from sao.envs.base import Split, Task
    from sao.envs.math_tool import ENV_NAME, MathToolConfig, MathToolEnv
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer

    started = time.time()
    tokenizer = load_tokenizer(arm.policy_dir)
    tokenizer.padding_side = "left"  # GRPOTrainer needs left padding
    env = MathToolEnv(MathToolConfig(max_tool_calls=arm.max_tool_calls))
    tasks = runs.math_tasks(Split.TRAIN)
    dataset = Dataset.from_list([{"prompt": env.reset(t), "task_id": t.task_id, "answer": t.answer} for t in tasks])
    current: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []

    def math_tool_reward(completion_ids, task_id, answer, **_) -> list[float]:
        """Our environment's reward: MathToolEnv.step on the completion decoded as the agent loop decodes it."""
        rewards = []
        for ids, tid, reference in zip(completion_ids, task_id, answer, strict=True):
            env.reset(Task(tid, ENV_NAME, "", reference, Split.TRAIN))
            rewards.append(env.step(tokenizer.decode(list(ids), skip_special_tokens=False)).reward)
        current["reward"] = statistics.fmean(rewards)
        return rewards

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current.update(begin=time.time(), generate_s=0.0, generate_score_s=0.0, tokens=0, completions=0)

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({**current, "end": time.time(), "step": len(steps)})

    config = GRPOConfig(**trl_settings(arm))
    trainer = GRPOTrainer(model=load_policy(arm.policy_dir), reward_funcs=math_tool_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its log lines only; TRL's metrics are still gathered every step
    generate, generate_and_score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(prompts):
        t = time.perf_counter()
        output = generate(prompts)
        current["generate_s"] += time.perf_counter() - t
        return output

    def timed_generate_and_score(inputs):
        t = time.perf_counter()
        output = generate_and_score(inputs)
        current["generate_score_s"] += time.perf_counter() - t
        current["tokens"] += int(output["completion_mask"].sum())
        current["completions"] += int(output["completion_mask"].shape[0])
        return output

    trainer._generate = timed_generate  # the instance attributes shadow the methods; nothing else changes
    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    return {"trainer": "trl", "wall_s": time.time() - started,
            "torch_threads": torch.get_num_threads(),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "steps": [_trl_step(s, steps[k - 1]["end"] if k else s["begin"], arm) for k, s in enumerate(steps)],
            "events": [[s["end"], s["tokens"], s["completions"]] for s in steps]}


def _trl_step(s: dict[str, Any], previous_end: float, arm: Arm) -> dict[str, Any]:
    """A TRL step in the common form, its cycle from the previous step's end: generation =
    ``_generate``; training = the step less ``_generate_and_score_completions``; other = the rest of
    that call (rewards, advantages) and the trainer's work between steps (callbacks, logging)."""
    step_s = s["end"] - s["begin"]
    between = s["begin"] - previous_end
    return {"step": s["step"], "begin": s["begin"], "end": s["end"], "reward": s.get("reward", 0.0),
            "trained": arm.batch, "tokens": s["tokens"],
            "split": {"generation": s["generate_s"], "training": step_s - s["generate_score_s"], "lake": 0.0,
                      "other": s["generate_score_s"] - s["generate_s"] + between}}


def _run_ours(arm: Arm) -> dict[str, Any]:
    """Our pipeline (``run_pipeline``: Serve replicas, lake, trainer) on the arm's shape; the steps and
    trajectories are read back from the lake."""
    import torch

    from sao import runs
    from sao.envs.base import Split
    from sao.lake.store import Lake
    from sao.pipeline import run_pipeline
    from sao.runtime import shutdown_ray

    started = time.time()
    shutil.rmtree(Path(arm.workdir) / arm.name, ignore_errors=True)  # a fresh run, never a resumed one
    settings, config = our_config(arm)
    tasks = runs.math_tasks(Split.TRAIN, runs.tasks_path(settings))
    pretrain_s = 0.0
    if arm.value_samples:
        t = time.time()
        _pretrain_value(config, settings, tasks)
        pretrain_s = time.time() - t
    result = run_pipeline(config, tasks)
    lake = Lake.open(config.train.lake)
    data = _read_run(lake, arm)
    shutdown_ray()
    driver = result.driver
    return {"trainer": "ours", "pretrain_s": pretrain_s, "wall_s": time.time() - started,
            # torch's threads are set per thread: the trainer's (config.train) are not the main thread's
            "torch_threads": torch.get_num_threads(), "trainer_threads": config.train.torch_threads,
            "ray_train": arm.ray_train,
            "driver": {"launched": driver.launched, "finished": driver.finished, "wall_s": driver.wall_s,
                       "slot_busy_s": driver.slot_busy_s, "slot_utilisation": driver.slot_utilisation(arm.batch),
                       "by_reason": dict(driver.by_reason)},
            **data}


def _pretrain_value(config, settings, tasks) -> None:
    """``sao.runs.pretrain_value`` with the arm's own pipeline config (its environment options and tool
    latency), so that the run's recorded configuration is the one it trains with: version-0 rollouts
    stored as run ``<run>-v0``, then the run's version-0 critic fitted on them (Ray Train)."""
    from sao import runs
    from sao.pipeline import collect_rollouts
    from sao.runtime import init_ray
    from sao.train.loop import prepare_run
    from sao.train.pretrain import PretrainConfig, pretrain_value

    train = config.train
    init_ray(config.ray)
    prepare_run(train)
    data = dataclasses.replace(train, run_id=runs.value_data_run(settings),
                               checkpoint_root=str(Path(train.checkpoint_root).parent / "v0-data-checkpoints"))
    prepare_run(data)
    collect_rollouts(dataclasses.replace(config, train=data), tasks, data.run_id, settings.value_pretraining.samples)
    pretrain_value(train, PretrainConfig(num_samples=settings.value_pretraining.samples, data_run_id=data.run_id))


def _epoch(value) -> float:
    return value.timestamp()


def _read_run(lake, arm: Arm) -> dict[str, Any]:
    """Per step (common form plus the raw timings) and per trajectory, from ``train_steps`` and
    ``trajectories``."""
    from sao.lake.store import sql_literal

    where = f"run_id = {sql_literal(arm.name)}"
    trajectories = {r["trajectory_id"]: r for r in lake.read(
        "trajectories", columns=["trajectory_id", "reward", "num_action_tokens", "timings", "arrived_at",
                                 "termination_reason", "num_turns"], predicate=where).to_pylist()}
    rows = sorted(lake.read("train_steps", predicate=where).to_pylist(), key=lambda r: r["step"])
    steps = []
    for row in rows:
        timings, metrics = dict(row["timings"]), dict(row["metrics"])
        batch = [trajectories[i] for i in row["trajectory_ids"]]
        created = [_epoch(t["timings"]["created_at"]) for t in batch]
        finished = [_epoch(t["timings"]["finished_at"]) for t in batch]
        steps.append({
            "step": row["step"], "begin": _epoch(row["started_at"]), "end": _epoch(row["finished_at"]),
            "reward": metrics.get("batch/reward_mean", statistics.fmean(t["reward"] for t in batch)),
            "trained": len(batch), "timings": timings,
            "batch_created_first": min(created), "batch_finished_last": max(finished),
            "batch_arrived_last": max(_epoch(t["arrived_at"]) for t in batch),
            "group_wait_s": mean_group_wait(finished),
            "staleness_mean": metrics.get("batch/staleness_mean", 0.0),
            "kept_frac": metrics.get("actor/kept_frac", float("nan")),
            "actor_s": metrics.get("time/actor_s", 0.0), "critic_s": metrics.get("time/critic_s", 0.0),
        })
    events = sorted([_epoch(t["timings"]["finished_at"]), t["num_action_tokens"], 1] for t in trajectories.values())
    durations = sorted(_epoch(t["timings"]["finished_at"]) - _epoch(t["timings"]["created_at"])
                       for t in trajectories.values())
    tool_s = sorted(t["timings"]["tool_s"] for t in trajectories.values())
    return {"steps": _split_ours(steps, arm.synchronous), "events": events,
            "rollout_s": _quantiles(durations), "tool_s": _quantiles(tool_s),
            "turns_mean": statistics.fmean(t["num_turns"] for t in trajectories.values()) if trajectories else 0.0}


def _split_ours(steps: list[dict[str, Any]], synchronous: bool) -> list[dict[str, Any]]:
    """Each step's split of its cycle (previous step's end to this step's end; the first step from its
    own start). From the step's timings (``wait_read_s``: waiting for the batch and selecting it;
    ``update_s``: the update; ``commit_s``: checkpoint and ``train_steps`` row) and its batch:

    synchronous: generation = first launch to last finish of the batch's rollouts; training = update;
        lake = commit + last finish -> batch selected by the trainer (writer flush, lake commit, poll);
        other = the rest (weights published, the version reaching the replicas, Serve dispatch, rows read).
    asynchronous: generation = the trainer waiting for rollouts (generation not hidden behind training);
        training = update; lake = commit; other = the rest (weights published, rows read).
    """
    out = []
    for k, s in enumerate(steps):
        cycle = s["end"] - (steps[k - 1]["end"] if k else s["begin"])
        t = s["timings"]
        if synchronous:
            generation = s["batch_finished_last"] - s["batch_created_first"]
            selected = s["begin"] + t.get("wait_read_s", 0.0)
            lake = t.get("commit_s", 0.0) + max(0.0, selected - s["batch_finished_last"])
        else:
            generation, lake = t.get("wait_read_s", 0.0), t.get("commit_s", 0.0)
        training = t.get("update_s", 0.0)
        other = max(0.0, cycle - generation - training - lake)
        out.append({**s, "split": {"generation": generation, "training": training, "lake": lake, "other": other}})
    return out


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731 - values are sorted
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1], "mean": statistics.fmean(values)}


def _arm_child(arm: Arm, out: str) -> None:
    """The body of an arm's child process: run it, write its record to ``out``, with the names of this
    process's Python threads by kernel thread id (the parent samples each thread's CPU by that id)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    names: dict[int, str] = {}
    stop = threading.Event()

    def record_names() -> None:
        while True:
            names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id is not None})
            if stop.wait(0.5):
                return

    recorder = threading.Thread(target=record_names, name="peer-thread-names", daemon=True)
    recorder.start()
    record = _run_trl(arm) if arm.trainer == "trl" else _run_ours(arm)
    stop.set()
    recorder.join()
    Path(out).write_text(json.dumps({**record, "thread_names": {str(k): v for k, v in names.items()}}))


# --- one arm in a child process, its tree sampled ---------------------------------------------------


def run_arm(arm: Arm, records: Path, warmup: int, timeout_s: float) -> dict[str, Any]:
    """Run ``arm`` in a child process while sampling its process tree: its record, plus the tree's peak
    memory and its CPU seconds by component, over the whole arm and over the steady-state window."""
    out = records / f"{arm.name}.json"
    out.unlink(missing_ok=True)
    process = multiprocessing.get_context("spawn").Process(target=_arm_child, args=(arm, str(out)),
                                                           name=f"peer-{arm.name}")
    started = time.time()
    process.start()
    sampler = TreeSampler(process.pid, "TRL process" if arm.trainer == "trl" else "driver + trainer process")
    sampler.start()
    process.join(timeout_s)
    sampler.stop()
    if process.is_alive():
        process.kill()
        process.join()
        raise TimeoutError(f"arm {arm.name} ran past {timeout_s:.0f} s")
    if process.exitcode != 0 or not out.exists():
        raise RuntimeError(f"arm {arm.name} failed (exit code {process.exitcode}); its traceback is above")
    record = json.loads(out.read_text())
    window = steady_window(record["steps"], warmup)
    record.update(arm=dataclasses.asdict(arm), process_wall_s=time.time() - started,
                  setup_s=record["steps"][0]["begin"] - started,  # process start to the first step's start
                  peak_rss_gib=sampler.peak_rss / 2**30, peak_pss_gib=sampler.peak_pss / 2**30,
                  processes=sampler.processes, cpu_s=sampler.cpu_total(), cpu_window_s=sampler.cpu_between(*window),
                  thread_cpu_window_s={str(k): v for k, v in sampler.thread_cpu_between(*window).items()},
                  kernel_thread_names={str(k): v for k, v in sampler.thread_names.items()},
                  machine_busy_window_s=sampler.machine_busy_between(*window))
    return record


def thread_group(name: str | None) -> str:
    """What a thread of the arm's own process does, from its Python name (None: a thread Python did not
    start: Ray's core worker and gRPC threads, torch's OpenMP workers)."""
    if name is None:
        return "native threads"
    if name == "MainThread":
        return "main thread"  # TRL's whole loop; ours waits for the run there
    if name == "trainer":
        return "trainer thread"  # our in-process trainer (sao.pipeline)
    if name == "rollout-driver":
        return "rollout driver"  # the asyncio driver: Serve handle calls, staleness gate
    if name.startswith("sink") or name.endswith("-timer"):
        return "lake writer"  # commits of trajectories and issued tasks
    return "other Python threads"  # Ray's and Serve's (handle router, metrics), ours (name recorder)


# --- summaries -----------------------------------------------------------------------------------------


def steady_window(steps: list[dict[str, Any]], warmup: int) -> tuple[float, float]:
    """The steady state: from the end of step ``warmup - 1`` to the end of the last step."""
    return steps[_warmup(steps, warmup) - 1]["end"], steps[-1]["end"]


def _warmup(steps: list[dict[str, Any]], warmup: int) -> int:
    return min(max(warmup, 1), len(steps) - 1)


def summarize(record: dict[str, Any], warmup: int, target_reward: float | None) -> dict[str, Any]:
    """Steady-state figures of one arm (:func:`steady_window`)."""
    steps = record["steps"]
    start, end = steady_window(steps, warmup)
    window_s = end - start
    kept = steps[_warmup(steps, warmup):]
    generated = [e for e in record["events"] if start < e[0] <= end]
    split = {part: statistics.fmean(s["split"][part] for s in kept) for part in SPLIT_PARTS}
    cycle = (end - start) / len(kept)
    rewards = [s["reward"] for s in steps]
    rolling = [statistics.fmean(rewards[max(0, k - 2):k + 1]) for k in range(len(rewards))]
    reached = next((k for k, r in enumerate(rolling) if k >= 2 and r >= target_reward), None) \
        if target_reward is not None else None
    trained = sum(s["trained"] for s in kept)
    cpu = record.get("cpu_window_s", {})
    update = {part: statistics.fmean(s.get(part, 0.0) for s in kept) for part in ("actor_s", "critic_s")}
    threads, native = _thread_ms(record, trained)
    outside = record.get("machine_busy_window_s", 0.0) - sum(cpu.values())
    return {
        "window_s": window_s, "window_steps": len(kept), "step_s": cycle,
        "cpu_ms_per_completion": {k: 1000 * v / trained for k, v in cpu.items()},
        "root_threads_ms_per_completion": threads, "native_threads_ms_per_completion": native,
        "outside_cpu_s_per_s": max(0.0, outside) / window_s,  # cores' worth of other processes meanwhile
        "trained_per_s": trained / window_s,
        "generated_per_s": sum(e[2] for e in generated) / window_s,
        "tokens_per_s": sum(e[1] for e in generated) / window_s,
        "split_s": split, "split_frac": {k: v / cycle for k, v in split.items()}, "update_s": update,
        "reward_first3": statistics.fmean(rewards[:3]), "reward_last3": statistics.fmean(rewards[-3:]),
        "target_step": reached,
        "time_to_target_s": None if reached is None else steps[reached]["end"] - steps[0]["begin"],
        "peak_rss_gib": record["peak_rss_gib"], "peak_pss_gib": record["peak_pss_gib"],
    }


def over_runs(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Median, min and max over the rounds: each arm's trained completions/s and CPU ms per completion,
    and each :data:`RATIOS` ratio computed within a round (arms of one round ran back to back)."""
    def spread(values: list[float]) -> dict[str, Any]:
        return median_spread(values) | {"runs": values}

    names = [name for name in ARMS if all(name in r for r in rounds)]
    out: dict[str, Any] = {
        "trained_per_s": {name: spread([r[name]["trained_per_s"] for r in rounds]) for name in names},
        "cpu_ms_per_completion": {name: spread([sum(r[name]["cpu_ms_per_completion"].values()) for r in rounds])
                                  for name in names},
        "ratios": {},
    }
    def ratios(top: str, bottom: str, figure) -> list[float]:
        """Each round's ratio, leaving out rounds whose denominator is 0 (a window too short for the
        CPU sampler to see, in a quick run)."""
        return [figure(r[top]) / figure(r[bottom]) for r in rounds if figure(r[bottom]) > 0]

    for label, (top, bottom, target) in RATIOS.items():
        values = ratios(top, bottom, lambda s: s["trained_per_s"]) if top in names and bottom in names else []
        if values:
            out["ratios"][label] = spread(values) | {"target": target}
    for name in ("grpo-single", "sao-single"):
        values = (ratios(name, "trl-single", lambda s: sum(s["cpu_ms_per_completion"].values()))
                  if name in names and "trl-single" in names else [])
        if values:
            out["ratios"][f"CPU per completion: {name} / trl-single"] = spread(values) | {"target": CPU_TARGET, "at_most": True}
    return out


def _thread_ms(record: dict[str, Any], trained: int) -> tuple[dict[str, float], dict[str, float]]:
    """CPU ms per trained completion of the arm's own process in the steady state, by :func:`thread_group`,
    and of its native threads by the kernel's name for them; largest first."""
    names, kernel_names = record.get("thread_names", {}), record.get("kernel_thread_names", {})
    threads: dict[str, float] = {}
    native: dict[str, float] = {}
    for tid, cpu_s in record.get("thread_cpu_window_s", {}).items():
        group, ms = thread_group(names.get(tid)), 1000 * cpu_s / trained
        threads[group] = threads.get(group, 0.0) + ms
        if group == "native threads":
            native[kernel_names.get(tid, "?")] = native.get(kernel_names.get(tid, "?"), 0.0) + ms
    by_size = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
    return by_size(threads), by_size(native)


# --- the figure (the text: benchmarks/peer_report.py) -----------------------------------------------


def plot(records: dict[str, dict[str, Any]], summaries: dict[str, dict[str, Any]], path: Path,
         target_reward: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(summaries)
    axes[0].bar(names, [summaries[n]["trained_per_s"] for n in names], color="tab:blue")
    axes[0].set(title="trained completions / s (steady state)")
    axes[0].tick_params(axis="x", rotation=30)
    bottom = [0.0] * len(names)
    for part, colour in zip(SPLIT_PARTS, ("tab:orange", "tab:green", "tab:purple", "tab:gray"), strict=True):
        values = [summaries[n]["split_s"][part] for n in names]
        axes[1].bar(names, values, bottom=bottom, label=part, color=colour)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[1].set(title="one step's time by part (s)")
    axes[1].legend(fontsize=8)
    axes[1].tick_params(axis="x", rotation=30)
    for name in names:
        steps = records[name]["steps"]
        if records[name]["arm"]["shape"] == "multi":
            axes[2].plot([s["end"] - steps[0]["begin"] for s in steps], [s["reward"] for s in steps], marker=".",
                         label=name)
    axes[2].set(title="multi-turn: batch reward against wall time", xlabel="seconds from the first step")
    if axes[2].lines and target_reward is not None:
        axes[2].axhline(target_reward, linestyle="--", color="gray", label=f"target {target_reward:g} (3-step mean)")
    if axes[2].lines:
        axes[2].legend(fontsize=8)
    return save_figure(figure, path)


# --- main ---------------------------------------------------------------------------------------------------


def _policies(args: argparse.Namespace) -> tuple[Path, Path]:
    """(single-turn random policy, multi-turn SFT policy)."""
    from benchmarks._settings import bench_config
    from sao import runs
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    random_dir = args.workdir / "random-policy"
    if not (random_dir / "config.json").exists():
        save_policy(build_policy(seed=0), random_dir, build_tokenizer())
    if args.quick or not ({"grpo-multi", "sao-multi"} & set(args.arms)):
        return random_dir, random_dir
    if args.sft is not None:
        return random_dir, args.sft
    if (DEFAULT_SFT / "config.json").exists():
        return random_dir, DEFAULT_SFT
    return random_dir, runs.warm_start(bench_config(run_id="bench-peer", workdir=str(args.workdir)))


def arms(args: argparse.Namespace, random_dir: Path, sft_dir: Path) -> list[Arm]:
    quick = dict(prompts=2, generations=4, max_tokens=24) if args.quick else {}
    steps = 3 if args.quick else args.steps
    multi_steps = 3 if args.quick else args.multi_steps
    common = dict(workdir=str(args.workdir.resolve()), lr=args.lr, **quick)
    single = dict(shape="single", steps=steps, policy_dir=str(random_dir.resolve()), max_tool_calls=0, **common)
    latency = {"kind": "lognormal", "median_s": args.latency_median, "sigma": args.latency_sigma,
               "max_s": args.latency_max, "seed": 0}
    multi = dict(shape="multi", steps=multi_steps, policy_dir=str(sft_dir.resolve()), max_tool_calls=3,
                 latency=latency, max_turns=4, **{**common, "max_tokens": 48 if args.quick else 96})
    every = {
        "trl-single": Arm("trl-single", "trl", algorithm="grpo", synchronous=True, **single),
        "grpo-single": Arm("grpo-single", "ours", algorithm="grpo", synchronous=True, **single),
        "sao-single": Arm("sao-single", "ours", algorithm="sao", synchronous=False, max_staleness=2, **single),
        "sao-single-raytrain": Arm("sao-single-raytrain", "ours", algorithm="sao", synchronous=False,
                                   max_staleness=2, ray_train=True, **single),
        "grpo-multi": Arm("grpo-multi", "ours", algorithm="grpo", synchronous=True, **multi),
        "sao-multi": Arm("sao-multi", "ours", algorithm="sao", synchronous=False, max_staleness=2,
                         value_samples=(0 if args.quick else 256) if args.value_samples is None else args.value_samples,
                         **multi),
    }
    return [every[name] for name in ARMS if name in args.arms]


def main(argv: list[str]) -> int:
    args = _parse(argv)
    name = f"peer-{args.tag}" if args.tag else "peer"
    if args.render:  # the last round's summaries are made again from its records, which are kept whole
        record = json.loads((args.out / f"{name}.json").read_text())
        record["summary"] = {arm: summarize(r, record["warmup"], record["target_reward"] if r["arm"]["shape"] == "multi"
                                            else None) for arm, r in record["arms"].items()}
        text = markdown(record, args.out / f"{name}.png")
        print(text)
        update_section(args.results_md, name, text)
        return 0
    if "trl-single" in args.arms:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("sao bench peer: TRL is not installed; install the bench extra (pip install -e '.[bench]') "
                  "or leave out the trl-single arm (--arms ...)", file=sys.stderr)
            return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    info = machine()
    random_dir, sft_dir = _policies(args)
    rounds: list[dict[str, dict[str, Any]]] = []  # each round's summaries, by arm
    for round_ in range(args.runs):
        records: dict[str, dict[str, Any]] = {}
        for arm in arms(args, random_dir, sft_dir):
            print(f"peer: round {round_ + 1}/{args.runs}: {arm.name} ...", file=sys.stderr, flush=True)
            records[arm.name] = run_arm(arm, args.workdir, args.warmup, timeout_s=600 if args.quick else 1800)
            print(f"peer: {arm.name} done in {records[arm.name]['process_wall_s']:.0f} s", file=sys.stderr, flush=True)
        summary = {name: summarize(r, args.warmup, args.target_reward if r["arm"]["shape"] == "multi" else None)
                   for name, r in records.items()}
        rounds.append(summary)
    # The tables describe the last round (its records are kept whole); the ratios span every round.
    record = {"machine": info, "command": " ".join(["sao bench peer", *argv]), "warmup": args.warmup, "tag": args.tag,
              "target_reward": args.target_reward, "wall_s": time.time() - started, "runs": args.runs,
              "summary": summary, "arms": records, "rounds": rounds, "over_runs": over_runs(rounds)}
    figure = plot(records, summary, args.workdir / "peer-quick.png" if args.quick else args.out / f"{name}.png",
                  args.target_reward)
    text = markdown(record, figure)
    print(text)
    if args.quick:
        write_json(args.workdir / "peer-quick.json", record)
        (args.workdir / "peer-quick.md").write_text(text + "\n")
    else:
        write_json(args.out / f"{name}.json", record)
        update_section(args.results_md, name, text)
    return 0 if all(math.isfinite(v["trained_per_s"]) for v in summary.values()) else 1
