"""Step replay: re-run recorded updates on the frozen data they used and compare bit for bit.

``replay_steps(lake, run, first, last)`` (``sao replay --run R --step N`` / ``--steps N:M``):

1. reads the recorded ``train_steps`` rows: each names the policy version before and after it, the
   ``trajectories`` snapshot it read, the trajectory ids in the order it used them, its metrics and
   its torch seed;
2. reads the run's settings from ``run_config.json`` at its checkpoint root
   (:mod:`sao.train.run_config`; a missing or unreadable file is a :class:`ReplayError`) and applies
   them: the same :class:`~sao.train.config.UpdateConfig` (so the same token-budget micro-batch split),
   thread count and deterministic kernels;
3. loads the full checkpoint (policy, critic, optimisers, schedulers, running-mean window) of the
   version before step ``first``. If retention pruned it, it loads the newest version before that still
   kept in full (version 0 always is) and replays the recorded steps in between first ("lead-in"
   steps, each checked like the others);
4. recomputes every step with :func:`sao.train.loop.compute_update`, the very function the training
   loop runs, continuing in memory from step to step as the trainer did;
5. compares the SHA-256 of the resulting policy weights with the ``policy_versions.weights_hash`` the
   step recorded, and every recorded metric with the recomputed one (exactly, by default), except
   wall-clock timings (``time/...``) and what the reader passed over (``batch/stale_skipped``,
   ``batch/no_action_skipped``, ``batch/cut_short_skipped``: facts about the reader at the time, not
   about the update). The weights of the loaded start version are checked against its
   recorded hash too, so a tampered checkpoint is named as such.

On CPU with ``deterministic`` settings (the default) a single-worker step reproduces bit for bit.
Steps of a multi-worker run summed gradients across workers in another order: they replay within
float tolerance only (``batch/world_size`` then differs, and the report says so).

Replay runs on CPU in float32 whatever the run's ``train.device`` and ``train.bf16``
(:mod:`sao.train.device`): checkpoints load on CPU and the recomputation stays there, so a replay
needs no GPU and a CPU run's steps stay bit-for-bit checkable. What that means for each kind of run:

- a CPU run (one worker, ``deterministic``): bit for bit, weights hash and every metric exactly;
- a GPU run: not bit for bit. CUDA kernels differ from the CPU's in summation order and some (atomic
  adds in the MoE's scatter and attention backward passes) do not even repeat on the GPU itself;
  bf16 autocast rounds every matmul. The replayed weights hash differs from the recorded one, and the
  metrics agree within a tolerance only (``metric_tolerance``, ``sao replay --metric-tolerance``; looser
  under bf16, and metrics that count tokens near a threshold, such as DIS kept fractions, may move by
  a token). A GPU-trained step replayed on CPU checks that the step's data, settings and arithmetic were
  what the lake says, up to that tolerance.

Where the rows come from (:class:`RowSource`): one step reads only its ids from its snapshot with the
lake reader (:func:`sao.lake.reader.read_trajectories`: an index scan and a predicate on those rows).
A range reads a whole snapshot once: with a Ray instance available (``ray.is_initialized()``, or
``RowSource.RAY_DATA``) through ``ray.data.read_delta`` at the newest snapshot the range recorded,
filtered to the run, which parallelises over files and is how whole snapshots are read elsewhere
(value pretraining, evaluation); rows are immutable once written (the writer only inserts,
compaction rewrites files not rows), so a row read at a later snapshot equals the row the step read,
and each id is checked present in the step's own recorded snapshot. Without Ray it falls back to
the lake reader, step by step.

Compaction and vacuum keep every recorded snapshot readable (:mod:`sao.lake.maintenance`), so a replay
works after more data was appended and the table compacted and vacuumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

from sao.lake.ledger import record_train_step, register_policy_version
from sao.lake.reader import read_trajectories
from sao.lake.records import PolicyVersionRecord, TrainStepRecord, utc_now
from sao.lake.store import Lake, LakeError, is_valid_run_id, sql_literal
from sao.models.tokenizer import load_tokenizer
from sao.train.checkpoint import (
    CheckpointPrunedError,
    has_full_state,
    load_checkpoint,
    policy_dir,
    save_checkpoint,
    weights_hash,
)
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.loop import TRAIN_COLUMNS, compute_update
from sao.train.oracle import attach_oracle
from sao.train.run_config import RunConfigError, read_run_config, write_run_config
from sao.train.step import Learner
from schemas import policy_versions, train_steps, trajectories

__all__ = [
    "NOT_REPLAYED",
    "MetricMismatch",
    "RecordedStep",
    "ReplayError",
    "RowSource",
    "StepReplay",
    "StepReplayReport",
    "WhatIfReport",
    "WhatIfStep",
    "compare_metrics",
    "recorded_steps",
    "replay_steps",
    "run_checkpoints",
    "torch_settings",
    "what_if_steps",
]

NOT_REPLAYED = ("time/", "batch/stale_skipped", "batch/no_action_skipped", "batch/cut_short_skipped")
"""Metric name prefixes replay does not compare: timings, and what the reader skipped at the time."""


class ReplayError(Exception):
    """A replay that cannot start: unknown run, step or trajectory, missing configuration or
    checkpoints. (A replay that runs and disagrees is a report with ``ok`` False, not an error.)"""


class RowSource(enum.StrEnum):
    """Where replay reads a step's trajectories from (see the module docstring)."""

    AUTO = "auto"  # Ray Data for a range when a Ray instance is up, else the lake reader
    LAKE = "lake"  # the lake reader, step by step
    RAY_DATA = "ray_data"  # ray.data.read_delta at the range's newest recorded snapshot


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """One ``train_steps`` row, as replay needs it."""

    step: int
    policy_version_before: int
    policy_version_after: int
    trajectories_version: int
    trajectory_ids: tuple[str, ...]
    metrics: dict[str, float]
    seeds: dict[str, int]
    data_run_id: str  # the run whose trajectories it read (its own, or a what-if's parent)


