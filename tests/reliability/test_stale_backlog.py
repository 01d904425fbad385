"""After an outage, a backlog of trajectories sampled by an old policy arrives beyond max_staleness:
the trainer does not train on it, nothing deletes it, and `sao lake check` reports it by length."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from sao.audit import check_run
from sao.cli import app
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.ledger import consumed_ids
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectory
from sao.lake.writer import TrajectoryWriter
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.loop import prepare_run, run_training

RUN = "outage"
BACKLOG_LENGTHS = (20, 40, 60, 100, 120, 300, 300, 300)  # "17-32", 2 x "33-64", 2 x "65-128", 3 x "257-512"


def write(lake: Lake, rng: np.random.Generator, lengths, version: int) -> list[str]:
    records = [make_trajectory(rng, run_id=RUN, num_tokens=n, prompt_tokens=8, policy_versions=(version,))
               for n in lengths]  # fmt: skip
    with TrajectoryWriter(lake, WriterConfig(flush_rows=64, background_flush=False)) as writer:
        writer.add_many(records)
    return [r.trajectory_id for r in records]


def test_an_old_backlog_is_kept_reported_and_not_trained_on(tmp_path, policy_dir, one_thread):
    cfg = TrainConfig(run_id=RUN, lake=LakeConfig(root=str(tmp_path / "lake")),
                      checkpoint_root=str(tmp_path / "ckpt"), policy_path=str(policy_dir),
                      update=UpdateConfig(token_budget=4096), batch_size=4, max_staleness=1, total_steps=2,
                      app_name=None, wait_timeout_s=30, poll_s=0.02)  # fmt: skip
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    rng = np.random.default_rng(0)
    write(lake, rng, [24] * 8, version=0)
    run_training(cfg)  # versions 1 and 2
    backlog = write(lake, rng, BACKLOG_LENGTHS, version=0)  # held up by the outage: staleness 2 > 1
    fresh = write(lake, rng, [24] * 4, version=2)
    (report,) = run_training(TrainConfig(**{**cfg.__dict__, "total_steps": 3}))
    assert set(report.trajectory_ids) == set(fresh)  # the newer arrivals, not the older backlog
    assert report.metrics["batch/stale_skipped"] == len(BACKLOG_LENGTHS)

    stored = set(lake.read("trajectories", columns=["trajectory_id"])["trajectory_id"].to_pylist())
    assert set(backlog) <= stored  # kept
    assert not set(backlog) & set(consumed_ids(lake, RUN).to_pylist())  # not trained on
    check = check_run(lake, RUN)  # max_staleness from the run's stored configuration
    assert check.ok, check.lines()
    assert check.max_staleness == 1 and check.checkpoints_verified == 4
    assert (check.backlog.trainer_version, check.backlog.count, check.backlog.eligible) == (3, 8, 0)
    assert check.backlog.by_length == {"17-32": 1, "33-64": 2, "65-128": 2, "257-512": 3}
    result = CliRunner().invoke(app, ["lake", "check", "--run", RUN, "--lake", cfg.lake.root])
    assert result.exit_code == 0, result.output
    assert ("stale backlog at version 3: 8 kept, not trained on (by completion length: 17-32: 1, "
            "33-64: 2, 65-128: 2, 257-512: 3)") in result.stdout  # fmt: skip
