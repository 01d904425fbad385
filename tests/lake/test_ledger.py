"""policy_versions and train_steps: ordered, idempotent, and a trajectory consumed at most once."""

from __future__ import annotations

import pytest

from sao.lake.config import WriterConfig
from sao.lake.ledger import (
    ConsumptionError,
    LedgerError,
    NewestVersions,
    StepsSeen,
    VersionsSeen,
    consumed_ids,
    newest_policy_version,
    newest_policy_versions,
    protected_versions,
    record_train_step,
    register_policy_version,
    unconsumed_count,
)
from sao.lake.maintenance import compact_ledger
from sao.lake.reader import TrajectoryReader
from sao.lake.records import PolicyVersionRecord, TrainStepRecord, utc_now
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter
from tests.lake.conftest import RUN


def _version(
    version: int, parent: int | None, run_id: str = RUN, uri: str | None = None
) -> PolicyVersionRecord:
    return PolicyVersionRecord(
        run_id,
        version,
        uri or f"ckpt/{version}",
        f"sha256:{version}",
        parent_version=parent,
        step=None if parent is None else parent,
    )


def test_policy_versions_are_registered_in_order(lake):
    # the fixture registered 0 and 1
    assert newest_policy_version(lake, RUN) == 1
    assert newest_policy_version(lake, "other-run") is None
    assert register_policy_version(lake, _version(1, 0)).version is None  # identical again: no-op
    with pytest.raises(LedgerError, match="next version is 2"):
        register_policy_version(lake, _version(3, 2))
    with pytest.raises(LedgerError, match="must have parent_version 1"):
        register_policy_version(lake, _version(2, 0))
    with pytest.raises(LedgerError, match="already has policy version 1"):
        register_policy_version(lake, _version(1, 0, uri="elsewhere"))
    register_policy_version(lake, _version(0, None, run_id="other-run"))
    assert newest_policy_version(lake, "other-run") == 0


def _stored_ids(lake, count: int = 6) -> list[str]:
    records = make_trajectories(count, seed=21, num_tokens=12)
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)
    return [r.trajectory_id for r in records]


def _step(number: int, ids, version: int, run_id: str = RUN) -> TrainStepRecord:
    now = utc_now()
    return TrainStepRecord(
        run_id, number, 1, 2, version, tuple(ids), now, now, {"actor/kept_frac": 1.0}
    )


def test_a_trajectory_is_consumed_at_most_once(lake):
    ids = _stored_ids(lake)
    version = lake.version("trajectories")
    record_train_step(lake, _step(0, ids[:3], version))
    assert (
        record_train_step(lake, _step(0, ids[:3], version)).version is None
    )  # a restart re-records
    with pytest.raises(ConsumptionError, match="consumed by an earlier step"):
        record_train_step(lake, _step(1, ids[2:5], version))
    with pytest.raises(ConsumptionError, match="twice"):
        record_train_step(lake, _step(1, [ids[4], ids[4]], version))
    with pytest.raises(LedgerError, match="already has a different step 0"):
        record_train_step(lake, _step(0, ids[3:5], version))
    record_train_step(lake, _step(1, ids[3:5], version))
    with pytest.raises(LedgerError, match="not after the last recorded step 1"):
        record_train_step(lake, _step(-1, ids[5:], version))
    assert sorted(consumed_ids(lake, RUN).to_pylist()) == sorted(ids[:5])
    assert protected_versions(lake) == [version]


def test_the_rows_no_step_consumed_are_counted_per_run(lake):
    ids = _stored_ids(lake)
    assert unconsumed_count(lake, RUN) == 6
    assert unconsumed_count(lake, "other-run") == 0
    record_train_step(lake, _step(0, ids[:4], lake.version("trajectories")))
    assert unconsumed_count(lake, RUN) == 2


def test_a_step_must_read_ids_present_in_its_snapshot(local_lake):
    ids = _stored_ids(local_lake, 3)
    version = local_lake.version("trajectories")
    with pytest.raises(ConsumptionError, match="not in trajectories version"):
        record_train_step(local_lake, _step(0, [*ids, "never-written"], version))
    with pytest.raises(ConsumptionError, match="not in trajectories version"):
        record_train_step(
            local_lake, _step(0, ids, version, run_id="other-run")
        )  # right ids, wrong run
    with pytest.raises(LedgerError, match="newest version is"):
        record_train_step(local_lake, _step(0, ids, version + 5))


