"""The trainer's query: unconsumed, in arrival order, within staleness, exactly once across restarts."""

from __future__ import annotations

import dataclasses
import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from sao.lake.config import WriterConfig
from sao.lake.ledger import record_train_step
from sao.lake.maintenance import compact
from sao.lake.reader import (
    INDEX_COLUMNS,
    TrajectoryReader,
    read_step_trajectories,
    read_trajectories,
    select_unconsumed,
)
from sao.lake.records import Segment, TrainStepRecord, TrajectoryRecord, utc_now
from sao.lake.store import LakeError
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter
from schemas.trajectories import SegmentKind
from schemas.vocabulary import TerminationReason
from tests.lake.conftest import RUN, register_versions

MANUAL = WriterConfig(flush_rows=10_000, background_flush=False)


def write(lake, records: list[TrajectoryRecord]) -> None:
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many(records)


def step(run_id: str, number: int, batch, ids=None) -> TrainStepRecord:
    now = utc_now()
    listed = batch.trajectory_ids if ids is None else ids
    return TrainStepRecord(
        run_id, number, number, number + 1, batch.snapshot_version, tuple(listed), now, now
    )


def test_micro_batches_come_in_arrival_order_and_each_row_once(lake):
    records = make_trajectories(25, seed=1, num_tokens=16)
    write(lake, records[:10])
    write(lake, records[10:])
    reader = TrajectoryReader(lake, RUN, columns=["completion_ids"])
    first = reader.next_micro_batch(trainer_version=0, max_staleness=4, max_rows=8)
    second = reader.next_micro_batch(trainer_version=0, max_staleness=4, max_rows=8)
    assert first.data["ingest_seq"].to_pylist() == list(range(1, 9))
    assert second.data["ingest_seq"].to_pylist() == list(range(9, 17))
    assert first.trajectory_ids == [r.trajectory_id for r in records[:8]]
    assert first.data.column_names == ["trajectory_id", "ingest_seq", "completion_ids"]
    assert first.data["completion_ids"].to_pylist()[0] == records[0].completion_ids.tolist()
    assert sum(len(b) for b in first.batches) == 8
    rest = reader.next_micro_batch(trainer_version=0, max_staleness=4, max_rows=100)
    assert len(rest) == 9 and len(reader.next_micro_batch(0, 4, 100)) == 0


def test_rows_chosen_over_several_calls_are_read_once_at_the_last_snapshot(local_lake):
    records = make_trajectories(12, seed=2, num_tokens=16)
    write(local_lake, records[:5])
    reader = TrajectoryReader(local_lake, RUN, columns=["completion_ids"])
    with pytest.raises(ValueError, match="no snapshot yet"):
        reader.fetch(pa.table({"ingest_seq": pa.array([], pa.int64())}))
    assert len(reader.next_micro_batch(0, 4, 3)) == 3  # rows 1-3, read in full
    first = reader.next_micro_batch(0, 4, 3, fetch=False)  # rows 4 and 5, all the first snapshot has left
    write(local_lake, records[5:])
    second = reader.next_micro_batch(0, 4, 4, fetch=False)
    assert first.data.column_names == list(INDEX_COLUMNS) and len(first) == 2 and len(second) == 4
    assert second.snapshot_version > first.snapshot_version
    chosen = pa.concat_tables([second.data, first.data])  # any order: the rows come back in it
    rows = reader.fetch(chosen)
    assert rows.column_names == ["trajectory_id", "ingest_seq", "completion_ids"]
    assert rows["ingest_seq"].to_pylist() == [6, 7, 8, 9, 4, 5]
    by_id = {r.trajectory_id: r.completion_ids.tolist() for r in records}
    assert rows["completion_ids"].to_pylist() == [by_id[i] for i in rows["trajectory_id"].to_pylist()]
    assert reader.fetch(chosen.slice(0, 0)).num_rows == 0