@dataclasses.dataclass(frozen=True)
class MetricMismatch:
    """A metric that differs (None: absent on that side)."""

    name: str
    recorded: float | None
    replayed: float | None


@dataclasses.dataclass(frozen=True)
class StepReplay:
    """One replayed step.

    Attributes:
        recorded_hash: ``policy_versions.weights_hash`` of the version after the step (None: no row).
        replayed_hash: the hash of the weights the replay produced.
        metric_mismatches: recorded metrics that differ from the recomputed ones.
        metrics_compared: how many metrics were compared.
        recorded_world_size: Ray Train workers of the original step (> 1: bit-exactness not expected).
        lead_in: replayed only to reach the requested steps from an older kept checkpoint.
        seconds: wall time of reading the rows and recomputing the update.
    """

    step: int
    policy_version_before: int
    policy_version_after: int
    trajectories_version: int
    num_trajectories: int
    recorded_hash: str | None
    replayed_hash: str
    metric_mismatches: tuple[MetricMismatch, ...]
    metrics_compared: int
    recorded_world_size: int
    lead_in: bool
    seconds: float

    @property
    def hash_ok(self) -> bool:
        return self.recorded_hash == self.replayed_hash

    @property
    def ok(self) -> bool:
        return self.hash_ok and not self.metric_mismatches


