"""The Prefect flow `train`, end to end on two steps of each example config (the demo's in `make test`):
warm start reused, Serve rollouts into the lake, Ray Train updates, evaluation, report artifacts. Value
pretraining in the flow: tests/flows/test_deployments.py (a run from the UI, crashed and retried)."""

import json
import shutil
from pathlib import Path

import pytest

from sao.lake.store import Lake

pytestmark = pytest.mark.ray


REPO = Path(__file__).resolve().parents[2]
# The demo's config in `make test`; the examples in the slow tier.
EXAMPLE_CONFIGS = ["configs/demo.yaml", *(pytest.param(str(p.relative_to(REPO)), marks=pytest.mark.slow)
                                          for p in sorted(REPO.glob("examples/*/config.yaml")))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", EXAMPLE_CONFIGS)
def test_every_example_config_trains_two_steps(example, tmp_path, policy_dir, ray_session, prefect_harness,
                                               monkeypatch):
    """An example as its README says to run it (from the repository root, where its data and reward
    modules are found), for 2 steps, its warm start reused; the run reconciles with `sao lake check`.
    (Value pretraining in the flow, with its artifact: tests/flows/test_deployments.py.)"""
    from flows.train import train
    from sao.audit import check_run
    from sao.config import resolve

    monkeypatch.chdir(REPO)
    config, sources = resolve(example, [
        f"workdir={tmp_path / 'runs'}", f"lake.root={tmp_path / 'lake'}", "train.steps=2", "train.batch_size=8",
        "eval.tasks=4", "value_pretraining.samples=0", "rollout.num_replicas=1", "rollout.max_tokens=64"])
    shutil.copytree(policy_dir, config.sft_dir)
    result = train(config=config, sources=sources)
    assert result["version"] == 2 and result["settings"]["data"] == config.public()["data"]
    assert 0.0 <= result["accuracy_before"] <= 1.0 and 0.0 <= result["accuracy_after"] <= 1.0
    assert result["stderr_after"] >= 0.0 and result["eval_tasks"] == 4 and result["train_wall_s"] > 0
    lake = Lake.open(config.lake.root)
    report = check_run(lake, config.run_id)
    assert report.ok, report
    if example == "configs/demo.yaml":
        _demo_run_reported(config, result)
    rows = lake.read("trajectories", predicate=f"run_id = '{config.run_id}'").to_pylist()
    if config.data.train is not None:  # the user's tasks, scored by the user's rewards
        assert {row["env_name"] for row in rows} == {"dataset"}
        assert all(row["error"] is None for row in rows), [row["error"] for row in rows if row["error"]]
    (started,) = lake.read("runs", predicate=f"run_id = '{config.run_id}'").to_pylist()
    assert json.loads(started["config"]) == config.public() and started["event"] == "start"


def _demo_run_reported(config, result: dict) -> None:
    """What the demo's run reports besides its steps: failures by class, the learning curve, and the
    flow's artifacts."""
    from prefect.client.orchestration import get_client

    from flows.train import artifact_key

    for when in ("before", "after"):  # every failed held-out episode has its class
        failures = result[f"failures_{when}"]
        assert set(failures) == {"tool_call", "answer", "structure"}
        assert sum(failures.values()) == round((1 - result[f"accuracy_{when}"]) * result["eval_tasks"])
    assert (config.run_dir / "plots" / "learning_curve.png").exists()

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts()

    import asyncio

    keys = {a.key for a in asyncio.run(artifacts())}
    assert {artifact_key(config.run_id, what) for what in ("progress", "report", "metrics")} <= keys


def test_the_replay_flow_runs_a_what_if_replay(tmp_path, policy_dir, tokenizer, prefect_harness):
    from flows.replay import replay
    from tests.train.test_replay import trained_run

    cfg, lake = trained_run(tmp_path, policy_dir, tokenizer, 3)
    result = replay(run_id=cfg.run_id, step=0, last_step=2, lake_root=cfg.lake.root,
                    overrides={"algorithm.eps_high": 0.01, "algorithm.eps_low": 0.01}, as_run_id="what-if-flow")
    assert result["as_run"] == "what-if-flow" and [s["step"] for s in result["steps"]] == [0, 1, 2]
    assert result["overrides"] == {"eps_high": 0.01, "eps_low": 0.01}
    (row,) = lake.read("runs", predicate="run_id = 'what-if-flow'").to_pylist()
    assert row["event"] == "what_if" and row["parent_steps"] == "0:2"
    from sao.audit import check_run

    checked = check_run(lake, "what-if-flow")  # reconciled: 3 steps on the parent's data, 4 versions
    assert checked.ok and (checked.steps, checked.policy_versions, checked.checkpoints_verified) == (3, 4, 4), checked
