"""A trainer worker killed (SIGKILL) in the middle of a step, after its update and before the commit:
the run resumes from the last committed step, consumes nothing twice, skips nothing, and ends with the
same weights, version by version, as an uninterrupted run on the same data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from sao.audit import check_run
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.ledger import consumed_ids
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectory
from sao.lake.writer import TrajectoryWriter
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.loop import prepare_run, run_training

RUN = "killed-trainer"
STEPS = 4

CHILD = textwrap.dedent('''
    import sys, time
    import sao.train.loop as loop
    from tests.reliability.test_trainer_faults import config
    real = loop.compute_update
    def update_then_hang(learner, rows, version, rank=0, world=1):
        metrics = real(learner, rows, version, rank, world)
        if version == 2:  # the third step: weights changed in memory, nothing committed yet
            print("mid-step", version, flush=True)
            time.sleep(120)
        return metrics
    loop.compute_update = update_then_hang
    loop.run_training(config(sys.argv[1], sys.argv[2]))
''')


def config(root: str, policy_dir: str) -> TrainConfig:
    return TrainConfig(run_id=RUN, lake=LakeConfig(root=f"{root}/lake"), checkpoint_root=f"{root}/ckpt",
                       policy_path=policy_dir, update=UpdateConfig(token_budget=4096), batch_size=4,
                       max_staleness=8, total_steps=STEPS, app_name=None, wait_timeout_s=60, poll_s=0.02)  # fmt: skip


def prepare(root, policy_dir) -> tuple[TrainConfig, Lake]:
    """A run whose lake holds the same 18 trajectories, in the same order, for every caller."""
    cfg = config(str(root), str(policy_dir))
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    rng = np.random.default_rng(5)
    records = [make_trajectory(rng, run_id=RUN, num_tokens=int(n), prompt_tokens=8) for n in rng.integers(12, 40, 18)]
    with TrajectoryWriter(lake, WriterConfig(flush_rows=6, background_flush=False)) as writer:
        writer.add_many(records)
    return cfg, lake


def hashes(lake: Lake) -> dict[int, str]:
    rows = lake.read("policy_versions", predicate=f"run_id = '{RUN}'").to_pylist()
    return {r["version"]: r["weights_hash"] for r in rows}


def test_a_trainer_killed_mid_step_resumes_to_the_same_weights(tmp_path, policy_dir, one_thread):
    reference_cfg, reference = prepare(tmp_path / "uninterrupted", policy_dir)
    run_training(reference_cfg)

    cfg, lake = prepare(tmp_path / "interrupted", policy_dir)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "interrupted"), str(policy_dir)],
                             stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        line = child.stdout.readline()
        assert line.startswith("mid-step 2"), line
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert sorted(hashes(lake)) == [0, 1, 2]  # two steps committed, the third lost with the process
    resumed = run_training(cfg)
    assert [r.step for r in resumed] == [2, 3]

    assert hashes(lake) == hashes(reference)  # replay-equal weights, version by version
    steps = {name: lake.read("train_steps", predicate=f"run_id = '{RUN}'").sort_by("step")
             for name, lake in (("resumed", lake), ("reference", reference))}  # fmt: skip
    assert steps["resumed"]["trajectory_ids"].to_pylist() == steps["reference"]["trajectory_ids"].to_pylist()
    consumed = consumed_ids(lake, RUN).to_pylist()
    assert len(consumed) == len(set(consumed)) == STEPS * 4
    report = check_run(lake, RUN)
    assert report.ok, report.lines()
    assert report.checkpoints_verified == STEPS + 1 and report.backlog.eligible == 18 - STEPS * 4
