#!/usr/bin/env python
"""Screenshots of the Prefect UI with a finished tiny training run and its artifacts, for README.md.

    .venv/bin/python scripts/screenshot_ui.py              # writes docs/images/prefect-ui-*.png
    .venv/bin/python scripts/screenshot_ui.py --form-only  # only the train flow's Custom run form

Needs Debian's chromium (this script installs nothing):

    apt-get install -y chromium

What it does, all in a temporary folder and on 127.0.0.1 only:

1. writes a randomly initialised tiny policy as the warm start of run ``ui-demo`` (no SFT: seconds);
2. starts ``sao ui --port <free port>`` (a Prefect server plus the served flows);
3. takes a screenshot of the ``train/ui`` deployment's Custom run form, generated from the run config
   (``sao.config.RunConfig``: one collapsible group per section, each key with its description);
4. starts ``train/ui`` through the API the UI's Run button uses (2 steps of 4 trajectories, 4
   evaluation tasks, 1 rollout replica) and waits until it finishes (about 3-5 minutes on 2 cores);
5. takes headless screenshots of the flow run's page (the task graph with its artifacts; the
   ``?tab=Artifacts`` query does not select that tab in a headless load), of the report artifact
   (markdown: accuracy table and the learning curve as a data-URI PNG, which the UI renders) and of
   the latest metrics table artifact;
6. stops ``sao ui`` with SIGINT (it stops its server), by PID.

Each PNG is re-encoded with a 256-colour palette to stay small (under 300 KB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "images"
RUN_ID = "ui-demo"
TINY = {"train": {"steps": 2, "batch_size": 4}, "eval": {"tasks": 4}, "rollout": {"num_replicas": 1},
        "value_pretraining": {"samples": 0}}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--hide-scrollbars",
                  "--virtual-time-budget=30000"]


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("screenshot_ui: no chromium on PATH; install it with `apt-get install -y chromium`")


def write_policy(workdir: Path) -> None:
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    save_policy(build_policy(seed=0), workdir / RUN_ID / "sft", build_tokenizer(), policy_version=0)


def start_ui(root: Path, port: int) -> tuple[subprocess.Popen, Path]:
    from sao.prefect_server import prefect_env

    env = prefect_env(f"http://127.0.0.1:{port}/api", home=root / "prefect-home")
    log = root / "sao-ui.log"
    sao = Path(sys.executable).with_name("sao")
    with open(log, "wb") as out:
        process = subprocess.Popen([str(sao), "ui", "--port", str(port)], cwd=root, env=env,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return process, log


async def train_deployment(api_url: str, timeout_s: float) -> str:
    """The id of the ``train/ui`` deployment, once ``sao ui`` has served it."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(Exception):
                    return str((await client.read_deployment_by_name("train/ui")).id)
                if time.monotonic() > deadline:
                    raise TimeoutError("train/ui was not deployed in time")
                await asyncio.sleep(2)


async def run_train(api_url: str, deployment_id: str, timeout_s: float) -> tuple[str, dict[str, str]]:
    """Start a tiny run of ``train/ui`` through the API and wait for it; the flow run's id and the id
    of its latest artifact of each key."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            deadline = time.monotonic() + timeout_s
            run = await client.create_flow_run_from_deployment(
                deployment_id, parameters={"config": {"run_id": RUN_ID, **TINY, "workdir": "runs", "lake": {"root": "lake"}}})
            while not (run.state and run.state.is_final()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flow run {run.id} did not finish in time (state {run.state!r})")
                await asyncio.sleep(3)
                run = await client.read_flow_run(run.id)
            if not run.state.is_completed():
                raise RuntimeError(f"flow run {run.id} ended {run.state!r}")
            latest = {}
            for artifact in sorted(await client.read_artifacts(), key=lambda a: a.created):
                if artifact.flow_run_id == run.id and artifact.key:
                    latest[artifact.key] = str(artifact.id)
            return str(run.id), latest


def screenshot(chromium: str, url: str, path: Path, profile: Path, height: int = 900) -> None:
    shutil.rmtree(profile, ignore_errors=True)
    profile.mkdir(parents=True)
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--window-size=1400,{height}", f"--user-data-dir={profile}",
                    f"--screenshot={path}", url],
                   check=True, capture_output=True, timeout=120)
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)
    print(f"screenshot_ui: {path.relative_to(REPO)} ({path.stat().st_size // 1024} KB) <- {url}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds to wait for the run.")
    parser.add_argument("--form-only", action="store_true", help="Only the Custom run form (no training run).")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    from sao.prefect_server import free_port

    OUT.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="sao-screenshot-"))
    write_policy(root / "runs")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log = start_ui(root, port)
    try:
        deployment_id = asyncio.run(train_deployment(f"{url}/api", args.timeout))
        profile = root / "chromium"
        screenshot(chromium, f"{url}/deployments/deployment/{deployment_id}/run", OUT / "prefect-ui-train-form.png",
                   profile, 1800)
        if args.form_only:
            return 0
        flow_run_id, artifacts = asyncio.run(run_train(f"{url}/api", deployment_id, args.timeout))
        screenshot(chromium, f"{url}/runs/flow-run/{flow_run_id}", OUT / "prefect-ui-flow-run.png", profile)
        screenshot(chromium, f"{url}/artifacts/artifact/{artifacts[f'{RUN_ID}-report']}",
                   OUT / "prefect-ui-report.png", profile, 1000)
        screenshot(chromium, f"{url}/artifacts/artifact/{artifacts[f'{RUN_ID}-metrics']}",
                   OUT / "prefect-ui-metrics.png", profile, 700)
    except BaseException:
        print(f"screenshot_ui: failed; the tail of sao ui's log ({log}):", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
        raise
    finally:
        process.send_signal(signal.SIGINT)  # sao ui stops its runner, then its server
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            found = re.search(r"server pid (\d+)", log.read_text(errors="replace"))
            if found:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int(found.group(1)), signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