@pytest.mark.parametrize("given", ["table", "reader"])
def test_a_step_given_its_ids_ingest_seqs_and_snapshot_reads_only_those_rows_and_still_checks_them(
        local_lake, monkeypatch, given):
    ids = _stored_ids(local_lake, 3)
    version = local_lake.version("trajectories")
    if given == "table":
        snapshot = local_lake.table("trajectories", version=version)
    else:  # the trainer's reader: it looks the ids up in the files it has listed, not through delta-rs
        snapshot = TrajectoryReader(local_lake, RUN)
        snapshot.next_micro_batch(0, 4, 100)
        read_from = local_lake.read_from

        def ledger_only(table, name, **kwargs):
            assert name != "trajectories", "the check read trajectories through delta-rs"
            return read_from(table, name, **kwargs)

        monkeypatch.setattr(local_lake, "read_from", ledger_only)
    with pytest.raises(ConsumptionError, match="1 trajectory ids are not in trajectories version"):
        record_train_step(local_lake, _step(0, ids, version), ingest_seqs=[1, 2, 7], snapshot=snapshot)
    with pytest.raises(ValueError, match="2 ingest_seqs for 3 trajectory ids"):
        record_train_step(local_lake, _step(0, ids, version), ingest_seqs=[1, 2])
    with pytest.raises(ValueError, match="the step read"):
        record_train_step(local_lake, _step(0, ids, version - 1), snapshot=snapshot)
    result = record_train_step(local_lake, _step(0, ids, version), ingest_seqs=[1, 2, 3], snapshot=snapshot)
    assert result.rows == 1


def test_a_held_ledger_table_sees_what_was_committed_through_other_handles_and_compaction(lake):
    """The trainer keeps ``train_steps`` and ``policy_versions`` loaded from step to step: each commit
    through them first takes in the commits made since (another handle's step, a compaction)."""
    ids = _stored_ids(lake)
    version = lake.version("trajectories")
    steps, versions = lake.table("train_steps"), lake.table("policy_versions")
    record_train_step(lake, _step(0, ids[:2], version))  # through a handle of its own
    register_policy_version(lake, _version(2, 1))
    compact_ledger(lake)
    with pytest.raises(ConsumptionError, match="consumed by an earlier step"):
        record_train_step(lake, _step(1, ids[1:3], version), table=steps)
    with pytest.raises(LedgerError, match="already has a different step 0"):
        record_train_step(lake, _step(0, ids[2:4], version), table=steps)
    assert record_train_step(lake, _step(1, ids[2:4], version), table=steps).rows == 1
    with pytest.raises(LedgerError, match="next version is 3"):
        register_policy_version(lake, _version(4, 3), table=versions)
    assert register_policy_version(lake, _version(3, 2), table=versions).rows == 1
    assert newest_policy_version(lake, RUN) == 3
    assert sorted(consumed_ids(lake, RUN).to_pylist()) == sorted(ids[:4])


def test_steps_seen_reads_only_later_steps_and_still_sees_every_commit(lake):
    """With a :class:`StepsSeen` a call reads the run's rows after the last step seen, yet refuses
    what a full read refuses: ids consumed by steps it saw, by steps another handle committed since, and
    steps out of order; a compaction in between changes nothing."""
    ids = _stored_ids(lake, 8)
    version = lake.version("trajectories")
    seen = StepsSeen(RUN)
    assert record_train_step(lake, _step(0, ids[:2], version), seen=seen).rows == 1
    assert (seen.last_step, seen.consumed) == (0, set(ids[:2]))
    record_train_step(lake, _step(1, ids[2:4], version))  # another handle, which this seen has not read
    compact_ledger(lake)
    with pytest.raises(ConsumptionError, match="consumed by an earlier step"):
        record_train_step(lake, _step(2, [ids[3], ids[4]], version), seen=seen)  # step 1's id
    assert (seen.last_step, seen.consumed) == (1, set(ids[:4]))  # it took in step 1 while refusing
    with pytest.raises(ConsumptionError, match="consumed by an earlier step"):
        record_train_step(lake, _step(2, [ids[0], ids[4]], version), seen=seen)  # step 0's id, not read again
    with pytest.raises(LedgerError, match="not after the last recorded step 1"):
        record_train_step(lake, _step(-1, ids[4:6], version), seen=seen)
    with pytest.raises(LedgerError, match="already has a different step 1"):
        record_train_step(lake, _step(1, ids[4:6], version), seen=seen)
    assert record_train_step(lake, _step(1, ids[2:4], version), seen=seen).version is None  # identical: no-op
    assert record_train_step(lake, _step(2, ids[4:6], version), seen=seen).rows == 1
    with pytest.raises(ValueError, match="steps seen of run"):
        record_train_step(lake, _step(3, ids[6:], version, run_id="other-run"), seen=seen)
    resumed = StepsSeen(RUN)  # a restarted trainer starts with nothing seen and reads the run once
    assert record_train_step(lake, _step(3, ids[6:], version), seen=resumed).rows == 1
    assert resumed.consumed == set(ids) == set(consumed_ids(lake, RUN).to_pylist())


