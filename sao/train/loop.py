"""The training loop: read unconsumed trajectories from Delta, update, commit, publish.

Each step (one actor update):

1. rank 0 asks the lake reader for the next ``batch_size`` unconsumed trajectories of the run within
   ``max_staleness`` of the current version, pinned to one ``trajectories`` snapshot (it waits while
   fewer have arrived); the snapshot version and the ids go to every worker;
2. every worker reads its shard of those rows from the pinned snapshot and runs
   :meth:`sao.train.step.Learner.update` (gradients are summed across workers);
3. rank 0 writes the checkpoint of the new version, then the ``train_steps`` row (the commit point: the
   step happened, its trajectories are consumed), then the ``policy_versions`` row, then publishes the
   weights to the rollout replicas.

Every step runs :func:`compute_update` with the torch seed ``seed + policy_version_before`` (recorded
in the step's ``seeds``); step replay (:mod:`sao.train.replay`) calls the same function on the same rows,
with the settings :func:`sao.train.run_config.write_run_config` stored at the checkpoint root when the
run was prepared. With ``retention`` set, old checkpoints are pruned after each step
(:mod:`sao.train.retention`).

Resume: the last ``train_steps`` row of the run names the version to load; its checkpoint is complete
before the row is written, so a crash anywhere loses at most the step in flight, and that step's
trajectories are offered again (nothing consumed twice, nothing skipped). Trajectories beyond
``max_staleness`` stay in the table and are counted in the metrics, never deleted. A stop asked for
through the weight broker (a Ctrl-C of the run: :mod:`sao.interrupt`) ends the loop at the next step
boundary, or while it waits for a batch; the step in progress is committed first. Crash points
(:mod:`sao.faults`) mark the moments the crash harness kills the run at.

:func:`train_worker` is the body of one worker; :func:`run_training` runs it in-process (one worker)
and :func:`sao.train.ray_trainer.fit` runs it on Ray Train workers. A worker trains on the device
``train.device`` resolves to (:mod:`sao.train.device`): the GPU Ray Train gave it, this process's GPU
for the in-process trainer, or CPU. Checkpoints are written from and loaded onto CPU
(:mod:`sao.train.checkpoint`), so a run may resume on another kind of device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed as dist
from deltalake import DeltaTable

from sao.algos.advantages import flat_groups
from sao.faults import crash_point
from sao.lake.ledger import (
    StepsSeen,
    VersionsSeen,
    record_train_step,
    register_policy_version,
    registered_checkpoint,
)
from sao.lake.maintenance import compact_run
from sao.lake.reader import TrajectoryReader, read_trajectories
from sao.lake.records import PolicyVersionRecord, TrainStepRecord, utc_now
from sao.lake.store import Lake
from sao.models.critic import Critic, load_critic
from sao.models.policy import load_policy
from sao.models.tokenizer import load_tokenizer
from sao.train.batch import collate
from sao.train.checkpoint import (
    checkpoint_dir,
    is_complete,
    load_checkpoint,
    registered_location,
    save_checkpoint,
    weights_hash,
)
from sao.train.config import TrainConfig
from sao.train.device import CPU, configure_torch, resolve_device
from sao.train.oracle import attach_oracle
from sao.train.retention import apply_retention
from sao.train.run_config import write_run_config
from sao.train.step import Learner
from schemas import policy_versions, train_steps

__all__ = ["StepReport", "compute_update", "last_committed_step", "prepare_run", "run_training",
           "train_worker"]

log = logging.getLogger(__name__)

# Columns the trainer reads from ``trajectories`` (everything else stays in the lake).
TRAIN_COLUMNS = ("trajectory_id", "task_id", "prompt_ids", "completion_ids", "action_mask", "logprobs",
                 "logprob_kind", "reward", "termination_reason", "min_policy_version", "num_action_tokens",
                 "sampling", "routed_experts", "router_top_k")


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one committed step did (passed to the progress callback)."""

    step: int
    version: int
    trajectories_version: int
    trajectory_ids: tuple[str, ...]
    metrics: dict[str, float]
    report_due: bool = True  # whether to pass it on to Ray Train (see TrainConfig.report_interval_s)


