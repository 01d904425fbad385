"""`sao sql` and `sao lake ...` from the command line, on both backends."""

from __future__ import annotations

import csv

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sao.cli import app
from sao.lake.config import WriterConfig
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter

runner = CliRunner()


@pytest.fixture
def cli_lake(lake, lake_config) -> list[str]:
    """Lake arguments for the CLI, pointing at a lake holding three trajectories."""
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(make_trajectories(3, seed=51, num_tokens=12))
    args = ["--lake", lake_config.root]
    for key, value in lake_config.storage_options.items():
        args += ["--storage-option", f"{key}={value}"]
    return args


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("SELECT count(*) AS n FROM trajectories", "3"),
        ("SELECT count(*) AS n FROM quarantine", "0"),
        ("SELECT max(version) AS newest FROM policy_versions", "1"),
        ("SELECT count(*) AS steps FROM train_steps", "0"),
    ],
)
def test_sql_prints_a_table(cli_lake, query, expected):
    result = runner.invoke(app, ["sql", query, *cli_lake])
    assert result.exit_code == 0, result.output
    assert expected in result.stdout


def test_sql_writes_csv_and_parquet(cli_lake, tmp_path):
    query = "SELECT trajectory_id, segments, sampling FROM trajectories ORDER BY ingest_seq"
    out_csv, out_parquet = tmp_path / "r.csv", tmp_path / "r.parquet"
    result = runner.invoke(
        app, ["sql", query, *cli_lake, "--csv", str(out_csv), "--parquet", str(out_parquet)]
    )
    assert result.exit_code == 0, result.output
    with out_csv.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 and rows[0]["segments"].startswith('[{"kind": "action"')
    assert pq.read_table(out_parquet).num_rows == 3


@pytest.mark.parametrize("query", ["DELETE FROM trajectories", "COPY (SELECT 1) TO '/tmp/x.csv'"])
def test_sql_refuses_modifying_statements_with_one_line(cli_lake, query):
    result = runner.invoke(app, ["sql", query, *cli_lake])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "read-only" in result.stderr
    assert "Traceback" not in result.output


def test_sql_on_a_missing_lake_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["sql", "SELECT 1", "--lake", str(tmp_path / "none")])
    assert result.exit_code == 2 and "cannot open the lake" in result.stderr
    assert not (tmp_path / "none").exists()


def test_sql_engine_error_is_a_usage_error(cli_lake):
    result = runner.invoke(app, ["sql", "SELECT nope FROM trajectories", *cli_lake])
    assert result.exit_code == 2 and result.stderr.startswith("sao: error: query failed")


def test_lake_commands(cli_lake):
    tables = runner.invoke(app, ["lake", "tables", *cli_lake])
    assert tables.exit_code == 0 and "trajectories" in tables.stdout
    versions = runner.invoke(app, ["lake", "versions", "trajectories", *cli_lake])
    assert versions.exit_code == 0 and "WRITE" in versions.stdout
    counts = runner.invoke(app, ["lake", "counts", *cli_lake])
    assert counts.exit_code == 0 and "stop" in counts.stdout
    compact = runner.invoke(app, ["lake", "compact", "trajectories", *cli_lake])
    assert compact.exit_code == 0 and compact.stdout.startswith("trajectories:")
    refused = runner.invoke(app, ["lake", "vacuum", "--retention-hours", "0", *cli_lake])
    assert refused.exit_code == 2 and "below the minimum" in refused.stderr
    dry = runner.invoke(
        app, ["lake", "vacuum", "--retention-hours", "0", "--force", "--dry-run", *cli_lake]
    )
    assert dry.exit_code == 0 and "would delete" in dry.stdout
    unknown = runner.invoke(app, ["lake", "versions", "../../etc", *cli_lake])
    assert unknown.exit_code == 2 and "unknown table" in unknown.stderr


def test_bad_storage_option_is_a_usage_error(tmp_path):
    result = runner.invoke(
        app, ["lake", "tables", "--lake", str(tmp_path), "--storage-option", "novalue"]
    )
    assert result.exit_code == 2 and "KEY=VALUE" in result.stderr


def test_every_registered_benchmark_runs_through_sao_bench():
    """Each name `sao bench` lists reaches its module's main (its --help exits 0 naming its options);
    an unknown name is a usage error naming the known ones."""
    import importlib

    from typer.testing import CliRunner

    from sao.cli import BENCHMARKS, app

    listed = CliRunner().invoke(app, ["bench"])
    assert listed.exit_code == 0 and "lake" in listed.output
    for name, module in BENCHMARKS.items():
        assert name in listed.output and callable(importlib.import_module(f"benchmarks.{module}").main)
    usage = CliRunner().invoke(app, ["bench", "lake", "--help"])
    assert usage.exit_code == 0 and "--quick" in usage.output
    unknown = CliRunner().invoke(app, ["bench", "nope"])
    assert unknown.exit_code == 2 and "unknown benchmark 'nope'; known: bias, demo, endpoint, fresh, gpu-check, lake" in unknown.stderr
