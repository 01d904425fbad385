"""Reading trajectories: the trainer's next micro-batch, pinned snapshots, and a step's exact data.

The trainer asks: "trajectories of run R not yet consumed, in arrival order, with staleness at most S
at my version v, up to N rows". Terms:
    arrival order: ``ingest_seq`` (1, 2, 3, ... per run, increasing with the commit that stored the row;
        see :mod:`sao.lake.writer`).
    staleness at trainer version v: ``v - min_policy_version``. Trajectories without an action token
        (``min_policy_version`` null) have nothing to train on and are never returned; nor are those
        whose ``termination_reason`` the reader was told to pass over (``pass_over``: by default the
        trainer passes over ``cancelled`` and ``error`` ends, SAO.md section 2), which stay stored.
    consumed: listed by a ``train_steps`` row of the run (:func:`sao.lake.ledger.record_train_step`).

:class:`TrajectoryReader` answers it incrementally. It lists the run's data files once, then follows the
table's commits from its log (:mod:`sao.lake.log`) and reads the index columns of each file the first
time it appears, so a look costs in proportion to what was committed since the last one, not to the
table's files. Because ``ingest_seq`` only grows with commits, a row that is not in snapshot ``V`` will
get a larger ``ingest_seq`` than every row of ``V``; so the reader keeps a cursor (the largest
``ingest_seq`` it has seen) and drops the rows at or below it that a file rewritten by a compaction holds
again. Candidates (id, ``ingest_seq``, ``min_policy_version``: a few bytes per row) wait in memory; the
full rows of the chosen ones are then read from the files whose ``ingest_seq`` range holds them
(:meth:`TrajectoryReader.fetch`; a trainer that gathers a batch over several calls reads them once, at the
last). Rows too stale for a call are set aside (and counted in ``skipped_stale``); they come back only if
a later call allows older data (a lower ``trainer_version - max_staleness``), which a trainer whose
version only grows never does.

A reader hands each row out once, and only reads. The trainer records the step that used them with
:func:`sao.lake.ledger.record_train_step` and, once that commit succeeded, tells the reader with
:meth:`TrajectoryReader.consumed` (which forgets them); or it gives them back with
:meth:`TrajectoryReader.release`. Rows handed out but never recorded (the trainer crashed) are offered
again by the next reader, which starts from ``train_steps``: that is what makes consumption
exactly-once across restarts.

:func:`select_unconsumed` is the slow reference (a full scan of the run at one snapshot, anti-joined
with ``train_steps``); a test holds the two equal.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import DeltaTable

from sao.lake.ledger import consumed_ids
from sao.lake.log import commits_after
from sao.lake.store import Lake, LakeError, ingest_seq_predicate, is_valid_run_id, sql_literal
from schemas import train_steps, trajectories

__all__ = [
    "INDEX_COLUMNS",
    "MicroBatch",
    "TrajectoryReader",
    "read_step_trajectories",
    "read_trajectories",
    "select_unconsumed",
]

INDEX_COLUMNS = ("trajectory_id", "ingest_seq", "min_policy_version")
"""What the reader keeps per candidate row."""

log = logging.getLogger(__name__)

_INDEX_SCHEMA = pa.schema([trajectories.SCHEMA.field(name) for name in INDEX_COLUMNS])


@dataclass(frozen=True)
class MicroBatch:
    """Rows handed to the trainer.

    Attributes:
        run_id: the run.
        snapshot_version: the ``trajectories`` version read (record it as ``trajectories_version``).
        trainer_version, max_staleness: the bounds the rows were selected with.
        data: the rows, in ``ingest_seq`` order, with the reader's columns (declared types).
        skipped_stale: rows set aside by this call because they are too stale.
        skipped_no_actions: rows set aside by this call because they hold no action token.
        skipped_passed_over: rows set aside since the previous call because their termination reason
            is one the reader passes over (each row counted once, when first scanned).
    """

    run_id: str
    snapshot_version: int
    trainer_version: int
    max_staleness: int
    data: pa.Table
    skipped_stale: int
    skipped_no_actions: int
    skipped_passed_over: int = 0

    @property
    def trajectory_ids(self) -> list[str]:
        return self.data["trajectory_id"].to_pylist()

    @property
    def batches(self) -> list[pa.RecordBatch]:
        """The rows as Arrow record batches."""
        return self.data.to_batches()

    def __len__(self) -> int:
        return self.data.num_rows


def _run_predicate(run_id: str) -> str:
    if not is_valid_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} is not a valid run id")
    return f"run_id = {sql_literal(run_id)}"


def _check_bounds(trainer_version: int, max_staleness: int, max_rows: int) -> None:
    if trainer_version < 0:
        raise ValueError(f"trainer_version must be >= 0, got {trainer_version}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")


def _split_stale(index: pa.Table, oldest_version: int) -> tuple[pa.Table, pa.Table, int]:
    """(fresh rows, stale rows, count without actions): fresh means an action token and
    ``min_policy_version >= oldest_version`` (= trainer_version - max_staleness)."""
    no_actions = index["min_policy_version"].is_null()
    stale = pc.less(index["min_policy_version"], oldest_version).fill_null(False)
    fresh = pc.invert(pc.or_(no_actions, stale))
    return index.filter(fresh), index.filter(stale), pc.sum(no_actions).as_py() or 0


class TrajectoryReader:
    """Incremental reader of one run's unconsumed trajectories (see the module docstring).

    Args:
        lake: the lake.
        run_id: the run to read.
        columns: columns of :attr:`MicroBatch.data` (all when None); ``trajectory_id`` and
            ``ingest_seq`` are always included.
        pass_over: termination reasons whose rows are never handed out (counted in
            :attr:`MicroBatch.skipped_passed_over`; ``UpdateConfig.skip_reasons`` in training).
    """

    def __init__(self, lake: Lake, run_id: str, *, columns: Sequence[str] | None = None,
                 pass_over: Sequence[str] = ()) -> None:
        self.lake = lake
        self.run_id = run_id
        self._predicate = _run_predicate(run_id)
        names = list(columns) if columns is not None else list(trajectories.SCHEMA.names)
        for required in ("ingest_seq", "trajectory_id"):
            if required not in names:
                names.insert(0, required)
        self.columns = names
        self.pass_over = tuple(pass_over)
        self._passed_over = 0  # rows passed over since the last call
        self._version: int | None = None  # the snapshot of the last call
        self._table: DeltaTable | None = None  # loaded once; brought to _version when asked for
        self._consumed: pa.Array | None = None
        self._cursor = 0
        self._unscanned: list[str] = []  # data files of the run at _version not read yet
        self._live: dict[str, tuple[int, int]] = {}  # those read: path -> (min, max) ingest_seq
        self._files: pafs.PyFileSystem | None = None  # the table's storage, rooted at the table
        self._pending = _INDEX_SCHEMA.empty_table()
        self._stale = _INDEX_SCHEMA.empty_table()
        self._oldest_version: int | None = None
        self._handed_out: dict[str, tuple[int, int | None]] = {}

    @property
    def snapshot_version(self) -> int | None:
        """The ``trajectories`` version of the last call (None before the first)."""
        return self._version

    @property
    def table(self) -> DeltaTable | None:
        """The ``trajectories`` table as of the last call (at :attr:`snapshot_version`)."""
        if self._table is not None and self._table.version() != self._version:
            self._table.load_as_version(self._version)
        return self._table

    @property
    def pending(self) -> int:
        """Candidates seen and not yet handed out (staleness not yet applied)."""
        return self._pending.num_rows

    def next_micro_batch(
        self, trainer_version: int, max_staleness: int, max_rows: int, *, version: int | None = None,
        fetch: bool = True,
    ) -> MicroBatch:
        """Up to ``max_rows`` unconsumed rows, oldest ``ingest_seq`` first, with staleness at most
        ``max_staleness`` at ``trainer_version``, read from snapshot ``version`` (latest when None).
        With ``fetch`` False the batch's ``data`` holds just the chosen rows' ``INDEX_COLUMNS``: a
        trainer that gathers its batch over several calls reads the full rows once, with :meth:`fetch`.

        Raises:
            ValueError: bad bounds, or a snapshot older than the previous call's.
        """
        _check_bounds(trainer_version, max_staleness, max_rows)
        self._advance(version)
        self._scan_new_rows()
        oldest = trainer_version - max_staleness
        if (
            self._oldest_version is not None
            and oldest < self._oldest_version
            and self._stale.num_rows
        ):
            back, self._stale, _ = _split_stale(self._stale, oldest)  # older data allowed again
            self._pending = pa.concat_tables([self._pending, back]).sort_by("ingest_seq")
        self._oldest_version = oldest
        fresh, stale, no_actions = _split_stale(self._pending, oldest)
        chosen = fresh.slice(0, max_rows)
        data = self.fetch(chosen) if fetch else chosen
        self._pending = fresh.slice(max_rows)
        self._stale = pa.concat_tables([self._stale, stale])
        for row in chosen.to_pylist():
            self._handed_out[row["trajectory_id"]] = (row["ingest_seq"], row["min_policy_version"])
        passed_over, self._passed_over = self._passed_over, 0
        return MicroBatch(
            run_id=self.run_id,
            snapshot_version=self._version,
            trainer_version=trainer_version,
            max_staleness=max_staleness,
            data=data,
            skipped_stale=stale.num_rows,
            skipped_no_actions=no_actions,
            skipped_passed_over=passed_over,
        )

    def consumed(self, trajectory_ids: Iterable[str]) -> None:
        """Forget handed-out rows that a step recorded in ``train_steps`` consumed: they can no longer
        be released (ids this reader did not hand out are ignored). Call it after
        :func:`sao.lake.ledger.record_train_step` returned, never before: a failed commit leaves the
        rows handed out, to be recorded again or released."""
        for trajectory_id in trajectory_ids:
            self._handed_out.pop(trajectory_id, None)

    def release(self, trajectory_ids: Iterable[str]) -> None:
        """Offer handed-out rows again (their step was abandoned before it was recorded)."""
        returned = []
        for trajectory_id in trajectory_ids:
            if trajectory_id not in self._handed_out:
                raise KeyError(f"{trajectory_id!r} was not handed out by this reader")
            seq, min_version = self._handed_out.pop(trajectory_id)
            returned.append(
                {
                    "trajectory_id": trajectory_id,
                    "ingest_seq": seq,
                    "min_policy_version": min_version,
                }
            )
        if returned:
            merged = pa.concat_tables(
                [self._pending, pa.Table.from_pylist(returned, schema=_INDEX_SCHEMA)]
            )
            self._pending = merged.sort_by("ingest_seq")

    def _storage(self) -> pafs.PyFileSystem:
        if self._files is None:
            self._files = self.lake.table_storage(trajectories.NAME)
        return self._files

    def _advance(self, version: int | None) -> None:
        """Move to snapshot ``version`` (the latest when None). The first call lists the run's files from
        the table; later calls read just the commits since (:mod:`sao.lake.log`), so that a look costs in
        proportion to what was committed since the last, not to the table's files."""
        if self._version is None:
            self._table = self.lake.table(trajectories.NAME, version=version)
            self._version = self._table.version()
            actions = pa.table(self._table.get_add_actions(flatten=True))
            if actions.num_rows:
                mine = pc.equal(actions["partition.run_id"], self.run_id)
                self._unscanned = actions.filter(mine)["path"].to_pylist()
            return
        if version is not None and version < self._version:
            raise ValueError(f"snapshot {version} is older than the previous call's snapshot {self._version}")
        if version == self._version:
            return
        commits = commits_after(self._storage(), self._version, upto=version)
        if version is not None and (not commits or commits[-1].version != version):
            newest = commits[-1].version if commits else self._version
            raise LakeError(f"trajectories has no version {version} (the newest is {newest})")
        for commit in commits:
            for path in commit.removed:
                if self._live.pop(path, None) is None and path in self._unscanned:
                    self._unscanned.remove(path)
            self._unscanned += [path for path, partition in commit.added if partition.get("run_id") == self.run_id]
        if commits:
            self._version = commits[-1].version

    def _scan_new_rows(self) -> None:
        """Add the rows of the run's files not read before to the candidates. A file rewritten by a
        compaction is read again; its rows the cursor has passed are dropped."""
        if self._consumed is None:
            self._consumed = consumed_ids(self.lake, self.run_id)
        if not self._unscanned:
            return
        paths = self._unscanned
        read = [*INDEX_COLUMNS, "termination_reason"] if self.pass_over else list(INDEX_COLUMNS)
        try:
            new = ds.dataset(paths, filesystem=self._storage(), format="parquet").to_table(
                columns=[*read, "__filename"])
        except (OSError, pa.ArrowException) as error:
            raise LakeError(f"reading {len(paths)} new files of run {self.run_id!r} at version "
                            f"{self._version} failed (a file vacuumed away?): {error}") from error
        self._unscanned = []
        ranges = new.group_by("__filename").aggregate([("ingest_seq", "min"), ("ingest_seq", "max")])
        self._live.update(zip(ranges["__filename"].to_pylist(),
                              zip(ranges["ingest_seq_min"].to_pylist(), ranges["ingest_seq_max"].to_pylist(),
                                  strict=True), strict=True))
        new = new.filter(pc.greater(new["ingest_seq"], self._cursor))
        if new.num_rows == 0:
            return
        self._cursor = int(pc.max(new["ingest_seq"]).as_py())
        if len(self._consumed):
            new = new.filter(pc.invert(pc.is_in(new["trajectory_id"], value_set=self._consumed)))
        if self.pass_over:
            passed = pc.is_in(new["termination_reason"], value_set=pa.array(self.pass_over, pa.string()))
            self._passed_over += pc.sum(passed).as_py() or 0
            new = new.filter(pc.invert(passed))
        new = new.select(list(INDEX_COLUMNS)).cast(_INDEX_SCHEMA)
        self._pending = pa.concat_tables([self._pending, new.sort_by("ingest_seq")])

    def fetch(self, chosen: pa.Table) -> pa.Table:
        """The full rows (the reader's columns) of the rows in ``chosen`` (a table with their
        ``ingest_seq``: micro-batches read with ``fetch=False``), in ``chosen``'s order, read at the
        snapshot of the last call. A row chosen at an earlier call is there too: rows are only added
        to the table, and compaction rewrites them unchanged.

        The rows are read from the snapshot's data files whose ``ingest_seq`` range holds one of them
        (the reader read every file's range when it scanned it); a file that cannot be read that way
        (one written with an older schema) sends the read through delta-rs instead.

        Raises:
            LakeError: a chosen row is not in the snapshot.
            ValueError: called before :meth:`next_micro_batch`.
        """
        if self._version is None:
            raise ValueError("fetch() before next_micro_batch(): the reader has no snapshot yet")
        seqs = chosen["ingest_seq"]
        data = self._read(seqs, self.columns)
        if data.num_rows != len(seqs):
            raise LakeError(
                f"run {self.run_id!r}: expected {len(seqs)} rows at version {self._version}, "
                f"read {data.num_rows} (was a row deleted?)"
            )
        return data.take(pc.index_in(seqs, value_set=data["ingest_seq"]))

    def stored_ids(self, ingest_seqs: Sequence[int]) -> pa.Array:
        """The ``trajectory_id`` of the run's rows with these ``ingest_seq`` values that the snapshot of
        the last call holds (any order; a value it does not hold has none), read as :meth:`fetch` reads:
        a step's check that it lists stored rows (:func:`sao.lake.ledger.record_train_step`)."""
        if self._version is None:
            raise ValueError("stored_ids() before next_micro_batch(): the reader has no snapshot yet")
        seqs = pa.chunked_array([pa.array(list(ingest_seqs), pa.int64())])
        return self._read(seqs, ["trajectory_id", "ingest_seq"])["trajectory_id"].combine_chunks()

    def _read(self, seqs: pa.ChunkedArray, columns: Sequence[str]) -> pa.Table:
        """``columns`` of the run's rows with these ``ingest_seq`` values at the snapshot (any order)."""
        schema = pa.schema([trajectories.SCHEMA.field(c) for c in columns])
        if len(seqs) == 0:
            return schema.empty_table()
        try:
            return self._read_files(seqs, schema)
        except (OSError, pa.ArrowException) as error:
            log.info("run %s: reading %d rows from their files failed (%s); reading them through delta-rs",
                     self.run_id, len(seqs), error)
            predicate = f"{self._predicate} AND {ingest_seq_predicate(seqs.to_pylist())}"
            return self.lake.read_from(self.table, trajectories.NAME, columns=list(columns), predicate=predicate)

    def _read_files(self, seqs: pa.ChunkedArray, schema: pa.Schema) -> pa.Table:
        wanted = np.sort(seqs.to_numpy())
        paths = [path for path, (low, high) in self._live.items()
                 if (at := np.searchsorted(wanted, low)) < len(wanted) and wanted[at] <= high]
        # the partition column is in the files' folder, not in the files
        stored = pa.schema([field for field in schema if field.name != "run_id"])
        data = ds.dataset(paths, schema=stored, filesystem=self._storage(), format="parquet").to_table(
            filter=pc.field("ingest_seq").isin(seqs.combine_chunks()))
        if "run_id" in schema.names:
            data = data.append_column("run_id", pa.array([self.run_id] * data.num_rows, pa.string()))
        return data.select(schema.names).cast(schema)


