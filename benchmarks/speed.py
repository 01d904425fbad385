"""Benchmark: asynchronous SAO vs synchronous GRPO on the same hardware, with the roofline and the cost
of the lake.

    sao bench speed [--steps 40] [--sync-steps 12] [--batch 32] [--tool-median-s 1.0] [--tool-sigma 1.0] [--quick]
                    [--max-staleness S] [--tag TAG]

Every arm runs the same policy (the SFT warm start of ``sao bench learning``, made if missing), the same
math_tool tasks with the same heavy-tailed tool latency, one Serve rollout replica (its engine on one
core) and the trainer in this process, on the run config's torch threads (``train.threads``: one in
an asynchronous arm, so rollouts and training each have about one of the machine's two cores, as rollout
and trainer GPUs would in a cluster; every core in the synchronous arm, where nothing generates during
an update). Arms, one after
another in one run:

``rollout capacity``  the rollout app alone (no trainer, no staleness gate), writing to the lake:
                      trajectories per second at ``--in-flight`` rollouts at once, in the steady state
                      (rollouts finished while the driver still launched, after a quarter of that time);
``trainer capacity``  the SAO trainer alone on those trajectories (already in the lake, never
                      waiting): trajectories per second;
``async SAO (lake)``  the real pipeline: rollouts -> Delta -> trainer -> weights, at the run config's
                      max staleness (``--max-staleness``);
``async SAO (queue)`` the same, with an in-memory queue in place of Delta (the comparison systems
                      without a lake use; it keeps the checkpoint per step and the weight publication,
                      so the difference is Delta alone);
``sync GRPO``         synchronous: 8 rollouts per prompt, one batch per policy version, each rollout
                      sampled by the trainer's version (``PipelineConfig.synchronous``); the trainer waits
                      for the batch's slowest rollout, the rollouts wait for the update.

Tool latency is log-normal per tool call (median ``--tool-median-s``, sigma ``--tool-sigma``), keyed by
task, so a GRPO group shares its tool delays and a synchronous batch waits for the slowest of its 4
groups (fewer independent draws than 32 single rollouts: conservative for the speed-up).

Throughput is measured in the steady state, from the first step's end to the last step's end (the
Serve app's start is reported apart). ``--runs`` rounds (default 3) of every arm, one round after
another, the lake and queue arms taking turns to go first (:func:`lake_queue_order`); each target's
figure is taken within a round and reported as median, min and max. The roofline is the slower of the rollout capacity and the SAO
trainer's capacity, each measured alone. Writes ``docs/results/speed.json``, ``docs/results/speed.png``
and the ``speed`` section of ``docs/RESULTS.md`` (with ``--tag TAG``, a variant run at other settings:
``speed-TAG.json``, ``speed-TAG.png`` and section ``speed-TAG``, the default run's left as they are).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._report import (
    machine,
    machine_line,
    median_spread,
    save_figure,
    spread_text,
    update_section,
    write_json,
)
from benchmarks._settings import HEAVY_TAIL

DEFAULT_SFT = Path("runs/bench/bench-learning/sft")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench speed", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of each asynchronous arm")
    parser.add_argument("--sync-steps", type=int, default=12, help="steps of the synchronous arm")
    parser.add_argument("--trainer-steps", type=int, default=8, help="steps of each trainer-capacity arm")
    parser.add_argument("--rollouts", type=int, default=640, help="trajectories of the rollout-capacity arm")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--group", type=int, default=8, help="GRPO rollouts per prompt")
    parser.add_argument("--in-flight", type=int, default=64, help="rollouts at once (every arm)")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="of the asynchronous arms (default: the run config's, train.max_staleness of the "
                             "demo config the benchmarks start from): the gate admits (max staleness + 1) x batch "
                             "rollouts beyond what the trainer consumed, in flight or waiting")
    parser.add_argument("--tool-median-s", type=float, default=HEAVY_TAIL["median_s"])
    parser.add_argument("--tool-sigma", type=float, default=HEAVY_TAIL["sigma"])
    parser.add_argument("--tool-max-s", type=float, default=HEAVY_TAIL["max_s"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3,
                        help="rounds of every arm; each target's figure is taken within a round, reported as "
                             "median, min and max")
    parser.add_argument("--sft", type=Path, default=None,
                        help=f"version-0 policy (default: {DEFAULT_SFT} if present, else an SFT warm start)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/speed"))
    parser.add_argument("--quick", action="store_true", help="tiny run for the tests (random policy, short arms)")
    parser.add_argument("--tag", default="", help="names a variant run (other settings than the defaults): "
                             "speed-TAG.json/png and section speed-TAG of the results")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.quick:
        args.runs = 1
        args.steps, args.sync_steps, args.trainer_steps, args.rollouts = 3, 2, 2, 16
        args.batch, args.group, args.in_flight = 8, 4, 8
        args.tool_median_s, args.tool_max_s = 0.05, 0.5
    if args.max_staleness is None:
        from benchmarks._settings import bench_config

        args.max_staleness = bench_config().train.max_staleness
    if args.batch % args.group:
        parser.error(f"--batch {args.batch} is not a multiple of --group {args.group}")
    if args.rollouts < args.trainer_steps * args.batch:
        parser.error(f"--rollouts {args.rollouts} < --trainer-steps x --batch: the trainer-capacity arm would wait")
    return args


# -- settings shared by the arms ---------------------------------------------------------------------------


def policy_dir(args: argparse.Namespace) -> Path:
    """The version-0 policy of a benchmark with ``--sft``, ``--quick`` and ``--workdir`` options: the given
    one, a random policy (quick), or the SFT warm start of ``sao bench learning``."""
    from benchmarks._settings import bench_config
    from sao import runs
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    if args.sft is not None:
        return args.sft
    if args.quick:
        path = args.workdir / "random-policy"
        if not (path / "config.json").exists():
            save_policy(build_policy(seed=0), path, build_tokenizer())
        return path
    if (DEFAULT_SFT / "config.json").exists():
        return DEFAULT_SFT
    return runs.warm_start(bench_config(run_id="bench-learning", workdir="runs/bench"))


def _config(args: argparse.Namespace, policy: Path, run_id: str, algorithm: str, *, steps: int,
            synchronous: bool = False):
    from benchmarks._settings import bench_config
    from sao import runs

    settings = bench_config(
        run_id=run_id, workdir=str(args.workdir), lake_root=str(args.workdir / "lake"), algorithm=algorithm,
        steps=steps, batch_size=args.batch, max_staleness=0 if synchronous else args.max_staleness,
        num_replicas=1, max_in_flight=args.in_flight, group_size=args.group if algorithm == "grpo" else 1,
        synchronous=synchronous, value_samples=0, seed=args.seed)
    config = runs.pipeline_config(settings, policy)
    latency = {"kind": "lognormal", "median_s": args.tool_median_s, "sigma": args.tool_sigma,
               "max_s": args.tool_max_s, "seed": args.seed}
    return dataclasses.replace(config, use_ray_train=False, env_options={"math_tool": {"latency": latency}},
                               app_name=f"speed-{run_id}")


def _fresh(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)


# -- measurements ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ArmResult:
    """One arm's figures (None where an arm has no such figure)."""

    name: str
    trajectories: int  # trained (or, for rollout capacity, generated)
    steady_s: float  # from the first step's end to the last step's end (rollouts: the driver's wall)
    per_s: float
    wall_s: float  # the arm's whole wall time, start-up included
    startup_s: float | None = None  # from the arm's start to its first step's end
    trainer_busy: float | None = None
    slot_utilisation: float | None = None
    staleness_mean: float | None = None
    step_s: list[float] = dataclasses.field(default_factory=list)
    rollout_s: list[float] = dataclasses.field(default_factory=list)  # rollout wall times (capacity arm)
    finished: dict[str, float] | None = None  # lake arms: the rollouts that finished in the steady span
    trainer_path: dict[str, float] | None = None  # lake arms: the lake on the trainer's path (_trainer_path)