def last_committed_step(lake: Lake, run_id: str) -> tuple[int, int] | None:
    """(step, policy_version_after) of the run's last ``train_steps`` row, or None."""
    rows = lake.read_run(train_steps.NAME, run_id, ["step", "policy_version_after"])
    if rows.num_rows == 0:
        return None
    last = max(rows.to_pylist(), key=lambda r: r["step"])
    return int(last["step"]), int(last["policy_version_after"])


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(obj):
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _load_models(cfg: TrainConfig, version: int, device: torch.device = CPU):
    """Policy and critic at ``version`` on ``device``, and the trainer state (on CPU: the optimisers
    move it to their parameters' device); version 0 may come from the SFT directory."""
    root = Path(cfg.checkpoint_root)
    try:
        checkpoint = load_checkpoint(root, version, with_critic=cfg.update.uses_critic, require_state=True)
        policy, critic, state = checkpoint.policy, checkpoint.critic, checkpoint.trainer_state
    except FileNotFoundError:
        if version != 0:
            raise
        policy, state = load_policy(cfg.policy_path), None
        critic = None
        if cfg.update.uses_critic:
            critic = load_critic(cfg.critic_path) if cfg.critic_path else Critic.from_policy(policy, cfg.critic)
    return policy.to(device), None if critic is None else critic.to(device), state


@dataclasses.dataclass(frozen=True)
class _Broker:
    """The trainer's calls to the run's weight broker (none go anywhere when it publishes nowhere)."""

    publish: Callable[[int, torch.nn.Module], float] | None = None
    stop_requested: Callable[[], bool] = lambda: False
    skipped: Callable[[int], None] = lambda count: None
    # (commits seen, longest wait, rows still wanted) -> commits announced: returns at the next commit
    # the rollout writer announces (which it makes as soon as it holds the rows wanted), else after the
    # wait; with no broker, the wait itself (the lake is polled)
    wait_rows: Callable[[int, float, int], int] = lambda seen, timeout, wanted: (time.sleep(timeout), seen)[1]


def _broker_calls(cfg: TrainConfig) -> _Broker:
    """The trainer's :class:`_Broker` calls through the run's weight broker."""
    if cfg.app_name is None:
        return _Broker()
    import ray

    from sao.rollout.weights import get_or_create_broker, publish_weights

    broker = get_or_create_broker(cfg.app_name)
    return _Broker(publish=lambda version, policy: publish_weights(broker, version, policy.state_dict()),
                   stop_requested=lambda: ray.get(broker.stop_requested.remote()),
                   skipped=lambda count: ray.get(broker.add_skipped.remote(count)),
                   wait_rows=lambda seen, timeout, wanted: ray.get(broker.wait_committed.remote(seen, timeout, wanted)))


class _Stopped(Exception):
    """The run was asked to stop (a Ctrl-C) while the trainer waited for a batch."""


def _wait_for_batch(reader: TrajectoryReader, cfg: TrainConfig, version: int, broker: _Broker = _Broker()):
    """Block until ``batch_size`` eligible trajectories are in the lake; returns (snapshot version,
    rows, read at that snapshot once the batch is complete, stale rows passed over, rows without an
    action token passed over, rows passed over for their termination reason:
    ``UpdateConfig.skip_reasons``). Rows passed over are
    reported to the broker as they are found, so that the rollout driver launches others in their
    place while this waits (at ``max_staleness`` 0 a batch would otherwise never fill once one of its
    rollouts saw a weight update). Raises :class:`_Stopped` when the broker's stop is requested."""
    deadline = time.monotonic() + cfg.wait_timeout_s
    held: list[pa.Table] = []
    snapshot = None
    stale = no_actions = cut_short = 0
    # The rollout writer's announced commits so far, counted before the first look at the lake: a wait
    # then returns at the first commit that look did not see.
    commits = broker.wait_rows(-1, 0.0, 0)
    while True:
        if broker.stop_requested():
            raise _Stopped
        want = cfg.batch_size - sum(t.num_rows for t in held)
        # With rows enough seen already, they come from the snapshot they were seen at: the oldest
        # rows go first either way, and looking for newer commits would cost a read of the log.
        pinned = reader.snapshot_version if reader.pending >= want else None
        # The rows' ids alone: the full rows are read once, when the batch is complete.
        micro = reader.next_micro_batch(version, cfg.max_staleness, want, version=pinned, fetch=False)
        stale += micro.skipped_stale
        no_actions += micro.skipped_no_actions
        cut_short += micro.skipped_passed_over
        passed = micro.skipped_stale + micro.skipped_no_actions + micro.skipped_passed_over
        if passed:
            broker.skipped(passed)
        if len(micro):
            held.append(micro.data)
        snapshot = micro.snapshot_version
        if sum(t.num_rows for t in held) >= cfg.batch_size:
            return snapshot, reader.fetch(pa.concat_tables(held)), stale, no_actions, cut_short
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"run {cfg.run_id!r}: only {sum(t.num_rows for t in held)} of {cfg.batch_size} trajectories "
                f"arrived within {cfg.wait_timeout_s} s at version {version} (max_staleness {cfg.max_staleness})"
            )
        if pinned is None:  # else the rows seen were too few once the stale ones were out: look again now
            # told of the next commit, or polls
            commits = broker.wait_rows(commits, cfg.poll_s, cfg.batch_size - sum(t.num_rows for t in held))


