"""Compaction and vacuum never break the replay of a recorded step."""

from __future__ import annotations

import pytest

from sao.lake.config import WriterConfig
from sao.lake.ledger import record_train_step
from sao.lake.maintenance import MaintenanceError, compact, vacuum
from sao.lake.reader import TrajectoryReader, read_step_trajectories, read_trajectories
from sao.lake.records import TrainStepRecord, utc_now
from sao.lake.store import LakeError
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter
from tests.lake.conftest import RUN


def _append(lake, records) -> int:
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)
    return lake.version("trajectories")


def test_old_pinned_snapshot_survives_appends_compaction_and_vacuum(lake):
    records = make_trajectories(40, seed=31, num_tokens=16)
    for start in range(0, 20, 5):  # four small files
        _append(lake, records[start : start + 5])
    batch = TrajectoryReader(lake, RUN).next_micro_batch(0, 1, 8)
    now = utc_now()
    record_train_step(
        lake,
        TrainStepRecord(
            RUN, 0, 0, 1, batch.snapshot_version, tuple(batch.trajectory_ids), now, now
        ),
    )
    pinned = read_trajectories(lake, version=batch.snapshot_version)
    unrecorded = _append(lake, records[20:30])  # a version no step read
    _append(lake, records[30:])
    reports = {r.table: r for r in compact(lake, ["trajectories"])}
    assert reports["trajectories"].files_removed == 6 and reports["trajectories"].files_added == 1

    removed = {r.table: r for r in vacuum(lake, retention_hours=0, force=True)}
    assert removed["trajectories"].kept_versions == (batch.snapshot_version,)
    assert len(removed["trajectories"].removed) == 2  # the two files only newer versions had

    assert read_trajectories(lake, version=batch.snapshot_version).equals(pinned)
    replay = read_step_trajectories(lake, RUN, 0, columns=["trajectory_id"])
    assert replay["trajectory_id"].to_pylist() == batch.trajectory_ids
    assert read_trajectories(lake)["trajectory_id"].to_pylist() == [
        r.trajectory_id for r in records
    ]
    with pytest.raises(LakeError, match="failed"):  # a version nobody recorded lost its files
        read_trajectories(lake, version=unrecorded)


def test_short_retention_is_refused_unless_forced(local_lake):
    with pytest.raises(MaintenanceError, match="below the minimum of 1 h"):
        vacuum(local_lake, retention_hours=0)
    reports = vacuum(local_lake, retention_hours=0, force=True, dry_run=True)
    assert {r.table for r in reports} == {
        "trajectories",
        "quarantine",
        "policy_versions",
        "train_steps",
        "rollout_tasks",
        "runs",
    }
    assert all(r.dry_run for r in reports)


def test_ledger_compaction_keeps_every_row_and_the_order_checks(local_lake):
    from sao.lake.ledger import LedgerError, register_policy_version
    from sao.lake.maintenance import compact_ledger
    from sao.lake.records import PolicyVersionRecord

    def register(version):
        return register_policy_version(local_lake, PolicyVersionRecord(
            "ledger-run", version, f"/ckpt/v{version}", f"{version:064d}", None if version == 0 else version - 1, version))

    for version in range(5):
        register(version)
    before = len(local_lake.table("policy_versions").file_uris())
    assert before >= 5  # one file per commit
    reports = {r.table: r for r in compact_ledger(local_lake)}
    assert set(reports) == {"train_steps", "policy_versions"}
    assert (reports["policy_versions"].files_removed, reports["policy_versions"].files_added) == (before, 1)
    assert len(local_lake.table("policy_versions").file_uris()) == 1
    rows = local_lake.read("policy_versions", predicate="run_id = 'ledger-run'").sort_by("version").to_pylist()
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4]
    assert register(4).version is None  # the same row again: a no-op, found in the compacted file
    with pytest.raises(LedgerError, match="out of order"):
        register(6)
    register(5)
    assert sorted(local_lake.read("policy_versions", predicate="run_id = 'ledger-run'").column("version").to_pylist()) == [
        0, 1, 2, 3, 4, 5]