def _steady(name: str, batch: int, ends: Sequence[float], busy: Sequence[float], started: float,
            wall_s: float, **extra) -> ArmResult:
    """Figures of a training arm from its steps' end times (monotonic-comparable seconds) and busy
    seconds (update + commit) per step."""
    span = ends[-1] - ends[0]
    steps = len(ends) - 1
    return ArmResult(name=name, trajectories=steps * batch, steady_s=span, per_s=steps * batch / span,
                     wall_s=wall_s, startup_s=ends[0] - started, trainer_busy=sum(busy[1:]) / span,
                     step_s=[b - a for a, b in zip(ends, ends[1:], strict=False)], **extra)


def _read_run(lake_root: Path, name: str, run_id: str, columns: list[str]) -> list[dict[str, Any]]:
    from sao.lake.config import LakeConfig
    from sao.lake.store import Lake

    return Lake.open(LakeConfig(root=str(lake_root))).read_run(name, run_id, columns).to_pylist()


def _lake_steps(lake_root: Path, run_id: str) -> list[dict[str, Any]]:
    rows = _read_run(lake_root, "train_steps", run_id,
                     ["step", "trajectory_ids", "started_at", "finished_at", "timings", "metrics"])
    return sorted(rows, key=lambda r: r["step"])


def _run_trajectories(lake_root: Path, run_id: str) -> list[dict[str, Any]]:
    """The columns of the run's ``trajectories`` rows that :func:`_finished` and :func:`_trainer_path` read."""
    return _read_run(lake_root, "trajectories", run_id,
                     ["trajectory_id", "termination_reason", "timings", "arrived_at", "ingested_at"])


