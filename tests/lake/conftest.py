"""Lake fixtures: every lake test runs against a local folder and against an ``s3://`` lake served by
moto in server mode on 127.0.0.1 (a random free port, started once per session).

S3 storage options: the endpoint, plain HTTP, test credentials and a region. No locking option:
delta-rs 1.x commits to S3 with conditional puts (``If-None-Match: *``), which moto honours (checked
by ``test_moto_honours_conditional_put``); ``AWS_S3_ALLOW_UNSAFE_RENAME`` would disable that safety
and is not set. Nothing talks to any host but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from sao.lake.config import LakeConfig
from sao.lake.ledger import register_policy_version
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import Lake

BUCKET = "sao-lake-tests"
RUN = "run-0"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_moto(port: int) -> subprocess.Popen:
    """moto in server mode, in its own process: delta-rs holds the GIL in some blocking calls, so
    a server thread inside the test process could not answer them."""
    return subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_until_listening(port: int, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not listen on 127.0.0.1:{port} within {timeout_s} s")


@contextlib.contextmanager
def moto_bucket(bucket: str) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with ``bucket`` created; yields the endpoint URL and stops the server
    after. moto checks no credentials, so any work."""
    import boto3

    port = _free_port()
    process = _start_moto(port)
    try:
        _wait_until_listening(port, process)
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="setup", aws_secret_access_key="setup",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def s3_options() -> Iterator[dict[str, str]]:
    """Storage options of a moto S3 server on 127.0.0.1 with the test bucket created."""
    pytest.importorskip("moto")
    with moto_bucket(BUCKET) as endpoint:
        yield {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }


BACKENDS = ["local", "s3"]


def fresh_lake_config(request: pytest.FixtureRequest, folder) -> LakeConfig:
    """A fresh, empty lake location for the backend ``request.param`` names: ``folder / "lake"``, or a
    fresh prefix in the moto bucket."""
    if request.param == "local":
        return LakeConfig(root=str(folder / "lake"))
    options = request.getfixturevalue("s3_options")
    return LakeConfig(root=f"s3://{BUCKET}/{uuid.uuid4().hex}", storage_options=options)


@pytest.fixture(params=BACKENDS)
def lake_config(request: pytest.FixtureRequest, tmp_path) -> LakeConfig:
    """A fresh, empty lake location: a temporary folder, or a fresh prefix in the moto bucket."""
    return fresh_lake_config(request, tmp_path)


def open_with_versions(config: LakeConfig) -> Lake:
    """Open (create) the lake and register policy versions 0 and 1 of run ``run-0``."""
    opened = Lake.open(config)
    register_versions(opened, RUN)
    return opened


def register_versions(lake: Lake, run_id: str) -> None:
    """Register policy versions 0 and 1 of ``run_id`` (rows sampled by unknown versions are quarantined)."""
    register_policy_version(lake, PolicyVersionRecord(run_id, 0, "ckpt/0", "sha256:0"))
    register_policy_version(lake, PolicyVersionRecord(run_id, 1, "ckpt/1", "sha256:1", parent_version=0, step=0))


@pytest.fixture
def lake(lake_config: LakeConfig) -> Lake:
    """An opened lake (both backends) with policy versions 0 and 1 registered for ``run-0``."""
    return open_with_versions(lake_config)


@pytest.fixture
def local_lake(tmp_path) -> Lake:
    """A local lake only (for tests of pure logic where the backend does not matter)."""
    return open_with_versions(LakeConfig(root=str(tmp_path / "lake")))