@dataclasses.dataclass(frozen=True)
class StepReplayReport:
    """A replay of steps ``first`` .. ``last`` of ``run_id``.

    Attributes:
        start_version: the checkpoint the replay loaded (below ``first``'s version when pruned).
        start_hash_recorded / start_hash_loaded: the recorded and actual hash of that checkpoint's
            weights (they differ for a tampered or corrupted checkpoint).
        source: where the rows came from.
        steps: every replayed step, lead-in steps first.
        load_s: seconds spent loading the checkpoint and the settings.
    """

    run_id: str
    first: int
    last: int
    start_version: int
    start_hash_recorded: str | None
    start_hash_loaded: str
    source: RowSource
    steps: tuple[StepReplay, ...]
    load_s: float

    @property
    def start_ok(self) -> bool:
        return self.start_hash_recorded == self.start_hash_loaded

    @property
    def ok(self) -> bool:
        return self.start_ok and all(step.ok for step in self.steps)

    def to_dict(self) -> dict:
        """A JSON-ready form (``sao replay --json``)."""
        out = dataclasses.asdict(self)
        out["source"] = str(self.source)
        out["ok"] = self.ok
        out["start_ok"] = self.start_ok
        for step, replayed in zip(out["steps"], self.steps, strict=True):
            step["ok"], step["hash_ok"] = replayed.ok, replayed.hash_ok
        return out


# ----- locating a run's records and checkpoints --------------------------------------------------


def _run_predicate(run_id: str) -> str:
    if not is_valid_run_id(run_id):
        raise ReplayError(f"{run_id!r} is not a valid run id")
    return f"run_id = {sql_literal(run_id)}"


def _version_rows(lake: Lake, run_id: str) -> dict[int, dict]:
    rows = lake.read(policy_versions.NAME, predicate=_run_predicate(run_id)).to_pylist()
    return {int(row["version"]): row for row in rows}


def run_checkpoints(lake: Lake, run_id: str, checkpoint_root: str | Path | None = None
                    ) -> tuple[Path, TrainConfig, dict[int, dict]]:
    """(checkpoint root, stored TrainConfig, ``policy_versions`` rows by version) of ``run_id``.

    The root is where ``policy_versions`` says version 0 was checkpointed, unless ``checkpoint_root``
    overrides it (checkpoints moved).

    Raises:
        ReplayError: unknown run, or no readable run configuration at the root.
    """
    versions = _version_rows(lake, run_id)
    if not versions:
        raise ReplayError(f"unknown run {run_id!r}: it has no policy_versions rows in the lake at {lake.root}")
    if checkpoint_root is None:
        first = versions[min(versions)]
        checkpoint_root = Path(first["checkpoint_uri"]).parent
    root = Path(checkpoint_root)
    try:
        cfg = read_run_config(root)
    except RunConfigError as error:
        raise ReplayError(str(error)) from None
    if cfg.run_id != run_id:
        raise ReplayError(f"the run configuration at {root} is of run {cfg.run_id!r}, not {run_id!r}")
    return root, cfg, versions


def recorded_steps(lake: Lake, run_id: str) -> dict[int, RecordedStep]:
    """Every recorded step of ``run_id`` by step number."""
    rows = lake.read(train_steps.NAME, predicate=_run_predicate(run_id)).to_pylist()
    return {
        int(row["step"]): RecordedStep(
            step=int(row["step"]),
            policy_version_before=int(row["policy_version_before"]),
            policy_version_after=int(row["policy_version_after"]),
            trajectories_version=int(row["trajectories_version"]),
            trajectory_ids=tuple(row["trajectory_ids"]),
            metrics=dict(row["metrics"]),
            seeds=dict(row["seeds"]),
            data_run_id=row.get("data_run_id") or run_id,
        )
        for row in rows
    }


def _chain(steps: dict[int, RecordedStep], run_id: str, first: int, last: int, root: Path, with_critic: bool
           ) -> tuple[int, list[RecordedStep], list[RecordedStep]]:
    """(start version, lead-in steps, requested steps): the newest version kept in full at or before
    step ``first``'s, and the recorded steps from there."""
    missing = [n for n in range(first, last + 1) if n not in steps]
    if missing:
        known = f"{min(steps)}..{max(steps)}" if steps else "none"
        raise ReplayError(f"run {run_id!r} has no recorded step {missing[0]} (recorded steps: {known})")
    requested = [steps[n] for n in range(first, last + 1)]
    version = requested[0].policy_version_before
    lead_in: list[RecordedStep] = []
    while not has_full_state(root, version, with_critic=with_critic):
        previous = [s for s in steps.values() if s.policy_version_after == version]
        if version == 0 or not previous:
            raise ReplayError(
                f"run {run_id!r}: no checkpoint at {root} holds the full state of version {version} or of "
                "an earlier version reachable through recorded steps (deleted, or never written)")
        lead_in.insert(0, previous[0])
        version = previous[0].policy_version_before
    for a, b in zip(lead_in + requested, (lead_in + requested)[1:], strict=False):
        if a.policy_version_after != b.policy_version_before:
            raise ReplayError(f"run {run_id!r}: steps {a.step} and {b.step} do not chain "
                              f"(version {a.policy_version_after} then {b.policy_version_before})")
    return version, lead_in, requested


