"""One asynchronous training run, end to end: Serve rollouts -> Delta -> Ray Train -> new weights.

    prepare_run          version 0 (or the resumed version) registered, with its checkpoint
    start_rollout_app    N Serve replicas holding the current policy
    RolloutDriver        keeps trajectories in flight; the lake writer commits them in small batches
    fit / run_training   Ray Train workers (or this process) read unconsumed trajectories from Delta
    stop                 the driver drains in-flight rollouts into the lake; the app is deleted

The trainer and the rollouts meet only in the lake and the weight broker: the driver's staleness gate
reads the trainer's version from the broker, the trainer reads what the writer committed. Stopping the
run never loses a trajectory: in-flight rollouts finish and are written; those the trainer did not
consume stay in the table for a resumed run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from sao.envs.base import Task
from sao.lake.config import WriterConfig
from sao.lake.issued import IssueLog
from sao.lake.store import Lake, sql_literal
from sao.lake.writer import TrajectoryWriter
from sao.rollout.agent import AgentConfig
from sao.rollout.driver import DriverConfig, DriverStats, RolloutDriver
from sao.rollout.serve import RolloutConfig
from sao.rollout.torch_engine import TorchEngineConfig
from sao.runtime import RayConfig, init_ray
from sao.train.checkpoint import checkpoint_dir
from sao.train.loop import StepReport, TrainConfig, last_committed_step, prepare_run

__all__ = ["PipelineConfig", "PipelineResult", "run_pipeline", "task_stream"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """An asynchronous run: where rollouts run, how they are fed, how the trainer runs.

    Attributes:
        train: the trainer (run id, lake, checkpoints, algorithm, batch size, staleness, steps).
        ray: where Ray runs (local by default).
        num_replicas, cpus_per_replica, resources_per_replica: the Serve rollout app (custom resources
            place the replicas: :class:`sao.rollout.serve.RolloutConfig`).
        engine: the torch engine of each replica.
        agent: budgets and sampling of the agent loop.
        env_options: options per environment name (e.g. tool latency for benchmarks).
        max_in_flight: trajectories generated at once across replicas.
        group_size: rollouts of each task, launched one after another (GRPO's groups; 1 for SAO).
        synchronous: synchronous RL (the comparison of the speed benchmark): with
            ``train.max_staleness = 0`` the driver launches one batch per trainer version, and each of
            its rollouts starts only once its replica runs that version; the trainer waits for the
            whole batch, the rollouts for the update. False: asynchronous (SAO).
        writer: lake writer batching (small batches keep the trainer fed; the age flush bounds delay).
        use_ray_train: run the trainer on Ray Train workers (False: in this process, one worker).
        seed: shuffles the task stream and seeds rollouts.
        app_name: Serve application name.
    """

    train: TrainConfig
    ray: RayConfig = RayConfig()
    num_replicas: int = 2
    cpus_per_replica: float = 0.5
    resources_per_replica: dict[str, float] = dataclasses.field(default_factory=dict)
    engine: TorchEngineConfig = TorchEngineConfig()
    agent: AgentConfig = AgentConfig()
    env_options: dict = dataclasses.field(default_factory=dict)
    max_in_flight: int = 64
    group_size: int = 1
    synchronous: bool = False
    writer: WriterConfig = WriterConfig(flush_rows=16, flush_seconds=0.25)
    use_ray_train: bool = True
    seed: int = 0
    app_name: str = "rollout"

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.train.batch_size % self.group_size:
            raise ValueError(f"batch_size {self.train.batch_size} is not a multiple of group_size {self.group_size}: "
                             "a batch would split a group")
        if self.synchronous and self.train.max_staleness != 0:
            raise ValueError(f"a synchronous run trains on its own batch only: max_staleness must be 0, "
                             f"got {self.train.max_staleness}")


@dataclasses.dataclass
class PipelineResult:
    """What a run did."""

    steps: int
    version: int
    driver: DriverStats
    wall_s: float
    train_s: float


def task_stream(tasks: Sequence[Task], seed: int, start: int = 0, repeat: int = 1) -> Iterator[Task]:
    """An endless shuffled stream of ``tasks`` (reshuffled each pass), each task ``repeat`` times in a
    row (a group), skipping the first ``start`` items."""
    if not tasks:
        raise ValueError("task_stream needs at least one task")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    rng = random.Random(seed)

    def passes() -> Iterator[Task]:
        while True:
            order = list(tasks)
            rng.shuffle(order)
            for task in order:
                yield from itertools.repeat(task, repeat)

    return itertools.islice(passes(), start, None)


def _current_policy_path(train: TrainConfig, version: int) -> str:
    return str(checkpoint_dir(train.checkpoint_root, version) / "policy")


def run_pipeline(cfg: PipelineConfig, tasks: Sequence[Task], *,
                 on_step: Callable[[StepReport], None] | None = None,
                 on_record: Callable[[object], None] | None = None) -> PipelineResult:
    """Run ``cfg.train.total_steps`` asynchronous updates on ``tasks`` (resuming a run that has steps)."""
    import ray
    from ray import serve

    from sao.rollout.serve import start_rollout_app
    from sao.rollout.weights import get_or_create_broker

    started = time.monotonic()
    init_ray(cfg.ray)
    train = dataclasses.replace(cfg.train, app_name=cfg.app_name)
    version = prepare_run(train)
    lake = Lake.open(train.lake)
    done_before = last_committed_step(lake, train.run_id)
    rollout = RolloutConfig(
        policy_path=_current_policy_path(train, version), app_name=cfg.app_name, initial_version=version,
        num_replicas=cfg.num_replicas, cpus_per_replica=cfg.cpus_per_replica, engine=cfg.engine,
        agent=cfg.agent, env_options=cfg.env_options, resources_per_replica=cfg.resources_per_replica,
    )
    broker = get_or_create_broker(cfg.app_name)
    # The broker outlives runs (a detached actor per app name): a run starts it over at its version.
    ray.get(broker.reset.remote(version))
    handle = start_rollout_app(rollout)

    async def trainer_version() -> int:
        return max(version, await broker.latest_version.remote())

    async def trainer_skipped() -> int:
        return await broker.skipped_total.remote()

    writer = TrajectoryWriter(lake, cfg.writer, writer_id=f"{train.run_id}-driver")
    issue_log = IssueLog(lake, cfg.writer, issuer_id=f"{train.run_id}-driver")
    driver = RolloutDriver(
        handle, writer, train.run_id,
        DriverConfig(max_in_flight=cfg.max_in_flight, batch_size=train.batch_size,
                     max_staleness=train.max_staleness, seed=cfg.seed + version, synchronous=cfg.synchronous),
        trainer_version=trainer_version, initial_version=version, on_record=on_record, issue_log=issue_log,
        trainer_skipped=trainer_skipped,
    )
    stop_rollouts = threading.Event()
    driver_result: dict[str, object] = {}

    def drive() -> None:
        async def main() -> None:
            stop = asyncio.Event()

            async def watch() -> None:
                while not stop_rollouts.is_set():
                    await asyncio.sleep(0.05)
                stop.set()

            watcher = asyncio.ensure_future(watch())
            try:
                driver_result["stats"] = await driver.run(task_stream(tasks, cfg.seed + version, repeat=cfg.group_size),
                                                           stop=stop)
            finally:
                watcher.cancel()

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced to the caller below
            driver_result["error"] = exc

    thread = threading.Thread(target=drive, name="rollout-driver", daemon=True)
    thread.start()
    watcher = _StepWatcher(lake, train.run_id, done_before, on_step) if on_step is not None else None
    train_started = time.monotonic()
    try:
        if cfg.use_ray_train:
            from sao.train.ray_trainer import fit

            fit(train)
        else:
            from sao.train.loop import run_training

            run_training(train)
        train_s = time.monotonic() - train_started
    finally:
        stop_rollouts.set()
        if watcher is not None:
            watcher.close()
        thread.join(timeout=max(cfg.agent.timeout_s * 2, 60.0))
        issue_log.flush()
        writer.close()
        serve.delete(cfg.app_name)
    if "error" in driver_result:
        raise RuntimeError("the rollout driver failed") from driver_result["error"]
    last = last_committed_step(lake, train.run_id)
    return PipelineResult(steps=0 if last is None else last[0] + 1, version=0 if last is None else last[1],
                          driver=driver_result["stats"], wall_s=time.monotonic() - started, train_s=train_s)


def collect_rollouts(cfg: PipelineConfig, tasks: Sequence[Task], run_id: str, count: int, *,
                     on_record: Callable[[object], None] | None = None) -> DriverStats:
    """Roll out ``count`` tasks with the run's version-0 policy into the lake under ``run_id``, with no
    training (the data of value pretraining). Idempotent: only what the run lacks is rolled out."""
    from ray import serve

    from sao.rollout.serve import start_rollout_app

    init_ray(cfg.ray)
    lake = Lake.open(cfg.train.lake)
    stored = lake.read("trajectories", columns=["trajectory_id"], predicate=f"run_id = {sql_literal(run_id)}").num_rows
    missing = count - stored
    if missing <= 0:
        return DriverStats()
    app_name = f"{cfg.app_name}-collect"
    rollout = RolloutConfig(policy_path=_current_policy_path(cfg.train, 0), app_name=app_name, initial_version=0,
                            num_replicas=cfg.num_replicas, cpus_per_replica=cfg.cpus_per_replica, engine=cfg.engine,
                            agent=cfg.agent, env_options=cfg.env_options,
                            resources_per_replica=cfg.resources_per_replica)
    handle = start_rollout_app(rollout)
    writer = TrajectoryWriter(lake, cfg.writer, writer_id=f"{run_id}-driver")
    issue_log = IssueLog(lake, cfg.writer, issuer_id=f"{run_id}-driver")
    driver = RolloutDriver(handle, writer, run_id, DriverConfig(max_in_flight=cfg.max_in_flight, seed=cfg.seed),
                           on_record=on_record, issue_log=issue_log)
    try:
        return asyncio.run(driver.run(task_stream(tasks, cfg.seed, start=stored), limit=missing))
    finally:
        issue_log.flush()
        writer.close()
        serve.delete(app_name)


class _StepWatcher:
    """Calls ``on_step`` for each step the run commits (read from ``train_steps``), wherever the
    trainer runs: the lake is where progress is visible."""

    def __init__(self, lake: Lake, run_id: str, done_before: tuple[int, int] | None,
                 on_step: Callable[[StepReport], None], interval_s: float = 0.5) -> None:
        self._lake, self._run_id, self._on_step, self._interval_s = lake, run_id, on_step, interval_s
        self._next = 0 if done_before is None else done_before[0] + 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-watcher", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        predicate = f"run_id = {sql_literal(self._run_id)} AND step >= {self._next}"
        rows = self._lake.read("train_steps", predicate=predicate)
        for row in sorted(rows.to_pylist(), key=lambda r: r["step"]):
            self._on_step(StepReport(row["step"], row["policy_version_after"], row["trajectories_version"],
                                     tuple(row["trajectory_ids"]), dict(row["metrics"])))
            self._next = row["step"] + 1

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._poll()
            except Exception:  # progress output must never break the run
                log.exception("reading progress from train_steps failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()


def default_checkpoint_root(workdir: str | Path, run_id: str) -> str:
    return str(Path(workdir) / run_id / "checkpoints")
