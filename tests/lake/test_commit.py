"""Exactly-once appends: a plan decided on snapshot V commits as V + 1 or is made again."""

from __future__ import annotations

import dataclasses
import time

import pyarrow as pa
import pytest

from sao.lake.columnar import records_to_arrow
from sao.lake.commit import CommitConflictError, append_exactly
from sao.lake.config import CommitConfig, WriterConfig
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from schemas import trajectories
from tests.lake.validate.test_rules import base

MANUAL = WriterConfig(flush_rows=10_000, background_flush=False)
NO_PAUSE = CommitConfig(backoff_s=0.0, max_backoff_s=0.0)


def stored_ids(lake: Lake) -> set[str]:
    return set(lake.read("trajectories", columns=["trajectory_id"])["trajectory_id"].to_pylist())


def test_a_lost_commit_race_is_replanned_on_the_new_snapshot(local_lake):
    """Another commit lands between plan and commit: the commit fails and the plan runs again."""
    seen_versions = []

    def plan(delta):
        seen_versions.append(delta.version())
        if len(seen_versions) == 1:  # a second writer commits after our snapshot
            with TrajectoryWriter(local_lake, MANUAL) as other:
                other.add(base())
            return _one_row()
        return None if len(seen_versions) > 2 else _one_row("mine")

    result = append_exactly(local_lake, "trajectories", plan, NO_PAUSE)
    assert seen_versions[1] == seen_versions[0] + 1 and result.attempts == 2
    assert result.version == seen_versions[1] + 1
    assert stored_ids(local_lake) == {"t-1", "mine"}


def _one_row(trajectory_id: str = "raced") -> pa.Table:
    table = records_to_arrow([dataclasses.replace(base(), trajectory_id=trajectory_id)])
    now = pa.array([time.time_ns() // 1000], pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    extra = {
        "arrived_at": now,
        "ingested_at": now,
        "writer_id": pa.array(["test"]),
        "ingest_seq": pa.array([99], pa.int64()),
        "schema_version": pa.array([1], pa.int32()),
    }
    for name, column in extra.items():
        table = table.append_column(trajectories.SCHEMA.field(name), column)
    return table.select(trajectories.SCHEMA.names).cast(trajectories.SCHEMA)


def test_endless_races_give_up_without_writing(local_lake):
    def plan(delta):
        with TrajectoryWriter(local_lake, MANUAL) as other:  # someone always commits first
            other.add(dataclasses.replace(base(), trajectory_id=f"other-{delta.version()}"))
        return _one_row("never")

    with pytest.raises(CommitConflictError, match="3 times in a row"):
        append_exactly(
            local_lake, "trajectories", plan, dataclasses.replace(NO_PAUSE, max_attempts=3)
        )
    assert "never" not in stored_ids(local_lake) and len(stored_ids(local_lake)) == 3


def test_an_empty_plan_commits_nothing(local_lake):
    before = local_lake.version("trajectories")
    result = append_exactly(local_lake, "trajectories", lambda delta: None, NO_PAUSE)
    assert (result.version, result.rows, result.attempts) == (None, 0, 1)
    assert local_lake.version("trajectories") == before


def test_a_held_table_is_refreshed_only_when_a_commit_followed_it(lake, monkeypatch):
    """On a local lake :meth:`Lake.has_commit_after` looks up the next commit's file (delta-rs lists the
    whole log to find new commits), so a held table that is current is not refreshed before its plan;
    one that is behind is, and on an object store every held table is, as before."""
    from deltalake import DeltaTable

    local = "://" not in lake.root
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add(base())
    held = lake.table("trajectories")
    latest = held.version()
    assert lake.has_commit_after("trajectories", latest) is (False if local else None)
    assert lake.has_commit_after("trajectories", latest - 1) is (True if local else None)
    refreshes = []
    real = DeltaTable.update_incremental
    monkeypatch.setattr(DeltaTable, "update_incremental", lambda self: refreshes.append(1) or real(self))
    versions = []

    def plan(delta):
        versions.append(delta.version())
        return _one_row(f"held-{len(versions)}")

    append_exactly(lake, "trajectories", plan, NO_PAUSE, table=held)  # current: no refresh on a local lake
    assert (versions, len(refreshes)) == ([latest], 0 if local else 1)
    with TrajectoryWriter(lake, MANUAL) as other:  # another handle commits: the held table is behind
        other.add(dataclasses.replace(base(), trajectory_id="other"))
    refreshes.clear()
    append_exactly(lake, "trajectories", plan, NO_PAUSE, table=held)
    assert (versions[-1], len(refreshes)) == (latest + 2, 1)
    assert {"held-1", "held-2", "other"} <= stored_ids(lake)
