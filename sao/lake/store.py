"""The lake: a root URI holding one Delta table per spec in :mod:`schemas`.

The same code serves a local folder and ``s3://...``: every read and write goes through delta-rs with
the lake's ``storage_options``. Tables are created from their specs, idempotently (two processes may
open a new lake at once), with the log kept forever so every recorded snapshot stays readable: Delta's
default log retention (30 days) would otherwise let a checkpoint delete the commits an old
``train_steps`` row points to.

Opening a lake compares each table's schema with its spec: nullable fields that a newer schema version
appends are added in place (old rows read null); any other difference raises
:class:`SchemaMismatchError` naming the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import DeltaError
from deltalake.fs import DeltaStorageHandler

from sao.lake.config import LakeConfig
from schemas import TABLES, TableSpec, plain, table_spec
from schemas.trajectories import RUN_ID_PATTERN

__all__ = [
    "STATS_COLUMNS_KEY",
    "TABLE_CONFIGURATION",
    "Lake",
    "LakeError",
    "LakeNotFoundError",
    "SchemaMismatchError",
    "is_valid_run_id",
    "ingest_seq_predicate",
    "sql_literal",
    "table_configuration",
]

ADDED_TABLES = frozenset({"rollout_tasks", "runs"})
"""Tables a later sao added: opening an existing lake without them creates them, even when the caller
asked not to create a lake (as opening an older table adds the nullable columns a newer schema has)."""

TABLE_CONFIGURATION: dict[str, str | None] = {
    # Keep every commit file: replay reads old versions, which needs their log entries.
    "delta.enableExpiredLogCleanup": "false",
    "delta.logRetentionDuration": "interval 36500 days",
}


STATS_COLUMNS_KEY = "delta.dataSkippingStatsColumns"


def table_configuration(spec: TableSpec) -> dict[str, str | None]:
    """The Delta table properties of ``spec``'s table: :data:`TABLE_CONFIGURATION` and its statistics
    columns (``TableSpec.stats_columns``)."""
    extra = {STATS_COLUMNS_KEY: ",".join(spec.stats_columns)} if spec.stats_columns else {}
    return TABLE_CONFIGURATION | extra


class LakeError(Exception):
    """Base class of the lake's errors."""


class LakeNotFoundError(LakeError):
    """The root holds no lake (or is missing tables) and the caller asked not to create one."""


class SchemaMismatchError(LakeError):
    """A table's stored schema differs from its spec in a way that cannot be migrated."""


def sql_literal(value: str) -> str:
    """``value`` as a SQL string literal (single quotes doubled) for delta-rs predicates."""
    return "'" + value.replace("'", "''") + "'"


def ingest_seq_predicate(seqs: Iterable[int]) -> str:
    """A delta-rs predicate for the rows with these ``ingest_seq`` values (non-empty). The range comes
    first: file statistics prune by it, so only the files the values fall in are read."""
    values = sorted(int(s) for s in seqs)
    listed = ", ".join(str(s) for s in values)
    return f"ingest_seq >= {values[0]} AND ingest_seq <= {values[-1]} AND ingest_seq IN ({listed})"


def is_valid_run_id(run_id: str) -> bool:
    """Run ids name partition folders: see ``schemas.trajectories.RUN_ID_PATTERN``."""
    return isinstance(run_id, str) and re.fullmatch(RUN_ID_PATTERN, run_id) is not None


