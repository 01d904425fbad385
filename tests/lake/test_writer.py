"""The trajectory writer: quarantine, exactly-once storage, batching, concurrent writers."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import time

import pyarrow as pa
import pytest

from sao.lake.columnar import records_to_arrow
from sao.lake.config import WriterConfig
from sao.lake.ledger import register_policy_version
from sao.lake.reader import read_trajectories
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectories
from sao.lake.validate import Rule
from sao.lake.writer import TrajectoryWriter, WriterClosedError
from schemas import trajectories
from tests.lake import _processes
from tests.lake.conftest import RUN
from tests.lake.validate.test_rules import CASES, base

MANUAL = WriterConfig(flush_rows=10_000, background_flush=False)


def stored(lake: Lake, columns=("trajectory_id", "ingest_seq")) -> pa.Table:
    return lake.read("trajectories", columns=list(columns)).sort_by("ingest_seq")


def assert_exactly_once(lake: Lake, expected_ids: set[str]) -> None:
    table = stored(lake)
    ids = table["trajectory_id"].to_pylist()
    assert len(ids) == len(set(ids)), "an id is stored twice"
    assert set(ids) == expected_ids
    assert table["ingest_seq"].to_pylist() == list(range(1, len(ids) + 1)), "ingest_seq has a gap"


def test_round_trip_gives_identical_arrow_data(lake):
    records = make_trajectories(20, seed=5, num_tokens=24, turns=3)
    records[3] = dataclasses.replace(records[3], token_rewards=[0.5] * 24)
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many(records)
    table = read_trajectories(lake, run_id=RUN)
    assert table.schema.equals(trajectories.SCHEMA, check_metadata=True)
    produced = table.select(trajectories.RECORD_SCHEMA.names)
    assert produced.equals(records_to_arrow(records), check_metadata=True)
    assert table["writer_id"].to_pylist() == [writer.writer_id] * 20
    assert table["schema_version"].to_pylist() == [trajectories.SCHEMA_VERSION] * 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_quarantines_the_record_and_keeps_the_batch(local_lake, name):
    bad, (rule, field, position, message) = CASES[name]
    good = [dataclasses.replace(base(), trajectory_id=f"good-{i}") for i in range(2)]
    with TrajectoryWriter(local_lake, MANUAL) as writer:
        writer.add_many([good[0], bad, good[1]])
        report = writer.flush()
    assert (report.written, report.quarantined) == (2, 1)
    assert set(stored(local_lake)["trajectory_id"].to_pylist()) == {"good-0", "good-1"}
    rows = local_lake.read("quarantine").to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert (row["reason"], row["field"], row["position"], row["message"]) == (
        str(rule),
        field,
        position,
        message,
    )
    assert (
        row["row"] == 1
        and row["table_name"] == "trajectories"
        and row["writer_id"] == writer.writer_id
    )
    assert row["violations"][0]["reason"] == str(rule)
    payload = json.loads(row["payload_json"])
    assert (
        payload["trajectory_id"] == bad.trajectory_id
        and len(payload["completion_ids"]) == bad.completion_ids.size
    )


def test_quarantine_on_every_backend(lake):
    """One batch with a record breaking each rule: all quarantined with their reason, valid rows kept."""
    bad = [
        dataclasses.replace(record, trajectory_id=f"bad-{name}") if record.trajectory_id else record
        for name, (record, _) in sorted(CASES.items())
    ]
    good = [dataclasses.replace(base(), trajectory_id=f"good-{i}") for i in range(3)]
    unreadable = {"run_id": RUN, "trajectory_id": "no-segments"}
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many([good[0], *bad, good[1], unreadable, good[2]])
        report = writer.flush()
    assert (report.written, report.quarantined) == (3, len(CASES) + 1)
    reasons = sorted(lake.read("quarantine", columns=["reason"])["reason"].to_pylist())
    assert reasons == sorted(
        [str(rule) for _, ((rule, *_rest)) in CASES.values()] + [str(Rule.TYPE)]
    )


def test_a_value_outside_int32_is_quarantined_not_raised(local_lake):
    huge = dataclasses.replace(
        base(),
        trajectory_id="huge",
        segments=(*base().segments[:2], dataclasses.replace(base().segments[2], end=2**40)),
    )
    with TrajectoryWriter(local_lake, MANUAL) as writer:
        writer.add_many([base(), huge])
        report = writer.flush()
    assert (report.written, report.quarantined) == (1, 1)
    row = local_lake.read("quarantine").to_pylist()[0]
    assert (row["reason"], row["record_id"]) == ("type", "huge")


@pytest.mark.parametrize("routing", [5, ["zz"], [-1], [1.5], [3]])
def test_a_delivery_with_unreadable_routing_is_quarantined_and_the_writer_goes_on(local_lake, routing):
    # A mapping delivery whose routed_experts is not a list of byte strings: before, decode_routing's
    # TypeError / ValueError escaped the flush and every later flush raised on the same record ([3] was
    # stored as three zero bytes).
    bad = base().to_row() | {"trajectory_id": "bad-routing", "routed_experts": routing, "router_top_k": 1}
    with TrajectoryWriter(local_lake, MANUAL) as writer:
        writer.add_many([bad, base()])
        report = writer.flush()
        assert (report.written, report.quarantined) == (1, 1)
        assert writer.flush().written == 0  # nothing left behind to fail again
    row = local_lake.read("quarantine").to_pylist()[0]
    assert (row["reason"], row["record_id"], row["field"]) == ("type", "bad-routing", "routed_experts")


def test_duplicate_delivery_is_stored_once_same_writer(lake):
    records = make_trajectories(30, seed=6, num_tokens=16)
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many(records[:20] + records[:5])  # repeated inside one batch
        first = writer.flush()
        writer.add_many(records[10:30])  # 10 repeats of committed rows
        writer.add(records[0].to_row())  # the same record delivered as a dict
        second = writer.flush()
    assert (first.written, first.duplicates) == (20, 5)
    assert (second.written, second.duplicates) == (10, 11)
    assert_exactly_once(lake, {r.trajectory_id for r in records})


def test_duplicate_delivery_is_stored_once_after_a_writer_restart(lake):
    records = make_trajectories(20, seed=7, num_tokens=16)
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many(records[:12])
    with TrajectoryWriter(lake, MANUAL) as restarted:  # knows nothing but what the table holds
        restarted.add_many(records)
    assert restarted.stats.written == 8 and restarted.stats.duplicates == 12
    assert_exactly_once(lake, {r.trajectory_id for r in records})


def test_a_writer_reads_back_only_what_other_writers_committed_since_its_last_commit(local_lake, monkeypatch):
    """Exactly once costs a read of the run's new rows before a commit; none is needed when the table's
    latest commit is the writer's own (the common case: one writer per run)."""
    reads = []
    real = local_lake.read_from

    def counted(table, name, **kwargs):
        if name == trajectories.NAME:
            reads.append(table.version())
        return real(table, name, **kwargs)

    monkeypatch.setattr(local_lake, "read_from", counted)
    records = make_trajectories(12, seed=9, num_tokens=16)
    writer = TrajectoryWriter(local_lake, MANUAL)
    writer.add_many(records[:4])
    writer.flush()  # the first commit reads the run's rows
    writer.add_many(records[4:8])
    writer.flush()  # the latest commit is its own: nothing to read
    assert len(reads) == 1
    with TrajectoryWriter(local_lake, MANUAL) as other:
        other.add_many(records[8:10])
    reads.clear()
    writer.add_many(records[8:12])  # two of them the other writer stored
    report = writer.flush()
    assert len(reads) == 1 and (report.written, report.duplicates) == (2, 2)
    writer.close()
    assert_exactly_once(local_lake, {r.trajectory_id for r in records})


