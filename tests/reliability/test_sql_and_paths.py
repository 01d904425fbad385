"""`sao sql` cannot modify or delete anything, and no table name or run id given by a user can reach a
path outside the lake root (or the run's work folder)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sao.cli import app
from sao.config import RunConfig
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.ledger import consumed_ids, newest_policy_version, register_policy_version
from sao.lake.reader import TrajectoryReader
from sao.lake.records import PolicyVersionRecord
from sao.lake.sql import ReadOnlyQueryError, run_sql
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter
from sao.train.config import TrainConfig
from schemas import TABLES

runner = CliRunner()

MODIFYING = [
    "DELETE FROM trajectories",
    "delete from trajectories where true",
    "UPDATE trajectories SET reward = 1",
    "INSERT INTO trajectories SELECT * FROM trajectories",
    "INSERT INTO policy_versions VALUES ('r', 9, NULL, 'x', 'y', NULL, now(), 1)",
    "DROP TABLE trajectories",
    "DROP VIEW IF EXISTS trajectories",
    "TRUNCATE trajectories",
    "ALTER TABLE trajectories ADD COLUMN x INT",
    "MERGE INTO trajectories t USING quarantine q ON false WHEN NOT MATCHED THEN INSERT *",
    "COPY trajectories TO '/tmp/stolen.parquet'",
    "COPY (SELECT * FROM train_steps) TO 'out.csv' STORED AS CSV",
    "CREATE TABLE t AS SELECT * FROM trajectories",
    "CREATE EXTERNAL TABLE leak STORED AS CSV LOCATION '/etc/passwd'",
    "CREATE OR REPLACE VIEW trajectories AS SELECT 1",
    "SET datafusion.execution.target_partitions = 1",
    "VACUUM trajectories",
    "OPTIMIZE trajectories",
    "SELECT 1; DELETE FROM trajectories",
    "SELECT 1;DROP TABLE train_steps;",
    "WITH x AS (SELECT 1) DELETE FROM trajectories",
    "EXPLAIN ANALYZE DELETE FROM trajectories",
    "/* harmless */ DELETE FROM trajectories",
    "-- comment\nDROP TABLE quarantine",
    "DEL/**/ETE FROM trajectories",
    "SELECT * INTO backup FROM trajectories",
    "  \n\tdElEtE FROM trajectories",
    "SELECT 'it''s' AS a; TRUNCATE trajectories",
]


@pytest.fixture
def lake(tmp_path) -> Lake:
    opened = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register_policy_version(opened, PolicyVersionRecord("run-0", 0, "mem://v0", "h0"))
    with TrajectoryWriter(opened, WriterConfig(background_flush=False)) as writer:
        writer.add_many(make_trajectories(5, seed=1, num_tokens=12))
    return opened


def snapshot(lake: Lake) -> dict[str, tuple[int, int]]:
    return {name: (lake.version(name), lake.read(name).num_rows) for name in TABLES}


@pytest.mark.parametrize("query", MODIFYING)
def test_sql_refuses_every_modifying_statement_and_the_lake_is_unchanged(lake, query, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(lake)
    with pytest.raises(ReadOnlyQueryError):
        run_sql(lake, query)
    result = runner.invoke(app, ["sql", query, "--lake", lake.root])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert snapshot(lake) == before
    assert not Path("/tmp/stolen.parquet").exists() and not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM '/etc/passwd'",
        "SELECT * FROM \"/etc/passwd\"",
        "SELECT * FROM 'file:///etc/hostname'",
        f"SELECT * FROM '{'../' * 8}etc/passwd'",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_parquet('../lake/trajectories')",
    ],
)
def test_sql_reads_only_the_lake_tables(lake, query):
    result = runner.invoke(app, ["sql", query, "--lake", lake.root])
    assert result.exit_code == 2 and "query failed" in result.stderr


@pytest.mark.parametrize("name", ["../etc", "trajectories/../../x", "/etc", "trajectories/", ".", "..", "~"])
def test_table_names_from_users_stay_inside_the_root(lake, name):
    with pytest.raises(KeyError, match="unknown table"):
        lake.table_uri(name)
    for command in (["lake", "versions", name], ["lake", "compact", name]):
        result = runner.invoke(app, [*command, "--lake", lake.root])
        assert result.exit_code == 2 and "unknown table" in result.stderr


BAD_RUN_IDS = ["../escape", "..", "a/../../b", "/abs", "run/sub", ".hidden", "x' OR 'a'='a", "run id", "", "r" * 129]


@pytest.mark.parametrize("run_id", BAD_RUN_IDS)
def test_run_ids_from_users_are_refused_everywhere(lake, run_id, tmp_path):
    root = Path(lake.root)
    before = sorted(p.relative_to(root.parent) for p in root.parent.rglob("*"))
    for call in (
        lambda: newest_policy_version(lake, run_id),
        lambda: consumed_ids(lake, run_id),
        lambda: TrajectoryReader(lake, run_id),
        lambda: register_policy_version(lake, PolicyVersionRecord(run_id, 0, "mem://v0", "h")),
        lambda: TrainConfig(run_id=run_id, lake=LakeConfig(root=lake.root), checkpoint_root=str(tmp_path),
                            policy_path=str(tmp_path)),
        lambda: RunConfig(run_id=run_id, workdir=str(tmp_path / "runs")),
    ):  # fmt: skip
        with pytest.raises(ValueError, match="not a valid run id"):
            call()
    result = runner.invoke(app, ["lake", "check", "--run", run_id, "--lake", lake.root])
    assert result.exit_code == 2 and "not a valid run id" in result.stderr
    # A trajectory claiming such a run is quarantined; no partition folder is made for it.
    record = dataclasses.replace(make_trajectories(1, seed=2, num_tokens=12)[0], run_id=run_id)
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add(record)
    assert writer.stats.quarantined == 1 and writer.stats.written == 0
    after = sorted(p.relative_to(root.parent) for p in root.parent.rglob("*"))
    created = [p for p in set(after) - set(before) if not str(p).startswith(("lake/quarantine", "lake/policy"))]
    assert created == []
    assert not (tmp_path.parent / "escape").exists()