def select_unconsumed(
    lake: Lake,
    run_id: str,
    trainer_version: int,
    max_staleness: int,
    max_rows: int,
    *,
    version: int | None = None,
    exclude: Iterable[str] = (),
    pass_over: Sequence[str] = (),
) -> pa.Table:
    """Reference answer to the trainer's query: the index columns (``INDEX_COLUMNS``) of up to
    ``max_rows`` rows of ``run_id`` at ``version``, oldest ``ingest_seq`` first, not consumed by a
    ``train_steps`` row, not in ``exclude``, holding an action token, not ending for a reason in
    ``pass_over``, with staleness <= ``max_staleness``. Scans the whole run: use
    :class:`TrajectoryReader` in training."""
    _check_bounds(trainer_version, max_staleness, max_rows)
    index = lake.read(
        trajectories.NAME,
        version=version,
        columns=[*INDEX_COLUMNS, "termination_reason"],
        predicate=_run_predicate(run_id),
    )
    taken = pa.concat_arrays([consumed_ids(lake, run_id), pa.array(list(exclude), pa.string())])
    index = index.filter(pc.invert(pc.is_in(index["trajectory_id"], value_set=taken)))
    index = index.filter(pc.invert(pc.is_in(index["termination_reason"], value_set=pa.array(list(pass_over), pa.string()))))
    index = index.select(list(INDEX_COLUMNS))
    fresh, _, _ = _split_stale(index, trainer_version - max_staleness)
    return fresh.sort_by("ingest_seq").slice(0, max_rows)