# ----- the rows of a step --------------------------------------------------------------------------


def _lake_rows(lake: Lake, step: RecordedStep) -> list[dict]:
    return read_trajectories(lake, version=step.trajectories_version, run_id=step.data_run_id,
                             trajectory_ids=list(step.trajectory_ids), columns=list(TRAIN_COLUMNS)).to_pylist()


class _RayDataRows:
    """The rows of a range of steps from one ``ray.data.read_delta`` of the newest recorded snapshot."""

    def __init__(self, lake: Lake, steps: Sequence[RecordedStep]) -> None:
        import ray

        runs = pa.array(sorted({s.data_run_id for s in steps}), pa.string())
        wanted = pa.array(sorted({i for s in steps for i in s.trajectory_ids}), pa.string())
        version = max(s.trajectories_version for s in steps)
        dataset = ray.data.read_delta(
            lake.table_uri(trajectories.NAME), version=version,
            storage_options=dict(lake.storage_options) or None, columns=["run_id", *TRAIN_COLUMNS])

        def keep(batch: pa.Table) -> pa.Table:
            chosen = pc.and_(pc.is_in(batch["run_id"], value_set=runs), pc.is_in(batch["trajectory_id"], value_set=wanted))
            return batch.filter(chosen).select(list(TRAIN_COLUMNS))

        self.rows: dict[str, dict] = {}
        for batch in dataset.map_batches(keep, batch_format="pyarrow").iter_batches(batch_format="pyarrow",
                                                                                     batch_size=None):
            for row in batch.to_pylist():
                self.rows[row["trajectory_id"]] = row
        self.lake = lake
        self._present: dict[tuple[int, str], pa.Array] = {}

    def __call__(self, step: RecordedStep) -> list[dict]:
        key = (step.trajectories_version, step.data_run_id)
        present = self._present.get(key)
        if present is None:  # index scan of the step's own snapshot: the ids must be in it
            present = self.lake.read(trajectories.NAME, version=step.trajectories_version, columns=["trajectory_id"],
                                     predicate=_run_predicate(step.data_run_id))["trajectory_id"].combine_chunks()
            self._present[key] = present
        ids = pa.array(step.trajectory_ids, pa.string())
        absent = [i for i, hit in zip(step.trajectory_ids, pc.is_in(ids, value_set=present).to_pylist(), strict=True)
                  if not hit or i not in self.rows]
        if absent:
            raise ReplayError(f"step {step.step}: {len(absent)} trajectories are not in snapshot "
                              f"{step.trajectories_version}, e.g. {absent[:3]}")
        return [self.rows[i] for i in step.trajectory_ids]


def _row_source(source: RowSource, chain_length: int) -> RowSource:
    source = RowSource(source)
    if source is not RowSource.AUTO:
        return source
    import ray

    return RowSource.RAY_DATA if chain_length > 1 and ray.is_initialized() else RowSource.LAKE


# ----- comparing --------------------------------------------------------------------------------


def _close(recorded: float, replayed: float, tolerance: float) -> bool:
    if math.isnan(recorded) or math.isnan(replayed):
        return math.isnan(recorded) and math.isnan(replayed)
    if tolerance == 0.0:
        return recorded == replayed
    return math.isclose(recorded, replayed, rel_tol=tolerance, abs_tol=tolerance)


