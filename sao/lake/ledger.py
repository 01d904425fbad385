"""The run ledger: ``policy_versions`` (which weights exist) and ``train_steps`` (which data each step
used). Both are small, written once per actor update, and keyed: ``(run_id, version)`` and
``(run_id, step)``. Writes go through :func:`sao.lake.commit.append_exactly`, so the checks below hold
in every Delta version even with concurrent writers.

Consumption: a trajectory is consumed when a ``train_steps`` row lists it. :func:`record_train_step`
refuses a step that lists an id an earlier step of the run consumed, or an id absent from the
``trajectories`` snapshot the step says it read, so a trajectory is used at most once per run, also
across trainer restarts. Re-recording an identical step (a restart after the commit) is a no-op.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import DeltaTable

from sao.lake.commit import CommitResult, append_exactly
from sao.lake.config import CommitConfig
from sao.lake.log import commits_after
from sao.lake.records import PolicyVersionRecord, TrainStepRecord, utc_now
from sao.lake.store import Lake, LakeError, ingest_seq_predicate, is_valid_run_id, sql_literal
from schemas import policy_versions, train_steps, trajectories

log = logging.getLogger(__name__)

__all__ = [
    "ConsumptionError",
    "LedgerError",
    "NewestVersions",
    "SnapshotReader",
    "StepsSeen",
    "VersionsSeen",
    "consumed_ids",
    "newest_policy_version",
    "newest_policy_versions",
    "protected_versions",
    "record_train_step",
    "register_policy_version",
    "registered_checkpoint",
]


class LedgerError(LakeError):
    """A ledger write that would break a ledger invariant."""


class ConsumptionError(LedgerError):
    """A step lists trajectories that are already consumed or were not in the snapshot it read."""


def _run_predicate(run_id: str) -> str:
    if not is_valid_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} is not a valid run id")
    return f"run_id = {sql_literal(run_id)}"


def newest_policy_version(
    lake: Lake, run_id: str, *, table: DeltaTable | None = None
) -> int | None:
    """Newest registered policy version of ``run_id``; None when none is registered."""
    delta = table if table is not None else lake.table(policy_versions.NAME)
    versions = lake.read_from(
        delta, policy_versions.NAME, columns=["version"], predicate=_run_predicate(run_id)
    )
    return None if versions.num_rows == 0 else int(pc.max(versions["version"]).as_py())


def registered_checkpoint(lake: Lake, run_id: str, version: int) -> str | None:
    """The ``checkpoint_uri`` registered for version ``version`` of ``run_id``; None without a row."""
    rows = lake.read(policy_versions.NAME, columns=["checkpoint_uri"],
                     predicate=f"{_run_predicate(run_id)} AND version = {int(version)}")
    return None if rows.num_rows == 0 else rows["checkpoint_uri"][0].as_py()


def newest_policy_versions(lake: Lake, *, table: DeltaTable | None = None) -> dict[str, int]:
    """Newest registered policy version of every run (at ``table``'s version when given)."""
    delta = table if table is not None else lake.table(policy_versions.NAME)
    return _newest_by_run(lake.read_from(delta, policy_versions.NAME, columns=["run_id", "version"]))


def _newest_by_run(rows: pa.Table) -> dict[str, int]:
    if rows.num_rows == 0:
        return {}
    grouped = rows.group_by("run_id").aggregate([("version", "max")])
    return dict(zip(grouped["run_id"].to_pylist(), grouped["version_max"].to_pylist(), strict=True))


class NewestVersions:
    """The newest registered policy version of every run, kept up to date from ``policy_versions``' log.

    The first :meth:`look` reads the table's ``run_id`` and ``version`` columns through delta-rs; each
    later one reads only the commit files after the version it knows (:mod:`sao.lake.log`) and those
    columns of the files they add. Versions only grow, so the files a commit removes (a compaction's)
    change no run's newest. A look that cannot read the files that way reads the table through delta-rs
    again. The rollout writer looks once per new version, to check the versions its records claim: a
    delta-rs read cost it 28 ms a look in a diagnostic run of ``sao bench speed``'s lake arm, about one
    look a step, on the path of the rows the trainer waits for."""

    def __init__(self, lake: Lake) -> None:
        self.lake = lake
        self.version: int | None = None  # the table version the figures are complete at
        self._newest: dict[str, int] = {}
        self._files: pafs.PyFileSystem | None = None

    def get(self, run_id: str) -> int | None:
        """``run_id``'s newest version as of the last :meth:`look`; None when it had none."""
        return self._newest.get(run_id)

    def look(self) -> None:
        """Take in the versions registered since the last look."""
        if self.version is not None:
            try:
                self._follow()
                return
            except (OSError, pa.ArrowException) as error:
                log.info("policy_versions read through delta-rs: its new files could not be read (%s)", error)
        table = self.lake.table(policy_versions.NAME)
        self._newest = newest_policy_versions(self.lake, table=table)
        self.version = table.version()

    def _follow(self) -> None:
        if self._files is None:
            self._files = self.lake.table_storage(policy_versions.NAME)
        commits = commits_after(self._files, self.version)
        paths = [path for commit in commits for path, _ in commit.added]
        if paths:
            rows = ds.dataset(paths, filesystem=self._files, format="parquet").to_table(columns=["run_id", "version"])
            for run_id, newest in _newest_by_run(rows).items():
                self._newest[run_id] = max(newest, self._newest.get(run_id, newest))
        if commits:
            self.version = commits[-1].version


def register_policy_version(
    lake: Lake, record: PolicyVersionRecord, config: CommitConfig | None = None, *, first_version: int = 0,
    table: DeltaTable | None = None, seen: VersionsSeen | None = None,
) -> CommitResult:
    """Append ``record`` to ``policy_versions``.

    Versions of a run are registered in order: the first is ``first_version`` (0, or where a what-if
    replay of another run's steps starts; parent None), each next one is the newest + 1. Registering
    an identical row again is a no-op (``result.version`` is None). ``table``: ``policy_versions`` as
    loaded by an earlier call, brought up to date from the commits after it instead of loaded again
    (a writer that registers every step keeps one). ``seen``: the run's newest version as read or
    written by earlier calls (:class:`VersionsSeen`); nothing is read when no commit followed, and it is
    brought up to date, this version included.

    Raises:
        LedgerError: out-of-order version, wrong parent, or a different row for an existing version.
    """
    _run_predicate(record.run_id)
    if seen is not None and seen.run_id != record.run_id:
        raise ValueError(f"version {record.version} of run {record.run_id!r} given the versions seen of run "
                         f"{seen.run_id!r}")
    row = record.to_row() | {"schema_version": policy_versions.SCHEMA_VERSION}

    def plan(delta: DeltaTable) -> pa.Table | None:
        if (seen is not None and seen.table_version == delta.version() and seen.newest is not None
                and record.version == seen.newest + 1 and record.parent_version == seen.newest):
            return pa.Table.from_pylist([row], schema=policy_versions.SCHEMA)  # every check holds by what is seen
        run = _run_predicate(record.run_id)
        existing = None
        if record.parent_version is not None and record.version == record.parent_version + 1:
            # The parent and what follows it decide every check below (versions are registered in
            # order), and file statistics on ``version`` skip the rest: a read of every row of the run
            # grew with its length. Without the parent (an out-of-order call) the run is read whole.
            existing = lake.read_from(delta, policy_versions.NAME,
                                      predicate=f"{run} AND version >= {int(record.parent_version)}")
            if not pc.any(pc.equal(existing["version"], record.parent_version)).as_py():
                existing = None
        if existing is None:
            existing = lake.read_from(delta, policy_versions.NAME, predicate=run)
        newest = pc.max(existing["version"]).as_py()  # the run's newest: a read from the parent on holds it
        if seen is not None:
            seen.newest, seen.table_version = newest, delta.version()
        same_version = existing.filter(pc.equal(existing["version"], record.version))
        if same_version.num_rows:
            stored = same_version.slice(0, 1).to_pylist()[0]
            same = all(stored[k] == v for k, v in record.to_row().items() if k != "created_at")
            if same:
                return None
            raise LedgerError(
                f"run {record.run_id!r} already has policy version {record.version} with "
                f"checkpoint {stored['checkpoint_uri']!r}, hash {stored['weights_hash']!r}"
            )
        expected = first_version if newest is None else newest + 1
        if record.version != expected:
            raise LedgerError(
                f"run {record.run_id!r}: policy version {record.version} registered out of order; "
                f"the next version is {expected}"
            )
        if record.parent_version != newest:
            raise LedgerError(
                f"run {record.run_id!r}: version {record.version} must have parent_version {newest}, "
                f"got {record.parent_version}"
            )
        return pa.Table.from_pylist([row], schema=policy_versions.SCHEMA)

    result = append_exactly(lake, policy_versions.NAME, plan, config or CommitConfig(), table=table)
    if seen is not None and result.version is not None:
        seen.newest, seen.table_version = record.version, result.version
    return result


def consumed_ids(lake: Lake, run_id: str, *, table: DeltaTable | None = None) -> pa.Array:
    """Trajectory ids consumed by the recorded steps of ``run_id`` (a string array, no duplicates)."""
    delta = table if table is not None else lake.table(train_steps.NAME)
    steps = lake.read_from(
        delta, train_steps.NAME, columns=["trajectory_ids"], predicate=_run_predicate(run_id)
    )
    return _flatten_ids(steps["trajectory_ids"])


def unconsumed_count(lake: Lake, run_id: str) -> int:
    """Rows of ``run_id`` in ``trajectories`` that no recorded step consumed: what a resumed run's
    trainer consumes next or passes over (too stale, no action token, a reason it skips)."""
    stored = lake.read(trajectories.NAME, columns=["trajectory_id"], predicate=_run_predicate(run_id))
    taken = pc.is_in(stored["trajectory_id"], value_set=consumed_ids(lake, run_id))
    return stored.num_rows - (pc.sum(taken).as_py() or 0)


def _flatten_ids(lists: pa.ChunkedArray) -> pa.Array:
    flat = pc.list_flatten(lists)
    return flat.combine_chunks() if isinstance(flat, pa.ChunkedArray) else flat


@dataclasses.dataclass
class StepsSeen:
    """A run's ``train_steps`` rows as :func:`record_train_step` has read and written them: the last
    step and every trajectory id consumed up to it.

    Each step is planned on the table's newest version and its commit refused if another commit took
    that version (:func:`sao.lake.commit.append_exactly`), so steps are committed in order: the rows
    committed after those seen are exactly the run's rows with a later step. Given one, a call reads
    those rows alone (file statistics on ``step`` skip the rest) instead of every row of the run, a cost
    that grew with the run's length. A caller keeps one per run (the trainer does) and passes it to
    every call for that run.

    It also keeps the ``train_steps`` version at which the rows seen are all of the run's rows
    (``table_version``): a step planned on that very version (no commit followed the last one it read
    or made, as in a run with one trainer) reads nothing. A Delta read costs about 12 ms however few
    rows it finds, and each step's commit is on the trainer's path to publishing the weights."""

    run_id: str
    last_step: int | None = None
    consumed: set[str] = dataclasses.field(default_factory=set)
    table_version: int | None = None

    def fold(self, rows: pa.Table) -> None:
        """Take in committed ``train_steps`` rows of the run (columns ``step`` and ``trajectory_ids``)."""
        if rows.num_rows == 0:
            return
        newest = int(pc.max(rows["step"]).as_py())
        self.last_step = newest if self.last_step is None else max(self.last_step, newest)
        self.consumed.update(_flatten_ids(rows["trajectory_ids"]).to_pylist())


_STEP_COLUMNS = ["step", "trajectory_ids", "trajectories_version", "policy_version_before", "policy_version_after"]
_NO_STEPS = pa.schema([train_steps.SCHEMA.field(c) for c in _STEP_COLUMNS]).empty_table()


@dataclasses.dataclass
class VersionsSeen:
    """A run's newest ``policy_versions`` row as :func:`register_policy_version` has read or written it,
    and the table's version at which it is the newest (``table_version``). Versions are registered in
    order, so the next version registered on that very table version (no commit followed: a run with
    one trainer) needs no read: its checks hold by what is seen. A caller keeps one per run."""

    run_id: str
    newest: int | None = None
    table_version: int | None = None


def record_train_step(
    lake: Lake, record: TrainStepRecord, config: CommitConfig | None = None, *,
    ingest_seqs: Sequence[int] | None = None, snapshot: DeltaTable | SnapshotReader | None = None,
    table: DeltaTable | None = None,
    seen: StepsSeen | None = None,
) -> CommitResult:
    """Append ``record`` to ``train_steps``, marking its trajectories consumed.

    The ids are looked up in ``trajectories`` at the step's snapshot: with ``ingest_seqs`` (their
    ``ingest_seq`` values, in order, as the trainer's reader handed them out) only the files those
    values fall in are read; without, the run's ``trajectory_id`` column (a cost that grows with the
    run). Either way an id not stored in the data run at that snapshot is refused. ``snapshot``: the
    ``trajectories`` table already loaded at ``record.trajectories_version``, which saves loading its log
    twice, or the trainer's reader at that snapshot (:class:`SnapshotReader`), which looks the ids up with
    ``ingest_seqs`` in the files it has listed. ``table``: ``train_steps`` as loaded by an earlier call,
    brought up to date from the commits after it instead of loaded again (the trainer keeps one).
    ``seen``: the run's rows read by earlier calls (:class:`StepsSeen`); only the rows committed since
    are read, and it is brought up to date, this step included.

    Raises:
        ConsumptionError: an id is listed twice, was consumed by an earlier step of the run, or is not
            in ``trajectories`` (run ``record.data_run``) at ``record.trajectories_version``.
        LedgerError: the step is not after the last recorded step, the trajectories version does not
            exist yet, or a different row exists for the same step.
    """
    _run_predicate(record.run_id)
    ids = list(record.trajectory_ids)
    duplicates = sorted({i for i in ids if ids.count(i) > 1}) if len(set(ids)) != len(ids) else []
    if duplicates:
        raise ConsumptionError(f"step {record.step} lists trajectory ids twice: {duplicates[:5]}")
    if record.policy_version_after < record.policy_version_before:
        raise LedgerError(
            f"step {record.step}: policy_version_after {record.policy_version_after} is before "
            f"policy_version_before {record.policy_version_before}"
        )
    if seen is not None and seen.run_id != record.run_id:
        raise ValueError(f"step {record.step} of run {record.run_id!r} given the steps seen of run {seen.run_id!r}")
    _check_ids_in_snapshot(lake, record, ingest_seqs, snapshot)

    def plan(delta: DeltaTable) -> pa.Table | None:
        later = seen is not None and (seen.last_step is None or record.step > seen.last_step)
        if later and seen.table_version == delta.version():
            existing = _NO_STEPS  # nothing was committed since the rows seen
        else:
            predicate = _run_predicate(record.run_id)
            if later and seen.last_step is not None:
                predicate += f" AND step > {int(seen.last_step)}"
            existing = lake.read_from(delta, train_steps.NAME, columns=_STEP_COLUMNS, predicate=predicate)
            if seen is not None:
                seen.fold(existing)  # committed rows, whatever this plan decides
                seen.table_version = delta.version()
        # Arrow, not Python rows: the run's rows grow with it, and only one of them is ever looked at.
        same_step = existing.filter(pc.equal(existing["step"], record.step))
        if same_step.num_rows:
            stored = same_step.slice(0, 1).to_pylist()[0]
            if (
                stored["trajectory_ids"] == ids
                and stored["trajectories_version"] == record.trajectories_version
                and stored["policy_version_before"] == record.policy_version_before
                and stored["policy_version_after"] == record.policy_version_after
            ):
                return None
            raise LedgerError(f"run {record.run_id!r} already has a different step {record.step}")
        last = seen.last_step if seen is not None else pc.max(existing["step"]).as_py()
        if last is not None and record.step <= last:
            raise LedgerError(
                f"run {record.run_id!r}: step {record.step} is not after the last recorded step {last}"
            )
        if seen is not None:
            repeated = [i for i in ids if i in seen.consumed]
        else:
            again = pc.is_in(pa.array(ids, pa.string()), value_set=_flatten_ids(existing["trajectory_ids"]))
            repeated = [i for i, hit in zip(ids, again.to_pylist(), strict=True) if hit]
        if repeated:
            raise ConsumptionError(
                f"run {record.run_id!r} step {record.step}: {len(repeated)} trajectories were consumed "
                f"by an earlier step, e.g. {repeated[:3]}"
            )
        row = record.to_row() | {
            "recorded_at": utc_now(),
            "schema_version": train_steps.SCHEMA_VERSION,
        }
        return pa.Table.from_pylist([row], schema=train_steps.SCHEMA)

    result = append_exactly(lake, train_steps.NAME, plan, config or CommitConfig(), table=table)
    if seen is not None and result.version is not None:
        seen.last_step = record.step
        seen.consumed.update(ids)
        seen.table_version = result.version
    return result


class SnapshotReader(Protocol):
    """A reader of one run's ``trajectories`` at one snapshot that looks ids up by ``ingest_seq``: the
    trainer's :class:`sao.lake.reader.TrajectoryReader`, which has the snapshot's files listed already."""

    run_id: str

    @property
    def snapshot_version(self) -> int | None: ...

    def stored_ids(self, ingest_seqs: Sequence[int]) -> pa.Array: ...


def _check_ids_in_snapshot(lake: Lake, record: TrainStepRecord, ingest_seqs: Sequence[int] | None,
                           snapshot: DeltaTable | SnapshotReader | None) -> None:
    if snapshot is not None:
        given = snapshot.version() if isinstance(snapshot, DeltaTable) else snapshot.snapshot_version
        if given != record.trajectories_version:
            raise ValueError(f"step {record.step}: the snapshot given is trajectories version "
                             f"{given}, the step read {record.trajectories_version}")
    else:
        latest = lake.version("trajectories")
        if record.trajectories_version > latest:
            raise LedgerError(
                f"step {record.step} read trajectories version {record.trajectories_version}, "
                f"but the newest version is {latest}"
            )
    if not record.trajectory_ids:
        return
    if ingest_seqs is not None and len(ingest_seqs) != len(record.trajectory_ids):
        raise ValueError(f"step {record.step}: {len(ingest_seqs)} ingest_seqs for "
                         f"{len(record.trajectory_ids)} trajectory ids")
    reader = None if snapshot is None or isinstance(snapshot, DeltaTable) else snapshot
    if reader is not None and ingest_seqs is not None and reader.run_id == record.data_run:
        stored_ids = reader.stored_ids(ingest_seqs)
    else:
        table = snapshot if isinstance(snapshot, DeltaTable) else lake.table(
            "trajectories", version=record.trajectories_version)
        predicate = _run_predicate(record.data_run)
        if ingest_seqs is not None:
            predicate += " AND " + ingest_seq_predicate(ingest_seqs)
        stored_ids = lake.read_from(table, "trajectories", columns=["trajectory_id"],
                                    predicate=predicate)["trajectory_id"].combine_chunks()
    present = pc.is_in(pa.array(record.trajectory_ids, pa.string()), value_set=stored_ids)
    missing = np.flatnonzero(~present.to_numpy(zero_copy_only=False))
    if missing.size:
        examples = [record.trajectory_ids[i] for i in missing[:3].tolist()]
        raise ConsumptionError(
            f"run {record.run_id!r} step {record.step}: {missing.size} trajectory ids are not in "
            f"trajectories version {record.trajectories_version} (run {record.data_run!r}), e.g. {examples}"
        )


def protected_versions(lake: Lake) -> list[int]:
    """Every ``trajectories`` version a recorded step read (replay needs them): vacuum keeps them."""
    table = lake.read(train_steps.NAME, columns=["trajectories_version"])
    return sorted(set(table["trajectories_version"].to_pylist()))
