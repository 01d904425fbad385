"""Arrow schemas of the lake's Delta tables, one module per table: the single source of truth.

Tables are created from these specs, never inferred from data; writes that do not match fail or go to
``quarantine``. :data:`TABLES` maps each table name (its folder under the lake root and its SQL name)
to its :class:`TableSpec`.
"""

from __future__ import annotations

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

TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        trajectories.SPEC,
        quarantine.SPEC,
        policy_versions.SPEC,
        train_steps.SPEC,
        rollout_tasks.SPEC,
        runs.SPEC,
    )
}


def table_spec(name: str) -> TableSpec:
    """The spec of table ``name``; ``KeyError`` naming the known tables otherwise."""
    try:
        return TABLES[name]
    except KeyError:
        known = ", ".join(sorted(TABLES))
        raise KeyError(f"unknown table {name!r}; the lake has: {known}") from None