def test_a_version_registered_after_its_parent_reads_from_the_parent_on(lake, monkeypatch):
    """The next version's checks read the run's rows from its parent on (statistics skip the rest); a
    call without its parent stored reads the whole run and fails as before."""
    predicates = []
    real = lake.read_from
    monkeypatch.setattr(lake, "read_from", lambda *a, **k: predicates.append(k.get("predicate")) or real(*a, **k))
    assert register_policy_version(lake, _version(2, 1)).rows == 1
    assert predicates == [f"run_id = '{RUN}' AND version >= 1"]
    predicates.clear()
    with pytest.raises(LedgerError, match="next version is 3"):
        register_policy_version(lake, _version(5, 4))
    assert predicates == [f"run_id = '{RUN}' AND version >= 4", f"run_id = '{RUN}'"]


def _reads_of(lake, monkeypatch, name: str) -> list[str | None]:
    """The predicates of every delta-rs read of table ``name`` from now on."""
    predicates: list[str | None] = []
    real = lake.read_from

    def recorded(table, table_name, **kwargs):
        if table_name == name:
            predicates.append(kwargs.get("predicate"))
        return real(table, table_name, **kwargs)

    monkeypatch.setattr(lake, "read_from", recorded)
    return predicates


def test_steps_seen_reads_nothing_when_no_commit_followed_and_reads_again_when_one_did(lake, monkeypatch):
    """A step planned on the version its own last step made reads no ``train_steps`` row, and is still
    refused what a read refuses once another handle committed; an identical step again is a no-op."""
    ids = _stored_ids(lake, 10)
    version = lake.version("trajectories")
    steps, seen = lake.table("train_steps"), StepsSeen(RUN)
    reads = _reads_of(lake, monkeypatch, "train_steps")
    record_train_step(lake, _step(0, ids[:2], version), table=steps, seen=seen)
    assert reads == [f"run_id = '{RUN}'"]  # a new trainer reads the run once
    assert seen.table_version == lake.version("train_steps")
    reads.clear()
    record_train_step(lake, _step(1, ids[2:4], version), table=steps, seen=seen)
    with pytest.raises(ConsumptionError, match="consumed by an earlier step"):
        record_train_step(lake, _step(2, [ids[1], ids[4]], version), table=steps, seen=seen)  # step 0's id
    assert reads == []
    assert (seen.last_step, seen.table_version) == (1, lake.version("train_steps"))
    record_train_step(lake, _step(2, ids[4:6], version))  # another handle: this trainer has not seen it
    reads.clear()
    with pytest.raises(ConsumptionError, match="consumed by an earlier step"):
        record_train_step(lake, _step(3, [ids[5], ids[6]], version), table=steps, seen=seen)
    assert reads == [f"run_id = '{RUN}' AND step > 1"]
    reads.clear()
    assert record_train_step(lake, _step(3, ids[6:8], version), table=steps, seen=seen).rows == 1
    assert reads == []  # step 2 was taken in by the refused call's read
    assert record_train_step(lake, _step(3, ids[6:8], version), table=steps, seen=seen).version is None
    with pytest.raises(LedgerError, match="already has a different step 3"):
        record_train_step(lake, _step(3, ids[8:], version), table=steps, seen=seen)
    assert reads == [f"run_id = '{RUN}'", f"run_id = '{RUN}'"]  # a step not after the last is read whole
    assert seen.consumed == set(ids[:8]) == set(consumed_ids(lake, RUN).to_pylist())