def _pipeline_arm(name: str, config, tasks, *, lake_figures: bool = True) -> ArmResult:
    """A run of the real pipeline; figures from its ``train_steps`` rows, and with ``lake_figures`` (the
    asynchronous lake arm) the rollouts that finished in its steady span and the lake on the trainer's
    path, from its ``trajectories`` rows."""
    from sao.pipeline import run_pipeline

    started_wall = time.time()
    started = time.monotonic()
    result = run_pipeline(config, tasks)
    wall_s = time.monotonic() - started
    lake_root, run_id = Path(config.train.lake.root), config.train.run_id
    rows = _lake_steps(lake_root, run_id)
    ends = [r["finished_at"].timestamp() - started_wall for r in rows]
    busy = [dict(r["timings"])["update_s"] + dict(r["timings"])["commit_s"] for r in rows]
    staleness = statistics.fmean(dict(r["metrics"]).get("batch/staleness_mean", 0.0) for r in rows)
    figures = {}
    if lake_figures:
        stored = _run_trajectories(lake_root, run_id)
        figures = {"finished": _finished(stored, rows, rows[0]["finished_at"], rows[-1]["finished_at"]),
                   "trainer_path": _trainer_path(stored, rows)}
    return _steady(name, config.train.batch_size, ends, busy, 0.0, wall_s,
                   slot_utilisation=result.driver.slot_utilisation(config.max_in_flight), staleness_mean=staleness,
                   **figures)


def _trainer_path(stored: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, float]:
    """Where the lake sits on the trainer's path, from the run's ``stored`` rows (:func:`_run_trajectories`)
    and its ``steps`` (its ``train_steps`` rows in step order, :func:`_lake_steps`; medians over the steps
    after the first, in seconds): from the arrival at the writer of the last row a step trained on to the plan of
    its commit (``ingested_at``; conversion, checks, the launches' commit), from there to the batch
    selected (the commit, the trainer told, its look and read), and from a step's end (``finished_at``,
    after its checkpoint) to the next step's start (its ``train_steps`` and ``policy_versions`` commits,
    retention, the weights' publication)."""
    rows = {r["trajectory_id"]: r for r in stored}
    to_commit, to_selected, between = [], [], []
    for before, step in zip(steps, steps[1:], strict=False):
        last = max((rows[i] for i in step["trajectory_ids"]), key=lambda r: r["arrived_at"])
        selected = step["started_at"].timestamp() + dict(step["timings"])["wait_read_s"]
        to_commit.append((last["ingested_at"] - last["arrived_at"]).total_seconds())
        to_selected.append(selected - last["ingested_at"].timestamp())
        between.append((step["started_at"] - before["finished_at"]).total_seconds())
    if not between:
        return {}
    return {"arrival_to_commit_s": statistics.median(to_commit), "commit_to_selected_s": statistics.median(to_selected),
            "between_steps_s": statistics.median(between)}