def test_staleness_is_trainer_version_minus_the_oldest_sampling_version(local_lake):
    # versions (0, 1): min version 0; (1,): min version 1; an error trajectory without actions
    old = make_trajectories(3, seed=2, num_tokens=16, turns=2, policy_versions=(0, 1))
    new = make_trajectories(3, seed=3, num_tokens=16, policy_versions=(1,))
    empty = dataclasses.replace(
        new[0],
        trajectory_id="no-actions",
        action_mask=[False] * 16,
        logprobs=[0.0] * 16,
        segments=(Segment(SegmentKind.OBSERVATION, 0, 16, None),),
    )
    write(local_lake, [old[0], new[0], empty, old[1], new[1]])
    reader = TrajectoryReader(local_lake, RUN)
    batch = reader.next_micro_batch(trainer_version=2, max_staleness=1, max_rows=10)
    assert batch.trajectory_ids == [new[0].trajectory_id, new[1].trajectory_id]  # staleness 1 <= 1
    assert (batch.skipped_stale, batch.skipped_no_actions) == (2, 1)  # staleness 2 > 1; no actions
    write(local_lake, [old[2], new[2]])
    later = reader.next_micro_batch(2, 1, 10)
    assert later.trajectory_ids == [new[2].trajectory_id] and later.skipped_stale == 1
    allowing_older = reader.next_micro_batch(2, 2, 10)  # set-aside rows come back, in arrival order
    assert allowing_older.trajectory_ids == [
        old[0].trajectory_id,
        old[1].trajectory_id,
        old[2].trajectory_id,
    ]


def ended(record: TrajectoryRecord, reason: str) -> TrajectoryRecord:
    return dataclasses.replace(record, termination_reason=TerminationReason(reason),
                               error="ValueError: boom" if reason == "error" else None)


def test_rows_of_the_reasons_passed_over_stay_stored_and_are_counted_once(local_lake):
    records = make_trajectories(6, seed=21, num_tokens=16)
    cut = [ended(records[1], "cancelled"), ended(records[3], "error"), ended(records[4], "timeout")]
    write(local_lake, [records[0], cut[0], records[2], cut[1]])
    reader = TrajectoryReader(local_lake, RUN, pass_over=("cancelled", "error"))
    first = reader.next_micro_batch(0, 1, 1)
    assert first.trajectory_ids == [records[0].trajectory_id] and first.skipped_passed_over == 2
    write(local_lake, [cut[2], records[5]])
    rest = reader.next_micro_batch(0, 1, 10)  # a budget end is trained on; counted rows are not again
    assert rest.trajectory_ids == [records[2].trajectory_id, cut[2].trajectory_id, records[5].trajectory_id]
    assert rest.skipped_passed_over == 0
    stored = read_trajectories(local_lake, run_id=RUN, columns=["trajectory_id", "termination_reason"])
    assert stored.num_rows == 6 and stored["termination_reason"].to_pylist().count("cancelled") == 1
    every = TrajectoryReader(local_lake, RUN).next_micro_batch(0, 1, 10)  # passing over nothing: all six
    assert len(every) == 6 and every.skipped_passed_over == 0


def test_consumption_is_exactly_once_across_a_restart(lake):
    records = make_trajectories(12, seed=4, num_tokens=16)
    write(lake, records)
    reader = TrajectoryReader(lake, RUN)
    used = reader.next_micro_batch(0, 2, 4)
    record = step(RUN, 0, used)
    record_train_step(lake, record)
    reader.consumed(record.trajectory_ids)
    with pytest.raises(KeyError, match="not handed out"):  # consumed rows cannot be given back
        reader.release(used.trajectory_ids[:1])
    lost = reader.next_micro_batch(0, 2, 4)  # handed out, the trainer dies before recording it
    restarted = TrajectoryReader(lake, RUN)
    again = restarted.next_micro_batch(0, 2, 100)
    assert again.trajectory_ids == [r.trajectory_id for r in records[4:]]
    assert set(lost.trajectory_ids) <= set(again.trajectory_ids)
    assert not set(used.trajectory_ids) & set(again.trajectory_ids)