def compute_update(learner: Learner, rows: Sequence[Mapping], version: int, rank: int = 0,
                   world: int = 1) -> dict[str, float]:
    """One step's update: ``rows`` are the step's whole batch in recorded order, ``version`` the
    trainer's version before it; this worker trains on its shard (rows ``rank::world``). Step replay
    calls this too, so a replayed step computes exactly what the loop computed."""
    full = collate(rows, trainer_version=version, bootstrap_reasons=learner.config.bootstrap_reasons)
    sequence_advantages = learner.sequence_advantages(full.scalar_rewards, full.group_ids)
    shard = list(range(rank, len(rows), world))
    batch = full.select(shard)
    policy_values = None
    if learner.config.oracle_values:
        if learner.policy_values is None:
            raise ValueError("algorithm.oracle_values is on but the learner has no oracle "
                             "(sao.train.oracle.attach_oracle)")
        policy_values = learner.policy_values([rows[i] for i in shard], batch.to(learner.device))
    metrics = learner.update(batch, None if sequence_advantages is None else sequence_advantages[shard], policy_values)
    groups, flat = flat_groups(full.scalar_rewards, full.group_ids)
    if groups:  # the whole batch's groups (every worker reports the same share)
        metrics["batch/flat_group_frac"] = flat / groups
    return metrics


@dataclasses.dataclass
class _Worker:
    """What one training worker carries from step to step (rank 0 alone has a reader and a broker)."""

    cfg: TrainConfig
    rank: int
    world: int
    lake: Lake
    learner: Learner
    tokenizer: object
    broker: _Broker
    reader: TrajectoryReader | None
    step: int  # the next step to run
    version: int  # the policy's version before it
    held: pa.Table | None = None  # rank 0: the rows the reader handed out for the step in progress
    ledger: dict[str, DeltaTable] = dataclasses.field(default_factory=dict)
    """Rank 0: ``train_steps`` and ``policy_versions`` as last committed to, each step bringing them up to
    date from the commits since (loading one afresh replays its log from the last checkpoint: up to 99
    commits, a cost that rose and fell with the step number in ``sao bench longrun``)."""

    steps_seen: StepsSeen | None = None
    """Rank 0: the run's ``train_steps`` rows read so far, so that each step's exactly-once check reads
    only the rows committed since (reading every row of the run grew with its length), and nothing when
    no other commit followed the last step's."""

    versions_seen: VersionsSeen | None = None
    """Rank 0: the run's newest ``policy_versions`` row as last read or written, so that registering the
    next version reads nothing when no other commit followed."""

    retention_after: int = -1
    """Rank 0: checkpoint versions up to this one are settled by retention (the last plan's
    ``settled``; -1 at the start, so a resumed run looks at every version once)."""

    def ledger_table(self, name: str) -> DeltaTable:
        if name not in self.ledger:
            self.ledger[name] = self.lake.table(name)
        return self.ledger[name]

    @property
    def policy(self) -> torch.nn.Module:
        return self.learner.policy

    @property
    def critic(self) -> Critic | None:
        return self.learner.critic