class Lake:
    """A set of Delta tables under one root.

    Use :meth:`open`. ``table(name)`` returns a fresh ``DeltaTable`` at the latest (or a pinned)
    version; names are checked against :data:`schemas.TABLES`, so no path from user input can leave
    the root.
    """

    def __init__(self, root: str, storage_options: Mapping[str, str] | None = None) -> None:
        self.root = _normalise_root(root)
        self.storage_options: dict[str, str] = dict(storage_options or {})

    @classmethod
    def open(
        cls,
        config: LakeConfig | str,
        *,
        storage_options: Mapping[str, str] | None = None,
        create: bool = True,
    ) -> Lake:
        """Open the lake at ``config.root``, creating missing tables when ``create`` (else raise
        :class:`LakeNotFoundError`), and check every table's schema against its spec."""
        if isinstance(config, str):
            config = LakeConfig(root=config, storage_options=dict(storage_options or {}))
        elif storage_options is not None:
            raise TypeError("pass storage_options inside LakeConfig, not both")
        lake = cls(config.root, config.storage_options)
        for spec in TABLES.values():
            lake._ensure_table(spec, create=create or spec.name in ADDED_TABLES)
        return lake

    @property
    def is_local(self) -> bool:
        return "://" not in self.root

    def table_uri(self, name: str) -> str:
        """URI of table ``name`` (validated against the known tables)."""
        spec = table_spec(name)
        return f"{self.root}/{spec.name}"

    def table_storage(self, name: str) -> pafs.PyFileSystem:
        """The storage of table ``name`` as a pyarrow file system rooted at the table (its log files and
        data files by their paths in the log), on whatever store the lake is on."""
        return pafs.PyFileSystem(DeltaStorageHandler(self.table_uri(name), self.storage_options))

    def table(self, name: str, version: int | None = None) -> DeltaTable:
        """A ``DeltaTable`` for ``name`` at ``version`` (latest when None)."""
        return DeltaTable(
            self.table_uri(name), version=version, storage_options=self.storage_options
        )

    def version(self, name: str) -> int:
        """Latest Delta version of table ``name``."""
        return self.table(name).version()

    def has_commit_after(self, name: str, version: int) -> bool | None:
        """Whether table ``name`` has a commit after ``version``, told without listing its log; None
        where that cannot be told cheaply (an object store: refresh as usual).

        delta-rs finds new commits by listing the table's ``_delta_log`` folder, which on a local
        filesystem costs in proportion to every commit the table ever had (its log is kept whole for
        replay: :data:`TABLE_CONFIGURATION`): about 4 ms at 4,000 commits, against 0.6 ms at 100. On a
        local lake the next commit's file is looked up instead. A commit landing just after the lookup
        is no harm: a writer's commit on the older version is refused and planned again
        (:func:`sao.lake.commit.append_exactly`), and a reader sees it at its next look."""
        if "://" in self.root:
            return None
        return os.path.exists(os.path.join(self.table_uri(name), "_delta_log", f"{version + 1:020d}.json"))

    def refresh(self, name: str, table: DeltaTable) -> None:
        """Bring ``table`` (a loaded ``DeltaTable`` of table ``name``) up to its latest version, skipping
        the listing of its log when :meth:`has_commit_after` tells that no commit followed it."""
        if self.has_commit_after(name, table.version()) is not False:
            table.update_incremental()

    def read(
        self,
        name: str,
        *,
        version: int | None = None,
        columns: list[str] | None = None,
        predicate: str | None = None,
    ) -> pa.Table:
        """Read table ``name`` (a projection and a delta-rs SQL predicate are pushed down), cast to the
        spec's schema: strings come back as ``string``, not DataFusion's ``string_view``."""
        return self.read_from(self.table(name, version), name, columns=columns, predicate=predicate)

    def read_run(self, name: str, run_id: str, columns: list[str] | None = None, *,
                 version: int | None = None) -> pa.Table:
        """:meth:`read` of run ``run_id``'s rows of table ``name`` (the run id pushed down as a predicate)."""
        return self.read(name, version=version, columns=columns, predicate=f"run_id = {sql_literal(run_id)}")

    def read_from(
        self,
        table: DeltaTable,
        name: str,
        *,
        columns: list[str] | None = None,
        predicate: str | None = None,
    ) -> pa.Table:
        """Like :meth:`read` on an already loaded ``table`` (keeps its pinned version)."""
        schema = table_spec(name).schema
        if columns is not None:
            unknown = [c for c in columns if c not in schema.names]
            if unknown:
                raise KeyError(f"table {name} has no column(s) {unknown}")
            schema = pa.schema([schema.field(c) for c in columns])
        # A snapshot from before a schema version added nullable columns reads them as null.
        present = set(pa.schema(table.schema().to_arrow()).names)
        added = [f for f in schema if f.name not in present and f.nullable]
        scanned = [n for n in schema.names if n in present or not any(f.name == n for f in added)]
        try:
            data = pa.table(table.scan(columns=scanned, predicate=predicate).read_all())
        except Exception as error:  # delta-rs raises plain Exception from the Arrow C stream
            raise LakeError(
                f"reading table {name} at version {table.version()} failed (a file vacuumed away, or "
                f"a bad predicate {predicate!r}?): {error}"
            ) from error
        for f in added:
            data = data.append_column(f.name, pa.nulls(data.num_rows, f.type))
        return data.select(schema.names).cast(schema)

    def _ensure_table(self, spec: TableSpec, *, create: bool) -> None:
        uri = self.table_uri(spec.name)
        if not DeltaTable.is_deltatable(uri, storage_options=self.storage_options):
            if not create:
                raise LakeNotFoundError(f"no Delta table {spec.name!r} at {uri}")
            self._create(spec, uri)
        table = self.table(spec.name)
        self._check_schema(spec, table)
        self._check_stats_columns(spec, table)

    def _check_stats_columns(self, spec: TableSpec, table: DeltaTable) -> None:
        """A table created before its spec named statistics columns gets them (a metadata commit; files
        written before keep the statistics they have until compaction rewrites them)."""
        wanted = table_configuration(spec).get(STATS_COLUMNS_KEY)
        if wanted is None:
            return
        if table.metadata().configuration.get(STATS_COLUMNS_KEY) == wanted:
            return
        try:
            table.alter.set_table_properties({STATS_COLUMNS_KEY: wanted})
        except DeltaError:
            # Another process set it first (a commit race): fine if it is set now.
            if self.table(spec.name).metadata().configuration.get(STATS_COLUMNS_KEY) != wanted:
                raise

    def _create(self, spec: TableSpec, uri: str) -> None:
        if self.is_local:
            Path(uri).mkdir(parents=True, exist_ok=True)
        try:
            DeltaTable.create(
                uri,
                spec.schema,
                mode="ignore",
                partition_by=list(spec.partition_by) or None,
                name=spec.name,
                description=f"{spec.description} (schema version {spec.schema_version})",
                configuration=table_configuration(spec),
                storage_options=self.storage_options,
                # Only version 0 may create the table: a racing creator fails instead of committing a
                # second CREATE as version 1.
                commit_properties=CommitProperties(max_commit_retries=0),
            )
        except DeltaError:
            # Another process created it between our check and our commit: fine if it exists now.
            if not DeltaTable.is_deltatable(uri, storage_options=self.storage_options):
                raise

    def _check_schema(self, spec: TableSpec, table: DeltaTable) -> None:
        found = plain(pa.schema(table.schema().to_arrow()))
        expected = plain(spec.schema)
        for index, want in enumerate(expected):
            if index >= len(found):
                missing = [f for f in spec.schema][index:]
                self._migrate(spec, table, missing)
                return
            have = found.field(index)
            if not have.equals(want):
                raise SchemaMismatchError(
                    f"table {spec.name}: column {index} is {_describe(have)} but schema version "
                    f"{spec.schema_version} declares {_describe(want)}"
                )
        if len(found) > len(expected):
            extra = found.names[len(expected) :]
            raise SchemaMismatchError(
                f"table {spec.name}: columns {extra} are not in schema version {spec.schema_version} "
                "(was the table written by a newer sao?)"
            )

    def _migrate(self, spec: TableSpec, table: DeltaTable, missing: list[pa.Field]) -> None:
        """Append the nullable fields a newer schema version added."""
        required = [f.name for f in missing if not f.nullable]
        if required:
            raise SchemaMismatchError(
                f"table {spec.name}: schema version {spec.schema_version} adds non-nullable "
                f"column(s) {required}; only nullable columns can be added to existing rows"
            )
        from deltalake.schema import Field as DeltaField

        table.alter.add_columns([DeltaField.from_arrow(f) for f in missing])
        table.alter.set_table_description(
            f"{spec.description} (schema version {spec.schema_version})"
        )


def _describe(field: pa.Field) -> str:
    return f"{field.name}: {field.type}{'' if field.nullable else ' not null'}"


def _normalise_root(root: str) -> str:
    if not root:
        raise ValueError("the lake root is empty")
    if "://" in root:
        scheme = root.split("://", 1)[0]
        if scheme == "file":
            return str(Path(root[len("file://") :]).resolve())
        return root.rstrip("/")
    return str(Path(root).expanduser().resolve())