def _finished(stored: list[dict[str, Any]], steps: list[dict[str, Any]], begin, end) -> dict[str, float]:
    """The run's rollouts that finished between ``begin`` and ``end`` (its steady span), from its
    ``stored`` rows (:func:`_run_trajectories`): how many a second, and how many were trained (by its
    ``steps``, :func:`_lake_steps`), cancelled (too stale to finish: the driver cuts them short), or stored
    and not trained (passed over as stale, or not yet consumed when the run stopped)."""
    consumed = {i for row in steps for i in row["trajectory_ids"]}
    window = [r for r in stored if begin < r["timings"]["finished_at"] <= end]
    trained = sum(1 for r in window if r["trajectory_id"] in consumed)
    cancelled = sum(1 for r in window if r["trajectory_id"] not in consumed and r["termination_reason"] == "cancelled")
    return {"count": len(window), "per_s": len(window) / (end - begin).total_seconds(), "trained": trained,
            "cancelled": cancelled, "not_trained": len(window) - trained - cancelled}


def _capacity_arms(args: argparse.Namespace, policy: Path, tasks) -> tuple[ArmResult, ArmResult]:
    """Rollouts alone into the lake, then the SAO trainer alone on those rollouts (already there: it
    never waits)."""
    from sao.pipeline import collect_rollouts
    from sao.train.loop import prepare_run, run_training

    config = _config(args, policy, "capacity", "sao", steps=args.trainer_steps)
    prepare_run(config.train)
    started = time.monotonic()
    stats = collect_rollouts(config, tasks, "capacity", args.rollouts)
    rows = _read_run(args.workdir / "lake", "trajectories", "capacity", ["timings"])
    launched = sorted(r["timings"]["created_at"].timestamp() for r in rows)
    finished = [r["timings"]["finished_at"].timestamp() for r in rows]
    # Steady state: while the driver still launched (the drain of the last rollouts' tail is not
    # capacity), after the first quarter of that window (the ramp-up).
    begin = launched[0] + (launched[-1] - launched[0]) / 4
    window = launched[-1] - begin
    done = sum(1 for f in finished if begin <= f <= launched[-1])
    rollouts = ArmResult(name="rollout capacity", trajectories=done, steady_s=window, per_s=done / window,
                         wall_s=time.monotonic() - started,
                         slot_utilisation=stats.slot_utilisation(config.max_in_flight))
    rollouts.rollout_s = sorted((r["timings"]["finished_at"] - r["timings"]["started_at"]).total_seconds()
                                for r in rows)
    cfg = dataclasses.replace(config.train, max_staleness=10**6, app_name=None)  # every row eligible
    began = time.time()
    t0 = time.monotonic()
    run_training(cfg)
    wall_s = time.monotonic() - t0
    steps = _lake_steps(args.workdir / "lake", "capacity")
    ends = [r["finished_at"].timestamp() - began for r in steps]
    busy = [dict(r["timings"])["update_s"] + dict(r["timings"])["commit_s"] for r in steps]
    return rollouts, _steady("trainer capacity (SAO)", cfg.batch_size, ends, busy, 0.0, wall_s)


# -- the in-memory queue arm ---------------------------------------------------------------------------------


class MemoryQueue:
    """Finished trajectories in memory (what systems without a lake use): the driver's sink and the
    trainer's source. Stale ones (and any without an action token) are dropped and counted, and the
    count gives their places back to the driver's staleness gate, as the broker's does in a run."""

    def __init__(self) -> None:
        self._records: list = []
        self._cond = threading.Condition()
        self.dropped_stale = 0

    def add_many(self, records) -> None:
        with self._cond:
            self._records.extend(records)
            self._cond.notify_all()

    def flush(self) -> None:
        return None

    def take(self, count: int, version: int, max_staleness: int, timeout_s: float = 600.0) -> list:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                fresh = [r for r in self._records
                         if r.min_policy_version is not None and version - r.min_policy_version <= max_staleness]
                self.dropped_stale += len(self._records) - len(fresh)
                self._records = fresh
                if len(fresh) >= count:
                    batch, self._records = fresh[:count], fresh[count:]
                    return batch
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"only {len(fresh)} of {count} trajectories within {timeout_s} s")


