"""What the `train` flow checks before it starts anything (the UI's and the deployments' way in; `sao
train` checks the same in `sao.runs_cli.run_or_resume`)."""

import pytest

from sao import runs
from sao.config import ConfigError, RunConfig


def test_a_finished_run_started_again_with_a_setting_that_may_not_change_is_refused(tmp_path):
    from flows.train import train

    where = {"run_id": "done", "workdir": str(tmp_path / "runs"), "lake": {"root": str(tmp_path / "lake")},
             "train": {"steps": 4}}
    config = RunConfig(**where)
    runs.record_start(config)
    runs.record_finished(config, {"steps": 4, "version": 4, "summary": "s"})
    # Before, the flow returned the recorded result for any settings: the change went unnoticed.
    with pytest.raises(ConfigError, match="algorithm.eps_high: recorded 5.0, now 4.0"):
        train.fn(RunConfig(**where, algorithm={"eps_high": 4.0}))


def test_the_pretrain_value_flow_takes_the_run_config_of_the_run_it_prepares(tmp_path):
    from prefect.utilities.callables import parameter_schema

    from flows.pretrain_value import pretrain_value_flow

    # Its form is the train flow's run config and value pretraining's own settings: before, it built a
    # config of its own from a run id, an algorithm, a learning rate and a seed, so a run with a model,
    # tasks or settings of its own was warm-started and prepared with the defaults instead.
    schema = parameter_schema(pretrain_value_flow).model_dump()
    assert list(schema["properties"]) == ["config", "data_run_id", "num_samples", "heldout_fraction", "epochs",
                                          "batch_size", "target"]
    where = {"run_id": "pv", "workdir": str(tmp_path / "runs"), "lake": {"root": str(tmp_path / "lake")}}
    runs.record_start(RunConfig(**where))
    with pytest.raises(ConfigError, match="algorithm.lr_policy: recorded"):  # refused before anything starts
        pretrain_value_flow.fn(RunConfig(**where, algorithm={"lr_policy": 1e-3}))
    assert not (tmp_path / "runs" / "pv").exists()
