"""Two training runs in two processes writing to one lake at the same time (trajectories, issue log,
train steps, policy versions): each run's data stays in its own partition and rows, complete, and
each reconciles on its own."""

from __future__ import annotations

import pyarrow.compute as pc

from sao.audit import check_run
from sao.lake.config import LakeConfig
from sao.lake.ledger import consumed_ids
from sao.lake.store import Lake
from tests.reliability._children import BATCH, BATCHES, batch
from tests.reliability.test_writer_faults import kill, start_child

RUNS = ("concurrent-a", "concurrent-b")


def test_two_runs_in_two_processes_stay_separate_and_complete(tmp_path):
    root = str(tmp_path / "lake")
    Lake.open(LakeConfig(root=root))  # created once; the children race on everything else
    children = [start_child("train", root, run) for run in RUNS]
    try:
        outputs = [child.communicate(timeout=240)[0] for child in children]
    finally:
        for child in children:
            kill(child)
    assert [child.returncode for child in children] == [0, 0], outputs
    lake = Lake.open(LakeConfig(root=root))
    stored = lake.read("trajectories", columns=["run_id", "trajectory_id"])
    for run in RUNS:
        own = {r.trajectory_id for index in range(BATCHES) for r in batch(run, index, index)}
        rows = stored.filter(pc.equal(stored["run_id"], run))["trajectory_id"].to_pylist()
        assert len(rows) == len(set(rows)) == BATCH * BATCHES and set(rows) == own
        consumed = consumed_ids(lake, run).to_pylist()
        assert len(consumed) == len(set(consumed)) == BATCH * BATCHES and set(consumed) == own
        versions = lake.read("policy_versions", predicate=f"run_id = '{run}'")["version"].to_pylist()
        assert sorted(versions) == list(range(BATCHES + 1))
        report = check_run(lake, run, max_staleness=1, verify_checkpoints=False)
        assert report.ok, report.lines()
        assert (report.issued, report.stored, report.consumed, report.steps) == (
            BATCH * BATCHES, BATCH * BATCHES, BATCH * BATCHES, BATCHES,
        )  # fmt: skip
    assert stored.num_rows == 2 * BATCH * BATCHES
