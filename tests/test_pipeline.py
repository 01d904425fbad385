"""The pipeline: task streams with groups, its settings' checks, and a synchronous GRPO run in which
every batch is whole groups sampled by the trainer's own version."""

import collections
import dataclasses
import itertools

import pytest

from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.config import LakeConfig
from sao.pipeline import PipelineConfig, task_stream
from sao.train.config import TrainConfig

TASKS = generate_tasks(MathToolConfig(num_train=5, num_heldout=0))


def _train(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(run_id="r", lake=LakeConfig(root=str(tmp_path / "lake")), checkpoint_root=str(tmp_path / "c"),
                       policy_path="p", **kw)


def test_task_stream_repeats_each_task_in_a_row_and_covers_every_task_each_pass():
    stream = [t.task_id for t in itertools.islice(task_stream(TASKS, seed=3, repeat=3), 30)]
    groups = [stream[i:i + 3] for i in range(0, 30, 3)]
    assert all(len(set(g)) == 1 for g in groups)
    first_pass, second_pass = [g[0] for g in groups[:5]], [g[0] for g in groups[5:]]
    assert sorted(first_pass) == sorted(second_pass) == sorted(t.task_id for t in TASKS)
    # repeat=1 is the plain stream; start skips items of the repeated stream
    assert [t.task_id for t in itertools.islice(task_stream(TASKS, seed=3), 5)] == first_pass
    assert [t.task_id for t in itertools.islice(task_stream(TASKS, seed=3, start=4, repeat=3), 2)] == stream[4:6]


def test_pipeline_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="multiple of group_size"):
        PipelineConfig(train=_train(tmp_path, batch_size=6), group_size=4)
    with pytest.raises(ValueError, match="max_staleness must be 0"):
        PipelineConfig(train=_train(tmp_path, max_staleness=2), synchronous=True)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        PipelineConfig(train=_train(tmp_path), group_size=0)
    with pytest.raises(ValueError, match="repeat"):
        next(task_stream(TASKS, 0, repeat=0))


def test_the_writer_commits_half_batches_asynchronously_and_whole_batches_synchronously(tmp_path):
    from sao.lake.config import WriterConfig
    from sao.pipeline import ASYNC_FLUSH_ROWS, ASYNC_FLUSH_S, SYNC_FLUSH_S

    asynchronous = PipelineConfig(train=_train(tmp_path, batch_size=32)).writer_config()
    assert (asynchronous.flush_rows, asynchronous.flush_seconds) == (ASYNC_FLUSH_ROWS, ASYNC_FLUSH_S) == (16, 1.0)
    larger = PipelineConfig(train=_train(tmp_path, batch_size=128)).writer_config()
    assert (larger.flush_rows, larger.flush_seconds) == (64, 1.0)  # a commit per half batch, or 1 s
    synchronous = PipelineConfig(train=_train(tmp_path, batch_size=32, max_staleness=0), synchronous=True)
    assert (synchronous.writer_config().flush_rows, synchronous.writer_config().flush_seconds) == (32, SYNC_FLUSH_S)
    chosen = WriterConfig(flush_rows=3, flush_seconds=1.0)
    assert PipelineConfig(train=_train(tmp_path), synchronous=False, writer=chosen).writer_config() == chosen


def test_each_wait_of_the_trainer_for_rows_becomes_one_demand_at_the_writer():
    """The follower passes each newly announced wait on once (a timed-out wait for one passes nothing
    on), starts over after a broker reset, and stops when told or when the broker is gone."""
    import threading

    from sao.pipeline import _follow_demand

    stop = threading.Event()
    answers = iter([(0, 0), (1, 5), (1, 5), (2, 3), (0, 0), (1, 9), ConnectionError("the broker is gone")])
    asked = []

    def wait_demand(seen, wait_s):
        asked.append(seen)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    class Writer:
        demands = []

        def demand(self, rows):
            self.demands.append(rows)

    writer = Writer()
    _follow_demand(wait_demand, writer, stop)  # returns when the broker is gone
    assert writer.demands == [5, 3, 9]
    assert asked == [0, 0, 1, 1, 2, 0, 1]
    stop.set()
    _follow_demand(lambda seen, wait_s: (1, 4), writer, stop)  # stopped: asks nothing
    assert writer.demands == [5, 3, 9]


def test_a_failing_progress_reader_does_not_break_the_runs_shutdown(caplog):
    # The watcher's last read runs in the pipeline's cleanup, before the issue log's and the writer's last
    # flushes: an error there (a lake that hiccups, an artifact API that fails) skipped them.
    from sao.pipeline import _StepWatcher

    class Unreadable:
        def read(self, *args, **kwargs):
            raise OSError("the object store hiccupped")

    watcher = _StepWatcher(Unreadable(), "r", None, on_step=lambda report: None, interval_s=60)
    watcher.close()  # logs, does not raise
    assert "reading progress from train_steps failed" in caplog.text


