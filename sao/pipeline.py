"""One asynchronous training run, end to end: Serve rollouts -> Delta -> Ray Train -> new weights.

    prepare_run          version 0 (or the resumed version) registered, with its checkpoint
    start_rollout_app    N Serve replicas holding the current policy
    RolloutDriver        keeps trajectories in flight; the lake writer commits them in small batches
    fit / run_training   Ray Train workers (or this process) read unconsumed trajectories from Delta
    stop                 the driver drains in-flight rollouts into the lake; the app is deleted

The trainer and the rollouts meet only in the lake and the weight broker: the driver's staleness gate
reads the trainer's version from the broker, the trainer reads what the writer committed. The broker
also carries who waits for whom: each commit is announced to a trainer waiting for its batch, and the
rows that trainer still wants are committed the moment the writer holds them. Stopping the
run never loses a trajectory: in-flight rollouts finish and are written; those the trainer did not
consume stay in the table for a resumed run.

Resume: a run that starts again first closes out the rollouts its predecessor left in flight (a
driver process that died: :func:`sao.lake.issued.close_out_unresolved`) and launches their tasks again
as new attempts. A Ctrl-C (:mod:`sao.interrupt`) stops launching, lets the trainer commit the step it
is in, gives in-flight rollouts :data:`sao.interrupt.GRACE_S` to finish, cancels the rest (stored as
``cancelled``), and the run's result says ``interrupted``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from sao import interrupt
from sao.envs.base import Task
from sao.lake.config import WriterConfig
from sao.lake.issued import IssuedRollout, IssueLog, close_out_unresolved
from sao.lake.ledger import unconsumed_count
from sao.lake.store import Lake, sql_literal
from sao.lake.writer import TrajectoryWriter
from sao.progress import Progress
from sao.rollout.agent import AgentConfig
from sao.rollout.driver import DriverConfig, DriverStats, RolloutDriver
from sao.rollout.serve import RolloutConfig
from sao.rollout.torch_engine import TorchEngineConfig
from sao.rollout.vllm_engine import VLLMEngineConfig
from sao.runtime import RayConfig, init_ray
from sao.train.checkpoint import policy_dir
from sao.train.config import TrainConfig
from sao.train.loop import StepReport, last_committed_step, prepare_run

__all__ = ["PipelineConfig", "PipelineResult", "collect_rollouts", "collected", "run_pipeline", "task_stream"]

log = logging.getLogger(__name__)


ASYNC_FLUSH_ROWS, ASYNC_FLUSH_S = 16, 1.0  # an asynchronous run's smallest commit, and its age flush
SYNC_FLUSH_S = 5.0  # a synchronous run's age flush (its batches are committed whole)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """An asynchronous run: where rollouts run, how they are fed, how the trainer runs.

    Attributes:
        train: the trainer (run id, lake, checkpoints, algorithm, batch size, staleness, steps).
        ray: where Ray runs (local by default).
        num_replicas, cpus_per_replica, gpus_per_replica, resources_per_replica: the Serve rollout app (custom resources
            place the replicas: :class:`sao.rollout.serve.RolloutConfig`).
        engine: the engine of each replica and its settings (the torch engine's, or vLLM's).
        rollout_python: the Python executable the replicas run in (the vLLM environment:
            :func:`sao.rollout.vllm_engine.vllm_python`); None: this process's.
        agent: budgets and sampling of the agent loop.
        env_options: options per environment name (e.g. tool latency for benchmarks).
        max_in_flight: trajectories generated at once across replicas.
        group_size: rollouts of each task, launched one after another (GRPO's groups; 1 for SAO).
        cancel_stale: cancel a rollout in flight that has become too stale to be trained on
            (:class:`sao.rollout.driver.DriverConfig`).
        synchronous: synchronous RL (the comparison of the speed benchmark): with
            ``train.max_staleness = 0`` the driver launches one batch per trainer version, and each of
            its rollouts starts only once its replica runs that version; the trainer waits for the
            whole batch, the rollouts for the update. False: asynchronous (SAO).
        writer: lake writer batching (also the issue log's); None: :meth:`writer_config` picks it by mode.
        use_ray_train: run the trainer on Ray Train workers (False: in this process, one worker).
        seed: shuffles the task stream and seeds rollouts.
        app_name: Serve application name.
        stop_grace_s: after a Ctrl-C, how long rollouts in flight may finish before they are cancelled.
    """

    train: TrainConfig
    ray: RayConfig = RayConfig()
    num_replicas: int = 2
    cpus_per_replica: float = 0.5
    gpus_per_replica: float = 0.0
    resources_per_replica: dict[str, float] = dataclasses.field(default_factory=dict)
    engine: TorchEngineConfig | VLLMEngineConfig = TorchEngineConfig()
    rollout_python: str | None = None
    agent: AgentConfig = AgentConfig()
    env_options: dict = dataclasses.field(default_factory=dict)
    max_in_flight: int = 64
    group_size: int = 1
    cancel_stale: bool = True
    synchronous: bool = False
    writer: WriterConfig | None = None
    use_ray_train: bool = True
    seed: int = 0
    app_name: str = "rollout"
    stop_grace_s: float = interrupt.GRACE_S

    def writer_config(self) -> WriterConfig:
        """``writer``, or by default: in an asynchronous run, a commit per half batch, at least
        :data:`ASYNC_FLUSH_ROWS` rows, when the oldest row has waited :data:`ASYNC_FLUSH_S`, or as soon as
        the rows the trainer waits for are in (:meth:`sao.lake.writer.TrajectoryWriter.demand`): that is
        what keeps the trainer fed, and each commit costs the driver's process CPU the replicas and the
        trainer share. At batch 128, commits of 64 rows or 1 s instead of 16 rows or 0.25 s took its CPU
        per completion from 22.8 to 18.2 ms in ``sao bench peer``'s ``sao-single``; at batch 32, an age
        flush of 1 s instead of 0.25 s took the writer from 4.5 to 3.2 commits a step in a diagnostic run
        of ``sao bench speed``'s lake arm (three rounds; ``docs/RESULTS.md``, the ``speed`` notes). In a
        synchronous run, one commit per batch (the trainer cannot start before the whole batch is in, and
        the driver commits it the moment its last rollout ends: :mod:`sao.rollout.driver`), with
        :data:`SYNC_FLUSH_S` bounding how long a row waits in memory."""
        if self.writer is not None:
            return self.writer
        if self.synchronous:
            return WriterConfig(flush_rows=self.train.batch_size, flush_seconds=SYNC_FLUSH_S)
        rows = max(ASYNC_FLUSH_ROWS, self.train.batch_size // 2)
        return WriterConfig(flush_rows=rows, flush_seconds=ASYNC_FLUSH_S)

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
    interrupted: bool = False
    relaunched: int = 0  # rollouts a dead predecessor left in flight, closed out and launched again


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
    return str(policy_dir(train.checkpoint_root, version))


def _relaunches(lake: Lake, run_id: str, issuer_id: str,
                tasks: Sequence[Task]) -> list[tuple[Task, IssuedRollout]]:
    """Close out what a dead predecessor of the run left in flight; (task, abandoned launch) for each
    one whose task is still among ``tasks`` (the others stay closed out, with a warning)."""
    abandoned = close_out_unresolved(lake, run_id, issuer_id)
    if not abandoned:
        return []
    by_id = {(task.env, task.task_id): task for task in tasks}
    pairs = [(by_id[(a.env_name, a.task_id)], a) for a in abandoned if (a.env_name, a.task_id) in by_id]
    log.warning("run %s: %d rollouts were in flight when the run last stopped without closing them; closed out "
                "as abandoned, %d launched again", run_id, len(abandoned), len(pairs))
    if len(pairs) < len(abandoned):
        log.warning("run %s: %d abandoned rollouts name tasks that are no longer in the task set: not relaunched",
                    run_id, len(abandoned) - len(pairs))
    return pairs


async def _drive(driver: RolloutDriver, tasks: Iterator[Task], *, stop_when: threading.Event | None = None,
                 grace_s: float, limit: int | None = None,
                 relaunch: Sequence[tuple[Task, IssuedRollout]] = ()) -> DriverStats:
    """Run ``driver``: launching stops when ``stop_when`` is set or on a Ctrl-C (:mod:`sao.interrupt`);
    after a Ctrl-C, what is still in flight ``grace_s`` later is cancelled."""
    stop, cancel = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        while not (interrupt.requested() or (stop_when is not None and stop_when.is_set())):
            await asyncio.sleep(0.05)
        stop.set()
        while not interrupt.requested():
            await asyncio.sleep(0.05)
        await asyncio.sleep(grace_s)
        cancel.set()

    watcher = asyncio.ensure_future(watch())
    try:
        return await driver.run(tasks, limit=limit, stop=stop, cancel=cancel, relaunch=relaunch)
    finally:
        watcher.cancel()


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
    _check_rollout_gpus(cfg)
    if cfg.use_ray_train:  # GPUs the trainer cannot have are refused now, before rollouts start
        from sao.train.device import use_gpu

        use_gpu(train.device, bf16=train.bf16, workers=train.num_workers, gpus_per_worker=train.gpus_per_worker,
                rollout_gpus=train.rollout_gpus)
    version = prepare_run(train)
    lake = Lake.open(train.lake)
    done_before = last_committed_step(lake, train.run_id)
    issuer_id = f"{train.run_id}-driver"
    relaunch = _relaunches(lake, train.run_id, issuer_id, tasks)
    if done_before is not None and done_before[0] + 1 >= train.total_steps:
        # Trained already (stopped in its final evaluation, or asked for fewer steps than it has): no
        # rollout app, and no window of rollouts that no step would take.
        log.info("run %s: %d steps committed, %d asked for: nothing to train", train.run_id, done_before[0] + 1,
                 train.total_steps)
        return PipelineResult(steps=done_before[0] + 1, version=done_before[1], driver=DriverStats(),
                              wall_s=time.monotonic() - started, train_s=0.0)
    backlog = unconsumed_count(lake, train.run_id)  # a resumed run's rows beyond its last step
    if backlog:
        log.info("run %s: %d stored trajectories wait for the trainer (consumed next, or passed over); they hold "
                 "places in the staleness gate", train.run_id, backlog)
    rollout = RolloutConfig(
        policy_path=_current_policy_path(train, version), app_name=cfg.app_name, initial_version=version,
        num_replicas=cfg.num_replicas, cpus_per_replica=cfg.cpus_per_replica,
        gpus_per_replica=cfg.gpus_per_replica, engine=cfg.engine,
        agent=cfg.agent, env_options=cfg.env_options, resources_per_replica=cfg.resources_per_replica,
        python=cfg.rollout_python,
    )
    if isinstance(cfg.engine, VLLMEngineConfig) and not cfg.gpus_per_replica and ray.cluster_resources().get("GPU"):
        log.warning("run %s: the Ray cluster has GPUs but the vLLM replicas ask Ray for none (rollout.gpus 0), so "
                    "none is assigned to them: set rollout.gpus (1, or a share beside the trainer)", train.run_id)
    if isinstance(cfg.engine, VLLMEngineConfig) and not cfg.engine.record_routing:  # said once per run
        log.warning("run %s: the vLLM replicas record no MoE routing (routed_experts is null in the lake, and the "
                    "trainer routes by its own forward); rollout.vllm.record_routing records it where vLLM returns "
                    "it (its V2 model runner, on a GPU)", train.run_id)
    broker = get_or_create_broker(cfg.app_name)
    # The broker outlives runs (a detached actor per app name): a run starts it over at its version.
    ray.get(broker.reset.remote(version))
    handle = start_rollout_app(rollout)

    async def trainer_version() -> int:
        return max(version, await broker.latest_version.remote())

    async def trainer_skipped() -> int:
        return await broker.skipped_total.remote()

    async def trainer_newer(seen: int, timeout_s: float) -> int:
        return await broker.wait_version.remote(seen, timeout_s)

    issue_log = IssueLog(lake, cfg.writer_config(), issuer_id=issuer_id)
    # No record is committed before its launch: a trajectory commit first commits the launches of its
    # records that the issue log still holds (those of longer rollouts are often committed by then).
    # Each commit is announced at the broker, where a trainer waiting for its batch is told at once.
    writer = TrajectoryWriter(lake, cfg.writer_config(), writer_id=issuer_id,
                              before_flush=issue_log.flush_for, after_commit=broker.rows_committed.remote)
    # And the rows a waiting trainer still needs are committed the moment the writer holds them.
    stop_demand = threading.Event()
    demand = threading.Thread(
        target=_follow_demand, name="writer-demand", daemon=True,
        args=(lambda seen, wait_s: ray.get(broker.wait_demand.remote(seen, wait_s)), writer, stop_demand))
    driver = RolloutDriver(
        handle, writer, train.run_id,
        DriverConfig(max_in_flight=cfg.max_in_flight, batch_size=train.batch_size,
                     max_staleness=train.max_staleness, seed=cfg.seed + version, synchronous=cfg.synchronous,
                     cancel_stale=cfg.cancel_stale),
        trainer_version=trainer_version, initial_version=version, backlog=backlog, on_record=on_record,
        issue_log=issue_log, trainer_skipped=trainer_skipped, trainer_newer=trainer_newer,
    )
    stop_rollouts = threading.Event()
    driver_result: dict[str, object] = {}

    def drive() -> None:
        stream = task_stream(tasks, cfg.seed + version, repeat=cfg.group_size)
        try:
            driver_result["stats"] = asyncio.run(_drive(driver, stream, stop_when=stop_rollouts,
                                                        grace_s=cfg.stop_grace_s, relaunch=relaunch))
        except BaseException as exc:  # surfaced to the caller below
            driver_result["error"] = exc

    thread = threading.Thread(target=drive, name="rollout-driver", daemon=True)
    watcher = _StepWatcher(lake, train.run_id, done_before, on_step) if on_step is not None else None
    train_started = time.monotonic()
    with interrupt.graceful():
        demand.start()
        thread.start()
        try:
            _train_until_done_or_stopped(cfg.use_ray_train, train, broker, lambda: "error" in driver_result)
            train_s = time.monotonic() - train_started
        finally:
            stop_rollouts.set()
            if watcher is not None:
                watcher.close()
            thread.join(timeout=max(cfg.agent.timeout_s * 2, 60.0))
            stop_demand.set()
            demand.join(timeout=10.0)
            try:  # each of the three runs even if one before it raises: buffered rows are never dropped
                issue_log.flush()
            finally:
                try:
                    writer.close()
                finally:
                    serve.delete(cfg.app_name)
    if "error" in driver_result:
        raise RuntimeError(f"the rollout driver failed: {driver_result['error']}") from driver_result["error"]
    last = last_committed_step(lake, train.run_id)
    steps = 0 if last is None else last[0] + 1
    return PipelineResult(steps=steps, version=0 if last is None else last[1], driver=driver_result["stats"],
                          wall_s=time.monotonic() - started, train_s=train_s,
                          interrupted=interrupt.requested() and steps < train.total_steps, relaunched=len(relaunch))


def _follow_demand(wait_demand: Callable[[int, float], tuple[int, int]], writer: TrajectoryWriter,
                   stop: threading.Event, wait_s: float = 0.5) -> None:
    """Until ``stop``: each time the trainer starts waiting for rows, ask the writer to commit that many
    as soon as it holds them (:meth:`TrajectoryWriter.demand`), rather than at its batch size or age
    (an asynchronous run's age flush, :data:`ASYNC_FLUSH_S` per 16 rows, would hold them).
    ``wait_demand``: :meth:`sao.rollout.weights.WeightBroker.wait_demand`. A failure to reach the
    broker is logged, and the writer keeps its own flush rules."""
    seen = 0
    while not stop.is_set():
        try:
            count, wanted = wait_demand(seen, wait_s)
        except Exception as exc:  # the writer still flushes by rows and age
            log.warning("the writer no longer follows the trainer's waits: %s", exc)
            return
        if count > seen and not stop.is_set():  # a new wait (else the wait for one timed out)
            writer.demand(wanted)
        seen = count  # a reset of the broker starts the count over


def _train_until_done_or_stopped(use_ray_train: bool, train: TrainConfig, broker,
                                 driver_failed: Callable[[], bool] = lambda: False) -> None:
    """Run the trainer on a thread of its own while this (main) thread watches for a Ctrl-C or a failed
    rollout driver, either of which it passes to the trainer through the weight broker (the trainer
    commits its step and returns)."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            if use_ray_train:
                from sao.train.ray_trainer import fit

                fit(train)
            else:
                from sao.train.loop import run_training

                run_training(train)
        except BaseException as exc:
            outcome["error"] = exc

    trainer = threading.Thread(target=target, name="trainer", daemon=True)
    trainer.start()
    asked = False
    while trainer.is_alive():
        trainer.join(0.2)
        if (interrupt.requested() or driver_failed()) and not asked:
            broker.request_stop.remote()
            asked = True
    if "error" in outcome:
        raise outcome["error"]


def _check_rollout_gpus(cfg: PipelineConfig) -> None:
    """Refuse rollout replicas that ask for more GPUs than the Ray cluster has: Serve would wait for
    them forever."""
    import ray

    wanted = cfg.num_replicas * cfg.gpus_per_replica
    if wanted and ray.is_initialized():
        have = float(ray.cluster_resources().get("GPU", 0.0))
        if have < wanted:
            from sao.train.device import DeviceUnavailableError

            raise DeviceUnavailableError(
                f"the rollout replicas ask for {wanted:g} GPU(s) (rollout.gpus {cfg.gpus_per_replica:g} x "
                f"rollout.num_replicas {cfg.num_replicas}) and the Ray cluster has {have:g}: lower rollout.gpus or "
                "rollout.num_replicas, or start Ray on nodes with GPUs (ray start --num-gpus N)")


def collected(lake: Lake, run_id: str, skip_reasons: Sequence[str]) -> tuple[int, int]:
    """(rows stored, rows value pretraining fits on) of the data run ``run_id``: how far along its seeded
    task stream it is, and how many of its rollouts count towards what :func:`collect_rollouts` was
    asked for. A rollout that ended for one of ``skip_reasons`` (the run's ``algorithm.skip_reasons``,
    which :func:`sao.train.pretrain.select_samples` leaves out: by default ``cancelled``, as a Ctrl-C
    stores what was in flight, and ``error``) does not count, and the next task of the stream is rolled
    out in its place when the collection resumes: an interrupted run ends with as many samples as asked."""
    ends = lake.read_run("trajectories", run_id, ["termination_reason"])["termination_reason"]
    if len(ends) == 0:
        return 0, 0
    skipped = pc.sum(pc.is_in(ends, value_set=pa.array(list(skip_reasons), pa.string()))).as_py() or 0
    return len(ends), len(ends) - skipped


def collect_rollouts(cfg: PipelineConfig, tasks: Sequence[Task], run_id: str, count: int, *,
                     on_record: Callable[[object], None] | None = None,
                     on_progress: Callable[[str], None] | None = None) -> DriverStats:
    """Roll out ``count`` tasks with the run's version-0 policy into the lake under ``run_id``, with no
    training (the data of value pretraining). Idempotent: only what the run lacks is rolled out.
    ``on_progress`` gets a progress line at most every 10 s and at the end (default: this module's log)."""
    from ray import serve

    from sao.rollout.serve import start_rollout_app

    init_ray(cfg.ray)
    _check_rollout_gpus(cfg)
    lake = Lake.open(cfg.train.lake)
    issuer_id = f"{run_id}-driver"
    relaunch = _relaunches(lake, run_id, issuer_id, tasks)  # closes out a dead predecessor's rollouts
    stored, usable = collected(lake, run_id, cfg.train.update.skip_reasons)
    missing = count - usable
    if missing <= 0:
        return DriverStats()
    relaunch = relaunch[:missing]
    app_name = f"{cfg.app_name}-collect"
    rollout = RolloutConfig(policy_path=_current_policy_path(cfg.train, 0), app_name=app_name, initial_version=0,
                            num_replicas=cfg.num_replicas, cpus_per_replica=cfg.cpus_per_replica,
                            gpus_per_replica=cfg.gpus_per_replica, engine=cfg.engine,
                            agent=cfg.agent, env_options=cfg.env_options,
                            resources_per_replica=cfg.resources_per_replica, python=cfg.rollout_python)
    handle = start_rollout_app(rollout)
    issue_log = IssueLog(lake, cfg.writer_config(), issuer_id=issuer_id)
    writer = TrajectoryWriter(lake, cfg.writer_config(), writer_id=issuer_id, before_flush=issue_log.flush_for)
    driver = RolloutDriver(handle, writer, run_id, DriverConfig(max_in_flight=cfg.max_in_flight, seed=cfg.seed),
                           on_record=_shown_every(10.0, Progress("value pretraining:", count, "version-0 rollouts",
                                                                 start=usable), usable, on_record,
                                                  on_progress or log.info),
                           issue_log=issue_log)
    try:
        with interrupt.graceful():
            stats = asyncio.run(_drive(driver, task_stream(tasks, cfg.seed, start=stored), limit=missing,
                                       grace_s=cfg.stop_grace_s, relaunch=relaunch))
    finally:
        issue_log.flush()
        writer.close()
        serve.delete(app_name)
    if interrupt.requested():
        raise interrupt.RunInterrupted(f"run {run_id}: stopped while collecting version-0 rollouts")
    return stats


def _shown_every(every_s: float, progress: Progress, done: int, on_record: Callable[[object], None] | None,
                 show: Callable[[str], None]) -> Callable[[object], None]:
    """``on_record`` that also shows ``progress`` at most every ``every_s`` seconds, and at the end."""
    shown_at = -math.inf

    def counted(record) -> None:
        nonlocal done, shown_at
        done += 1
        if on_record is not None:
            on_record(record)
        if time.monotonic() - shown_at >= every_s or done >= progress.total:
            shown_at = time.monotonic()
            show(progress.line(done))

    return counted


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
        try:
            self._poll()
        except Exception:  # as in _run: progress output must never break the run, nor its shutdown
            log.exception("reading progress from train_steps failed")


def default_checkpoint_root(workdir: str | Path, run_id: str) -> str:
    return str(Path(workdir) / run_id / "checkpoints")
