"""Shared building blocks of the table schemas: documented fields and the table spec.

A field's documentation lives in its Arrow metadata under ``comment`` (the key Delta readers show as a
column comment), so it is written once and travels into the Delta log with the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

__all__ = ["TIMESTAMP", "TableSpec", "doc_field", "field_doc", "list_of", "plain"]

TIMESTAMP = pa.timestamp("us", tz="UTC")
"""Every time in the lake: microseconds since the epoch, UTC (Delta's ``timestamp``)."""


def doc_field(name: str, type_: pa.DataType, nullable: bool, doc: str) -> pa.Field:
    """An Arrow field with its documentation in the ``comment`` metadata."""
    return pa.field(name, type_, nullable=nullable, metadata={"comment": doc})


def field_doc(field: pa.Field) -> str:
    """The documentation of a field made by :func:`doc_field` (empty when it has none)."""
    metadata = field.metadata or {}
    return metadata.get(b"comment", b"").decode()


def list_of(type_: pa.DataType, items_nullable: bool = False) -> pa.ListType:
    """A list type whose item field is named ``element``, as Delta names it on read."""
    return pa.list_(pa.field("element", type_, nullable=items_nullable))


def plain(schema: pa.Schema) -> pa.Schema:
    """``schema`` without field metadata at any depth (for structural comparison)."""
    return pa.schema([_plain_field(f) for f in schema])


def _plain_field(field: pa.Field) -> pa.Field:
    type_ = field.type
    if pa.types.is_struct(type_):
        type_ = pa.struct([_plain_field(type_.field(i)) for i in range(type_.num_fields)])
    elif pa.types.is_list(type_):
        type_ = pa.list_(_plain_field(type_.value_field))
    elif pa.types.is_map(type_):
        type_ = pa.map_(_plain_field(type_.key_field), _plain_field(type_.item_field))
    return pa.field(field.name, type_, nullable=field.nullable)


@dataclass(frozen=True)
class TableSpec:
    """Everything needed to create one Delta table: tables are created from this, never inferred.

    Attributes:
        name: the table's folder name under the lake root (also its SQL name).
        schema: the Arrow schema, with nullability and a ``comment`` per field.
        schema_version: bumped on every change; rows carry the version that wrote them.
        partition_by: partition columns (folders), chosen for the reads that dominate.
        description: one line, stored as the Delta table description.
        stats_columns: the columns whose per-file min/max statistics the Delta log keeps
            (``delta.dataSkippingStatsColumns``), which is what lets a predicate on them skip files
            unopened; empty: Delta's default, the first 32 leaf columns (nested columns count each leaf).
    """

    name: str
    schema: pa.Schema
    schema_version: int
    partition_by: tuple[str, ...]
    description: str
    stats_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for column in self.partition_by:
            if column not in self.schema.names:
                raise ValueError(
                    f"table {self.name}: partition column {column!r} is not in the schema"
                )
        for column in self.stats_columns:
            if column not in self.schema.names:
                raise ValueError(f"table {self.name}: statistics column {column!r} is not in the schema")
        missing_docs = [f.name for f in self.schema if not field_doc(f)]
        if missing_docs:
            raise ValueError(f"table {self.name}: fields without a comment: {missing_docs}")
