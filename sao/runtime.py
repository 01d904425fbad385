"""Starting and reaching the engines: a local Ray instance by default, a cluster by address.

Defaults run on a laptop: a local Ray with the machine's CPUs, no dashboard, Serve without an HTTP
proxy (rollouts are called through deployment handles). Past one machine, set ``address`` to
``"auto"`` or ``"ray://host:10001"``; nothing else in the code changes.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import tempfile

__all__ = ["RayConfig", "init_ray", "shutdown_ray"]

log = logging.getLogger(__name__)

# Serve's default replica-queue probe deadline floods logs with warnings under bursts on small machines.
_QUIET_ENV = {
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "1",
}


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Where Ray runs.

    Attributes:
        address: None starts a local instance; ``"auto"`` or ``"ray://host:port"`` joins a cluster.
        num_cpus: CPUs of a local instance (None = all of the machine's).
        namespace: Ray namespace of the run's named actors and Serve apps.
        include_dashboard: start the dashboard with a local instance (costs memory).
        log_to_driver: forward worker logs to the driver's stdout.
    """

    address: str | None = None
    num_cpus: int | None = None
    namespace: str = "sao"
    include_dashboard: bool = False
    log_to_driver: bool = False


def _clear_stale_local_cluster_marker() -> None:
    """A killed ``ray start`` can leave ``ray_current_cluster`` behind; a local init then fails with
    "When connecting to an existing cluster, num_cpus ... must not be provided". Remove the marker
    when no Ray session is actually alive."""
    for marker in glob.glob(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")):
        session = os.path.join(os.path.dirname(marker), "session_latest")
        if not os.path.exists(os.path.join(session, "sockets")):
            log.warning("removing stale Ray cluster marker %s", marker)
            os.remove(marker)


def init_ray(config: RayConfig | None = None) -> None:
    """Connect to Ray (idempotent): start a local instance or join ``config.address``."""
    import ray

    config = config or RayConfig()
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    kwargs: dict[str, object] = {"namespace": config.namespace, "log_to_driver": config.log_to_driver}
    if config.address is None:
        _clear_stale_local_cluster_marker()
        kwargs |= {"num_cpus": config.num_cpus, "include_dashboard": config.include_dashboard}
    else:
        kwargs["address"] = config.address
    ray.init(**kwargs)


def shutdown_ray() -> None:
    """Stop Serve (if running) and disconnect from Ray."""
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # Serve was never started in this instance
        pass
    ray.shutdown()