def read_trajectories(
    lake: Lake,
    *,
    version: int | None = None,
    run_id: str | None = None,
    trajectory_ids: Sequence[str] | None = None,
    ingest_seqs: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """Trajectories at snapshot ``version`` (time travel), optionally of one run and a list of ids.

    Rows come in the order of ``trajectory_ids`` when given (else by run and ``ingest_seq``). With ids,
    the index columns of the run are scanned to find them, then just those rows are read (a predicate
    on ``ingest_seq``, which file statistics prune). With ``ingest_seqs`` as well (the ids' values, in
    the same order, from a reader's :class:`MicroBatch`), the scan is skipped: only the files those
    values fall in are read, so the cost follows the number of ids, not the run's files.

    Raises:
        LakeError: an id in ``trajectory_ids`` is not in the snapshot (with ``ingest_seqs``: not there
            with its value), or (without ``run_id``) is in several runs.
        ValueError: ``ingest_seqs`` without ``run_id`` and ids of the same length.
    """
    table = lake.table(trajectories.NAME, version=version)
    predicate = _run_predicate(run_id) if run_id is not None else None
    names = list(columns) if columns is not None else list(trajectories.SCHEMA.names)
    extra = [c for c in ("trajectory_id", "run_id", "ingest_seq") if c not in names]
    if trajectory_ids is None:
        data = lake.read_from(table, trajectories.NAME, columns=names + extra, predicate=predicate)
        return data.sort_by([("run_id", "ascending"), ("ingest_seq", "ascending")]).select(names)
    wanted = list(trajectory_ids)
    if ingest_seqs is not None and (run_id is None or len(ingest_seqs) != len(wanted)):
        raise ValueError("ingest_seqs needs run_id and one value per trajectory id")
    if not wanted:
        return pa.schema([trajectories.SCHEMA.field(c) for c in names]).empty_table()
    if ingest_seqs is None:
        index = lake.read_from(
            table,
            trajectories.NAME,
            columns=["run_id", "trajectory_id", "ingest_seq"],
            predicate=predicate,
        )
        index = index.filter(pc.is_in(index["trajectory_id"], value_set=pa.array(wanted, pa.string())))
        found = index["trajectory_id"].to_pylist()
        if len(set(found)) != len(found):
            raise LakeError("some trajectory ids are in several runs; pass run_id")
        _no_missing(wanted, found, table.version())
    else:
        index = pa.table({"run_id": pa.array([run_id] * len(wanted), pa.string()),
                          "ingest_seq": pa.array(list(ingest_seqs), pa.int64())})
    data = lake.read_from(
        table, trajectories.NAME, columns=names + extra, predicate=_rows_predicate(index)
    )
    position = {
        trajectory_id: i for i, trajectory_id in enumerate(data["trajectory_id"].to_pylist())
    }
    if ingest_seqs is not None:
        _no_missing(wanted, list(position), table.version())
    order = np.array([position[i] for i in wanted], dtype=np.int64)
    return data.take(order).select(names)


def _no_missing(wanted: Sequence[str], found: Sequence[str], version: int) -> None:
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise LakeError(f"{len(missing)} trajectory ids are not in version {version}, e.g. {missing[:3]}")


def _rows_predicate(index: pa.Table) -> str:
    """A delta-rs predicate selecting exactly the rows of ``index`` (run_id, ingest_seq)."""
    clauses = []
    for group in index.group_by("run_id").aggregate([("ingest_seq", "list")]).to_pylist():
        clauses.append(f"({_run_predicate(group['run_id'])} AND {ingest_seq_predicate(group['ingest_seq_list'])})")
    return " OR ".join(clauses)


def read_step_trajectories(
    lake: Lake, run_id: str, step: int, *, columns: Sequence[str] | None = None
) -> pa.Table:
    """The exact rows step ``step`` of ``run_id`` consumed, in the order it listed them, read from the
    ``trajectories`` snapshot it recorded (what a replay of the step needs)."""
    predicate = f"{_run_predicate(run_id)} AND step = {int(step)}"
    rows = lake.read(
        train_steps.NAME, columns=["trajectories_version", "trajectory_ids"], predicate=predicate
    )
    if rows.num_rows != 1:
        raise LakeError(f"run {run_id!r} has no recorded step {step}")
    version = rows["trajectories_version"][0].as_py()
    ids = rows["trajectory_ids"][0].as_py()
    return read_trajectories(
        lake, version=version, run_id=run_id, trajectory_ids=ids, columns=columns
    )