def compare_metrics(recorded: Mapping[str, float], replayed: Mapping[str, float], tolerance: float = 0.0
                    ) -> tuple[tuple[MetricMismatch, ...], int]:
    """(mismatches, number compared) over the recorded names, skipping :data:`NOT_REPLAYED`; equal
    means exactly equal when ``tolerance`` is 0, else within it (relative and absolute). A recorded
    metric the replay lacks is a mismatch; one only the replay has (computed by a newer version of
    the code than the one that recorded the step) is not compared."""
    names = sorted(n for n in recorded if not n.startswith(NOT_REPLAYED))
    mismatches = tuple(
        MetricMismatch(name, recorded.get(name), replayed.get(name))
        for name in names
        if name not in recorded or name not in replayed or not _close(recorded[name], replayed[name], tolerance)
    )
    return mismatches, len(names)


@contextlib.contextmanager
def torch_settings(threads: int, deterministic: bool) -> Iterator[None]:
    """Run the block with the run's thread count and deterministic-kernel setting, then restore."""
    old_threads, old_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic)


# ----- replay -----------------------------------------------------------------------------------


def replay_steps(lake: Lake, run_id: str, first: int, last: int | None = None, *,
                 checkpoint_root: str | Path | None = None, source: RowSource = RowSource.AUTO,
                 metric_tolerance: float = 0.0) -> StepReplayReport:
    """Replay steps ``first`` .. ``last`` (both included; ``last`` defaults to ``first``) of ``run_id``.

    Raises:
        ReplayError: unknown run or step, ``last < first``, no run configuration, or no checkpoint
            to start from.
    """
    last = first if last is None else last
    if first < 0 or last < first:
        raise ReplayError(f"need 0 <= first <= last, got steps {first}..{last}")
    started = time.perf_counter()
    root, cfg, versions = run_checkpoints(lake, run_id, checkpoint_root)
    steps = recorded_steps(lake, run_id)
    with_critic = cfg.update.uses_critic
    start_version, lead_in, requested = _chain(steps, run_id, first, last, root, with_critic)
    chain = lead_in + requested
    chosen = _row_source(source, len(chain))
    try:
        checkpoint = load_checkpoint(root, start_version, with_critic=with_critic, require_state=True)
    except (FileNotFoundError, CheckpointPrunedError) as error:
        raise ReplayError(str(error)) from None
    learner = Learner(cfg.update, checkpoint.policy, checkpoint.critic)
    attach_oracle(learner, policy_dir(root, start_version))
    if checkpoint.trainer_state is not None:
        learner.load_state_dict(checkpoint.trainer_state)
    start_hash = weights_hash(checkpoint.policy)
    fetch = (_RayDataRows(lake, chain) if chosen is RowSource.RAY_DATA
             else lambda step: _lake_rows(lake, step))
    load_s = time.perf_counter() - started
    replayed: list[StepReplay] = []
    with torch_settings(cfg.torch_threads, cfg.deterministic):
        for index, step in enumerate(chain):
            replayed.append(_replay_one(learner, step, fetch, versions, metric_tolerance, cfg.seed,
                                        lead_in=index < len(lead_in)))
    recorded_start = versions.get(start_version, {}).get("weights_hash")
    return StepReplayReport(run_id=run_id, first=first, last=last, start_version=start_version,
                            start_hash_recorded=recorded_start, start_hash_loaded=start_hash, source=chosen,
                            steps=tuple(replayed), load_s=load_s)


