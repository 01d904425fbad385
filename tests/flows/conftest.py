"""The flows' tests run against a temporary Prefect server of their own (one per test module)."""

import pytest


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
