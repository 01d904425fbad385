"""Programs the fault-injection tests run in child processes (``python -m tests.reliability._children``):
a lake writer to kill between batches, and a stand-in trainer for concurrent runs. Both issue every
trajectory in ``rollout_tasks`` first, as the rollout driver does."""

from __future__ import annotations

import sys
import time
import zlib

from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.issued import IssuedRollout, IssueLog
from sao.lake.ledger import record_train_step, register_policy_version
from sao.lake.reader import TrajectoryReader
from sao.lake.records import PolicyVersionRecord, TrainStepRecord, utc_now
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter

BATCHES, BATCH = 10, 20
NO_FLUSH = WriterConfig(flush_rows=10_000, background_flush=False)


def batch(run_id: str, index: int, version: int = 0):
    """Batch ``index`` of a run: the same ids in every process."""
    seed = zlib.crc32(f"{run_id}/{index}".encode())
    return make_trajectories(BATCH, seed=seed, run_id=run_id, num_tokens=16, prompt_tokens=2,
                             policy_versions=(version,))  # fmt: skip


def issue(log: IssueLog, records) -> None:
    log.add_many(IssuedRollout(r.run_id, r.trajectory_id, r.task_id, r.env_name) for r in records)
    log.flush()


def write(root: str, run_id: str, pause_s: float) -> None:
    """Deliver BATCHES batches of version-0 trajectories, one commit each; print after each commit and
    pause ``pause_s`` (the parent kills us in a pause, or at any moment when it is 0)."""
    lake = Lake.open(LakeConfig(root=root))
    log = IssueLog(lake, NO_FLUSH, issuer_id=f"{run_id}-child")
    writer = TrajectoryWriter(lake, WriterConfig(flush_rows=BATCH, background_flush=False))
    for index in range(BATCHES):
        records = batch(run_id, index)
        issue(log, records)
        writer.add_many(records)
        print("committed", index, flush=True)
        time.sleep(pause_s)
    writer.close()
    print("done", flush=True)


def train(root: str, run_id: str) -> None:
    """A stand-in training run (no model): each round writes a batch sampled by the current version,
    consumes a batch through the reader, records the step and registers the next version."""
    lake = Lake.open(LakeConfig(root=root))
    register_policy_version(lake, PolicyVersionRecord(run_id, 0, f"mem://{run_id}/0", "h0"))
    log = IssueLog(lake, NO_FLUSH, issuer_id=f"{run_id}-child")
    reader = TrajectoryReader(lake, run_id, columns=["trajectory_id"])
    with TrajectoryWriter(lake, WriterConfig(flush_rows=BATCH, background_flush=False)) as writer:
        for version in range(BATCHES):
            records = batch(run_id, version, version)
            issue(log, records)
            writer.add_many(records)
            micro = reader.next_micro_batch(version, max_staleness=1, max_rows=BATCH)
            now = utc_now()
            record = TrainStepRecord(run_id, version, version, version + 1, micro.snapshot_version,
                                     tuple(micro.trajectory_ids), now, now)
            record_train_step(lake, record)
            reader.consumed(record.trajectory_ids)
            register_policy_version(lake, PolicyVersionRecord(
                run_id, version + 1, f"mem://{run_id}/{version + 1}", f"h{version + 1}", version, version))
    print("done", flush=True)


if __name__ == "__main__":
    mode, root, run_id, *rest = sys.argv[1:]
    if mode == "write":
        write(root, run_id, float(rest[0]))
    else:
        train(root, run_id)
