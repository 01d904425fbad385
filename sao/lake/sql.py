"""Read-only SQL over the lake, through DataFusion (``deltalake.QueryBuilder``).

All tables of :data:`schemas.TABLES` are registered under their names (``trajectories``,
``quarantine``, ``policy_versions``, ``train_steps``, ``rollout_tasks``, ``runs``), at their latest versions or at
pinned ones.

Read-only is enforced before the query reaches the engine, because DataFusion would happily run
``COPY (...) TO 'file'`` or ``CREATE VIEW``: the query is parsed (sqlglot, PostgreSQL's dialect, which
DataFusion's SQL follows) and must be one statement (a trailing ``;`` is fine), a query (SELECT, WITH,
VALUES, set operations), DESCRIBE, or EXPLAIN [ANALYZE] of such a statement, with no node that
modifies anything (INSERT, UPDATE, DELETE, MERGE, CREATE, DROP, ALTER, COPY, TRUNCATE, SET, SELECT
INTO, ...). What does not parse is refused. A refusal names the statement kind.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import sqlglot
from deltalake import QueryBuilder
from sqlglot import exp

from sao.lake.store import Lake, LakeError
from schemas import TABLES

__all__ = [
    "ALLOWED_STATEMENTS",
    "EXAMPLE_QUERIES",
    "ReadOnlyQueryError",
    "check_read_only",
    "plain_types",
    "run_sql",
    "to_display_rows",
    "write_result",
]

ALLOWED_STATEMENTS = ("SELECT", "WITH", "EXPLAIN", "DESCRIBE", "VALUES")

EXAMPLE_QUERIES: dict[str, str] = {
    "Which policy version sampled which tokens?": (
        "SELECT trajectory_id, seg['kind'] AS kind, seg['policy_version'] AS policy_version, "
        "seg['start'] AS start_token, seg['end'] AS end_token "
        "FROM (SELECT trajectory_id, ingest_seq, unnest(segments) AS seg FROM trajectories) "
        "ORDER BY ingest_seq, start_token LIMIT 20"
    ),
    "Why did trajectories end, per run?": (
        "SELECT run_id, termination_reason, count(*) AS trajectories, avg(reward) AS mean_reward, "
        "avg(num_action_tokens) AS mean_action_tokens FROM trajectories GROUP BY 1, 2 ORDER BY 1, 2"
    ),
    "How stale was the data each step used?": (
        "SELECT s.run_id, s.step, s.policy_version_before - t.min_policy_version AS staleness, "
        "count(*) AS trajectories "
        "FROM (SELECT run_id, step, policy_version_before, unnest(trajectory_ids) AS trajectory_id "
        "FROM train_steps) s "
        "JOIN trajectories t ON t.run_id = s.run_id AND t.trajectory_id = s.trajectory_id "
        "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
    ),
    "What did DIS mask per step?": (
        "SELECT run_id, step, metrics['actor/kept_frac'] AS kept_frac FROM train_steps ORDER BY 1, 2"
    ),
    "Which snapshot and weights does replaying a step need?": (
        "SELECT s.run_id, s.step, s.trajectories_version, s.num_trajectories, p.checkpoint_uri, "
        "p.weights_hash FROM train_steps s JOIN policy_versions p "
        "ON p.run_id = s.run_id AND p.version = s.policy_version_before ORDER BY 1, 2"
    ),
    "Which settings produced each trajectory?": (
        "SELECT t.run_id, t.trajectory_id, t.reward, r.settings['algorithm.name'] AS algorithm, "
        "r.settings['algorithm.eps_high'] AS eps_high, r.settings['rollout.max_tokens'] AS max_tokens "
        "FROM trajectories t JOIN runs r ON r.run_id = t.run_id AND r.event = 'start' LIMIT 20"
    ),
    "Which code of one's own did each start and resume run with?": (
        "SELECT run_id, event, started_at, code FROM runs WHERE code IS NOT NULL ORDER BY 1, 3"
    ),
    "What was rejected, and why?": (
        "SELECT reason, field, count(*) AS deliveries FROM quarantine GROUP BY 1, 2 ORDER BY 3 DESC"
    ),
}
"""Audit questions and the SQL that answers them (``sao lake examples`` prints them)."""
_READ_ONLY = (exp.Select, exp.Union, exp.Intersect, exp.Except, exp.Values, exp.Describe)
"""What a statement may be (a WITH query parses as the SELECT it prefixes)."""
_MODIFYING = tuple(getattr(exp, name) for name in (
    "Insert", "Update", "Delete", "Merge", "Create", "Drop", "Alter", "Copy", "Set", "Command", "Into",
    "TruncateTable", "Use", "Pragma", "LoadData", "Grant", "Revoke", "Analyze") if hasattr(exp, name))
"""Nodes that change something (or that the parser could not read as a query: ``Command``)
anywhere in the statement: refused even inside a read-only one (``SELECT ... INTO``)."""
_EXPLAIN = re.compile(r"\s*EXPLAIN(\s+ANALYZE)?(\s+VERBOSE)?\b", re.IGNORECASE)
_NAMES = {"TruncateTable": "TRUNCATE", "Describe": "DESCRIBE", "Into": "INTO"}


class ReadOnlyQueryError(LakeError):
    """The query is not a single read-only statement."""


def check_read_only(query: str) -> None:
    """Raise :class:`ReadOnlyQueryError` unless ``query`` is one read-only statement (see the module
    docstring): parsed as SQL, not matched against keywords, so a column called ``use`` or a string
    saying ``delete`` is no refusal, and a statement that does not parse is one."""
    explained = _strip_comments(query)
    match = _EXPLAIN.match(explained)
    if match:  # EXPLAIN [ANALYZE] runs (or plans) the statement that follows: that one is checked
        explained = explained[match.end():]
        if not explained.strip(" \t\n;"):
            raise ReadOnlyQueryError("EXPLAIN needs a statement to explain")
    statements = _parse(explained)
    if len(statements) > 1:
        raise ReadOnlyQueryError("sao sql runs one statement at a time; found several separated by ';'")
    (statement,) = statements
    kind = _kind(statement)
    if not isinstance(statement, _READ_ONLY):
        raise ReadOnlyQueryError(f"sao sql is read-only: refusing the statement {kind} (allowed statements: "
                                 f"{', '.join(ALLOWED_STATEMENTS)})")
    for node in statement.walk():
        if isinstance(node, _MODIFYING):
            raise ReadOnlyQueryError(f"sao sql is read-only: refusing the statement {kind} because it contains "
                                     f"{_kind(node)}")


def _strip_comments(query: str) -> str:
    """``query`` without its leading comments (for the EXPLAIN prefix; the parser reads the rest)."""
    previous = None
    while previous != query:
        previous = query
        query = re.sub(r"^\s*(--[^\n]*(\n|$)|/\*.*?\*/)", "", query, flags=re.DOTALL)
    return query


def _parse(query: str) -> list[exp.Expression]:
    """The statements of ``query`` (DataFusion's SQL is read as PostgreSQL's, which it follows)."""
    quiet = logging.getLogger("sqlglot")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "falling back to parsing as a Command": such a statement is refused below
    try:
        statements = [s for s in sqlglot.parse(query, dialect="postgres") if s is not None]
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError) as error:
        first = query.split()[0].upper() if query.split() else "?"
        reason = str(error).splitlines()[0]
        raise ReadOnlyQueryError(f"refusing the statement {first}: it does not parse as SQL ({reason})") from None
    finally:
        quiet.setLevel(level)
    if not statements:
        raise ReadOnlyQueryError("the query is empty")
    return statements


def _kind(node: exp.Expression) -> str:
    """The statement kind a person would name: the first keyword (WITH for a query with CTEs)."""
    if isinstance(node, exp.Command):
        return str(node.this).upper()
    if isinstance(node, exp.Select) and node.args.get("with"):
        return "WITH"
    name = type(node).__name__
    return _NAMES.get(name, name.upper())


def run_sql(lake: Lake, query: str, *, versions: Mapping[str, int] | None = None) -> pa.Table:
    """Run a read-only ``query`` over every lake table; ``versions`` pins tables to Delta versions
    (others are read at their latest). Returns the result with plain Arrow types
    (:func:`plain_types`)."""
    check_read_only(query)
    pinned = dict(versions or {})
    unknown = sorted(set(pinned) - set(TABLES))
    if unknown:
        raise KeyError(f"unknown table(s) {unknown}; the lake has: {', '.join(sorted(TABLES))}")
    builder = QueryBuilder()
    for name in TABLES:
        builder.register(name, lake.table(name, version=pinned.get(name)))
    try:
        result = pa.table(builder.execute(query).read_all())
    except (
        Exception
    ) as error:  # DataFusion raises DeltaError / generic errors with the plan message
        raise LakeError(f"query failed: {error}") from error
    return plain_types(result)


def plain_types(table: pa.Table) -> pa.Table:
    """``table`` with DataFusion's view types (``string_view``, ``binary_view``) cast to the plain
    ones, at any depth, so every Arrow consumer (CSV, Parquet, pandas) takes it."""
    return table.cast(
        pa.schema([pa.field(f.name, _plain(f.type), f.nullable) for f in table.schema])
    )


def _plain(type_: pa.DataType) -> pa.DataType:
    if type_ == pa.string_view():
        return pa.string()
    if type_ == pa.binary_view():
        return pa.binary()
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_list_view(type_):
        item = type_.value_field
        return pa.list_(pa.field(item.name, _plain(item.type), item.nullable))
    if pa.types.is_struct(type_):
        return pa.struct([pa.field(f.name, _plain(f.type), f.nullable) for f in type_])
    if pa.types.is_map(type_):
        return pa.map_(_plain(type_.key_type), _plain(type_.item_type))
    return type_


def _is_nested(type_: pa.DataType) -> bool:
    return pa.types.is_nested(type_)


def write_result(table: pa.Table, path: Path, fmt: str) -> None:
    """Write a query result as ``csv`` (nested values as JSON text) or ``parquet`` (as is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "csv":
        pa_csv.write_csv(_nested_as_json(table), path)
    else:
        raise ValueError(f"unknown output format {fmt!r}; use csv or parquet")


def _nested_as_json(table: pa.Table) -> pa.Table:
    columns = []
    for field, column in zip(table.schema, table.columns, strict=True):
        if _is_nested(field.type):
            column = pa.array([json.dumps(v, default=str) for v in column.to_pylist()], pa.string())
        columns.append(column)
    return pa.table(columns, names=table.column_names)


def to_display_rows(table: pa.Table, max_rows: int, max_width: int = 60) -> list[list[str]]:
    """The first ``max_rows`` rows as strings for a terminal table (long values shortened)."""
    rows = []
    for row in table.slice(0, max_rows).to_pylist():
        cells = []
        for value in row.values():
            text = "NULL" if value is None else str(value)
            cells.append(text if len(text) <= max_width else text[: max_width - 1] + "…")
        rows.append(cells)
    return rows