def test_release_offers_abandoned_rows_again_in_order(local_lake):
    write(local_lake, make_trajectories(6, seed=5, num_tokens=16))
    reader = TrajectoryReader(local_lake, RUN)
    first = reader.next_micro_batch(0, 1, 3)
    reader.release(first.trajectory_ids[1:])
    assert reader.next_micro_batch(0, 1, 3).data["ingest_seq"].to_pylist() == [2, 3, 4]
    with pytest.raises(KeyError, match="not handed out"):
        reader.release(["nope"])


def test_pinned_snapshot_and_monotone_bounds(local_lake):
    records = make_trajectories(6, seed=6, num_tokens=16)
    write(local_lake, records[:3])
    pinned = local_lake.version("trajectories")
    write(local_lake, records[3:])
    reader = TrajectoryReader(local_lake, RUN)
    batch = reader.next_micro_batch(1, 1, 10, version=pinned)
    assert batch.snapshot_version == pinned and len(batch) == 3
    assert len(reader.next_micro_batch(1, 1, 10)) == 3
    with pytest.raises(ValueError, match="older than the previous"):
        reader.next_micro_batch(1, 1, 10, version=pinned)
    with pytest.raises(ValueError, match="max_rows"):
        reader.next_micro_batch(1, 1, 0)


def test_incremental_reader_equals_the_full_scan_reference(local_lake):
    """Random appends (some ending cancelled or in an error), steps, staleness and batch sizes: the
    reader returns what the reference returns."""
    rng = random.Random(7)
    pass_over = ("cancelled", "error")
    reader = TrajectoryReader(local_lake, RUN, columns=["trajectory_id"], pass_over=pass_over)
    handed_out: list[str] = []
    trainer_version, step_number, seed = 0, 0, 100
    for _ in range(16):
        if rng.random() < 0.7:
            versions = (rng.choice([0, 1]),)
            made = make_trajectories(rng.randint(1, 8), seed=seed, num_tokens=12, policy_versions=versions)
            write(local_lake, [ended(r, rng.choice(["stop", "stop", "length", "cancelled", "error"]))
                               for r in made])
            seed += 1
        trainer_version = max(0, trainer_version + rng.choice([-1, 0, 1, 1]))
        staleness, rows = rng.choice([0, 1, 2]), rng.randint(1, 6)
        version = local_lake.version("trajectories")
        expected = select_unconsumed(
            local_lake, RUN, trainer_version, staleness, rows, version=version, exclude=handed_out,
            pass_over=pass_over,
        )
        batch = reader.next_micro_batch(trainer_version, staleness, rows, version=version)
        assert batch.trajectory_ids == expected["trajectory_id"].to_pylist()
        handed_out += batch.trajectory_ids
        if batch.trajectory_ids and rng.random() < 0.5:
            record_train_step(local_lake, step(RUN, step_number, batch))
            step_number += 1


def test_read_step_trajectories_returns_the_recorded_rows_in_order(lake):
    records = make_trajectories(8, seed=8, num_tokens=16)
    write(lake, records[:5])
    batch = TrajectoryReader(lake, RUN).next_micro_batch(0, 1, 5)
    order = list(reversed(batch.trajectory_ids))
    record_train_step(lake, step(RUN, 0, batch, ids=order))
    write(lake, records[5:])
    replay = read_step_trajectories(lake, RUN, 0, columns=["trajectory_id", "reward"])
    assert replay["trajectory_id"].to_pylist() == order
    with pytest.raises(LakeError, match="no recorded step 9"):
        read_step_trajectories(lake, RUN, 9)
    with pytest.raises(LakeError, match="not in version"):
        read_trajectories(
            lake, version=batch.snapshot_version, trajectory_ids=[records[7].trajectory_id]
        )