def _replay_one(learner: Learner, step: RecordedStep, fetch, versions: dict[int, dict], tolerance: float,
                run_seed: int, *, lead_in: bool) -> StepReplay:
    began = time.perf_counter()
    try:
        rows = fetch(step)
    except LakeError as error:
        raise ReplayError(f"step {step.step}: cannot read its trajectories: {error}") from None
    torch.manual_seed(step.seeds.get("torch", run_seed + step.policy_version_before))
    metrics = compute_update(learner, rows, step.policy_version_before)
    metrics["batch/world_size"] = 1.0
    mismatches, compared = compare_metrics(step.metrics, metrics, tolerance)
    return StepReplay(
        step=step.step, policy_version_before=step.policy_version_before,
        policy_version_after=step.policy_version_after, trajectories_version=step.trajectories_version,
        num_trajectories=len(rows), recorded_hash=versions.get(step.policy_version_after, {}).get("weights_hash"),
        replayed_hash=weights_hash(learner.policy), metric_mismatches=mismatches, metrics_compared=compared,
        recorded_world_size=int(step.metrics.get("batch/world_size", 1.0)), lead_in=lead_in,
        seconds=time.perf_counter() - began,
    )


# ----- what-if replay: the same frozen data, changed settings ------------------------------------------

WHAT_IF_METRICS = ("actor/kept_frac", "actor/pg_loss", "actor/grad_norm", "actor/rho_mean", "critic/loss",
                   "critic/grad_norm", "batch/reward_mean")
"""The metrics a what-if replay prints side by side (its JSON report has every one)."""

FIXED_IN_WHAT_IF = ("warmup_steps_policy", "warmup_steps_critic", "cosine_steps_policy", "lr_final_ratio",
                    "running_mean_window", "token_budget")
"""Settings a what-if replay cannot change mid-run: they shape the optimiser schedules, the baseline's
window and the recorded micro-batch split that the loaded checkpoint state was built with."""


@dataclasses.dataclass(frozen=True)
class WhatIfStep:
    """One step re-run with changed settings, beside what was recorded.

    Attributes:
        recorded / rerun: every metric of the step as recorded and as re-run.
        weight_distance: L2 distance between the re-run policy weights after the step and the recorded
            version's weights.
        recorded_update_norm: L2 distance between the recorded weights before and after the step (the
            scale to read ``weight_distance`` against).
    """

    step: int
    policy_version_before: int
    policy_version_after: int
    trajectories_version: int
    num_trajectories: int
    recorded: dict[str, float]
    rerun: dict[str, float]
    weight_distance: float
    recorded_update_norm: float


@dataclasses.dataclass(frozen=True)
class WhatIfReport:
    """Steps ``first`` .. ``last`` of ``run_id`` re-run on their recorded snapshots and trajectory ids
    with ``overrides`` (``UpdateConfig`` fields), from the checkpoint of ``start_version`` (recorded
    lead-in steps, if any, re-run with the recorded settings first)."""

    run_id: str
    first: int
    last: int
    overrides: dict[str, object]
    start_version: int
    steps: tuple[WhatIfStep, ...]
    load_s: float

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


def _distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    other = dict(b.named_parameters())
    total = sum(float((p.detach().double() - other[name].detach().double()).pow(2).sum())
                for name, p in a.named_parameters())
    return math.sqrt(total)


def _apply_settings(learner: Learner, update: UpdateConfig) -> None:
    """Switch ``learner`` to ``update``: the loss and estimator settings are read from its config each
    step; learning rates, weight decay and Adam's epsilon are set on the optimisers (the warm-up
    schedule's position is kept); Adam's beta2 too (its moments so far are kept)."""
    learner.config = update
    pairs = [(learner.policy_optimizer, learner.policy_scheduler, update.lr_policy)]
    if learner.critic_optimizer is not None:
        pairs.append((learner.critic_optimizer, learner.critic_scheduler, update.lr_critic))
    for optimizer, scheduler, lr in pairs:
        scheduler.base_lrs = [lr for _ in optimizer.param_groups]
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        for group in optimizer.param_groups:
            group.update(lr=lr * factor, initial_lr=lr, weight_decay=update.weight_decay, eps=update.adam_eps,
                         betas=(group["betas"][0], update.adam_beta2))