def test_a_run_compacted_while_a_writer_appends_keeps_every_row_once_and_leaves_other_runs_alone(local_lake):
    import threading

    from sao.lake.ledger import register_policy_version
    from sao.lake.maintenance import compact_run
    from sao.lake.records import PolicyVersionRecord

    register_policy_version(local_lake, PolicyVersionRecord("run-1", 0, "ckpt/0", "sha256:0"))
    _append(local_lake, make_trajectories(4, seed=40, num_tokens=8, run_id="run-1"))
    _append(local_lake, make_trajectories(4, seed=41, num_tokens=8, run_id="run-1"))
    other_files = sorted(local_lake.table("trajectories").file_uris(file_pruning_predicate=[("run_id", "=", "run-1")]))
    records = make_trajectories(60, seed=42, num_tokens=8)
    failures = []

    def produce():
        try:
            with TrajectoryWriter(local_lake, WriterConfig(flush_rows=3, background_flush=False)) as writer:
                writer.add_many(records)  # 20 commits
        except Exception as error:  # reported below
            failures.append(error)

    writer = threading.Thread(target=produce)
    writer.start()
    reader = TrajectoryReader(local_lake, RUN)
    handed: list[str] = []
    compactions = 0
    while writer.is_alive() or len(handed) < len(records):
        handed += reader.next_micro_batch(0, 4, 7).trajectory_ids
        compactions += bool(compact_run(local_lake, RUN))
        assert not failures, failures
    writer.join()
    assert compactions >= 2
    assert sorted(handed) == sorted(r.trajectory_id for r in records)  # each row once, none lost
    stored = local_lake.read("trajectories", predicate=f"run_id = '{RUN}'")
    assert sorted(stored["ingest_seq"].to_pylist()) == list(range(1, 61))
    compact_run(local_lake, RUN)
    assert len(local_lake.table("trajectories").file_uris(file_pruning_predicate=[("run_id", "=", RUN)])) == 1
    assert sorted(local_lake.table("trajectories").file_uris(file_pruning_predicate=[("run_id", "=", "run-1")])) == other_files


def test_compacting_a_live_run_leaves_files_above_its_target_as_they_are(local_lake):
    """Each compaction under a run rewrites what arrived since the last, not the run's whole partition."""
    import pyarrow as pa

    from sao.lake.config import MaintenanceConfig
    from sao.lake.maintenance import compact_run

    def sizes() -> dict[str, int]:
        actions = pa.table(local_lake.table("trajectories").get_add_actions(flatten=True))
        return dict(zip(actions["path"].to_pylist(), actions["size_bytes"].to_pylist(), strict=True))

    records = make_trajectories(243, seed=50, num_tokens=128)
    for start in range(0, 240, 60):
        _append(local_lake, records[start:start + 60])
    compact_run(local_lake, RUN)
    (first, first_size), = sizes().items()
    for record in records[240:]:  # three one-row files
        _append(local_lake, [record])
    new = {path: size for path, size in sizes().items() if path != first}
    assert 3 * max(new.values()) < first_size  # what makes a target between them possible
    target = (first_size + 3 * max(new.values())) / 2
    reports = {r.table: r for r in compact_run(local_lake, RUN, MaintenanceConfig(run_target_file_mb=target / 2**20))}
    assert reports["trajectories"].files_removed == 3 and reports["trajectories"].files_added == 1
    assert first in sizes() and len(sizes()) == 2  # the large file was left as it was
    stored = local_lake.read("trajectories", predicate=f"run_id = '{RUN}'")
    assert sorted(stored["trajectory_id"].to_pylist()) == sorted(r.trajectory_id for r in records)


def test_compacting_one_runs_partition_is_refused_for_a_table_not_partitioned_by_run(local_lake):
    # Only trajectories and rollout_tasks have run_id partitions; a filter on another table's run_id
    # would not be a partition filter.
    assert [r.table for r in compact(local_lake, ["trajectories", "rollout_tasks"], run_id=RUN)] == [
        "trajectories", "rollout_tasks"]
    with pytest.raises(ValueError, match=r"\['train_steps'\] are not partitioned by run_id"):
        compact(local_lake, ["train_steps"], run_id=RUN)