def test_flush_by_rows_by_age_and_on_close(local_lake):
    records = make_trajectories(25, seed=8, num_tokens=16)
    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=10, flush_seconds=0.2))
    writer.add_many(records[:25])
    assert writer.stats.flushes == 2 and writer.buffered == 5  # two full batches of 10
    deadline = time.monotonic() + 10
    while writer.buffered and time.monotonic() < deadline:  # the timer flushes the old remainder
        time.sleep(0.05)
    assert writer.buffered == 0 and writer.stats.written == 25
    writer.add_many(make_trajectories(3, seed=9, num_tokens=16))
    writer.close()
    assert writer.stats.written == 28
    with pytest.raises(WriterClosedError):
        writer.add(records[0])
    writer.close()  # idempotent


def test_a_newer_registered_version_is_picked_up(local_lake, monkeypatch):
    """The writer looks at policy_versions when a row claims a version newer than the one it knows:
    once for the first flush, once per new version, never for rows of a version it knows."""
    from sao.lake.ledger import NewestVersions

    looks = []
    look = NewestVersions.look
    monkeypatch.setattr(NewestVersions, "look", lambda self: looks.append(1) or look(self))
    last = dataclasses.replace(base().segments[2], policy_version=2)
    record = dataclasses.replace(base(), trajectory_id="v2", segments=(*base().segments[:2], last))
    with TrajectoryWriter(local_lake, MANUAL) as writer:
        writer.add(dataclasses.replace(base(), trajectory_id="v1"))
        assert writer.flush().written == 1 and len(looks) == 1
        writer.add(record)
        assert writer.flush().quarantined == 1  # versions 0 and 1 are registered, 2 is not yet
        assert len(looks) == 2
        register_policy_version(
            local_lake, PolicyVersionRecord(RUN, 2, "ckpt/2", "sha256:2", parent_version=1, step=1)
        )
        writer.add(record)
        assert writer.flush().written == 1 and len(looks) == 3
        writer.add(dataclasses.replace(record, trajectory_id="v2-again"))
        writer.add(dataclasses.replace(base(), trajectory_id="v1-again"))
        assert writer.flush().written == 2 and len(looks) == 3  # versions it knows: no look


