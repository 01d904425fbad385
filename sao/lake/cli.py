"""``sao sql`` and ``sao lake ...``: the lake from the command line (registered by ``sao.cli``).

Every command but ``sao lake examples`` takes ``--lake`` (default: ``LakeConfig().root``, or the
``SAO_LAKE`` environment variable) and ``--storage-option KEY=VALUE`` for object stores (delta-rs also reads ``AWS_*`` from the
environment). Commands only open an existing lake: a wrong path is an error, never a new empty lake.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sao.cli_common import HELP_MARKUP, fail, open_lake
from sao.lake.config import LakeConfig, MaintenanceConfig

__all__ = ["lake_app", "sql"]

DEFAULT_ROOT = LakeConfig().root
DEFAULT_RETENTION_HOURS = MaintenanceConfig().retention_hours

lake_app = typer.Typer(
    name="lake",
    help="Inspect, check and maintain the Delta lake (tables, versions, counts, examples, check, "
    "compact, vacuum).",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)

LakeOption = Annotated[
    str,
    typer.Option("--lake", envvar="SAO_LAKE", help="Lake root: a folder or s3://bucket/prefix."),
]
StorageOption = Annotated[
    list[str] | None,
    typer.Option("--storage-option", "-o", help="Object-store option KEY=VALUE (repeatable)."),
]


def _print_table(table, title: str | None = None, max_rows: int = 50,  # table: pa.Table
                 more: str = "`sao sql` with --max-rows, --csv or --parquet shows them all") -> None:
    from rich.console import Console
    from rich.table import Table

    from sao.lake.sql import to_display_rows

    view = Table(title=title, show_lines=False)
    for name in table.column_names:
        view.add_column(name, overflow="fold")
    for row in to_display_rows(table, max_rows):
        view.add_row(*row)
    console = Console()
    console.print(view)
    if table.num_rows > max_rows:
        console.print(
            f"({table.num_rows} rows, showing {max_rows}; {more})"
        )


def sql(
    query: Annotated[
        str, typer.Argument(help="One read-only statement (SELECT, WITH, EXPLAIN, ...).")
    ],
    lake: LakeOption = DEFAULT_ROOT,
    storage_option: StorageOption = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Write the result as CSV here.")] = None,
    parquet: Annotated[
        Path | None, typer.Option("--parquet", help="Write the result as Parquet here.")
    ] = None,
    max_rows: Annotated[int, typer.Option("--max-rows", help="Rows to print.")] = 50,
) -> None:
    """Run read-only SQL over the lake's tables: trajectories, quarantine, policy_versions, train_steps,
    rollout_tasks, runs."""
    from sao.lake.sql import ReadOnlyQueryError, check_read_only, run_sql, write_result
    from sao.lake.store import LakeError

    try:
        check_read_only(query)
    except ReadOnlyQueryError as error:
        raise fail(str(error)) from None
    opened = open_lake(lake, storage_option)
    try:
        result = run_sql(opened, query)
    except LakeError as error:
        raise fail(str(error).splitlines()[0]) from None
    for path, fmt in ((csv, "csv"), (parquet, "parquet")):
        if path is not None:
            write_result(result, path, fmt)
            typer.echo(f"wrote {result.num_rows} rows to {path}", err=True)
    if csv is None and parquet is None:
        _print_table(result, max_rows=max_rows, more="use --max-rows, --csv or --parquet")


@lake_app.command("tables")
def tables(lake: LakeOption = DEFAULT_ROOT, storage_option: StorageOption = None) -> None:
    """Each table: Delta version, files, rows, schema version, partition columns."""
    import pyarrow as pa

    from schemas import TABLES

    opened = open_lake(lake, storage_option)
    rows = []
    for name, spec in TABLES.items():
        table = opened.table(name)
        actions = pa.table(table.get_add_actions())
        rows.append(
            {
                "table": name,
                "version": table.version(),
                "files": actions.num_rows,
                "rows": int(pa.compute.sum(actions["num_records"]).as_py() or 0)
                if actions.num_rows
                else 0,
                "schema_version": spec.schema_version,
                "partition_by": ", ".join(spec.partition_by) or "-",
            }
        )
    _print_table(pa.Table.from_pylist(rows), title=f"lake {opened.root}")


@lake_app.command("versions")
def versions(
    table: Annotated[str, typer.Argument(help="Table name.")],
    lake: LakeOption = DEFAULT_ROOT,
    storage_option: StorageOption = None,
    limit: Annotated[int, typer.Option("--limit", help="Newest versions to show.")] = 20,
) -> None:
    """The commit history of one table, newest first (in Python, `sao.lake.sql.run_sql(lake, query,
    versions={table: N})` reads a table as it was at version N)."""
    import datetime as dt

    import pyarrow as pa

    from schemas import TABLES

    if table not in TABLES:
        raise fail(f"unknown table {table!r}; the lake has: {', '.join(sorted(TABLES))}")
    opened = open_lake(lake, storage_option)
    rows = []
    for entry in opened.table(table).history(limit):
        metrics = entry.get("operationMetrics") or {}
        millis = entry.get("timestamp") or 0
        rows.append(
            {
                "version": entry.get("version"),
                "time (UTC)": dt.datetime.fromtimestamp(millis / 1000, dt.UTC).isoformat(
                    timespec="seconds"
                ),
                "operation": entry.get("operation"),
                "rows_added": metrics.get("num_added_rows"),
                "files_added": metrics.get("num_added_files", metrics.get("numFilesAdded")),
                "files_removed": metrics.get("num_removed_files", metrics.get("numFilesRemoved")),
                "writer": entry.get("sao.writer_id") or "-",
            }
        )
    _print_table(pa.Table.from_pylist(rows), title=f"{table} history", max_rows=max(limit, 1))


@lake_app.command("counts")
def counts(lake: LakeOption = DEFAULT_ROOT, storage_option: StorageOption = None) -> None:
    """Trajectories per run and termination reason; quarantined deliveries per reason."""
    from sao.lake.sql import run_sql

    opened = open_lake(lake, storage_option)
    _print_table(
        run_sql(
            opened,
            "SELECT run_id, termination_reason, count(*) AS trajectories, "
            "min(min_policy_version) AS oldest_version, max(max_policy_version) AS newest_version "
            "FROM trajectories GROUP BY run_id, termination_reason ORDER BY run_id, termination_reason",
        ),
        title="trajectories",
    )
    _print_table(
        run_sql(
            opened,
            "SELECT reason, count(*) AS deliveries FROM quarantine GROUP BY reason ORDER BY reason",
        ),
        title="quarantine",
    )


@lake_app.command("examples")
def examples() -> None:
    """Audit questions and the `sao sql` query that answers each."""
    from sao.lake.sql import EXAMPLE_QUERIES

    for question, query in EXAMPLE_QUERIES.items():
        typer.echo(f'# {question}\nsao sql "{query}"\n')


@lake_app.command("compact")
def compact(
    table: Annotated[list[str] | None, typer.Argument(help="Tables (all when omitted).")] = None,
    lake: LakeOption = DEFAULT_ROOT,
    storage_option: StorageOption = None,
) -> None:
    """Rewrite small files into large ones (a new version; old versions stay readable)."""
    from sao.lake.maintenance import compact as run_compact
    from schemas import TABLES

    unknown = [t for t in table or [] if t not in TABLES]
    if unknown:
        raise fail(f"unknown table(s) {unknown}; the lake has: {', '.join(sorted(TABLES))}")
    for report in run_compact(open_lake(lake, storage_option), table or None):
        typer.echo(
            f"{report.table}: {report.files_removed} files -> {report.files_added} "
            f"(version {report.version_before} -> {report.version_after})"
        )


@lake_app.command("vacuum")
def vacuum(
    lake: LakeOption = DEFAULT_ROOT,
    storage_option: StorageOption = None,
    retention_hours: Annotated[
        int,
        typer.Option("--retention-hours", help="Delete files unreferenced for longer than this."),
    ] = DEFAULT_RETENTION_HOURS,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List, do not delete.")] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Allow a retention below the safe minimum (nothing running)."),
    ] = False,
) -> None:
    """Delete unreferenced files, keeping every snapshot a recorded train step read."""
    from sao.lake.maintenance import MaintenanceError
    from sao.lake.maintenance import vacuum as run_vacuum

    opened = open_lake(lake, storage_option)
    try:
        reports = run_vacuum(opened, retention_hours=retention_hours, dry_run=dry_run, force=force)
    except MaintenanceError as error:
        raise fail(str(error)) from None
    verb = "would delete" if dry_run else "deleted"
    for report in reports:
        kept = f", kept versions {list(report.kept_versions)}" if report.kept_versions else ""
        typer.echo(f"{report.table}: {verb} {len(report.removed)} files{kept}")


@lake_app.command("check")
def check(
    run: Annotated[str, typer.Option("--run", help="Run id to reconcile.")],
    lake: LakeOption = DEFAULT_ROOT,
    storage_option: StorageOption = None,
    max_staleness: Annotated[
        int | None,
        typer.Option(
            "--max-staleness",
            min=0,
            help="Staleness bound to check (default: the run's stored run_config.json).",
        ),
    ] = None,
    checkpoints: Annotated[
        bool,
        typer.Option(
            "--checkpoints/--no-checkpoints",
            help="Load every registered checkpoint and compare its weights hash.",
        ),
    ] = True,
) -> None:
    """Account for every rollout the run issued, every stored and consumed trajectory and every
    checkpoint; exit 1 with the findings listed when something was lost, doubled or misused."""
    from sao.audit import UnknownRunError, check_run

    opened = open_lake(lake, storage_option)
    try:
        report = check_run(
            opened, run, max_staleness=max_staleness, verify_checkpoints=checkpoints
        )
    except (ValueError, UnknownRunError) as error:
        raise fail(str(error)) from None
    for line in report.lines():
        typer.echo(line)
    if not report.ok:
        raise typer.Exit(1)
