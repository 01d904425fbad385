"""A real multi-node Ray cluster on one machine (sao.ray_cluster), and a training run on it.

The run is the product path a user takes past one machine, with configuration only: ``sao train
--ray-address`` joins a head and a worker node started with ``ray start`` (separate process trees, own
temp dir and ports, token authentication); rollout replicas need the custom resource ``rollout``
(head node only) and the trainer ``trainer`` (worker node only); the lake is ``s3://`` on a local
S3-compatible server (moto); the flow run goes to a Prefect server through ``PREFECT_API_URL``. The
S3 credentials come from the environment only, and the secret key is a unique marker that must not
appear in any lake object or row, any log line (the run's output, every node's Ray logs), the Prefect
server's database (artifacts, logs, parameters) or any run file. Everything is stopped by PID.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from sao.lake.config import LakeConfig
from sao.lake.store import Lake
from sao.prefect_server import LocalPrefectServer, free_port
from sao.ray_cluster import LocalRayCluster, NodeSpec
from tests._secrets import (
    files_containing,
    moto_bucket,
    objects_containing,
    rows_containing,
    secret_marker,
)

pytestmark = pytest.mark.ray

BUCKET = "sao-cluster-tests"
RUN = "cluster-run"
NODES = (NodeSpec(num_cpus=1, resources={"rollout": 1}), NodeSpec(num_cpus=1, resources={"trainer": 1}))


def test_node_spec_rejects_builtin_and_non_positive_resources():
    with pytest.raises(ValueError, match="CPU"):
        NodeSpec(resources={"CPU": 1})
    with pytest.raises(ValueError, match="trainer"):
        NodeSpec(resources={"trainer": 0})


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_bucket(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def secret():
    return secret_marker("env")


@pytest.fixture(scope="module")
def aws_env(s3_endpoint, secret):
    """What a node or the driver gets from its environment (the provider's usual chain here)."""
    return {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "sao-test-key-id", "AWS_SECRET_ACCESS_KEY": secret}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, aws_env):
    import os

    with LocalRayCluster(tmp_path_factory.mktemp("cluster"), NODES, base_env={**os.environ, **aws_env}) as running:
        yield running


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    server = LocalPrefectServer(port=free_port(), home=home, log_path=home / "server.log")
    with server:
        yield server


@pytest.mark.slow
def test_cluster_has_two_nodes_with_their_resources(cluster):
    nodes = {n["ip"]: n["resources"] for n in cluster.alive_nodes()}
    assert set(nodes) == {"127.0.0.2", "127.0.0.3"}
    assert nodes["127.0.0.2"].get("rollout") == 1 and "trainer" not in nodes["127.0.0.2"]
    assert nodes["127.0.0.3"].get("trainer") == 1 and "rollout" not in nodes["127.0.0.3"]
    assert all(pid > 0 for pid in cluster.pids()) and len(cluster.pids()) >= 4  # gcs, raylets, agents


def _actor_nodes(cluster: LocalRayCluster) -> dict[str, set[str]]:
    """Node address of every actor the cluster ran (dead ones included), by class, from the GCS's actor
    table (the state API would need the dashboard, which the test cluster does not start)."""
    probe = (
        "import json, ray\nfrom ray._private.state import actors\n"
        f"ray.init(address={cluster.address!r}, log_to_driver=False)\n"
        "out = {}\n"
        "for a in actors().values():\n"
        "    out.setdefault(a['ActorClassName'], set()).add(a['Address']['IPAddress'])\n"
        "print(json.dumps({k: sorted(v) for k, v in out.items()}))\n")
    result = subprocess.run([sys.executable, "-c", probe], env=cluster.env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return {k: set(v) for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def _nodes_of(placed: dict[str, set[str]], class_part: str) -> set[str]:
    return set().union(*(ips for name, ips in placed.items() if class_part in name))


@pytest.mark.slow
def test_training_on_the_cluster_with_an_s3_lake_and_a_prefect_server(cluster, prefect_server, s3_endpoint, aws_env,
                                                                      secret, policy_dir, tmp_path):
    workdir = tmp_path / "runs"  # every node of a real cluster would mount this path
    shutil.copytree(policy_dir, workdir / RUN / "sft")  # the SFT warm start is reused
    lake_root = f"s3://{BUCKET}/sao"
    env = cluster.env() | prefect_server.env() | aws_env | {"PREFECT_LOGGING_LEVEL": "INFO"}
    command = [sys.executable, "-m", "sao.cli", "train", "--run-id", RUN, "--steps", "2", "--batch-size", "4",
               "--num-replicas", "1", "--eval-tasks", "2", "--value-samples", "0", "--workdir", str(workdir),
               "--lake", lake_root, "--ray-address", cluster.address,
               "--replica-resource", "rollout=1", "--trainer-resource", "trainer=1"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "version 2" in output

    # The lake on S3 is complete and consistent.
    check = subprocess.run([sys.executable, "-m", "sao.cli", "lake", "check", "--lake", lake_root, "--run", RUN],
                           env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-2000:]
    lake = Lake.open(LakeConfig(root=lake_root, storage_options=aws_env), create=False)
    assert lake.read("train_steps").num_rows == 2

    # Placement: the replica ran on the head node only, the trainer's workers on the worker node only.
    placed = _actor_nodes(cluster)
    assert _nodes_of(placed, "RolloutReplica") == {"127.0.0.2"}, placed
    assert _nodes_of(placed, "RayTrainWorker") == {"127.0.0.3"}, placed

    # The Prefect server has the run: artifacts and logs. Read in a fresh process with the server's
    # environment: this process's Prefect settings may be pinned by earlier tests (harness, profiles).
    reader = ("import asyncio, json\nfrom prefect.client.orchestration import get_client\n"
              "async def keys():\n    async with get_client() as client:\n"
              "        return sorted({a.key for a in await client.read_artifacts()})\n"
              "print(json.dumps(asyncio.run(keys())))\n")
    listed = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    keys = set(json.loads(listed.stdout.strip().splitlines()[-1]))
    assert {f"{RUN}-progress", f"{RUN}-report"} <= keys

    # The secret reached the nodes (so the searches below look where it could leak) ...
    import psutil

    assert any(psutil.Process(pid).environ().get("AWS_SECRET_ACCESS_KEY") == secret
               for pid in cluster.pids() if psutil.pid_exists(pid))
    # ... and appears nowhere it must not.
    assert secret not in output and secret not in check.stdout + check.stderr
    objects, hits = objects_containing(s3_endpoint, BUCKET, "sao/", secret)
    assert objects > 10 and not hits, hits
    rows, tables = rows_containing(lake, secret)
    assert rows > 0 and not tables, tables
    for root in (cluster.temp_dir, prefect_server.home, workdir):  # Ray logs of every node; Prefect DB; run files
        read, leaked = files_containing(root, secret)
        assert read > 0 and not leaked, leaked
