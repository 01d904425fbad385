"""The flows as a user meets them in the Prefect UI: ``sao ui`` starts a local server and serves the
deployments; a run is started through the API the UI's Run button posts to, and completes with its
artifacts. ``prefect.yaml`` deploys the same flows to a ``process`` work pool that a worker runs. Ctrl-C
stops ``sao ui`` and its server.

The fixture runs ``sao ui --port <free port>`` in a temporary folder (its own ``PREFECT_HOME``), waits
for the server's health check and the three deployments, and stops everything by PID at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import psutil
import pytest
import yaml

from flows.deployments import FLOWS, SERVED_NAME
from flows.train import artifact_key
from sao.lake.store import Lake
from sao.prefect_server import LOOPBACK, free_port, port_in_use, prefect_env
from sao.train.pretrain import REPORT_FILE

REPO = Path(__file__).resolve().parents[2]
TINY = {"train": {"steps": 2, "batch_size": 4}, "eval": {"tasks": 4}, "rollout": {"num_replicas": 1, "max_tokens": 96},
        "value_pretraining": {"samples": 0}}  # the crashed-and-retried run below pretrains its critic
PREFECT_COMMANDS = {  # what README.md tells a user to run for prefect.yaml (tests/test_readme.py checks)
    "create_pool": ("work-pool", "create", "sao-local", "--type", "process"),
    "deploy": ("--no-prompt", "deploy", "--all"),
    "worker": ("worker", "start", "--pool", "sao-local"),
}


@dataclasses.dataclass
class UI:
    """A running ``sao ui``: its process, its server's PID, its folder and log."""

    process: subprocess.Popen
    port: int
    root: Path
    log: Path
    server_pid: int | None = None

    @property
    def api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/api"

    def env(self) -> dict[str, str]:
        env = prefect_env(self.api_url, home=self.root / "prefect-home")
        env.pop("RAY_ADDRESS", None)
        return env

    def tail(self, path: Path | None = None, lines: int = 40) -> str:
        text = (path or self.log).read_text(errors="replace") if (path or self.log).exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def call(ui: UI, coroutine_fn, *args):
    """Run ``coroutine_fn(client, *args)`` with a Prefect client of ``ui``'s server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def main():
        async with get_client() as client:
            return await coroutine_fn(client, *args)

    with temporary_settings(updates={PREFECT_API_URL: ui.api_url}):
        return asyncio.run(main())


async def _deployments(client) -> dict[str, dict]:
    flows = {f.id: f.name for f in await client.read_flows()}
    return {f"{flows[d.flow_id]}/{d.name}": d.model_dump(mode="json") for d in await client.read_deployments()}


async def _run_to_completion(client, name: str, parameters: dict, timeout_s: float):
    """What the UI's Run button does (``POST /api/deployments/{id}/create_flow_run``), then wait."""
    deployment = await client.read_deployment_by_name(name)
    run = await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = await client.read_flow_run(run.id)
        if run.state is not None and run.state.is_final():
            return run
        await asyncio.sleep(2)
    return run


