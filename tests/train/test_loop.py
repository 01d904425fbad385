"""The training loop in-process: reads from Delta, commits steps, exactly-once across a killed trainer."""

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sao.envs import make_env
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.ledger import consumed_ids
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from sao.models.policy import load_policy
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.torch_engine import TorchEngine
from sao.train.checkpoint import load_checkpoint, weights_hash
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.loop import prepare_run, run_training
from schemas.vocabulary import TerminationReason


def make_config(tmp_path, policy_dir, **kw):
    """A small run's TrainConfig. On CPU whatever the machine has (``train.device`` auto would train on a
    GPU once a Ray instance that sees one is up): these tests check bit-for-bit replay, which only CPU
    promises (GPU runs: tests/train/test_device.py)."""
    fields = dict(run_id="run-a", lake=LakeConfig(root=str(tmp_path / "lake")),
                  checkpoint_root=str(tmp_path / "ckpt"), policy_path=str(policy_dir),
                  update=UpdateConfig(token_budget=4096), batch_size=4, max_staleness=8, total_steps=2,
                  app_name=None, wait_timeout_s=30, poll_s=0.02, device="cpu")
    fields.update(kw)
    return TrainConfig(**fields)


def roll_out(policy_dir, tokenizer, lake, run_id, count, seed=0, ends=None):
    """``count`` real trajectories of the version-0 policy on math_tool, written to the lake (with
    ``ends``, their termination reasons replaced by these, in order, as if cut short there)."""
    engine = TorchEngine(load_policy(policy_dir))
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env), AgentConfig(max_tokens=24, max_turns=2))
    tasks = generate_tasks(MathToolConfig(num_train=count, num_heldout=0, seed=seed))

    async def many():
        return await asyncio.gather(*[loop.run(t, run_id=run_id, seed=seed * 100 + i) for i, t in enumerate(tasks)])

    records = asyncio.run(many())
    if ends is not None:
        records = [dataclasses.replace(r, termination_reason=TerminationReason(end),
                                       error="RuntimeError: replica died" if end == "error" else None)
                   for r, end in zip(records, ends, strict=True)]
    engine.close()
    loop.close()
    with TrajectoryWriter(lake, WriterConfig(flush_rows=5, background_flush=False)) as writer:
        writer.add_many(records)
    return [r.trajectory_id for r in records]


@pytest.fixture
def cfg(tmp_path, policy_dir):
    return make_config(tmp_path, policy_dir, compact_every=1)


def test_steps_read_from_the_lake_commit_and_register_versions(cfg, policy_dir, tokenizer):
    assert prepare_run(cfg) == 0
    lake = Lake.open(cfg.lake)
    ids = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 12)
    before = weights_hash(load_policy(policy_dir))
    reports = run_training(cfg)
    assert [r.step for r in reports] == [0, 1] and [r.version for r in reports] == [1, 2]
    consumed = consumed_ids(lake, cfg.run_id).to_pylist()
    assert len(consumed) == 8 == len(set(consumed)) and set(consumed) <= set(ids)
    assert set(consumed) == set(reports[0].trajectory_ids) | set(reports[1].trajectory_ids)
    versions = lake.read("policy_versions", predicate="run_id = 'run-a'").sort_by("version").to_pylist()
    assert [v["version"] for v in versions] == [0, 1, 2]
    assert versions[0]["weights_hash"] == before
    for row in versions[1:]:
        checkpoint = load_checkpoint(cfg.checkpoint_root, row["version"])
        assert weights_hash(checkpoint.policy) == row["weights_hash"] != before
    steps = lake.read("train_steps", predicate="run_id = 'run-a'").sort_by("step").to_pylist()
    metrics = dict(steps[0]["metrics"])
    assert 0.0 <= metrics["actor/kept_frac"] <= 1.0 and "critic/loss" in metrics
    assert steps[1]["trajectories_version"] >= steps[0]["trajectories_version"]
    # The ledger was compacted after every step: one file each, every row still there.
    assert len(lake.table("train_steps").file_uris()) == 1 == len(lake.table("policy_versions").file_uris())
    # A resumed run continues at step 2 with the remaining four trajectories.
    more = run_training(TrainConfig(**{**cfg.__dict__, "total_steps": 3}))
    assert [r.step for r in more] == [2]
    assert sorted(consumed_ids(lake, cfg.run_id).to_pylist()) == sorted(ids)