def _queue_arm(config, tasks) -> ArmResult:
    """The asynchronous run with the lake replaced by :class:`MemoryQueue`: the same Serve app, driver,
    update function (:func:`sao.train.loop.compute_update`), checkpoint per step and weight publication."""
    import ray
    import torch
    from ray import serve

    from sao.lake.columnar import records_to_arrow
    from sao.models.critic import Critic
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.pipeline import task_stream
    from sao.rollout.driver import DriverConfig, RolloutDriver
    from sao.rollout.serve import RolloutConfig, start_rollout_app
    from sao.rollout.weights import get_or_create_broker, publish_weights
    from sao.runtime import init_ray
    from sao.train.checkpoint import save_checkpoint
    from sao.train.loop import TRAIN_COLUMNS, compute_update
    from sao.train.step import Learner

    train = config.train
    started = time.monotonic()
    init_ray(config.ray)
    broker = get_or_create_broker(config.app_name)
    ray.get(broker.reset.remote(0))
    handle = start_rollout_app(RolloutConfig(
        policy_path=train.policy_path, app_name=config.app_name, num_replicas=config.num_replicas,
        cpus_per_replica=config.cpus_per_replica, engine=config.engine, agent=config.agent,
        env_options=config.env_options))
    queue = MemoryQueue()

    async def trainer_version() -> int:
        return max(0, await broker.latest_version.remote())

    async def trainer_skipped() -> int:
        return queue.dropped_stale

    driver = RolloutDriver(handle, queue, train.run_id,
                           DriverConfig(max_in_flight=config.max_in_flight, batch_size=train.batch_size,
                                        max_staleness=train.max_staleness, seed=config.seed),
                           trainer_version=trainer_version, trainer_skipped=trainer_skipped)
    stop = threading.Event()
    stats: dict[str, Any] = {}

    def drive() -> None:
        async def main() -> None:
            halt = asyncio.Event()

            async def watch() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.05)
                halt.set()

            watcher = asyncio.ensure_future(watch())
            stats["driver"] = await driver.run(task_stream(tasks, config.seed), stop=halt)
            watcher.cancel()

        asyncio.run(main())

    thread = threading.Thread(target=drive, name="rollout-driver", daemon=True)
    thread.start()
    torch.set_num_threads(train.torch_threads)
    torch.use_deterministic_algorithms(train.deterministic)
    torch.manual_seed(train.seed)
    policy = load_policy(train.policy_path)
    tokenizer = load_tokenizer(train.policy_path)
    learner = Learner(train.update, policy, Critic.from_policy(policy) if train.update.uses_critic else None)
    ends, busy, staleness = [], [], []
    try:
        for version in range(train.total_steps):
            batch = queue.take(train.batch_size, version, train.max_staleness)
            t0 = time.perf_counter()
            rows = records_to_arrow(batch).select(list(TRAIN_COLUMNS)).to_pylist()
            metrics = compute_update(learner, rows, version)
            save_checkpoint(Path(train.checkpoint_root) / "queue", version + 1, policy, tokenizer, learner.critic,
                            learner.state_dict())
            publish_weights(broker, version + 1, policy.state_dict())
            busy.append(time.perf_counter() - t0)
            ends.append(time.monotonic() - started)
            staleness.append(metrics.get("batch/staleness_mean", 0.0))
    finally:
        stop.set()
        thread.join(timeout=120)
        serve.delete(config.app_name)
    wall_s = time.monotonic() - started
    driver_stats = stats.get("driver")
    return _steady("async SAO (in-memory queue)", train.batch_size, ends, busy, 0.0, wall_s,
                   slot_utilisation=None if driver_stats is None else driver_stats.slot_utilisation(config.max_in_flight),
                   staleness_mean=statistics.fmean(staleness))