@pytest.mark.slow
@pytest.mark.ray
def test_a_synchronous_grpo_run_trains_whole_groups_of_its_own_version(tmp_path, policy_dir, ray_session):
    from sao.lake.store import Lake
    from sao.pipeline import run_pipeline
    from sao.rollout.agent import AgentConfig
    from sao.runs import math_tasks
    from sao.train.config import Algorithm, UpdateConfig
    from schemas import train_steps

    train = TrainConfig(run_id="sync", lake=LakeConfig(root=str(tmp_path / "lake")),
                        checkpoint_root=str(tmp_path / "ckpt"), policy_path=str(policy_dir),
                        update=UpdateConfig(algorithm=Algorithm.GRPO), batch_size=8, max_staleness=0,
                        total_steps=3, wait_timeout_s=300)
    config = PipelineConfig(train=train, num_replicas=2, agent=AgentConfig(max_tokens=48, max_turns=2),
                            max_in_flight=16, group_size=4, synchronous=True, use_ray_train=False,
                            app_name="rollout-sync-test")
    result = run_pipeline(config, math_tasks("train"))
    assert result.steps == 3

    lake = Lake.open(train.lake)
    rows = {r["trajectory_id"]: r for r in lake.read("trajectories", predicate="run_id = 'sync'").to_pylist()}
    steps = sorted(lake.read(train_steps.NAME, predicate="run_id = 'sync'").to_pylist(), key=lambda r: r["step"])
    for step in steps:
        batch = [rows[i] for i in step["trajectory_ids"]]
        assert len(batch) == 8
        # sampled wholly by the version the step trained (staleness 0, no version change mid-trajectory)
        assert {r["min_policy_version"] for r in batch} == {r["max_policy_version"] for r in batch} \
            == {step["policy_version_before"]}
        assert sorted(collections.Counter(r["task_id"] for r in batch).values()) == [4, 4]  # two whole groups
    # the run launches one batch per version: nothing beyond the last batch and the one the stop drained
    assert result.driver.launched <= 8 * 4


def test_value_pretraining_data_rolls_out_again_what_a_ctrl_c_cancelled(tmp_path):
    # collect_rollouts counted every stored row, so the rows a Ctrl-C stored as `cancelled` (no tokens,
    # never fitted on) were counted as samples: each interrupted collection fitted the critic on fewer.
    # What counts is what the fit takes: rows that did not end for one of the run's skip_reasons.
    import numpy as np

    from sao.lake.config import WriterConfig
    from sao.lake.ledger import register_policy_version
    from sao.lake.records import PolicyVersionRecord
    from sao.lake.store import Lake
    from sao.lake.synthetic import make_trajectory
    from sao.lake.writer import TrajectoryWriter
    from sao.pipeline import collected
    from sao.rollout.driver import failed_record

    lake = Lake.open(str(tmp_path / "lake"))
    skip = ("cancelled", "error")  # algorithm.skip_reasons' default: what the fit leaves out
    assert collected(lake, "r-v0", skip) == (0, 0)
    register_policy_version(lake, PolicyVersionRecord("r-v0", 0, "ckpt/0", "sha256:0"))
    rng = np.random.default_rng(0)
    task = generate_tasks(MathToolConfig(num_train=1, num_heldout=1, seed=0))[0]
    records = [make_trajectory(rng, run_id="r-v0", num_tokens=20, prompt_tokens=8) for _ in range(5)]
    records += [failed_record(task, "r-v0", f"c{k}", "the run was stopped (Ctrl-C)", reason="cancelled")
                for k in range(3)]
    records += [failed_record(task, "r-v0", "e0", "the reward raised", reason="error")]
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)
    assert collected(lake, "r-v0", skip) == (9, 5)  # 9 along the task stream; 4 the fit leaves out, rolled out again
    assert collected(lake, "r-v0", ("cancelled",)) == (9, 6)  # a run that fits on error ends counts them


def test_a_run_that_has_its_steps_starts_no_rollouts(tmp_path, policy_dir, monkeypatch):
    # Resumed after a stop in its final evaluation (or asked for fewer steps than it has), a run started
    # Serve and generated a window of rollouts that no step would take, then found nothing to train.
    import numpy as np
    import torch

    import sao.pipeline as pipeline
    import sao.rollout.serve as serve
    from sao.lake.config import WriterConfig
    from sao.lake.store import Lake
    from sao.lake.synthetic import make_trajectory
    from sao.lake.writer import TrajectoryWriter
    from sao.train.config import UpdateConfig
    from sao.train.loop import prepare_run, run_training

    train = TrainConfig(run_id="done", lake=LakeConfig(root=str(tmp_path / "lake")),
                        checkpoint_root=str(tmp_path / "ckpt"), policy_path=str(policy_dir),
                        update=UpdateConfig(token_budget=4096), batch_size=4, max_staleness=8, total_steps=2,
                        app_name=None, wait_timeout_s=60, poll_s=0.02)
    prepare_run(train)
    rng = np.random.default_rng(1)
    with TrajectoryWriter(Lake.open(train.lake), WriterConfig(background_flush=False)) as writer:
        writer.add_many([make_trajectory(rng, run_id="done", num_tokens=16, prompt_tokens=8) for _ in range(8)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        run_training(train)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(pipeline, "init_ray", lambda config: None)
    monkeypatch.setattr(serve, "start_rollout_app", lambda config: pytest.fail("the rollout app was started"))
    tasks = generate_tasks(MathToolConfig(num_train=4, num_heldout=1, seed=0))
    for asked in (2, 1):
        result = pipeline.run_pipeline(PipelineConfig(train=dataclasses.replace(train, total_steps=asked),
                                                      use_ray_train=False), tasks)
        assert (result.steps, result.version, result.driver.records) == (2, 2, 0)