def test_threads_sharing_one_writer(local_lake):
    records = make_trajectories(200, seed=10, num_tokens=16)
    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=32, background_flush=False))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(writer.add, records + records[:50]))
    writer.close()
    assert_exactly_once(local_lake, {r.trajectory_id for r in records})


def test_two_writer_processes_store_every_row_exactly_once(lake_config, lake):
    """Two processes append overlapping, shuffled sets at once: 0-239 and 120-359 (120 in common)."""
    context = multiprocessing.get_context("spawn")
    go = context.Manager().Event()
    options = dict(lake_config.storage_options)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        futures = [
            pool.submit(_processes.write_slice, lake_config.root, options, 0, 240, 20, go, 1),
            pool.submit(_processes.write_slice, lake_config.root, options, 120, 360, 20, go, 2),
        ]
        time.sleep(0.5)
        go.set()
        results = [f.result(timeout=300) for f in futures]
    expected = {
        r.trajectory_id for r in make_trajectories(360, seed=1234, num_tokens=16, prompt_tokens=2)
    }
    assert_exactly_once(lake, expected)
    assert sum(r["written"] for r in results) == 360
    assert sum(r["duplicates"] for r in results) == 120
    print("conflicts (lost commit races, re-planned):", [r["conflicts"] for r in results])


def test_a_failed_commit_loses_nothing_and_quarantines_once(local_lake, monkeypatch):
    import sao.lake.writer as writer_module

    real = writer_module.append_exactly
    records = make_trajectories(5, seed=12, num_tokens=16)
    bad = CASES["logprob_positive"][0]

    def broken(*args, **kwargs):
        raise OSError("object store unavailable")

    monkeypatch.setattr(writer_module, "append_exactly", broken)
    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=3, background_flush=False))
    with pytest.raises(OSError, match="unavailable"):
        writer.add_many([*records[:2], bad, *records[2:]])
    assert writer.buffered == 5  # the bad record is in quarantine; the five good ones still wait
    monkeypatch.setattr(writer_module, "append_exactly", real)
    writer.close()
    assert_exactly_once(local_lake, {r.trajectory_id for r in records})
    assert local_lake.read("quarantine", columns=["record_id"])["record_id"].to_pylist() == [
        bad.trajectory_id
    ]


def test_a_background_flush_error_is_raised_by_the_next_call(local_lake, monkeypatch):
    import sao.lake.writer as writer_module

    real = writer_module.append_exactly
    monkeypatch.setattr(
        writer_module, "append_exactly", lambda *a, **k: (_ for _ in ()).throw(OSError("down"))
    )
    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=100, flush_seconds=0.05))
    record = make_trajectories(1, seed=13, num_tokens=16)[0]
    writer.add(record)
    deadline = time.monotonic() + 10
    while writer._error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(OSError, match="down"):
        writer.add(record)
    monkeypatch.setattr(writer_module, "append_exactly", real)
    writer.close()
    assert_exactly_once(local_lake, {record.trajectory_id})


