"""A local Prefect server as a child process, on the loopback interface only.

``sao ui``, the UI screenshot script and the deployment tests use it the same way::

    server = LocalPrefectServer(port=4200).start()   # `prefect server start --host 127.0.0.1`
    server.wait_healthy()                            # GET /api/health answers true
    ... PREFECT_API_URL=server.api_url ...
    server.stop()                                    # SIGTERM its process group, SIGKILL if it lingers

The server runs in its own session (process group), so a Ctrl-C in the terminal reaches only the
parent, which stops its served flow runs first and then the server, by PID. It never binds anything
but 127.0.0.1. Its SQLite database lives under ``PREFECT_HOME`` (``~/.prefect`` unless ``home`` is set).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["LOOPBACK", "LocalPrefectServer", "PrefectServerError", "free_port", "port_in_use", "prefect_env",
           "temporary_server"]

LOOPBACK = "127.0.0.1"

QUIET_PREFECT_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry calls from an offline machine
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class PrefectServerError(RuntimeError):
    """The server could not start, or did not become healthy in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when something accepts connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def prefect_env(api_url: str, home: str | Path | None = None, base: Mapping[str, str] | None = None
                ) -> dict[str, str]:
    """Environment for a process that talks to the server at ``api_url`` (a CLI, worker or runner)."""
    env = dict(os.environ if base is None else base)
    for key, value in QUIET_PREFECT_ENV.items():
        env.setdefault(key, value)
    env["PREFECT_API_URL"] = api_url
    env["PREFECT_UI_URL"] = api_url.removesuffix("/api")  # links to runs in the logs
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env


class LocalPrefectServer:
    """``prefect server start`` on ``127.0.0.1:port`` as a child process.

    Attributes:
        port: TCP port of the API and the UI.
        home: ``PREFECT_HOME`` of the server (its database); None keeps the user's.
        log_path: where the server's output goes (None: discarded).
        ui: serve the UI as well as the API.
        die_with_parent: on Linux, the server gets SIGTERM when this process dies, however it dies
            (a SIGKILL included): a temporary server never outlives its run.
    """

    def __init__(self, port: int = 4200, home: str | Path | None = None, log_path: str | Path | None = None,
                 *, ui: bool = True, die_with_parent: bool = False) -> None:
        self.port, self.home = port, home
        self.log_path = None if log_path is None else Path(log_path)
        self.ui, self.die_with_parent = ui, die_with_parent
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def env(self) -> dict[str, str]:
        """The environment clients of this server need (``PREFECT_API_URL``, quiet defaults)."""
        return prefect_env(self.api_url, self.home)

    def start(self) -> LocalPrefectServer:
        """Start the server (returns at once; see :meth:`wait_healthy`).

        Raises:
            PrefectServerError: the port is taken (another server, or another program).
        """
        if port_in_use(self.port):
            raise PrefectServerError(
                f"port {self.port} on {LOOPBACK} is already in use (another `sao ui` or Prefect server?): "
                "stop what listens there, or pick another port (sao ui --port N)")
        env = self.env()
        env.pop("PREFECT_API_URL")
        env.pop("PREFECT_UI_URL")  # the server serves the API; it is not a client of one
        env |= {"PREFECT_SERVER_API_HOST": LOOPBACK, "PREFECT_SERVER_API_PORT": str(self.port),
                "PREFECT_SERVER_UI_API_URL": self.api_url}
        if not self.ui:
            env["PREFECT_UI_ENABLED"] = "false"
        command = [sys.executable, "-m", "prefect", "server", "start", "--host", LOOPBACK, "--port", str(self.port),
                   "--analytics-off"]
        output = subprocess.DEVNULL if self.log_path is None else open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_term_on_parent_death if self.die_with_parent else None)
        finally:
            if output is not subprocess.DEVNULL:
                output.close()
        return self

    def healthy(self) -> bool:
        """True when ``GET /api/health`` answers."""
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 120.0) -> LocalPrefectServer:
        """Wait until the API answers (about 13 s on 2 idle cores; more on a busy machine).

        Raises:
            PrefectServerError: the process exited, or ``timeout_s`` passed.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise PrefectServerError(f"the Prefect server exited with code {self.process.returncode} while "
                                         f"starting{self._log_hint()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise PrefectServerError(f"the Prefect server at {self.url} was not healthy after {timeout_s:.0f} s"
                                 f"{self._log_hint()}")

    def _log_hint(self) -> str:
        return f" (its output: {self.log_path})" if self.log_path is not None else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group (its PID), then SIGKILL what is left after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)

    def __enter__(self) -> LocalPrefectServer:
        try:
            return self.start().wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _term_on_parent_death() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextlib.contextmanager
def temporary_server(log_path: str | Path | None = None) -> Iterator[str | None]:
    """A Prefect API for this process: the configured one (``PREFECT_API_URL``) if set, else a
    temporary local server (no UI) on a free port, stopped on exit; yields its API URL (None: the
    configured one).

    This takes the place of Prefect's ephemeral mode for ``sao train``: Prefect starts its temporary
    server in the caller's process group, so the terminal's Ctrl-C (sent to the whole group) stops it
    under the running flow, which then cannot report its end. This one runs in a session of its own
    and dies with this process (:attr:`LocalPrefectServer.die_with_parent`)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value():
        yield None
        return
    with LocalPrefectServer(port=free_port(), log_path=log_path, ui=False, die_with_parent=True) as server, \
            temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        try:
            yield server.api_url
        finally:
            _drain_prefect_clients()


def _drain_prefect_clients(timeout_s: float = 10.0) -> None:
    """Send the logs and events Prefect's client still holds while the temporary server lives: its
    workers drain at interpreter exit otherwise, after the server is gone, and retry for ever."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)