async def _artifacts(client, flow_run_id: UUID) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    return await client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def _stop_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    port = free_port()
    log = root / "sao-ui.log"
    sao = Path(sys.executable).with_name("sao")
    command = [str(sao)] if sao.exists() else [sys.executable, "-m", "sao.cli"]
    handle = UI(process=None, port=port, root=root, log=log)  # type: ignore[arg-type]
    with open(log, "wb") as out:
        handle.process = subprocess.Popen([*command, "ui", "--port", str(port)], cwd=root, env=handle.env(),
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
    try:
        wanted = {f"{name}/{SERVED_NAME}" for name in FLOWS}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert handle.process.poll() is None, f"sao ui exited early:\n{handle.tail()}"
            found = re.search(r"server pid (\d+) is up", log.read_text(errors="replace"))
            if found:
                handle.server_pid = int(found.group(1))
                with contextlib.suppress(Exception):
                    if wanted <= set(call(handle, _deployments)):
                        break
            time.sleep(1)
        else:
            pytest.fail(f"sao ui did not serve {sorted(wanted)} within 240 s:\n{handle.tail()}")
        yield handle
    finally:
        if handle.process.poll() is None:
            handle.process.send_signal(signal.SIGINT)
            try:
                handle.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                _stop_group(handle.process.pid, signal.SIGKILL)
                handle.process.wait(timeout=30)
        if _alive(handle.server_pid):
            _stop_group(handle.server_pid, signal.SIGKILL)


@pytest.mark.slow
def test_sao_ui_listens_on_loopback_only(ui):
    for pid in (ui.server_pid, ui.process.pid):
        listening = [c.laddr for c in psutil.Process(pid).net_connections(kind="inet") if c.status == "LISTEN"]
        assert all(address.ip == LOOPBACK for address in listening), (pid, listening)
    assert any(c.laddr.port == ui.port for c in psutil.Process(ui.server_pid).net_connections(kind="inet"))


def _prefect(ui: UI, *args: str, cwd: Path = REPO) -> str:
    done = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=cwd, env=ui.env(), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prefect_yaml_deploys_the_same_flows_and_a_process_worker_runs_them(ui, policy_dir):
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    entrypoints = {d["entrypoint"].replace("/", ".").replace(".py:", ":") for d in spec["deployments"]}
    assert entrypoints == set(FLOWS.values()), "prefect.yaml and flows/deployments.py list different flows"
    _prefect(ui, *PREFECT_COMMANDS["create_pool"])
    _prefect(ui, *PREFECT_COMMANDS["deploy"])
    deployments = call(ui, _deployments)
    for name in FLOWS:
        deployed = deployments[f"{name}/sao-local"]
        assert deployed["work_pool_name"] == "sao-local"
        assert deployed["parameter_openapi_schema"] == deployments[f"{name}/{SERVED_NAME}"]["parameter_openapi_schema"]
    # A process worker picks up a run of the evaluate deployment (no Ray: a few seconds of work).
    shutil.copytree(policy_dir, ui.root / "worker-runs" / "tiny-eval" / "sft")
    worker_log = ui.root / "worker.log"
    with open(worker_log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "prefect", *PREFECT_COMMANDS["worker"]],
                                  cwd=ui.root, env=ui.env(), stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        parameters = {"run_id": "tiny-eval", "version": 0, "eval_tasks": 4, "workdir": str(ui.root / "worker-runs")}
        run = call(ui, _run_to_completion, "evaluate/sao-local", parameters, 300)
        assert run.state.is_completed(), f"{run.state!r}:\n{ui.tail(worker_log)}"
        (table,) = [a for a in call(ui, _artifacts, run.id) if a.key == artifact_key("tiny-eval", "eval-v0")]
        rows = json.loads(table.data) if isinstance(table.data, str) else table.data
        assert rows[0]["version"] == 0 and rows[0]["tasks"] == 4 and 0.0 <= rows[0]["accuracy"] <= 1.0
    finally:
        for _ in range(2):  # a process worker exits on the second SIGTERM
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.wait(timeout=20)
        if worker.poll() is None:
            _stop_group(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)


async def _wait_final(client, flow_run_id: UUID, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = await client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        await asyncio.sleep(2)
    return run


async def _start_run(client, name: str, parameters: dict):
    deployment = await client.read_deployment_by_name(name)
    return await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)


async def _retry(client, flow_run_id: UUID) -> None:
    """What the UI's Retry button does: the run goes back to Scheduled ("AwaitingRetry") and the runner
    that serves its deployment runs it again, with the same parameters."""
    from prefect.states import AwaitingRetry

    await client.set_flow_run_state(flow_run_id, AwaitingRetry(message="Retry from the UI"), force=True)


def _flow_run_processes(flow_run_id: UUID) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id):
                found.append(process)
    return found


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_a_run_from_the_ui_crashed_then_retried_resumes_to_completion_with_artifacts(ui, policy_dir):
    """A run started through the API the UI's Run button posts to; its flow run's process is killed
    (SIGKILL, with what it started) mid-training: Prefect marks the run Crashed; Retry resumes the same
    run id from its last committed step, the run completes with its artifacts, and the lake reconciles."""
    shutil.copytree(policy_dir, ui.root / "runs" / "retry" / "sft")
    steps = 12  # enough that the kill lands mid-run: a tiny step takes well under a second
    parameters = {"config": {"run_id": "retry", **TINY, "train": {"steps": steps, "batch_size": 4}, "workdir": "runs",
                             "lake": {"root": "lake"}, "value_pretraining": {"samples": 8}}}
    run = call(ui, _start_run, f"train/{SERVED_NAME}", parameters)
    lake_root = ui.root / "lake"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if Lake.open(str(lake_root), create=False).read("train_steps", predicate="run_id = 'retry'").num_rows:
                break
        time.sleep(0.2)
    else:
        pytest.fail(f"no step committed within 400 s:\n{ui.tail()}")
    victims = _flow_run_processes(run.id)
    assert victims, "the flow run's process was not found"
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            for process in [*victim.children(recursive=True), victim]:
                process.kill()
    crashed = call(ui, _wait_final, run.id, 120)
    assert crashed.state.is_crashed() or crashed.state.is_failed(), crashed.state
    done = Lake.open(str(lake_root), create=False).read("train_steps", predicate="run_id = 'retry'").num_rows
    assert done < steps, "the run finished before it was killed"
    call(ui, _retry, run.id)
    retried = call(ui, _wait_final, run.id, 600)
    assert retried.state.is_completed(), f"{retried.state!r}:\n{ui.tail()}"
    committed = Lake.open(str(lake_root), create=False).read("train_steps", predicate="run_id = 'retry'")
    assert sorted(committed["step"].to_pylist()) == list(range(steps))
    check = subprocess.run([str(Path(sys.executable).with_name("sao")), "lake", "check", "--lake", str(lake_root),
                            "--run", "retry"], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-4000:]
    # Value pretraining, done before the kill and not again: its version-0 rollouts, stored as their own
    # run, and the version-0 critic fitted on them.
    lake = Lake.open(str(lake_root), create=False)
    assert lake.read("trajectories", predicate="run_id = 'retry-v0'").num_rows == 8
    assert lake.read("policy_versions", predicate="run_id = 'retry-v0'").column("version").to_pylist() == [0]
    report = json.loads((ui.root / "runs" / "retry" / "checkpoints" / "v000000" / "critic" / REPORT_FILE).read_text())
    assert report["data_run_id"] == "retry-v0" and report["num_train"] + report["num_heldout"] == 8
    # What the run shows in the UI: its artifacts (each attempt writes its own versions of a key)...
    artifacts = call(ui, _artifacts, run.id)
    assert ({artifact_key("retry", what) for what in ("progress", "metrics", "report", "pretrain-value")}
            <= {a.key for a in artifacts})
    assert max(float(a.data) for a in artifacts if a.key == "retry-progress") == 100.0
    for metrics in (a.data for a in artifacts if a.key == "retry-metrics"):
        rows = json.loads(metrics) if isinstance(metrics, str) else metrics
        assert "actor/kept_frac" in {row["metric"] for row in rows}
    assert any("held-out accuracy" in a.data and "learning_curve" in a.data for a in artifacts
               if a.key == "retry-report")
    # ... and the form it was started from, the deployment's parameter schema: the run config's, one
    # group per section, each field with its description.
    schema = call(ui, _deployments)[f"train/{SERVED_NAME}"]["parameter_openapi_schema"]
    sections = schema["definitions"]
    assert {"TrainSection", "AlgorithmSection", "RolloutSection", "LakeSection", "RaySection"} <= set(sections)
    assert {"steps", "batch_size", "max_staleness"} <= set(sections["TrainSection"]["properties"])
    assert sections["AlgorithmSection"]["properties"]["eps_high"]["description"].startswith("DIS interval")
    assert "grpo_dis" in json.dumps(sections["Algorithm"])  # the algorithm is a choice, not free text


@pytest.mark.slow
def test_ctrl_c_stops_the_runner_and_the_server_by_pid(ui):
    """Last in this module: the fixture's ``sao ui`` is stopped here."""
    assert _alive(ui.server_pid) and port_in_use(ui.port)
    ui.process.send_signal(signal.SIGINT)
    assert ui.process.wait(timeout=90) == 0, ui.tail()
    deadline = time.monotonic() + 30
    while _alive(ui.server_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(ui.server_pid), "the Prefect server outlived sao ui"
    assert not port_in_use(ui.port)
    assert "sao ui: stopped." in ui.log.read_text()
