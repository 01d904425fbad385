"""The Prefect flow ``pretrain_value`` on a tiny run: the version-0 critic is refitted on version-0
trajectories from the lake, the figures appear as a table artifact, and a run without such data fails
with the reason."""

import asyncio
import json
import shutil

import pytest

from sao import runs
from sao.config import RunConfig
from sao.lake.store import Lake
from sao.train.checkpoint import checkpoint_dir
from sao.train.loop import prepare_run
from sao.train.pretrain import REPORT_FILE
from tests.train.test_loop import roll_out

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def tiny_run(tmp_path, policy_dir, tokenizer, run_id: str, trajectories: int) -> RunConfig:
    settings = RunConfig(run_id=run_id, workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")})
    shutil.copytree(policy_dir, settings.sft_dir)
    cfg = runs.pipeline_config(settings, settings.sft_dir).train
    prepare_run(cfg)
    if trajectories:
        roll_out(policy_dir, tokenizer, Lake.open(cfg.lake), run_id, trajectories)
    return settings


def test_pretrain_value_flow_writes_the_version_zero_critic_and_reports(tmp_path, policy_dir, tokenizer,
                                                                        ray_session, prefect_harness):
    from prefect.client.orchestration import get_client

    from flows.pretrain_value import pretrain_value_flow
    from flows.train import artifact_key

    settings = tiny_run(tmp_path, policy_dir, tokenizer, "tiny-pv", 12)
    result = pretrain_value_flow(config=settings, num_samples=12, heldout_fraction=0.25, epochs=1, batch_size=4)
    assert (result["num_train"], result["num_heldout"]) == (9, 3)
    written = json.loads((checkpoint_dir(settings.checkpoint_root, 0) / "critic" / REPORT_FILE).read_text())
    assert written["run_id"] == "tiny-pv" and written["loss_after"] == result["loss_after"]

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts()

    (table,) = [a for a in asyncio.run(artifacts()) if a.key == artifact_key("tiny-pv", "pretrain-value")]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert rows[0]["figure"] == "held-out value loss" and rows[0]["after"] == round(result["loss_after"], 5)


def test_pretrain_value_flow_without_version_zero_data_fails_with_the_reason(tmp_path, policy_dir, tokenizer,
                                                                              ray_session, prefect_harness):
    from flows.pretrain_value import pretrain_value_flow

    settings = tiny_run(tmp_path, policy_dir, tokenizer, "empty", 0)
    with pytest.raises(ValueError, match="needs at least 2 trajectories sampled by version 0 in run 'empty'"):
        pretrain_value_flow(config=settings)