def test_stale_trajectories_are_kept_and_reported_not_trained(cfg, policy_dir, tokenizer):
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 4)
    run_training(cfg.__class__(**{**cfg.__dict__, "total_steps": 1}))  # version 1 now
    old = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 4, seed=1)  # sampled by version 0: staleness 1
    strict = cfg.__class__(**{**cfg.__dict__, "max_staleness": 0, "total_steps": 2, "wait_timeout_s": 1.0})
    with pytest.raises(TimeoutError, match="only 0 of 4 trajectories"):
        run_training(strict)
    stored = lake.read("trajectories", columns=["trajectory_id"]).column(0).to_pylist()
    assert set(old) <= set(stored)
    assert not set(old) & set(consumed_ids(lake, cfg.run_id).to_pylist())


def test_cancelled_and_error_ends_are_stored_counted_and_not_trained_on_by_default(cfg, policy_dir, tokenizer):
    """SAO.md section 2: an episode the system cut short (cancelled, error) is neither a natural end nor a
    budget end; the trainer passes over it, counts it, and a step consumes it never."""
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    first = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 4)
    cut = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 3, seed=1, ends=["cancelled", "error", "timeout"])
    rest = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 3, seed=2)
    reports = run_training(cfg)
    consumed = consumed_ids(lake, cfg.run_id).to_pylist()
    assert sorted(consumed) == sorted(first + cut[2:] + rest)  # the timeout end is trained on (bootstrapped)
    steps = lake.read("train_steps", predicate="run_id = 'run-a'").sort_by("step").to_pylist()
    assert [dict(s["metrics"])["batch/cut_short_skipped"] for s in steps] == [2.0, 0.0]
    assert len(reports) == 2 and lake.read("trajectories").num_rows == 10


def test_rows_passed_over_are_reported_while_the_trainer_waits_so_their_batch_can_fill(cfg, policy_dir, tokenizer):
    """A row the trainer will never train on is reported the moment it is passed over, not after the
    step: the driver launches another in its place, and the batch that lacked it fills (before, a
    strict run waited for a step that could never come)."""
    from sao.envs.base import Task
    from sao.lake.reader import TrajectoryReader
    from sao.rollout.driver import failed_record
    from sao.train.loop import _Broker, _wait_for_batch

    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 3)
    failed = failed_record(Task("t-error", "math_tool", "1 + 1?", "2", "train"), cfg.run_id, "e" * 32, "replica died")
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many([failed])
    reported = []

    def skipped(count):  # the driver's side: a replacement is launched and lands in the lake
        reported.append(count)
        roll_out(policy_dir, tokenizer, lake, cfg.run_id, count, seed=5)

    strict = cfg.__class__(**{**cfg.__dict__, "wait_timeout_s": 20.0})
    reader = TrajectoryReader(lake, cfg.run_id, columns=["trajectory_id", "min_policy_version"])
    _, table, stale, no_actions, cut_short = _wait_for_batch(reader, strict, 0, _Broker(skipped=skipped))
    assert reported == [1] and (stale, no_actions, cut_short) == (0, 1, 0)
    assert table.num_rows == 4 and "e" * 32 not in table.column("trajectory_id").to_pylist()



def test_a_batch_from_rows_the_reader_has_seen_comes_from_their_snapshot(cfg, policy_dir, tokenizer):
    """With rows enough already seen the trainer takes them at the snapshot they were seen at, without
    refreshing the table (a refresh lists its log); once they are used up it looks for new commits."""
    from sao.lake.reader import TrajectoryReader
    from sao.train.loop import _wait_for_batch

    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    early = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 2 * cfg.batch_size)
    reader = TrajectoryReader(lake, cfg.run_id, columns=["trajectory_id", "min_policy_version"])
    seen_at, first, *_ = _wait_for_batch(reader, cfg, 0)
    late = roll_out(policy_dir, tokenizer, lake, cfg.run_id, cfg.batch_size, seed=1)
    assert lake.version("trajectories") > seen_at
    pinned, second, *_ = _wait_for_batch(reader, cfg, 0)
    refreshed, third, *_ = _wait_for_batch(reader, cfg, 0)
    assert pinned == seen_at and refreshed == lake.version("trajectories")
    batches = [t.column("trajectory_id").to_pylist() for t in (first, second, third)]
    assert batches == [early[:cfg.batch_size], early[cfg.batch_size:], late]


