"""Starting and reaching the engines: a local Ray instance by default, a cluster by address.

Defaults run on a laptop: a local Ray with the machine's CPUs, no dashboard, Serve without an HTTP
proxy (rollouts are called through deployment handles). Past one machine, set ``address`` to
``"auto"`` or ``"ray://host:10001"``; nothing else in the code changes (docs/SCALING.md).

Secure defaults of a local instance:

* **Loopback only.** Every Ray process of a local instance (GCS, raylet, object manager, workers,
  agents, dashboard) listens on ``127.0.0.1``. Ray 2.60 turns ``127.0.0.1`` given as the node
  address into the machine's routable address (``services.resolve_ip_for_localhost``) unless
  multi-node clusters are disabled, which is what Ray does on macOS and Windows laptops
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). :func:`init_ray` disables them for the start of a local
  instance only (in this process and the Ray processes it spawns), so the node's address stays
  ``127.0.0.1`` and its gRPC servers bind there instead of on every interface. A local instance takes
  no other nodes anyway; to build a cluster use ``ray start`` (see :mod:`sao.ray_cluster`).
* **Token authentication on.** Ray 2.60 enables it for a new local instance unless
  ``RAY_AUTH_MODE=disabled`` (it generates ``~/.ray/auth_token`` if missing); nothing here turns it
  off, :func:`init_ray` warns when the environment does, and ``tests/test_runtime.py`` checks that a
  client with a wrong token is refused. (Setting ``RAY_AUTH_MODE=token`` ourselves before
  ``ray.init`` would be wrong in 2.60: the driver's cached configuration would stay in the mode read
  at import while the new instance enforces tokens, and the driver could not connect.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import tempfile
from collections.abc import Iterator

__all__ = ["LOOPBACK", "RayConfig", "init_ray", "shutdown_ray"]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
_AUTH_ENV = "RAY_AUTH_MODE"

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
        include_dashboard: start the dashboard with a local instance (costs memory; it binds the
            loopback interface like the rest of the instance).
        log_to_driver: forward worker logs to the driver's stdout.
        node_ip_address: the address a local instance's processes advertise and listen on:
            ``127.0.0.1`` (nothing outside this machine can reach them). Another address opens the
            instance's ports on that interface: do it only with token authentication on and a
            firewall in front (docs/SCALING.md, "What to open"). Ignored with ``address`` (a cluster
            node's address is set by ``ray start --node-ip-address``).
    """

    address: str | None = None
    num_cpus: int | None = None
    namespace: str = "sao"
    include_dashboard: bool = False
    log_to_driver: bool = False
    node_ip_address: str = LOOPBACK


def _clear_stale_local_cluster_marker() -> None:
    """A killed ``ray start`` can leave ``ray_current_cluster`` behind; a local init then fails with
    "When connecting to an existing cluster, num_cpus ... must not be provided". Remove the marker
    when no Ray session is actually alive."""
    for marker in glob.glob(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")):
        session = os.path.join(os.path.dirname(marker), "session_latest")
        if not os.path.exists(os.path.join(session, "sockets")):
            log.warning("removing stale Ray cluster marker %s", marker)
            os.remove(marker)


def _is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


@contextlib.contextmanager
def _single_node_addressing(node_ip_address: str) -> Iterator[None]:
    """While a local instance starts, keep a loopback ``node_ip_address`` as it is (see the module
    docstring): Ray's switch for multi-node clusters is off in this process and in the Ray processes
    started meanwhile, and restored afterwards."""
    if not _is_loopback(node_ip_address):
        yield
        return
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_CLUSTERS_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTERS_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_CLUSTERS_ENV, None)
        else:
            os.environ[_CLUSTERS_ENV] = saved_env


def _warn_if_token_auth_off() -> None:
    """Ray enables token authentication for a local instance unless the environment turns it off."""
    mode = os.environ.get(_AUTH_ENV)
    if mode is not None and mode.lower() != "token":
        log.warning("%s=%s: Ray token authentication is OFF; anything that reaches this instance's ports can "
                    "run code in it. Unset %s to turn it back on.", _AUTH_ENV, mode, _AUTH_ENV)


def init_ray(config: RayConfig | None = None) -> None:
    """Connect to Ray (idempotent): start a local instance (on ``config.node_ip_address``, loopback by
    default, with token authentication) or join ``config.address``."""
    import ray

    config = config or RayConfig()
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    kwargs: dict[str, object] = {"namespace": config.namespace, "log_to_driver": config.log_to_driver}
    if config.address is not None:
        ray.init(address=config.address, **kwargs)
        return
    _clear_stale_local_cluster_marker()
    _warn_if_token_auth_off()
    kwargs |= {"num_cpus": config.num_cpus, "include_dashboard": config.include_dashboard,
               "_node_ip_address": config.node_ip_address}
    with _single_node_addressing(config.node_ip_address), _quiet_expected_token_auth_note():
        ray.init(**kwargs)


@contextlib.contextmanager
def _quiet_expected_token_auth_note():
    """Ray warns at every start of a local instance that "token authentication is enabled"; that is
    what this module relies on (see its docstring), so the note is not printed. A token turned off is
    still warned about (:func:`_warn_if_token_auth_off`)."""
    note = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = note.level
    note.setLevel(logging.ERROR)
    try:
        yield
    finally:
        note.setLevel(level)


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
