"""Shared fixtures: a tiny version-0 policy directory built from code (no model hub)."""

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