def what_if_steps(lake: Lake, run_id: str, first: int, last: int, overrides: Mapping[str, object], *,
                  checkpoint_root: str | Path | None = None, record_as: str | None = None,
                  record_root: str | Path | None = None) -> WhatIfReport:
    """Re-run steps ``first`` .. ``last`` of ``run_id`` on the very snapshots and trajectory ids they
    used, with the update settings changed by ``overrides`` (``UpdateConfig`` field -> value), and
    report the recorded and re-run metrics and weights side by side.

    Nothing is written unless ``record_as`` names a new run: then the re-run is recorded as that run, as
    a trainer would record it (:class:`_WhatIfRun`): its own checkpoints under ``record_root`` (default:
    beside the parent's run folder), ``run_config.json``, ``policy_versions`` rows and ``train_steps``
    rows that name the parent's snapshots and ids with ``data_run_id`` the parent; ``sao lake check``
    reconciles it and ``sao replay`` replays it.

    Raises:
        ReplayError: as :func:`replay_steps`, and for an override that is no ``UpdateConfig`` field,
            is out of range, changes whether the algorithm has a critic, or is in :data:`FIXED_IN_WHAT_IF`;
            ``record_as`` an invalid run id or one that has steps already.
    """
    if first < 0 or last < first:
        raise ReplayError(f"need 0 <= first <= last, got steps {first}..{last}")
    if record_as is not None:
        if not is_valid_run_id(record_as) or record_as == run_id:
            raise ReplayError(f"{record_as!r} cannot be the what-if run's id (a valid run id other than {run_id!r})")
        if recorded_steps(lake, record_as):
            raise ReplayError(f"run {record_as!r} has recorded steps already: name the what-if run otherwise (--as)")
    started = time.perf_counter()
    root, cfg, versions = run_checkpoints(lake, run_id, checkpoint_root)
    fields = {f.name for f in dataclasses.fields(UpdateConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ReplayError(f"what-if overrides {unknown} are not update settings; they are: {sorted(fields)}")
    fixed = sorted(set(overrides) & set(FIXED_IN_WHAT_IF))
    if fixed:
        raise ReplayError(f"a what-if replay cannot change {fixed}: {FIXED_IN_WHAT_IF} shape the checkpoint state "
                          "it starts from")
    try:
        update = dataclasses.replace(cfg.update, **overrides)
    except (TypeError, ValueError) as error:
        raise ReplayError(f"what-if overrides {dict(overrides)}: {error}") from None
    if update.uses_critic != cfg.update.uses_critic:
        needs = "needs a critic" if update.uses_critic else "has no critic"
        raise ReplayError(f"algorithm {update.algorithm.value!r} {needs}, unlike the run's "
                          f"{cfg.update.algorithm.value!r}: the checkpoint cannot start it")
    steps = recorded_steps(lake, run_id)
    start_version, lead_in, requested = _chain(steps, run_id, first, last, root, cfg.update.uses_critic)
    try:
        checkpoint = load_checkpoint(root, start_version, with_critic=cfg.update.uses_critic, require_state=True)
    except (FileNotFoundError, CheckpointPrunedError) as error:
        raise ReplayError(str(error)) from None
    learner = Learner(cfg.update, checkpoint.policy, checkpoint.critic)
    attach_oracle(learner, policy_dir(root, start_version))
    if checkpoint.trainer_state is not None:
        learner.load_state_dict(checkpoint.trainer_state)
    load_s = time.perf_counter() - started
    results: list[WhatIfStep] = []
    with torch_settings(cfg.torch_threads, cfg.deterministic):
        for step in lead_in:  # the recorded settings, to reach the first requested step's start
            _replay_one(learner, step, lambda s: _lake_rows(lake, s), versions, 0.0, cfg.seed, lead_in=True)
        _apply_settings(learner, update)
        attach_oracle(learner, policy_dir(root, start_version))  # what if the critic were the oracle
        recorder = None if record_as is None else _WhatIfRun(
            lake, record_as, record_root or _what_if_root(root, run_id, record_as),
            dataclasses.replace(cfg, run_id=record_as, update=update), learner, requested[0].policy_version_before)
        for step in requested:
            started_at = utc_now()
            rows = _lake_rows(lake, step)
            torch.manual_seed(step.seeds.get("torch", cfg.seed + step.policy_version_before))
            metrics = compute_update(learner, rows, step.policy_version_before)
            metrics["batch/world_size"] = 1.0
            if recorder is not None:
                recorder.record(step, metrics, started_at)
            before = _recorded_policy(root, step.policy_version_before)
            after = _recorded_policy(root, step.policy_version_after)
            results.append(WhatIfStep(
                step=step.step, policy_version_before=step.policy_version_before,
                policy_version_after=step.policy_version_after, trajectories_version=step.trajectories_version,
                num_trajectories=len(rows), recorded=dict(step.metrics), rerun=dict(metrics),
                weight_distance=_distance(learner.policy, after), recorded_update_norm=_distance(after, before)))
    return WhatIfReport(run_id=run_id, first=first, last=last, overrides=dict(overrides), start_version=start_version,
                        steps=tuple(results), load_s=load_s)


def _what_if_root(root: Path, run_id: str, new_run: str) -> Path:
    """Where a what-if run's checkpoints go: ``<workdir>/<new run>/checkpoints`` beside the parent's
    ``<workdir>/<run>/checkpoints``, else a folder beside the parent's checkpoint root."""
    return root.parent.parent / new_run / root.name if root.parent.name == run_id else root.parent / new_run


class _WhatIfRun:
    """Records a what-if re-run as run ``run_id`` (see :func:`what_if_steps`): created with the learner
    at the first re-run step's start (saved as that version, with the changed settings), then one
    checkpoint, ``train_steps`` row and ``policy_versions`` row per re-run step."""

    def __init__(self, lake: Lake, run_id: str, root: Path, cfg: TrainConfig, learner: Learner, version: int) -> None:
        self.lake, self.run_id, self.root, self.learner = lake, run_id, root, learner
        self.cfg = dataclasses.replace(cfg, checkpoint_root=str(root))
        self.tokenizer = load_tokenizer(cfg.policy_path)
        self.first_version = version
        write_run_config(self.cfg)
        self._register(version, parent=None, step=None)

    def _register(self, version: int, parent: int | None, step: int | None,
                  saved: tuple[Path, str] | None = None) -> None:
        path, digest = saved or self._save(version)
        register_policy_version(self.lake, PolicyVersionRecord(
            run_id=self.run_id, version=version, parent_version=parent, checkpoint_uri=str(path.resolve()),
            weights_hash=digest, step=step), first_version=self.first_version)

    def _save(self, version: int) -> tuple[Path, str]:
        return save_checkpoint(self.root, version, self.learner.policy, self.tokenizer, self.learner.critic,
                               self.learner.state_dict())

    def record(self, step: RecordedStep, metrics: Mapping[str, float], started_at) -> None:
        """The trainer's order (:func:`sao.train.loop._commit`): the checkpoint, the step's row, the
        version's row."""
        saved = self._save(step.policy_version_after)
        record_train_step(self.lake, TrainStepRecord(
            run_id=self.run_id, step=step.step, policy_version_before=step.policy_version_before,
            policy_version_after=step.policy_version_after, trajectories_version=step.trajectories_version,
            trajectory_ids=step.trajectory_ids, started_at=started_at, finished_at=utc_now(), metrics=metrics,
            seeds=step.seeds, timings={}, data_run_id=step.data_run_id))
        self._register(step.policy_version_after, parent=step.policy_version_before, step=step.step, saved=saved)


def _recorded_policy(root: Path, version: int) -> torch.nn.Module:
    try:
        return load_checkpoint(root, version, with_critic=False, with_state=False).policy
    except (FileNotFoundError, CheckpointPrunedError) as error:
        raise ReplayError(f"the recorded weights of version {version} are gone ({error}); a what-if replay compares "
                          "against them") from None