# -- report ----------------------------------------------------------------------------------------------------


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1], "mean": statistics.fmean(ordered)}


def _plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = record["arms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [a["name"] for a in arms]
    left.barh(names, [a["per_s"] for a in arms], color=["#999", "#999", "#2a7", "#7a2", "#c44"][:len(arms)])
    left.axvline(record["roofline_per_s"], color="k", linestyle="--", label="roofline")
    left.set_xlabel("trajectories per second")
    left.legend()
    left.invert_yaxis()
    for arm in arms:
        if arm["name"].startswith(("async SAO (lake)", "sync GRPO")):
            ends = [sum(arm["step_s"][:i]) for i in range(len(arm["step_s"]) + 1)]
            right.plot(ends, [i * record["batch"] for i in range(len(ends))], label=arm["name"])
    right.set_xlabel("seconds since the first step")
    right.set_ylabel("trajectories trained")
    right.legend()
    save_figure(fig, path)


def _markdown(record: dict[str, Any], plot: Path | None) -> str:
    arms = {a["name"]: a for a in record["arms"]}
    asyn, sync = arms["async SAO (lake)"], arms["sync GRPO"]
    rollout_q = record["rollout_time_s"]

    def opt(value: float | None, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    lines = [
        "## Speed: asynchronous SAO vs synchronous GRPO (`sao bench speed`)"
        + (f" ({record['tag']})" if record.get("tag") else ""), "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])} Benchmark wall time "
        f"{record['wall_s']:.0f} s.", "",
        "Setup: one Serve rollout replica (engine on one core), the trainer in the driver's process on the run "
        "config's torch threads (`train.threads`: one in the asynchronous arms, every core in the synchronous one), "
        f"{record['in_flight']} rollouts at once, batch {record['batch']}; math_tool with "
        f"log-normal tool latency per call (median {record['tool']['median_s']} s, sigma {record['tool']['sigma']}, "
        f"cap {record['tool']['max_s']} s, keyed by task). Rollout wall times measured in the capacity arm: "
        f"p50 {rollout_q['p50']:.1f} s, p90 {rollout_q['p90']:.1f} s, p99 {rollout_q['p99']:.1f} s, max "
        f"{rollout_q['max']:.1f} s (mean {rollout_q['mean']:.1f} s). Async: max staleness {record['max_staleness']}; "
        f"sync GRPO: {record['group']} rollouts per prompt, one batch per version.", "",
        f"Each arm's row is its median round of {record['runs']} (by trajectories/s; every round's figure in the last "
        "column); the rollout wall times are the first round's. In each round the arms ran in the table's order, "
        "except that the lake and queue arms took turns to go first (lake first in the first round).", "",
        "| arm | trajectories/s | steady span (s) | trajectories | start-up to first step (s) | trainer busy | "
        "rollout-slot use | mean staleness | trajectories/s, each round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for arm in record["arms"]:
        lines.append(f"| {arm['name']} | {arm['per_s']:.2f} | {arm['steady_s']:.1f} | {arm['trajectories']} | "
                     f"{opt(arm['startup_s'], '.1f')} | {opt(arm['trainer_busy'], '.0%')} | "
                     f"{opt(arm['slot_utilisation'], '.0%')} | {opt(arm['staleness_mean'], '.2f')} | "
                     f"{', '.join(f'{v:.2f}' for v in arm['per_s_runs'])} |")
    speedup, roof, lake_cost = (record[name] for name in RATIOS)
    fixed = record["fixed_trajectories"]

    lines += [
        "",
        f"Wall time to {fixed} trained trajectories (steady rate, start-up excluded): async "
        f"{fixed / asyn['per_s']:.0f} s, sync {fixed / sync['per_s']:.0f} s. Mean sync step "
        f"{statistics.fmean(sync['step_s']):.1f} s (the slowest rollout of the batch, then the update).", "",
        f"Targets: each figure computed within a round, median (min-max) over {record['runs']} round(s).", "",
        "| target | measured | met |", "|---|---:|---|",
        f"| async / sync >= 3x (AReaL 2.77x, ROLL Flash 2.72x, verl fully-async 2.67x) | {spread_text(speedup, '.2f', 'x')} | "
        f"{'yes' if speedup['median'] >= 3 else 'NO'} |",
        f"| async >= 90% of the roofline (min of rollout capacity {record['rollout_capacity_per_s']:.2f}/s and "
        f"SAO trainer capacity {record['trainer_capacity_per_s']:.2f}/s, medians) | {spread_text(roof, '.0%')} | "
        f"{'yes' if roof['median'] >= 0.9 else 'NO'} |",
        f"| lake cost: throughput lost to Delta vs the in-memory queue < 5% | {spread_text(lake_cost, '.1%')} | "
        f"{'yes' if lake_cost['median'] < 0.05 else 'NO'} |",
    ]
    if "trained_share" in record:
        done = asyn["finished"]
        lines += [
            "", f"What the roofline figure is made of (the lake arm; median (min-max) over the rounds): rollouts "
            f"finished at {spread_text(record['finished_over_capacity'], '.0%')} of the rollout capacity arm's rate "
            f"while the trainer shared the cores, and {spread_text(record['trained_share'], '.0%')} of them were "
            f"trained. In the median round, of the {done['count']} rollouts that finished in the steady span, "
            f"{done['trained']} were trained, {done['cancelled']} were cancelled as too stale to be trained (max "
            f"staleness {record['max_staleness']}, while the tail of rollout wall times spans several steps), and "
            f"{done['not_trained']} were stored and not trained (passed over as stale, or not yet consumed when the "
            "run stopped).",
        ]
    path = asyn.get("trainer_path")
    if path:
        lines += [
            "", "Where the lake sits on the trainer's path (the lake arm's median round; medians over its steps): "
            f"the last row a step trained on waited {path['arrival_to_commit_s'] * 1e3:.0f} ms from its arrival at "
            f"the writer to its commit's plan, and {path['commit_to_selected_s'] * 1e3:.0f} ms more until the "
            "trainer had its batch (the commit, the trainer told, its look and read); between a step's end "
            f"and the next one's start, {path['between_steps_s'] * 1e3:.0f} ms (the step's two ledger commits, "
            "retention, the weights' publication; the queue arm publishes only). The staleness gate admits "
            "rollouts by the trainer's published version, so time the trainer spends here also holds back "
            "new rollouts.",
        ]
    if record.get("notes"):
        lines += ["", *record["notes"]]
    if plot is not None:
        lines += ["", f"![speed]({plot.as_posix().removeprefix('docs/')})"]
    return "\n".join(lines)


def lake_queue_order(index: int) -> tuple[str, str]:
    """The order of the two arms whose ratio is the lake cost in round ``index`` (0-based): the lake arm
    first in even rounds, the queue arm first in odd ones, so that neither always runs right after the
    capacity arms or always last before the synchronous arm."""
    return ("lake", "queue") if index % 2 == 0 else ("queue", "lake")


def _round(args: argparse.Namespace, policy: Path, tasks, say, index: int) -> dict[str, Any]:
    """Every arm once, one after another, on fresh lakes and run folders (the lake and queue arms in
    :func:`lake_queue_order`)."""
    _fresh(args.workdir / "lake")
    for name in ("capacity", "async-lake", "async-queue", "sync-grpo"):
        _fresh(args.workdir / name)
    say("speed: rollout capacity, then trainer capacity ...")
    rollouts, trainer = _capacity_arms(args, policy, tasks)
    say(f"  rollouts {rollouts.per_s:.2f}/s, trainer {trainer.per_s:.2f}/s")
    results: dict[str, ArmResult] = {}
    for arm in lake_queue_order(index):
        if arm == "lake":
            say("speed: async SAO with the lake ...")
            results[arm] = _pipeline_arm("async SAO (lake)", _config(args, policy, "async-lake", "sao",
                                                                     steps=args.steps), tasks)
        else:
            say("speed: async SAO with an in-memory queue ...")
            results[arm] = _queue_arm(_config(args, policy, "async-queue", "sao", steps=args.steps), tasks)
        say(f"  {results[arm].per_s:.2f}/s")
    asyn, queue = results["lake"], results["queue"]
    say("speed: sync GRPO ...")
    sync = _pipeline_arm("sync GRPO", _config(args, policy, "sync-grpo", "grpo", steps=args.sync_steps,
                                              synchronous=True), tasks, lake_figures=False)
    say(f"  {sync.per_s:.2f}/s")
    roofline = min(rollouts.per_s, trainer.per_s)
    return {"arms": [dataclasses.asdict(a) for a in (rollouts, trainer, asyn, queue, sync)],
            "rollout_capacity_per_s": rollouts.per_s, "trainer_capacity_per_s": trainer.per_s,
            "roofline_per_s": roofline, "rollout_time_s": _quantiles(rollouts.rollout_s),
            "order": list(lake_queue_order(index)),
            "async_over_sync": asyn.per_s / sync.per_s, "async_over_roofline": asyn.per_s / roofline,
            "lake_cost": 1 - asyn.per_s / queue.per_s,
            "trained_share": asyn.finished["trained"] / asyn.finished["count"],
            "finished_over_capacity": asyn.finished["per_s"] / rollouts.per_s}


RATIOS = ("async_over_sync", "async_over_roofline", "lake_cost")
"""The targets' figures, each computed within a round and reported as median, min and max."""

EXPLAINING = ("trained_share", "finished_over_capacity")
"""What the roofline's figure is made of, in the lake arm: the share of the rollouts finished in its steady
span that were trained, and how fast rollouts finished there against the rollout capacity arm's rate."""


def over_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's figures from its rounds: each ratio of :data:`RATIOS` as median (min-max) of the
    rounds' own; each arm as the round whose ``per_s`` is its median (the table and plot show real runs,
    not mixtures), with every round's ``per_s`` beside it."""
    out: dict[str, Any] = {name: median_spread([r[name] for r in rounds])
                           for name in RATIOS + EXPLAINING if all(name in r for r in rounds)}
    for name in ("rollout_capacity_per_s", "trainer_capacity_per_s", "roofline_per_s"):
        out[name] = statistics.median(r[name] for r in rounds)
    arms = []
    for index, first in enumerate(rounds[0]["arms"]):
        ordered = sorted((r["arms"][index] for r in rounds), key=lambda arm: arm["per_s"])
        arms.append(ordered[(len(ordered) - 1) // 2] | {"per_s_runs": [r["arms"][index]["per_s"] for r in rounds]})
        assert arms[-1]["name"] == first["name"]
    out["arms"] = arms
    out["rollout_time_s"] = rounds[0]["rollout_time_s"]
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    from sao.runs import math_tasks

    started = time.monotonic()
    policy = policy_dir(args)
    tasks = math_tasks("train")
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    rounds = []
    for index in range(args.runs):
        say(f"speed: round {index + 1} of {args.runs}")
        rounds.append(_round(args, policy, tasks, say, index))
    record: dict[str, Any] = {
        "machine": machine_info, "command": " ".join(["sao bench speed", *argv]), "wall_s": time.monotonic() - started,
        "runs": args.runs, "tag": args.tag, "batch": args.batch, "group": args.group, "in_flight": args.in_flight,
        "max_staleness": args.max_staleness,
        "tool": {"kind": "lognormal", "median_s": args.tool_median_s, "sigma": args.tool_sigma,
                 "max_s": args.tool_max_s},
        "fixed_trajectories": args.steps * args.batch,
        **over_rounds(rounds),
        "rounds": rounds,
    }
    name = f"speed-{args.tag}" if args.tag else "speed"
    plot = None if args.quick and args.out == Path("docs/results") else args.out / f"{name}.png"
    if plot is not None:
        _plot(record, plot)
    markdown = _markdown(record, plot)
    print(markdown)
    if not (args.quick and args.out == Path("docs/results")):
        write_json(args.out / f"{name}.json", record)
    if not args.quick:
        update_section(args.results_md, name, markdown)
    return 0
