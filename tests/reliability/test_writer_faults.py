"""The lake writer under faults: a writer process killed (SIGKILL) between batches or at any moment,
then a restarted producer that re-delivers everything; a delivery whose acknowledgement timed out,
retried to the same writer and to another. Every trajectory is stored exactly once, ``ingest_seq``
has no gap, and ``sao lake check`` accounts for every issued id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sao.audit import check_run
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.issued import IssueLog
from sao.lake.ledger import register_policy_version
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from tests.reliability import _children
from tests.reliability._children import BATCH, BATCHES, NO_FLUSH, batch, issue

RUN = "writer-faults"


@pytest.fixture
def lake(tmp_path) -> Lake:
    opened = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register_policy_version(opened, PolicyVersionRecord(RUN, 0, "mem://v0", "h0"))
    return opened


def start_child(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", _children.__name__, *args], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # fmt: skip


def kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def all_records():
    return [r for index in range(BATCHES) for r in batch(RUN, index)]


def assert_stored_exactly_once(lake: Lake) -> None:
    table = lake.read("trajectories", columns=["trajectory_id", "ingest_seq"]).sort_by("ingest_seq")
    ids = table["trajectory_id"].to_pylist()
    assert len(ids) == len(set(ids)) == BATCH * BATCHES, "a trajectory is missing or stored twice"
    assert set(ids) == {r.trajectory_id for r in all_records()}
    assert table["ingest_seq"].to_pylist() == list(range(1, len(ids) + 1)), "ingest_seq has a gap"
    report = check_run(lake, RUN, max_staleness=0, verify_checkpoints=False)
    assert report.ok, report.lines()
    assert (report.issued, report.stored) == (BATCH * BATCHES, BATCH * BATCHES)


def redeliver_everything(lake: Lake) -> TrajectoryWriter:
    """A restarted producer: issues what the dead one had not issued, re-sends every record."""
    issued = set(lake.read("rollout_tasks", columns=["trajectory_id"])["trajectory_id"].to_pylist())
    issue(IssueLog(lake, NO_FLUSH), [r for r in all_records() if r.trajectory_id not in issued])
    with TrajectoryWriter(lake, WriterConfig(flush_rows=BATCH * 3, background_flush=False)) as writer:
        writer.add_many(all_records())
    return writer


@pytest.mark.parametrize("pause_s", [5.0, 0.0], ids=["between-batches", "at-any-moment"])
def test_a_killed_writer_then_a_full_redelivery_stores_each_trajectory_once(lake, pause_s):
    child = start_child("write", lake.root, RUN, str(pause_s))
    try:
        wanted = "committed 2" if pause_s else "committed 0"
        for line in child.stdout:
            if line.startswith(wanted):
                break
        if not pause_s:
            time.sleep(0.15)  # somewhere in the next batches: mid-write, mid-commit or between
    finally:
        kill(child)
    committed_before = lake.read("trajectories", columns=["trajectory_id"]).num_rows
    assert committed_before % BATCH == 0, "a commit is all or nothing"
    if pause_s:
        assert committed_before == 3 * BATCH
    writer = redeliver_everything(lake)
    assert writer.stats.duplicates == committed_before
    assert writer.stats.written == BATCH * BATCHES - committed_before
    assert_stored_exactly_once(lake)


def test_the_after_issue_crash_point_kills_with_launches_committed_and_their_records_not(lake):
    """The crash harness's ``after-issue:3`` (:mod:`sao.faults`): the third append of launches is committed,
    then the process group is killed before those rollouts' records: they are open launches, which a
    resume closes out and launches again."""
    from sao.lake.issued import unresolved_rollouts

    child = start_child("write", lake.root, RUN, "0", env={"SAO_CRASH_AT": "after-issue:3", "SAO_CRASH_PGID": "session"})
    output, _ = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, output
    assert output.split() == ["committed", "0", "committed", "1"]
    assert lake.read("rollout_tasks", columns=["trajectory_id"]).num_rows == 3 * BATCH
    assert lake.read("trajectories", columns=["trajectory_id"]).num_rows == 2 * BATCH
    open_, _ = unresolved_rollouts(lake, RUN)
    assert sorted(r.trajectory_id for r in open_) == sorted(r.trajectory_id for r in batch(RUN, 2))


def test_a_retried_delivery_after_a_timeout_is_stored_once(lake, monkeypatch):
    """The first commit lands but its acknowledgement is lost (the call times out): the producer
    retries to the same writer, and once more to a second writer."""
    import sao.lake.writer as writer_module

    real = writer_module.append_exactly
    calls = {"n": 0}

    def ack_lost(*args, **kwargs):
        result = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            raise TimeoutError("the commit's acknowledgement timed out")
        return result

    monkeypatch.setattr(writer_module, "append_exactly", ack_lost)
    records = all_records()
    issue(IssueLog(lake, NO_FLUSH), records)
    first = TrajectoryWriter(lake, WriterConfig(flush_rows=BATCH, background_flush=False))
    with pytest.raises(TimeoutError):
        first.add_many(records[:BATCH])
    assert lake.read("trajectories").num_rows == BATCH  # it did land
    first.add_many(records[:BATCH])  # retry: buffered twice now, plus already stored
    first.add_many(records[BATCH:])
    first.close()
    with TrajectoryWriter(lake, WriterConfig(flush_rows=BATCH, background_flush=False)) as second:
        second.add_many(records[: 2 * BATCH])  # the same deliveries, retried through another writer
    assert second.stats.written == 0 and second.stats.duplicates == 2 * BATCH
    assert_stored_exactly_once(lake)