def test_read_trajectories_by_ids_across_runs(local_lake):
    from sao.lake.ledger import register_policy_version
    from sao.lake.records import PolicyVersionRecord

    register_policy_version(local_lake, PolicyVersionRecord("run-1", 0, "ckpt/0", "sha256:0"))
    first = make_trajectories(4, seed=9, num_tokens=12)
    second = make_trajectories(4, seed=10, num_tokens=12, run_id="run-1")
    shared = dataclasses.replace(second[0], trajectory_id=first[0].trajectory_id)
    write(local_lake, [*first, *second[1:], shared])
    wanted = [second[2].trajectory_id, first[3].trajectory_id, second[1].trajectory_id]
    rows = read_trajectories(local_lake, trajectory_ids=wanted, columns=["trajectory_id", "run_id"])
    assert rows["trajectory_id"].to_pylist() == wanted
    assert rows["run_id"].to_pylist() == ["run-1", RUN, "run-1"]
    assert read_trajectories(local_lake, trajectory_ids=[], columns=["reward"]).num_rows == 0
    with pytest.raises(LakeError, match="several runs; pass run_id"):
        read_trajectories(local_lake, trajectory_ids=[first[0].trajectory_id])
    one = read_trajectories(local_lake, run_id="run-1", trajectory_ids=[first[0].trajectory_id])
    assert one["completion_ids"].to_pylist() == [shared.completion_ids.tolist()]


def test_a_poll_reads_only_the_commits_and_data_files_it_has_not_read(lake, monkeypatch):
    import sao.lake.reader as reader_module

    records = make_trajectories(12, seed=3, num_tokens=8)
    write(lake, records[:6])
    reader = TrajectoryReader(lake, RUN, columns=["completion_ids"])
    scans = []
    dataset = reader_module.ds.dataset

    def counting(paths, **kw):
        scans.append(list(paths))
        return dataset(paths, **kw)

    monkeypatch.setattr(reader_module.ds, "dataset", counting)
    assert len(reader.next_micro_batch(0, 4, 100, fetch=False)) == 6
    loaded = reader.table.version()

    def unloaded(call, *args, **kwargs):  # a call that must not load or refresh a snapshot of the table
        def no_load(*args, **kwargs):
            raise AssertionError("the reader loaded the table's snapshot")

        with monkeypatch.context() as patched:
            for owner, name in ((DeltaTable, "update_incremental"), (DeltaTable, "load_as_version"), (lake, "table")):
                patched.setattr(owner, name, no_load)
            return call(*args, **kwargs)

    def poll(**kwargs):
        return unloaded(reader.next_micro_batch, 0, 4, 100, **kwargs)

    assert len(poll(fetch=False)) == 0
    assert len(poll(fetch=False)) == 0
    assert len(scans) == 1  # the two idle polls found no new commit and read nothing
    write(lake, records[6:])
    batch = poll(fetch=False)
    assert batch.trajectory_ids == [r.trajectory_id for r in records[6:]]
    assert batch.snapshot_version > loaded
    assert len(scans) == 2 and not set(scans[0]) & set(scans[1])  # only the new commit's files
    rows = unloaded(reader.fetch, batch.data)
    assert len(scans) == 3 and set(scans[2]) == set(scans[1])  # only the files that hold the rows
    assert rows["completion_ids"].to_pylist() == [r.completion_ids.tolist() for r in records[6:]]


def test_rows_read_from_their_files_equal_the_delta_scan_across_a_compaction(local_lake):
    register_versions(local_lake, "other-run")
    records = make_trajectories(30, seed=4, num_tokens=8)
    for start in range(0, 20, 5):
        write(local_lake, records[start:start + 5])
    write(local_lake, [dataclasses.replace(r, run_id="other-run") for r in records[20:]])
    reader = TrajectoryReader(local_lake, RUN)  # every column, the partition column included
    first = reader.next_micro_batch(0, 4, 7)
    assert first.data.equals(delta_scan_of(local_lake, reader, first.data))
    compact(local_lake, ["trajectories"], run_id=RUN)  # rewrites the run's files into one
    rest = reader.next_micro_batch(0, 4, 100)
    assert rest.data["ingest_seq"].to_pylist() == list(range(8, 21))  # the rewritten rows once, as before
    assert rest.data.equals(delta_scan_of(local_lake, reader, rest.data))
    assert reader.fetch(first.data).equals(first.data)  # from the compacted file now