@dataclasses.dataclass(frozen=True)
class _Selection:
    """Rank 0's choice of a step's rows, sent to every worker."""

    snapshot: int  # the trajectories version the rows are read at
    ids: list[str]
    seqs: list[int]  # their ``ingest_seq`` values: the other workers read just those rows' files
    stale: int  # rows passed over as beyond max_staleness while waiting
    no_actions: int  # rows passed over as having no action token
    cut_short: int  # rows passed over for their termination reason (``UpdateConfig.skip_reasons``)
    due: bool  # whether this step is reported to Ray Train


def train_worker(cfg: TrainConfig, *, device: torch.device | None = None, max_steps: int | None = None,
                 on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
    """The body of one training worker (see the module docstring). ``device``: where it trains (a Ray
    Train worker's, :func:`sao.train.device.worker_device`); None resolves ``cfg.device`` in this
    process. ``max_steps`` stops early (tests); ``on_step`` runs on every worker after each committed step."""
    worker = _start_worker(cfg, resolve_device(cfg.device, bf16=cfg.bf16) if device is None else device)
    reports: list[StepReport] = []
    last_report = -math.inf
    while worker.step < cfg.total_steps and (max_steps is None or len(reports) < max_steps):
        started_at = utc_now()
        torch.manual_seed(cfg.seed + worker.version)  # recorded in the step's seeds
        t0 = time.perf_counter()
        last = worker.step + 1 == cfg.total_steps or (max_steps is not None and len(reports) + 1 == max_steps)
        selection = _broadcast(_select(worker, last, last_report) if worker.rank == 0 else None)  # to every worker
        if selection is None:
            break
        if selection.due:
            last_report = time.monotonic()
        timings = {"wait_read_s": time.perf_counter() - t0}
        metrics = _update(worker, selection, timings)
        worker.version += 1
        if worker.rank == 0:
            metrics = _commit(worker, selection, metrics, started_at, timings)
        report = StepReport(worker.step, worker.version, selection.snapshot, tuple(selection.ids), metrics,
                            report_due=selection.due)
        reports.append(report)
        if worker.world > 1:
            dist.barrier()
        if on_step is not None:
            on_step(report)  # on every worker: Ray Train's report is a collective call
        worker.step += 1
    return reports


def _start_worker(cfg: TrainConfig, device: torch.device) -> _Worker:
    """Resume point, models (on ``device``) and optimiser state; rank 0 also stores the run
    configuration, makes sure the current version is registered and re-publishes it (replicas may be
    behind after a restart)."""
    rank, world = _rank_world()
    configure_torch(device, threads=cfg.torch_threads, deterministic=cfg.deterministic)
    lake = Lake.open(cfg.lake)
    resumed = last_committed_step(lake, cfg.run_id)
    step, version = (0, 0) if resumed is None else (resumed[0] + 1, resumed[1])
    uri = _registered_uri(lake, cfg, version) if rank == 0 else ""
    torch.manual_seed(cfg.seed + version)
    policy, critic, trainer_state = _load_models(cfg, version, device)
    learner = Learner(cfg.update, policy, critic, bf16=cfg.bf16)
    if trainer_state is not None:
        learner.load_state_dict(trainer_state)
    tokenizer = load_tokenizer(cfg.policy_path)
    attach_oracle(learner, tokenizer)
    worker = _Worker(cfg, rank, world, lake, learner, tokenizer,
                     broker=_broker_calls(cfg) if rank == 0 else _Broker(),
                     reader=TrajectoryReader(lake, cfg.run_id, columns=TRAIN_COLUMNS,
                                             pass_over=cfg.update.skip_reasons) if rank == 0 else None,
                     step=step, version=version, steps_seen=StepsSeen(cfg.run_id) if rank == 0 else None,
                     versions_seen=VersionsSeen(cfg.run_id) if rank == 0 else None)
    if rank == 0:
        write_run_config(cfg)
        _ensure_version_registered(lake, cfg, version, uri, policy, critic, worker.tokenizer, learner, step - 1)
        if worker.broker.publish is not None and version > 0:
            worker.broker.publish(version, policy)
    return worker


def _select(worker: _Worker, last: bool, last_report: float) -> _Selection | None:
    """Rank 0: wait for the step's rows (None when a stop was asked for meanwhile); the step is reported
    to Ray Train when it is the ``last`` or ``report_interval_s`` passed since ``last_report``."""
    cfg = worker.cfg
    try:
        snapshot, table, stale, no_actions, cut_short = _wait_for_batch(worker.reader, cfg, worker.version, worker.broker)
    except _Stopped:
        log.info("run %s: stop requested; the trainer stops at step %d (version %d)",
                 cfg.run_id, worker.step, worker.version)
        return None
    due = last or time.monotonic() - last_report >= cfg.report_interval_s
    worker.held = table
    return _Selection(snapshot, table.column("trajectory_id").to_pylist(), table.column("ingest_seq").to_pylist(),
                      stale, no_actions, cut_short, due)


def _update(worker: _Worker, selection: _Selection, timings: dict[str, float]) -> dict[str, float]:
    """Every worker: the selected rows (rank 0 has them from its reader; the others read them at the
    pinned snapshot, from the files their ``ingest_seq`` values fall in) and the update on its shard;
    the step's metrics, merged across workers."""
    cfg = worker.cfg
    t0 = time.perf_counter()
    if worker.held is not None:
        table, worker.held = worker.held, None
    else:
        table = read_trajectories(worker.lake, version=selection.snapshot, run_id=cfg.run_id,
                                  trajectory_ids=selection.ids, ingest_seqs=selection.seqs, columns=TRAIN_COLUMNS)
    rows = table.select(list(TRAIN_COLUMNS)).to_pylist()
    t1 = time.perf_counter()
    timings["read_s"] = t1 - t0
    metrics = compute_update(worker.learner, rows, worker.version, worker.rank, worker.world)
    timings["update_s"] = time.perf_counter() - t1
    crash_point("mid-step", worker.step)  # the update is done, nothing of it is saved yet
    metrics = _merge_worker_metrics(metrics, worker.world)
    metrics["batch/stale_skipped"] = float(selection.stale)
    metrics["batch/no_action_skipped"] = float(selection.no_actions)
    metrics["batch/cut_short_skipped"] = float(selection.cut_short)
    metrics["batch/world_size"] = float(worker.world)
    return metrics


def _commit(worker: _Worker, selection: _Selection, metrics: dict[str, float], started_at,
            timings: dict[str, float]) -> dict[str, float]:
    """Rank 0, after the update to ``worker.version``: the checkpoint, then the ``train_steps`` row
    (the commit point), then the version's row, retention and compaction, then the weights to the
    replicas. Returns the step's metrics with the publication time (which is not in the row)."""
    cfg, step, version = worker.cfg, worker.step, worker.version
    t2 = time.perf_counter()
    _, digest = save_checkpoint(cfg.checkpoint_root, version, worker.policy, worker.tokenizer, worker.critic,
                                worker.learner.state_dict())
    record_train_step(worker.lake, TrainStepRecord(
        run_id=cfg.run_id, step=step, policy_version_before=version - 1, policy_version_after=version,
        trajectories_version=selection.snapshot, trajectory_ids=tuple(selection.ids), started_at=started_at,
        finished_at=utc_now(), metrics=metrics, seeds={"torch": cfg.seed + version - 1},
        timings={**timings, "commit_s": time.perf_counter() - t2},
    ), ingest_seqs=selection.seqs, snapshot=worker.reader, table=worker.ledger_table(train_steps.NAME),
        seen=worker.steps_seen)
    worker.reader.consumed(selection.ids)
    crash_point("after-commit", step)  # between the step's row and its version's row
    register_policy_version(worker.lake, PolicyVersionRecord(
        run_id=cfg.run_id, version=version, parent_version=version - 1,
        checkpoint_uri=str(checkpoint_dir(cfg.checkpoint_root, version).resolve()),
        weights_hash=digest, step=step), table=worker.ledger_table(policy_versions.NAME),
        seen=worker.versions_seen)
    if cfg.retention is not None:
        worker.retention_after = apply_retention(worker.lake, cfg.run_id, cfg.checkpoint_root, cfg.retention,
                                                 after=worker.retention_after).settled
    if cfg.compact_every and (step + 1) % cfg.compact_every == 0:
        compact_run(worker.lake, cfg.run_id)
    crash_point("before-publish", step)
    if worker.broker.publish is not None:  # after the commit: not in the step's row, only in its report
        metrics = {**metrics, "time/publish_s": worker.broker.publish(version, worker.policy)}
    return metrics


_SUMMED = ("batch/trajectories", "batch/action_tokens", "batch/staleness_count/", "actor/all_masked_rows",
           "actor/loss", "actor/entropy", "critic/loss")


def _merge_worker_metrics(metrics: dict[str, float], world: int) -> dict[str, float]:
    """One set of step metrics from every worker's shard: counts and losses (already divided by the
    whole batch's denominator) add up; other metrics are averaged, weighted by action tokens. Gradient
    norms are the same on every worker (taken after the all-reduce)."""
    if world == 1:
        return metrics
    gathered: list[dict[str, float]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, metrics)
    weights = [m.get("batch/action_tokens", 0.0) for m in gathered]
    total = sum(weights) or 1.0
    merged: dict[str, float] = {}
    for key in sorted({k for m in gathered for k in m}):
        values = [(m[key], w) for m, w in zip(gathered, weights, strict=True) if key in m]
        if key.startswith(_SUMMED):
            merged[key] = sum(v for v, _ in values)
        elif key.endswith("grad_norm") or key.startswith("time/"):
            merged[key] = max(v for v, _ in values)
        else:
            merged[key] = sum(v * w for v, w in values) / (sum(w for _, w in values) or total)
    return merged


def _registered_uri(lake: Lake, cfg: TrainConfig, version: int) -> str:
    """Where version ``version`` is (or will be) registered, checked before any load: a run moved away
    from where it registered its checkpoints is refused, naming both places
    (:class:`~sao.train.checkpoint.CheckpointMovedError`)."""
    return registered_location(registered_checkpoint(lake, cfg.run_id, version), cfg.checkpoint_root, version)


def _ensure_version_registered(lake: Lake, cfg: TrainConfig, version: int, uri: str, policy, critic, tokenizer,
                               learner: Learner, step: int) -> None:
    """Version 0 gets its checkpoint and ``policy_versions`` row at the start of a run; after a crash
    between a step's commit and its version row, the row is written now (idempotent). A version
    registered already keeps its recorded location ``uri`` (:func:`~sao.train.checkpoint.registered_location`)."""
    if not is_complete(cfg.checkpoint_root, version):
        save_checkpoint(cfg.checkpoint_root, version, policy, tokenizer, critic, learner.state_dict())
    register_policy_version(lake, PolicyVersionRecord(
        run_id=cfg.run_id, version=version, parent_version=None if version == 0 else version - 1,
        checkpoint_uri=uri, weights_hash=weights_hash(policy),
        step=None if version == 0 else step))


def prepare_run(cfg: TrainConfig) -> int:
    """Open the lake and make sure the run's current version has its checkpoint and
    ``policy_versions`` row (version 0 from ``policy_path`` for a new run); returns that version.
    Rollouts of a run may start only after this (the lake refuses versions not yet registered)."""
    lake = Lake.open(cfg.lake)
    resumed = last_committed_step(lake, cfg.run_id)
    step, version = (0, 0) if resumed is None else (resumed[0] + 1, resumed[1])
    uri = _registered_uri(lake, cfg, version)
    write_run_config(cfg)
    policy, critic, state = _load_models(cfg, version)
    learner = Learner(cfg.update, policy, critic)
    if state is not None:
        learner.load_state_dict(state)
    _ensure_version_registered(lake, cfg, version, uri, policy, critic, load_tokenizer(cfg.policy_path), learner,
                               step - 1)
    return version


def run_training(cfg: TrainConfig, **kwargs) -> list[StepReport]:
    """Run :func:`train_worker` in this process (one worker, no process group)."""
    return train_worker(cfg, **kwargs)
