"""A run whose folder was moved after it registered checkpoints: the start is refused before anything
loads, naming where the lake says the versions are and where the run now looks; with the old place
linked to the new one, the run resumes (its stored configuration's task file and module folders lead
to the same places) and its audit verifies every checkpoint, old and new."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sao import runs
from sao.audit import check_run
from sao.config import ConfigError, RunConfig
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectory
from sao.lake.writer import TrajectoryWriter
from sao.train.checkpoint import CheckpointMovedError
from sao.train.config import ReplayContext, TrainConfig, UpdateConfig
from sao.train.loop import prepare_run, run_training

RUN = "moved"


def settings(root) -> RunConfig:
    """The run's config as `sao train` reads it: its folder under the workdir, the lake beside it."""
    return RunConfig(run_id=RUN, workdir=str(root / "runs"), lake={"root": str(root / "lake")})


def trainer(root, policy_dir, steps: int) -> TrainConfig:
    """The trainer's config as `sao train` builds it: absolute paths, the run's task file and the folder
    of its reward module among them (what trajectory replay reads)."""
    run = settings(root)
    context = ReplayContext(tasks_path=str((run.run_dir / "tasks.jsonl").resolve()),
                            env_options={"dataset": {"rewards": ["my_rewards:correct"],
                                                     "paths": [str((root / "project").resolve())]}})
    return TrainConfig(run_id=RUN, lake=LakeConfig(root=str(Path(run.lake.root).resolve())),
                       checkpoint_root=str(run.checkpoint_root.resolve()), policy_path=str(policy_dir),
                       update=UpdateConfig(token_budget=4096), batch_size=4, max_staleness=8, total_steps=steps,
                       app_name=None, wait_timeout_s=60, poll_s=0.02, rollout=context)  # fmt: skip


def test_a_moved_run_is_refused_naming_both_places_and_resumes_once_linked(tmp_path, policy_dir, one_thread):
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "project").mkdir(parents=True)
    (old / "runs" / RUN).mkdir(parents=True)
    (old / "runs" / RUN / "tasks.jsonl").write_text("")
    cfg = trainer(old, policy_dir, steps=2)
    prepare_run(cfg)
    rng = np.random.default_rng(3)
    with TrajectoryWriter(Lake.open(cfg.lake), WriterConfig(flush_rows=6, background_flush=False)) as writer:
        writer.add_many([make_trajectory(rng, run_id=RUN, num_tokens=int(n), prompt_tokens=8)
                         for n in rng.integers(12, 40, 16)])
    assert [r.step for r in run_training(cfg)] == [0, 1]

    old.rename(new)
    moved = trainer(new, policy_dir, steps=4)
    recorded = old / "runs" / RUN / "checkpoints" / "v000002"
    with pytest.raises(CheckpointMovedError, match=f"registered at {recorded}"):
        prepare_run(moved)
    with pytest.raises(ConfigError, match=f"workdir: version 2 of this run is registered at {recorded}"):
        runs.check_resume(settings(new))
    lake = Lake.open(moved.lake)
    assert lake.read("policy_versions").num_rows == 3  # nothing was registered by the refused starts

    old.symlink_to(new)
    assert runs.check_resume(settings(new)) is None  # no runs row: the run was started by the trainer alone
    assert prepare_run(moved) == 2
    assert [r.step for r in run_training(moved)] == [2, 3]
    versions = {row["version"]: row["checkpoint_uri"] for row in lake.read("policy_versions").to_pylist()}
    assert versions[2] == str(recorded)  # the row written before the move, unchanged
    assert versions[4] == str((new / "runs" / RUN / "checkpoints" / "v000004").resolve())
    report = check_run(lake, RUN)
    assert report.ok, report.lines()
    assert report.checkpoints_verified == 5
