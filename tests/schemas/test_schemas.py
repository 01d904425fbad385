"""The schemas are the single source of truth: names, documentation, nullability, versions."""

from __future__ import annotations

import pyarrow as pa
import pytest

import schemas
from schemas import TABLES, TableSpec, doc_field, field_doc, plain, table_spec
from schemas import trajectories as tr


def _all_fields(fields: list[pa.Field]) -> list[tuple[str, pa.Field]]:
    """Every field at any depth, with its dotted path."""
    found = []
    for f in fields:
        found.append((f.name, f))
        type_ = f.type
        if pa.types.is_list(type_):
            type_ = type_.value_type
        if pa.types.is_struct(type_):
            found += [(f"{f.name}.{p}", g) for p, g in _all_fields(list(type_))]
    return found


def test_the_tables_of_the_design():
    # The four tables of the design, the driver's issue log (what ``sao lake check`` accounts for) and
    # the runs with their configs.
    assert set(TABLES) == {
        "trajectories",
        "quarantine",
        "policy_versions",
        "train_steps",
        "rollout_tasks",
        "runs",
    }
    for name, spec in TABLES.items():
        assert spec.name == name
        assert spec.schema_version >= 1


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_field_at_every_depth_is_documented(name):
    undocumented = [path for path, f in _all_fields(list(TABLES[name].schema)) if not field_doc(f)]
    assert undocumented == []


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_table_records_the_schema_version_per_row(name):
    field = TABLES[name].schema.field("schema_version")
    assert field.type == pa.int32() and not field.nullable


def test_trajectories_schema_is_the_record_schema_plus_writer_columns():
    # Schema versions 2 to 4: appended after version 1's writer fields, nullable (added in place).
    later = ["routed_experts", "router_top_k", "error", "episode_id", "episode_part", "agent_info"]
    assert tr.SCHEMA.names == tr.RECORD_SCHEMA.names[: -len(later)] + list(tr.WRITER_FIELDS) + later
    assert tr.RECORD_SCHEMA.names[-len(later):] == later
    assert all(tr.SCHEMA.field(name).nullable for name in later)
    assert tr.PARTITION_BY == ("run_id",)


def test_trajectories_records_what_sao_md_section_6_asks_for():
    names = set(tr.SCHEMA.names)
    required = {
        "trajectory_id",
        "run_id",
        "task_id",
        "env_name",
        "prompt_ids",
        "completion_ids",
        "action_mask",
        "logprobs",
        "logprob_kind",
        "segments",
        "reward",
        "token_rewards",
        "termination_reason",
        "num_turns",
        "sampling",
        "tokenizer_version",
        "chat_template_version",
        "engine_name",
        "engine_version",
        "worker_id",
        "timings",
        "min_policy_version",
        "max_policy_version",
        "ingest_seq",
        "arrived_at",
    }
    assert required <= names
    segment = tr.SCHEMA.field("segments").type.value_type
    assert [f.name for f in segment] == ["kind", "policy_version", "start", "end"]
    assert segment.field("policy_version").nullable and not segment.field("start").nullable
    sampling = tr.SCHEMA.field("sampling").type
    assert [f.name for f in sampling] == ["temperature", "top_p", "top_k", "max_tokens", "seed"]


def test_token_columns_have_the_declared_types_and_no_null_items():
    for name, value_type in (
        ("prompt_ids", pa.int32()),
        ("completion_ids", pa.int32()),
        ("action_mask", pa.bool_()),
        ("logprobs", pa.float32()),
    ):
        field = tr.SCHEMA.field(name)
        assert field.type.value_type == value_type
        assert not field.nullable and not field.type.value_field.nullable
    assert tr.SCHEMA.field("token_rewards").nullable


def test_enums_hold_the_design_terms():
    assert [str(r) for r in tr.TerminationReason] == [
        "stop",
        "length",
        "turns",
        "timeout",
        "cancelled",
        "error",
    ]
    assert [str(k) for k in tr.LogprobKind] == ["sampling", "raw"]
    assert [str(k) for k in tr.SegmentKind] == ["action", "observation"]


def test_table_spec_refuses_an_unknown_partition_column_or_an_undocumented_field():
    documented = pa.schema([doc_field("a", pa.int64(), False, "a column")])
    with pytest.raises(ValueError, match="partition column 'b'"):
        TableSpec("t", documented, 1, ("b",), "test")
    with pytest.raises(ValueError, match="without a comment"):
        TableSpec("t", pa.schema([pa.field("a", pa.int64())]), 1, (), "test")


def test_table_spec_lookup_names_the_known_tables():
    assert table_spec("train_steps") is schemas.train_steps.SPEC
    with pytest.raises(
        KeyError, match="policy_versions, quarantine, rollout_tasks, runs, train_steps, trajectories"
    ):
        table_spec("../etc")


def test_plain_drops_metadata_at_every_depth():
    stripped = plain(tr.SCHEMA)
    assert all(not f.metadata for _, f in _all_fields(list(stripped)))
    assert stripped.names == tr.SCHEMA.names
