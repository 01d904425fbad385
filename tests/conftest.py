"""Shared fixtures: a tiny version-0 policy directory built from code (no model hub)."""

import sys

import pytest

from sao.models.policy import build_policy, save_policy
from sao.models.tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory, tokenizer):
    """A randomly initialised tiny Qwen3-MoE policy with the project's tokenizer, as version 0."""
    path = tmp_path_factory.mktemp("policy") / "v0"
    save_policy(build_policy(seed=0), path, tokenizer, policy_version=0)
    return path


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the tests marked ``ray`` (started once, about 8 s)."""
    from sao.runtime import RayConfig, init_ray, shutdown_ray

    init_ray(RayConfig(num_cpus=2, namespace="sao-tests"))
    yield
    shutdown_ray()


@pytest.fixture(scope="session", autouse=True)
def _prefect_temporary_servers_stopped():
    """A flow called outside a harness makes Prefect start a temporary server, which it stops at
    interpreter exit, when pytest has closed the stream its logger writes to (a "--- Logging error ---"
    traceback after the summary). Stopped here instead, while the streams are open."""
    yield
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        for instance in list(server.SubprocessASGIServer._instances.values()):
            instance.stop()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``pytest -n 2 --dist loadgroup``), the tests marked
    ``ray`` run one after another on one worker, as in a run without workers: they share the
    session's local Ray instance (:func:`ray_session`) or start Ray of their own, and a second Ray
    instance beside it would take the same 2 CPUs (and write the same local-cluster address file)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
