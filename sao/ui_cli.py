"""``sao ui`` (and ``make ui``): the Prefect UI on http://127.0.0.1:4200 with the flows ready to run.

One command, two processes:

1. a Prefect server (``prefect server start --host 127.0.0.1``, a child process; UI and API);
2. this process serves the deployments of :mod:`flows.deployments` (``<flow>/ui`` for each flow of
   its ``FLOWS``: ``train``, ``evaluate``, ``replay``, ``pretrain_value``, ``online_shift``) with a
   Prefect ``Runner``, the engine of ``prefect.serve``: no work pool, no worker.
   A run started from the UI's form executes as a child process of this one, in this directory.

Ctrl-C (or SIGTERM) stops the runner, which cancels the flow runs in flight (each in its own process
group), then stops the server by its PID. Nothing listens beyond 127.0.0.1. For a shared server and
workers, use ``prefect.yaml`` instead (see README.md).
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from sao.cli_common import fail, require_flows

__all__ = ["ui"]

DEFAULT_PORT = 4200


def _serve(api_url: str, limit: int) -> None:
    """Serve the deployments until SIGINT / SIGTERM (both stop the runner gracefully)."""
    import asyncio

    from prefect.runner import Runner
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import served_deployments

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        runner = Runner(name="sao-ui", limit=limit, pause_on_shutdown=False)
        for deployment in served_deployments():
            runner.add_deployment(deployment)
        signal.signal(signal.SIGINT, runner.handle_sigterm)  # Ctrl-C: the same graceful stop as SIGTERM
        asyncio.run(runner.start())


def ui(
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port of the UI and API on 127.0.0.1.")]
    = DEFAULT_PORT,
    limit: Annotated[int, typer.Option(
        "--limit", min=1, help="Flow runs executed at once (others wait in the queue; 1 suits 2 cores).")] = 1,
) -> None:
    """Start a local Prefect server on 127.0.0.1 and serve the flows: open the printed URL, pick
    Deployments -> train/ui -> Run -> Custom run, and start a training run from the form.
    Ctrl-C stops the runs in flight, the runner and the server."""
    require_flows("sao ui")
    from flows.deployments import FLOWS, SERVED_NAME
    from sao.prefect_server import LocalPrefectServer, PrefectServerError

    log_path = Path(tempfile.gettempdir()) / f"sao-ui-server-{port}.log"
    server = LocalPrefectServer(port=port, log_path=log_path)
    typer.echo(f"sao ui: starting the Prefect server on {server.url} (log: {log_path}) ...")
    try:  # whatever happens from here on (Ctrl-C while starting too), the server is stopped by its PID
        try:
            server.start().wait_healthy()
        except PrefectServerError as error:
            raise fail(str(error)) from None
        os.environ.update(server.env())  # this process and the flow runs it starts talk to this server
        served = ", ".join(f"{name}/{SERVED_NAME}" for name in FLOWS)
        typer.echo(f"sao ui: server pid {server.pid} is up. Open {server.url} -> Deployments -> "
                   f"train/{SERVED_NAME} -> Run.\nsao ui: serving {served} from {Path.cwd()} (pid {os.getpid()}); "
                   "Ctrl-C stops everything.")
        _serve(server.api_url, limit)
    finally:
        if server.pid is not None:
            typer.echo(f"sao ui: stopping the Prefect server (pid {server.pid}) ...")
            server.stop()
            typer.echo("sao ui: stopped.")
