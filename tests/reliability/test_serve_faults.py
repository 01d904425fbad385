"""A Serve rollout replica killed mid-generation: Serve replaces it; the rollouts it held end as
``error`` records and are retried under new ids (each retry names the attempt it replaces in the issue
log); nothing is lost or stored twice, and `sao lake check` accounts for every issued rollout."""

from __future__ import annotations

import asyncio
import time

import pytest

from sao.audit import check_run
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.issued import IssueLog
from sao.lake.ledger import register_policy_version
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from sao.models.policy import load_policy
from sao.rollout.agent import AgentConfig
from sao.rollout.driver import DriverConfig, RolloutDriver
from sao.rollout.serve import RolloutConfig, start_rollout_app
from sao.train.checkpoint import weights_hash

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP, RUN = "rollout-kill-test", "serve-kill"


def replica_actors():
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in a["name"] and APP in a["name"]]  # fmt: skip


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["RolloutReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def test_a_killed_replica_loses_and_doubles_nothing(tmp_path, policy_dir, ray_session):
    import ray
    from ray import serve

    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register_policy_version(lake, PolicyVersionRecord(RUN, 0, str(policy_dir), weights_hash(load_policy(policy_dir))))
    handle = start_rollout_app(RolloutConfig(policy_path=str(policy_dir), app_name=APP, num_replicas=2,
                                             agent=AgentConfig(max_tokens=64, max_turns=2)))  # fmt: skip
    try:
        writer = TrajectoryWriter(lake, WriterConfig(flush_rows=8, flush_seconds=0.2))
        issue_log = IssueLog(lake, WriterConfig(flush_rows=8, flush_seconds=0.2))
        driver = RolloutDriver(handle, writer, RUN, DriverConfig(max_in_flight=8, max_staleness=None),
                               issue_log=issue_log)  # fmt: skip
        killed = []

        def kill_one_replica_mid_run(record) -> None:
            """Once 6 rollouts finished, kill the replica holding the most requests; a wave of rollouts can
            end together and leave both idle (then nothing would fail), so wait for a record after which
            one holds a request."""
            if driver.stats.finished < 6 or killed:
                return
            named = replica_actors()
            actors = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in named]
            ongoing = ray.get([actor.get_num_ongoing_requests.remote() for actor in actors])
            busiest = max(range(len(actors)), key=ongoing.__getitem__)
            if ongoing[busiest] >= 1:
                killed.append(named[busiest]["name"])
                ray.kill(actors[busiest], no_restart=True)

        driver.on_record = kill_one_replica_mid_run
        tasks = generate_tasks(MathToolConfig(num_train=40, num_heldout=0))
        stats = asyncio.run(driver.run(tasks))
        writer.close()
        assert killed, "no replica was killed"
        errors = stats.by_reason.get("error", 0)
        assert errors >= 1 and stats.retried == errors  # every interrupted rollout was retried
        assert stats.finished == stats.launched == len(tasks) + stats.retried

        report = check_run(lake, RUN)
        assert report.ok, report.lines()
        assert report.issued == report.stored == stats.launched and report.quarantined == 0
        retries = lake.read("rollout_tasks", predicate=f"run_id = '{RUN}' AND attempt > 0").to_pylist()
        failed = set(lake.read("trajectories", columns=["trajectory_id"],
                               predicate=f"run_id = '{RUN}' AND termination_reason = 'error'")["trajectory_id"]
                     .to_pylist())  # fmt: skip
        assert len(retries) == stats.retried and {r["retry_of"] for r in retries} <= failed

        deadline = time.monotonic() + 120  # Serve replaces the dead replica
        while running_replicas() < 2 or any(a["name"] == killed[0] for a in replica_actors()):
            assert time.monotonic() < deadline, "Serve did not replace the killed replica"
            time.sleep(0.5)
        assert handle.health.remote().result()["version"] == 0
    finally:
        serve.delete(APP)