def test_rows_its_files_cannot_give_are_read_through_delta_rs(local_lake, monkeypatch):
    import sao.lake.reader as reader_module

    records = make_trajectories(6, seed=5, num_tokens=8)
    write(local_lake, records)
    reader = TrajectoryReader(local_lake, RUN, columns=["completion_ids"])
    chosen = reader.next_micro_batch(0, 4, 4, fetch=False).data
    dataset = reader_module.ds.dataset

    def unreadable(paths, **kwargs):  # the fetch's read (it passes the columns' schema), as an older file's
        if "schema" in kwargs:
            raise pa.ArrowInvalid("No match for FieldRef.Name(completion_ids)")
        return dataset(paths, **kwargs)

    monkeypatch.setattr(reader_module.ds, "dataset", unreadable)
    rows = reader.fetch(chosen)
    assert rows["trajectory_id"].to_pylist() == chosen["trajectory_id"].to_pylist()
    assert rows["completion_ids"].to_pylist() == [r.completion_ids.tolist() for r in records[:4]]
    assert sorted(reader.stored_ids([2, 3, 99]).to_pylist()) == sorted(r.trajectory_id for r in records[1:3])


def delta_scan_of(lake, reader: TrajectoryReader, chosen) -> pa.Table:
    """The delta-rs scan of ``chosen``'s rows at the reader's snapshot, in its order."""
    seqs = chosen["ingest_seq"].to_pylist()
    data = lake.read("trajectories", version=reader.snapshot_version,
                     predicate=f"run_id = '{RUN}' AND ingest_seq IN ({', '.join(map(str, seqs))})")
    return data.take(pc.index_in(chosen["ingest_seq"], value_set=data["ingest_seq"]))


def test_reading_by_ids_with_their_ingest_seqs_skips_the_index_scan_and_reads_the_same_rows(local_lake, monkeypatch):
    records = make_trajectories(9, seed=11, num_tokens=10)
    for start in range(0, 9, 3):
        write(local_lake, records[start:start + 3])
    batch = TrajectoryReader(local_lake, RUN).next_micro_batch(0, 4, 9)
    wanted = [batch.trajectory_ids[i] for i in (7, 0, 4)]
    seqs = [batch.data["ingest_seq"][i].as_py() for i in (7, 0, 4)]
    scanned = read_trajectories(local_lake, run_id=RUN, trajectory_ids=wanted, columns=["completion_ids"])
    reads = []
    read_from = local_lake.read_from
    monkeypatch.setattr(local_lake, "read_from", lambda *a, **kw: reads.append(kw) or read_from(*a, **kw))
    direct = read_trajectories(local_lake, run_id=RUN, trajectory_ids=wanted, ingest_seqs=seqs,
                               columns=["completion_ids"])
    assert direct.equals(scanned)
    assert len(reads) == 1 and "ingest_seq IN" in reads[0]["predicate"]  # one read, of those rows only
    with pytest.raises(LakeError, match="1 trajectory ids are not in version"):  # a value that is not the id's
        read_trajectories(local_lake, run_id=RUN, trajectory_ids=wanted, ingest_seqs=[seqs[0], seqs[1], 99])
    with pytest.raises(ValueError, match="ingest_seqs needs run_id"):
        read_trajectories(local_lake, trajectory_ids=wanted, ingest_seqs=seqs)


def test_ingest_seq_has_file_statistics_so_reads_after_a_watermark_skip_old_files(local_lake):
    """The nested columns before ``ingest_seq`` use up Delta's default 32 statistics columns; the
    table names its own (``schemas.trajectories.SPEC.stats_columns``)."""
    import json
    from pathlib import Path

    write(local_lake, make_trajectories(3, seed=12, num_tokens=10))
    log = sorted((Path(local_lake.root) / "trajectories" / "_delta_log").glob("*.json"))[-1]
    adds = [json.loads(line)["add"] for line in log.read_text().splitlines() if '"add"' in line]
    stats = json.loads(adds[0]["stats"])
    assert (stats["minValues"]["ingest_seq"], stats["maxValues"]["ingest_seq"]) == (1, 3)
    assert "min_policy_version" in stats["minValues"] and "completion_ids" not in stats["minValues"]
