"""The flows that get deployments, in one place: ``sao ui`` serves these, ``prefect.yaml`` deploys the
same flows to the ``sao-local`` process work pool (a test checks that the two lists agree).

Served deployments are named ``<flow>/ui``; the work-pool deployments of ``prefect.yaml`` are named
``<flow>/sao-local``. The served ones load the flows by module path (``flows.train.train``) and run in
the directory ``sao ui`` was started in; the work-pool ones name the flows by file path
(``flows/train.py:train``) and run in the directory ``prefect deploy`` ran in (``prefect.yaml`` has no
``pull`` step). Relative ``workdir`` and ``lake.root`` settings resolve against that directory.
"""

from __future__ import annotations

import importlib

from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.flows import Flow

__all__ = ["FLOWS", "SERVED_NAME", "load_flow", "served_deployments"]

SERVED_NAME = "ui"

FLOWS: dict[str, str] = {
    "train": "flows.train:train",
    "evaluate": "flows.evaluate:evaluate",
    "replay": "flows.replay:replay",
    "pretrain_value": "flows.pretrain_value:pretrain_value_flow",
    "online_shift": "flows.online_shift:online_shift",
}
"""Flow name -> ``module:function``."""


def load_flow(name: str) -> Flow:
    """The flow object registered under ``name``."""
    module, _, attribute = FLOWS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def served_deployments(name: str = SERVED_NAME) -> list[RunnerDeployment]:
    """A deployment per flow of :data:`FLOWS`, for ``prefect.serve`` / a ``Runner``."""
    deployments = []
    for flow_name in FLOWS:
        flow = load_flow(flow_name)
        summary = " ".join((flow.description or "").strip().split("\n\n")[0].split()) or None
        deployments.append(flow.to_deployment(name=name, description=summary, tags=["sao"],
                                              entrypoint_type=EntrypointType.MODULE_PATH))
    return deployments
