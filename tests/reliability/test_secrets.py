"""Credentials passed as storage options never reach the lake, a log line or a run file.

A short asynchronous run (Serve rollouts, Ray Train trainer) writes to an ``s3://`` lake on a local
S3-compatible server (moto, which checks no credentials) with the secret key given only as a storage
option, and a unique marker as its value. Afterwards the marker is searched for in every object under
the lake prefix (Delta logs and data files), every row of every table, everything the run logged
(Python logging at DEBUG, the process's stdout and stderr, every file of the Ray session's logs) and
every file the run wrote (checkpoints, ``run_config.json``, Ray Train's storage). The same for
environment credentials through ``sao train`` on a cluster with a Prefect server:
``tests/test_ray_cluster.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from sao.config import from_data
from sao.lake.config import LakeConfig
from sao.lake.store import Lake
from sao.pipeline import PipelineConfig, run_pipeline
from sao.rollout.agent import AgentConfig
from sao.train.config import TrainConfig
from tests._secrets import (
    files_containing,
    moto_bucket,
    objects_containing,
    rows_containing,
    secret_marker,
)

BUCKET = "sao-secret-tests"


def test_the_run_config_has_no_place_for_storage_options():
    """Object-store options (credentials) come from the environment only: the run config (stored in
    the lake's runs table, shown in the Prefect form) refuses them."""
    with pytest.raises(ValueError, match="lake.storage_options: unknown key"):
        from_data({"lake": {"root": "s3://b/p", "storage_options": {"AWS_SECRET_ACCESS_KEY": "x"}}})


def test_storage_options_stay_out_of_reprs():
    secret = secret_marker("repr")
    lake = LakeConfig(root="s3://b/p", storage_options={"AWS_SECRET_ACCESS_KEY": secret})
    train = TrainConfig(run_id="r", lake=lake, checkpoint_root="c", policy_path="p")
    for shown in (repr(lake), str(lake), repr(train)):
        assert secret not in shown
    assert lake.storage_options["AWS_SECRET_ACCESS_KEY"] == secret  # still there for delta-rs


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_with_a_secret_storage_option_leaks_it_nowhere(tmp_path, policy_dir, ray_session, caplog, capfd):
    import ray

    from sao.runs import math_tasks

    secret = secret_marker("option")
    caplog.set_level(logging.DEBUG)
    with moto_bucket(BUCKET) as endpoint:
        options = {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
                   "AWS_ACCESS_KEY_ID": "sao-test-key-id", "AWS_SECRET_ACCESS_KEY": secret}
        lake_config = LakeConfig(root=f"s3://{BUCKET}/secret-run", storage_options=options)
        train = TrainConfig(run_id="secret-run", lake=lake_config, checkpoint_root=str(tmp_path / "run" / "ckpt"),
                            policy_path=str(policy_dir), batch_size=4, total_steps=2, wait_timeout_s=300)
        config = PipelineConfig(train=train, num_replicas=1, agent=AgentConfig(max_tokens=96, max_turns=4),
                                max_in_flight=8)
        result = run_pipeline(config, math_tasks("train"))
        assert result.steps == 2

        lake = Lake.open(lake_config, create=False)
        rows, tables = rows_containing(lake, secret)
        assert rows > 0 and not tables, f"the secret is in rows of {tables}"
        objects, keys = objects_containing(endpoint, BUCKET, "secret-run/", secret)
        assert objects > 10 and not keys, f"the secret is in lake objects {keys}"

    captured = capfd.readouterr()
    assert caplog.records, "nothing was logged: the search below would prove nothing"
    assert secret not in caplog.text and secret not in captured.out + captured.err
    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    for root in (session / "logs", tmp_path / "run"):  # Ray logs; checkpoints, run_config.json, ray_train
        read, leaked = files_containing(root, secret)
        assert read > 0 and not leaked, f"the secret is in {leaked}"
    assert dataclasses.asdict(lake_config)["storage_options"]["AWS_SECRET_ACCESS_KEY"] == secret  # the run had it
