"""sao.runs: what a run's pipeline is built from."""

from pathlib import Path

from sao import runs
from sao.config import RunSettings
from sao.train.retention import RetentionConfig


def test_a_run_prunes_old_checkpoints_but_keeps_every_policy(tmp_path):
    settings = RunSettings(run_id="r", workdir=str(tmp_path / "runs"), lake_root=str(tmp_path / "lake"))
    train = runs.pipeline_config(settings, tmp_path / "sft").train
    assert train.retention == RetentionConfig() and train.retention.keep_policy_weights
    assert Path(train.checkpoint_root).is_absolute() and Path(train.lake.root).is_absolute()