def test_versions_seen_reads_nothing_when_no_commit_followed_and_reads_again_when_one_did(lake, monkeypatch):
    """The next version registered on the version the last registration made reads no
    ``policy_versions`` row; after another handle's commit, or for any other version, it reads and
    refuses what it refused before."""
    versions, seen = lake.table("policy_versions"), VersionsSeen(RUN)
    reads = _reads_of(lake, monkeypatch, "policy_versions")
    assert register_policy_version(lake, _version(2, 1), table=versions, seen=seen).rows == 1
    assert reads == [f"run_id = '{RUN}' AND version >= 1"]
    reads.clear()
    assert register_policy_version(lake, _version(3, 2), table=versions, seen=seen).rows == 1
    assert reads == []
    assert (seen.newest, seen.table_version) == (3, lake.version("policy_versions"))
    with pytest.raises(LedgerError, match="next version is 4"):
        register_policy_version(lake, _version(5, 4), table=versions, seen=seen)
    with pytest.raises(LedgerError, match="must have parent_version 3"):
        register_policy_version(lake, _version(4, 2), table=versions, seen=seen)
    assert register_policy_version(lake, _version(3, 2), table=versions, seen=seen).version is None  # identical
    assert len(reads) == 4
    register_policy_version(lake, _version(4, 3))  # another handle
    reads.clear()
    with pytest.raises(LedgerError, match="already has policy version 4"):
        register_policy_version(lake, _version(4, 3, uri="elsewhere"), table=versions, seen=seen)
    assert seen.newest == 4
    assert register_policy_version(lake, _version(5, 4), table=versions, seen=seen).rows == 1
    assert reads == [f"run_id = '{RUN}' AND version >= 3"]
    assert newest_policy_version(lake, RUN) == 5
    with pytest.raises(ValueError, match="versions seen of run"):
        register_policy_version(lake, _version(0, None, run_id="other-run"), seen=seen)


def test_newest_versions_follow_the_log_after_one_read_and_match_the_table(lake, monkeypatch):
    """After its first look, :class:`NewestVersions` reads only the commits since and the files they
    add, with no delta-rs read, and agrees with a read of the table after every kind of commit: a
    version of its run, of another run, several commits at once, a compaction."""
    newest = NewestVersions(lake)
    newest.look()  # the fixture registered 0 and 1
    assert (newest.get(RUN), newest.get("other-run"), newest.version) == (1, None, lake.version("policy_versions"))

    def refused(*args, **kwargs):
        raise AssertionError("a look after the first read policy_versions through delta-rs")

    real_table, real_read = lake.table, lake.read_from
    monkeypatch.setattr(lake, "table", refused)
    monkeypatch.setattr(lake, "read_from", refused)

    def commit(*records, compact=False):
        with monkeypatch.context() as unpatched:
            unpatched.setattr(lake, "table", real_table)
            unpatched.setattr(lake, "read_from", real_read)
            for record in records:
                register_policy_version(lake, record)
            if compact:
                compact_ledger(lake)
            return newest_policy_versions(lake), lake.version("policy_versions")

    newest.look()  # nothing committed since: nothing read
    for records, compact in [
        ((_version(2, 1),), False),
        ((_version(0, None, run_id="other-run"), _version(1, 0, run_id="other-run"), _version(3, 2)), False),
        ((), True),
        ((_version(4, 3),), False),
    ]:
        expected, version = commit(*records, compact=compact)
        newest.look()
        assert {run: newest.get(run) for run in expected} == expected
        assert newest.version == version


def test_newest_versions_read_the_table_when_its_new_files_cannot_be_read(lake, monkeypatch):
    newest = NewestVersions(lake)
    newest.look()
    register_policy_version(lake, _version(2, 1))
    import sao.lake.ledger as ledger

    def unreadable(*args, **kwargs):
        raise OSError("no such file")

    monkeypatch.setattr(ledger.ds, "dataset", unreadable)
    newest.look()
    assert (newest.get(RUN), newest.version) == (2, lake.version("policy_versions"))