def test_before_flush_runs_before_each_commit_that_has_records_with_their_launched_ids(local_lake):
    """The pipeline commits the launches its issue log holds of these ids here: no record may be
    committed before its launch is."""
    seen = []
    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=4, background_flush=False),
                              before_flush=lambda ids: seen.append((local_lake.version("trajectories"), ids)))
    start = local_lake.version("trajectories")
    records = make_trajectories(9, seed=5, run_id=RUN)
    records[8] = dataclasses.replace(records[8], trajectory_id="ep.1", episode_id="ep", episode_part=1)
    writer.add_many(records)  # two full batches flush at once
    writer.flush()  # the ninth record, a later part of a split episode: launched as its episode
    writer.flush()  # nothing buffered: no call
    writer.close()
    ids = [r.trajectory_id for r in records]
    assert seen == [(start, frozenset(ids[:4])), (start + 1, frozenset(ids[4:8])), (start + 2, {"ep.1", "ep"})]
    assert local_lake.version("trajectories") == start + 3


def test_a_delivery_without_an_id_makes_before_flush_flush_every_launch(local_lake):
    seen = []
    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=4, background_flush=False),
                              before_flush=seen.append)
    writer.add_many([make_trajectories(1, seed=7, run_id=RUN)[0].to_row() | {"trajectory_id": None}])
    writer.close()
    assert seen == [None]


def test_after_commit_runs_after_each_commit_that_wrote_rows_and_its_failure_loses_nothing(local_lake, caplog):
    """The pipeline tells the trainer here that rows are in: after the commit, never for duplicates only."""
    seen = []

    def after_commit():
        seen.append(local_lake.version("trajectories"))
        if len(seen) == 2:
            raise ConnectionError("the broker is gone")

    writer = TrajectoryWriter(local_lake, WriterConfig(flush_rows=4, background_flush=False),
                              after_commit=after_commit)
    start = local_lake.version("trajectories")
    records = make_trajectories(9, seed=6, run_id=RUN)
    writer.add_many(records)  # two commits of 4, the second call fails
    writer.flush()
    writer.add_many(records[:3])  # duplicates only: nothing written, no call
    writer.flush()
    writer.close()
    assert seen == [start + 1, start + 2, start + 3]
    assert "after_commit call failed: the broker is gone" in caplog.text
    assert_exactly_once(local_lake, {r.trajectory_id for r in records})


def test_a_demand_commits_the_rows_a_reader_waits_for_as_soon_as_they_are_buffered(local_lake, monkeypatch):
    """demand(n): a flush the moment n rows are buffered (at once when they already are), not at
    flush_rows or the age; it holds until a flush commits rows; a failure of a flush it makes is
    raised by the next call and loses nothing."""
    import sao.lake.writer as writer_module

    writer = TrajectoryWriter(local_lake, MANUAL)
    records = make_trajectories(12, seed=14, run_id=RUN)
    writer.add_many(records[:2])
    writer.demand(3)  # two buffered: nothing yet
    assert writer.buffered == 2 and writer.stats.flushes == 0
    writer.add(records[2])  # the third: flushed with the others
    assert writer.buffered == 0 and writer.stats.written == 3
    writer.add_many(records[3:7])  # the demand was met: back to flush_rows
    assert writer.buffered == 4
    writer.demand(4)  # already buffered: flushed at once, on the caller's thread
    assert writer.buffered == 0 and writer.stats.written == 7
    writer.demand(0)  # nothing wanted: no demand
    writer.add(records[7])
    assert writer.buffered == 1

    real = writer_module.append_exactly
    monkeypatch.setattr(writer_module, "append_exactly", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
    writer.demand(1)  # the flush it makes fails: raised by the next call, which takes nothing
    assert writer.buffered == 1
    with pytest.raises(OSError, match="down"):
        writer.add(records[8])
    monkeypatch.setattr(writer_module, "append_exactly", real)
    writer.add_many(records[8:])
    writer.close()
    assert_exactly_once(local_lake, {r.trajectory_id for r in records})
