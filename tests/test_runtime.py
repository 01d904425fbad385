"""sao.runtime: a local Ray instance listens on the loopback interface only and keeps token
authentication on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sao.runtime import LOOPBACK, RayConfig, _is_loopback, _single_node_addressing

LOOPBACK_LISTEN = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _ray_node_pids() -> set[int]:
    """PIDs of this driver's local Ray node: every process Ray started, their children (workers,
    agents), and the driver itself (its core worker serves gRPC too)."""
    import psutil
    import ray

    node = ray._private.worker.global_worker.node
    pids = {os.getpid()}
    for infos in node.all_processes.values():
        for info in infos:
            pids.add(info.process.pid)
    for pid in list(pids):
        try:
            pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return pids


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    import psutil

    found = []
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def test_loopback_addresses_are_recognised():
    assert _is_loopback("127.0.0.1") and _is_loopback("127.0.0.2") and _is_loopback("localhost")
    assert not _is_loopback("10.0.0.5") and not _is_loopback("0.0.0.0")
    assert RayConfig().node_ip_address == LOOPBACK


def test_single_node_addressing_restores_rays_cluster_switch(monkeypatch):
    from ray._private import ray_constants

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with _single_node_addressing(LOOPBACK):
        assert ray_constants.ENABLE_RAY_CLUSTER is False
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    with _single_node_addressing("10.1.2.3"):  # a routable address: Ray's own behaviour, untouched
        assert ray_constants.ENABLE_RAY_CLUSTER == before


@pytest.mark.ray
def test_local_instance_listens_on_loopback_only(ray_session):
    import ray

    assert ray.util.get_node_ip_address() == LOOPBACK

    @ray.remote(num_cpus=0)
    def node_address() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(node_address.remote()) == LOOPBACK  # a worker starts (and listens) too
    sockets = _listening(_ray_node_pids())
    assert len(sockets) >= 3, f"expected the GCS, raylet and worker servers to listen, found {sockets}"
    exposed = [s for s in sockets if s[1] not in LOOPBACK_LISTEN]
    assert not exposed, f"Ray processes listen beyond the loopback interface: {exposed}"


@pytest.mark.slow
@pytest.mark.ray
def test_local_instance_refuses_a_client_without_its_token(ray_session):
    import ray
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert get_authentication_mode() == AuthenticationMode.TOKEN
    gcs = ray._private.worker.global_worker.node.gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # The probe must keep 127.0.0.1 as it is (Ray would turn it into the routable address, where
    # nothing listens: the instance is loopback-only), and it presents a wrong token.
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token-" + "0" * 32,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    probe = f"import ray\nray.init(address={gcs!r})\nprint('CONNECTED')\n"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=90)
    assert "CONNECTED" not in result.stdout
    assert result.returncode != 0
    assert "auth" in (result.stderr + result.stdout).lower(), result.stderr[-2000:]