def test_a_trainer_waiting_for_its_batch_is_told_of_each_commit(cfg, policy_dir, tokenizer):
    """Between two looks at the lake the trainer waits at the broker with the count of commits counted
    before its first look (asked for without waiting) and the rows it still wants, and looks again when
    a commit is announced, not after poll_s: one look before the wait, one after, none spent on
    learning the count."""
    from sao.lake.reader import TrajectoryReader
    from sao.train.loop import _Broker, _wait_for_batch

    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, cfg.batch_size - 1)
    waits, announced = [], {"commits": 5}

    def wait_rows(seen, timeout, wanted):  # the broker's side: the writer commits the missing row, announced
        waits.append((seen, timeout, wanted))
        if len(waits) == 2:
            roll_out(policy_dir, tokenizer, lake, cfg.run_id, 1, seed=3)
            announced["commits"] += 1
        return announced["commits"]

    slow_poll = cfg.__class__(**{**cfg.__dict__, "poll_s": 30.0})
    reader = TrajectoryReader(lake, cfg.run_id, columns=["trajectory_id", "min_policy_version"])
    started = time.monotonic()
    _, table, *_ = _wait_for_batch(reader, slow_poll, 0, _Broker(wait_rows=wait_rows))
    assert table.num_rows == cfg.batch_size and time.monotonic() - started < 20
    assert waits == [(-1, 0.0, 0), (5, 30.0, 1)]

KILL_SCRIPT = textwrap.dedent('''
    import sys, time
    from sao.train.loop import run_training
    from tests.train.test_loop import make_config
    import pathlib
    cfg = make_config(pathlib.Path(sys.argv[1]), sys.argv[2], total_steps=6)
    def slow(report):
        print("committed", report.step, flush=True)
        time.sleep(30)  # the parent kills us here, after the commit of step 0
    run_training(cfg, on_step=slow)
''')


def test_a_killed_trainer_resumes_with_no_trajectory_consumed_twice_or_skipped(tmp_path, policy_dir, tokenizer):
    cfg = make_config(tmp_path, policy_dir, total_steps=6)
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    ids = roll_out(policy_dir, tokenizer, lake, cfg.run_id, 12)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(policy_dir)],
                             stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("committed 0"), line
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    reports = run_training(TrainConfig(**{**cfg.__dict__, "total_steps": 3}))
    assert [r.step for r in reports] == [1, 2]
    consumed = consumed_ids(lake, cfg.run_id).to_pylist()
    assert len(consumed) == len(set(consumed)) == 12
    assert sorted(consumed) == sorted(ids)


@pytest.mark.parametrize(("interval", "due"), [(0.0, [True, True, True]), (1e9, [True, False, True])])
def test_steps_are_passed_on_to_ray_train_at_most_every_report_interval(tmp_path, policy_dir, tokenizer, interval,
                                                                         due):
    cfg = make_config(tmp_path, policy_dir, total_steps=3, report_interval_s=interval)
    prepare_run(cfg)
    roll_out(policy_dir, tokenizer, Lake.open(cfg.lake), cfg.run_id, 12)
    reports = run_training(cfg)
    assert [r.report_due for r in reports] == due  # the first and the last step always


def test_each_update_reports_the_share_of_groups_with_one_reward():
    """``batch/flat_group_frac``: of the batch's groups with two or more rollouts of one task, the share
    whose rewards are all equal (a GRPO group without signal); absent when no task repeats."""
    from sao.train.loop import compute_update
    from sao.train.step import Learner
    from tests.train.test_step import hand_built_rows, tiny

    policy = tiny()
    rows = hand_built_rows(policy)  # tasks a (rewards 1, 0), b, a
    learner = Learner(UpdateConfig(algorithm="grpo", eps_high=0.5), policy, None)
    assert compute_update(learner, rows, 5)["batch/flat_group_frac"] == 0.0
    rows[2]["reward"] = 1.0  # group a: 1, 1
    assert compute_update(learner, rows, 5)["batch/flat_group_frac"] == 1.0
    rows[2]["task_id"] = "c"  # no task twice
    assert "batch/flat_group_frac" not in compute_update(learner, rows, 5)
