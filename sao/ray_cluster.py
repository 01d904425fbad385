"""A real multi-node Ray cluster on one machine: a head and worker nodes, each a ``ray start`` process.

What the multi-node test (``tests/test_ray_cluster.py``) and a user trying placement on a laptop use::

    cluster = LocalRayCluster(temp_dir, [NodeSpec(num_cpus=1, resources={"rollout": 1}),
                                         NodeSpec(num_cpus=1, resources={"trainer": 1})]).start()
    cluster.wait_ready()                     # every node registered with the GCS
    ... sao train --ray-address {cluster.address} ...   (with cluster.env(): the token)
    cluster.stop()                           # SIGTERM each node's process group by PID, then SIGKILL

Each node is ``ray start --block`` in a session (process group) of its own, so :meth:`stop` ends that
node's processes (GCS, raylet, agents, workers) and nothing else: no ``ray stop``, which would stop
every Ray instance of the machine. Every node gets its own free ports (GCS, dashboard, client server,
dashboard agent) and the cluster its own ``--temp-dir``, so it runs beside other Ray instances.

Nodes advertise distinct loopback addresses (``127.0.0.2``, ``127.0.0.3``, ...): Ray 2.60 rewrites
``127.0.0.1`` given as a node address into the machine's routable address when multi-node clusters
are enabled (and refuses worker nodes when they are not), while other ``127.x`` addresses are kept.
Ray binds the gRPC servers of a node whose address is not exactly ``127.0.0.1`` on every interface,
so a cluster node is reachable from the network like on a real cluster: token authentication
(``RAY_AUTH_MODE=token`` with a token generated for this cluster, never the user's) is always on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from sao.prefect_server import free_port, port_in_use

__all__ = ["LocalRayCluster", "NodeSpec", "RayClusterError"]

RAY_CLI = str(Path(sys.executable).with_name("ray"))


class RayClusterError(RuntimeError):
    """A node did not start, or the cluster did not assemble in time."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One node of the cluster.

    Attributes:
        num_cpus: CPUs the node offers to Ray (fractions of this machine's cores are fine: they are
            a scheduling budget, not a pin).
        resources: custom resources of the node, e.g. ``{"rollout": 1}``; a Serve replica or Ray Train
            worker that asks for some of one lands only on a node that has it.
    """

    num_cpus: float = 1
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_cpus < 0:
            raise ValueError(f"NodeSpec.num_cpus must be >= 0, got {self.num_cpus}")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ValueError(f"NodeSpec.resources[{name!r}] = {amount}: custom resources need a new name "
                                 "(not CPU, GPU or memory) and a positive amount")


class LocalRayCluster:
    """A head and worker nodes as separate ``ray start`` processes (see the module docstring).

    Attributes:
        temp_dir: Ray's ``--temp-dir`` of every node (sessions and logs under it).
        nodes: the head first, then the worker nodes.
        base_env: environment of every node (the user's, if None); the cluster adds its token.
    """

    def __init__(self, temp_dir: str | Path, nodes: Sequence[NodeSpec], base_env: Mapping[str, str] | None = None
                 ) -> None:
        if not nodes:
            raise ValueError("LocalRayCluster needs at least one node (the head)")
        if len(nodes) > 250:
            raise ValueError(f"at most 250 nodes on one machine (127.0.0.2-127.0.0.251), got {len(nodes)}")
        self.temp_dir = Path(temp_dir).resolve()
        self.nodes = tuple(nodes)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.token_path = self.temp_dir / "auth_token"
        self.gcs_port = free_port()
        self.processes: list[subprocess.Popen] = []

    @property
    def head_ip(self) -> str:
        return self.node_ip(0)

    @staticmethod
    def node_ip(index: int) -> str:
        return f"127.0.0.{index + 2}"

    @property
    def address(self) -> str:
        """The GCS address a driver joins (``ray.init(address=...)``, ``sao train --ray-address``)."""
        return f"{self.head_ip}:{self.gcs_port}"

    def env(self) -> dict[str, str]:
        """Environment of the cluster's nodes and of any driver that joins it (the cluster's token)."""
        env = {k: v for k, v in self.base_env.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                "RAY_USAGE_STATS_ENABLED": "0"}
        return env

    def _command(self, index: int, spec: NodeSpec) -> list[str]:
        command = [RAY_CLI, "start", "--block", "--disable-usage-stats", f"--node-ip-address={self.node_ip(index)}",
                   f"--temp-dir={self.temp_dir / 'ray'}", f"--num-cpus={spec.num_cpus}",
                   f"--resources={json.dumps(dict(spec.resources))}",
                   f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"]
        if index == 0:
            return [*command, "--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                    f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"]
        return [*command, f"--address={self.address}"]

    def start(self) -> LocalRayCluster:
        """Start the head, wait until its GCS listens, then start the worker nodes (returns at once;
        see :meth:`wait_ready`)."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others
        with os.fdopen(descriptor, "w") as token:
            token.write(secrets.token_hex(32))
        self.token_path.chmod(0o600)  # a file that existed keeps its mode through os.open
        (self.temp_dir / "logs").mkdir(exist_ok=True)
        for index, spec in enumerate(self.nodes):
            log_path = self.temp_dir / "logs" / f"node-{index}.log"
            with open(log_path, "wb") as output:
                self.processes.append(subprocess.Popen(
                    self._command(index, spec), env=self.env(), stdin=subprocess.DEVNULL, stdout=output,
                    stderr=subprocess.STDOUT, start_new_session=True))
            if index == 0:
                self._wait_for(lambda: port_in_use(self.gcs_port, self.head_ip), "the head's GCS to listen", 90)
        return self

    def _wait_for(self, condition, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for index, process in enumerate(self.processes):
                if process.poll() is not None:
                    raise RayClusterError(f"node {index} ({self.node_ip(index)}) exited with code "
                                          f"{process.returncode}; its output: {self.temp_dir / 'logs'}/node-{index}.log")
            if condition():
                return
            time.sleep(0.5)
        raise RayClusterError(f"waited {timeout_s:.0f} s for {what}; node output in {self.temp_dir / 'logs'}")

    def alive_nodes(self) -> list[dict]:
        """The nodes the GCS knows alive, asked by a short driver process (address, resources)."""
        probe = (f"import json, ray\nray.init(address={self.address!r}, log_to_driver=False)\n"
                 "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
                 "for n in ray.nodes() if n['Alive']]))\n")
        result = subprocess.run([sys.executable, "-c", probe], env=self.env(), capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            raise RayClusterError(f"could not list the nodes of {self.address}: {result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def wait_ready(self, timeout_s: float = 180.0) -> list[dict]:
        """Wait until every node has registered; returns :meth:`alive_nodes`."""
        deadline = time.monotonic() + timeout_s
        nodes: list[dict] = []
        while time.monotonic() < deadline:
            self._wait_for(lambda: True, "the nodes", 1)  # raises if a node process died
            nodes = self.alive_nodes()
            if len(nodes) == len(self.nodes):
                return nodes
            time.sleep(1.0)
        raise RayClusterError(f"{len(nodes)} of {len(self.nodes)} nodes registered after {timeout_s:.0f} s: {nodes}")

    def pids(self) -> set[int]:
        """PIDs of every process of the cluster's nodes (each ``ray start`` and its descendants)."""
        import psutil

        found: set[int] = set()
        for process in self.processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(process.pid)
                found |= {root.pid, *(child.pid for child in root.children(recursive=True))}
        return found

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the worker nodes, then the head: SIGTERM each node's process group (and every
        descendant found by PID), SIGKILL whatever is left after ``timeout_s``."""
        import psutil

        descendants = [psutil.Process(pid) for pid in self.pids() if psutil.pid_exists(pid)]
        for process in reversed(self.processes):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for child in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.terminate()
        _, alive = psutil.wait_procs(descendants, timeout=timeout_s)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout_s)

    def __enter__(self) -> LocalRayCluster:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
