"""The Lake: created from the schemas, idempotently, on both backends; schema drift caught or migrated."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import boto3
import pyarrow as pa
import pytest
from botocore.exceptions import ClientError
from deltalake import DeltaTable, write_deltalake

from sao.lake.config import LakeConfig
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import (
    Lake,
    LakeNotFoundError,
    SchemaMismatchError,
    sql_literal,
    table_configuration,
)
from schemas import TABLES, doc_field, policy_versions


def test_tables_are_created_from_the_schemas_with_the_log_kept(lake_config):
    lake = Lake.open(lake_config)
    for name, spec in TABLES.items():
        table = lake.table(name)
        assert pa.schema(table.schema().to_arrow()).equals(spec.schema, check_metadata=True)
        assert table.metadata().partition_columns == list(spec.partition_by)
        assert table.metadata().configuration == table_configuration(spec)
        assert lake.read(name).schema.equals(spec.schema, check_metadata=True)
    assert Lake.open(lake_config).version("trajectories") == 0  # opening again changes nothing


def test_concurrent_opens_of_a_new_lake_all_succeed(lake_config):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        lakes = list(pool.map(lambda _: Lake.open(lake_config), range(4)))
    assert {lake.version(name) for lake in lakes for name in TABLES} == {0}


def test_opening_without_create_does_not_make_a_lake(tmp_path):
    with pytest.raises(LakeNotFoundError, match="no Delta table"):
        Lake.open(LakeConfig(root=str(tmp_path / "missing")), create=False)
    assert not (tmp_path / "missing").exists()


def test_table_names_cannot_leave_the_root(tmp_path):
    lake = Lake.open(str(tmp_path / "lake"))
    assert lake.table_uri("train_steps") == f"{tmp_path}/lake/train_steps"
    for name in ("../etc", "trajectories/../../x", "/abs"):
        with pytest.raises(KeyError, match="unknown table"):
            lake.table_uri(name)


def test_a_drifted_schema_is_refused_naming_the_column(tmp_path):
    root = tmp_path / "lake"
    wrong = pa.schema(
        [pa.field("run_id", pa.string(), False), pa.field("version", pa.string(), False)]
    )
    write_deltalake(str(root / "policy_versions"), wrong.empty_table())
    with pytest.raises(SchemaMismatchError, match="column 1 is version: string not null"):
        Lake.open(str(root))


def test_a_new_nullable_column_is_added_to_an_older_table(tmp_path, monkeypatch):
    root = str(tmp_path / "lake")
    lake = Lake.open(root)
    from sao.lake.ledger import register_policy_version

    register_policy_version(lake, PolicyVersionRecord("run-0", 0, "ckpt/0", "sha256:0"))
    newer = dataclasses.replace(
        policy_versions.SPEC,
        schema=policy_versions.SCHEMA.append(doc_field("notes", pa.string(), True, "Free text.")),
        schema_version=2,
    )
    monkeypatch.setitem(TABLES, "policy_versions", newer)
    migrated = Lake.open(root)
    table = migrated.read("policy_versions")
    assert table.schema.names[-1] == "notes" and table["notes"].to_pylist() == [None]
    assert "schema version 2" in DeltaTable(f"{root}/policy_versions").metadata().description
    # A snapshot from before the migration (as a replayed train step reads it) reads the column as null.
    before = migrated.read("policy_versions", version=migrated.version("policy_versions") - 2)
    assert before.schema.names[-1] == "notes" and before["notes"].to_pylist() == [None]
    required = dataclasses.replace(
        newer,
        schema=newer.schema.append(doc_field("must", pa.int64(), False, "Required.")),
        schema_version=3,
    )
    monkeypatch.setitem(TABLES, "policy_versions", required)
    with pytest.raises(SchemaMismatchError, match="non-nullable column"):
        Lake.open(root)


def test_read_run_reads_that_runs_rows_only(local_lake):
    """``local_lake`` holds versions 0 and 1 of ``run-0``; a run id with a quote is read as a literal."""
    from sao.lake.ledger import register_policy_version

    register_policy_version(local_lake, PolicyVersionRecord("run-1", 0, "ckpt/0", "sha256:0"))
    rows = local_lake.read_run(policy_versions.NAME, "run-0", ["run_id", "version"]).to_pylist()
    assert sorted(r["version"] for r in rows) == [0, 1] and {r["run_id"] for r in rows} == {"run-0"}
    assert local_lake.read_run(policy_versions.NAME, "run-1", ["version"]).num_rows == 1
    assert local_lake.read_run(policy_versions.NAME, "run-0' OR run_id = 'run-1").num_rows == 0


def test_sql_literal_escapes_quotes():
    assert sql_literal("it's") == "'it''s'"


def test_moto_honours_conditional_put(s3_options):
    """delta-rs's S3 commits rely on If-None-Match: a second put of the same key must fail."""
    client = boto3.client(
        "s3",
        endpoint_url=s3_options["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.put_object(Bucket="sao-lake-tests", Key="cond/x", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        client.put_object(Bucket="sao-lake-tests", Key="cond/x", Body=b"2", IfNoneMatch="*")


def test_a_table_created_before_its_statistics_columns_were_named_gets_them_on_open(lake_config):
    from sao.lake.store import STATS_COLUMNS_KEY
    from schemas import trajectories

    lake = Lake.open(lake_config)
    table = lake.table("trajectories")
    table.alter.set_table_properties({STATS_COLUMNS_KEY: "trajectory_id"})  # as an older sao left it
    Lake.open(lake_config)
    configuration = lake.table("trajectories").metadata().configuration
    assert configuration[STATS_COLUMNS_KEY] == ",".join(trajectories.SPEC.stats_columns)
    version = lake.version("trajectories")
    Lake.open(lake_config)
    assert lake.version("trajectories") == version  # set once
