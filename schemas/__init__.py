"""Arrow schemas of the lake's Delta tables, one module per table: the single source of truth.

Tables are created from these specs, never inferred from data; writes that do not match fail or go to
``quarantine``. :data:`TABLES` maps each table name (its folder under the lake root and its SQL name)
to its :class:`TableSpec`.

The table modules (and pyarrow with them) load on first use of a name below, not when the package
does: :mod:`schemas.vocabulary` (the tables' enums, standard library only) is imported by the algorithm
core, which must not pull in pyarrow.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loaded lazily by __getattr__ below
    from schemas import policy_versions, quarantine, rollout_tasks, runs, train_steps, trajectories
    from schemas._spec import TIMESTAMP, TableSpec, doc_field, field_doc, list_of, plain

__all__ = [
    "TABLES",
    "TIMESTAMP",
    "TableSpec",
    "doc_field",
    "field_doc",
    "list_of",
    "plain",
    "policy_versions",
    "quarantine",
    "rollout_tasks",
    "runs",
    "table_spec",
    "train_steps",
    "trajectories",
]

_TABLE_MODULES = ("trajectories", "quarantine", "policy_versions", "train_steps", "rollout_tasks", "runs")
_SPEC_NAMES = ("TIMESTAMP", "TableSpec", "doc_field", "field_doc", "list_of", "plain")


@functools.cache
def _tables() -> dict[str, TableSpec]:
    return {spec.name: spec for spec in (importlib.import_module(f"schemas.{m}").SPEC for m in _TABLE_MODULES)}


def __getattr__(name: str) -> Any:
    """``TABLES``, the table modules and the spec helpers, imported when first asked for."""
    if name == "TABLES":
        return _tables()
    if name in _TABLE_MODULES:
        return importlib.import_module(f"schemas.{name}")
    if name in _SPEC_NAMES:
        return getattr(importlib.import_module("schemas._spec"), name)
    raise AttributeError(f"module 'schemas' has no attribute {name!r}")


def table_spec(name: str) -> TableSpec:
    """The spec of table ``name``; ``KeyError`` naming the known tables otherwise."""
    try:
        return _tables()[name]
    except KeyError:
        known = ", ".join(sorted(_tables()))
        raise KeyError(f"unknown table {name!r}; the lake has: {known}") from None
