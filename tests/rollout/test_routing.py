"""The rollout app's request router: a burst of requests from one handle lands evenly on the replicas
(Serve's default router split a synchronous batch of 128 as unevenly as 38 and 90; run here with
it, this test fails)."""

import asyncio
import collections

import pytest

from sao.rollout.routing import ROUTER_PATH
from sao.rollout.serve import RolloutConfig, deployment_options


def test_the_rollout_app_routes_with_the_balancing_router_unless_told_otherwise():
    assert deployment_options(RolloutConfig(policy_path="p"))["request_router_config"].request_router_class \
        == ROUTER_PATH
    assert "request_router_config" not in deployment_options(RolloutConfig(policy_path="p", request_router=None))


@pytest.mark.ray
def test_a_burst_lands_evenly_on_the_replicas_and_the_counts_return_to_zero(ray_session):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=2, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1},
                      request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH))
    class Slow:
        async def __call__(self) -> str:
            await asyncio.sleep(0.3)
            return serve.get_replica_context().replica_id.unique_id

    handle = serve.run(Slow.bind(), name="routing-test", route_prefix=None)
    try:
        [r.result(timeout_s=60) for r in [handle.remote() for _ in range(8)]]  # the handle learns both replicas
        for _ in range(3):  # the 128 requests are in flight together, as a synchronous batch's rollouts are
            split = collections.Counter(r.result(timeout_s=60) for r in [handle.remote() for _ in range(128)])
            assert len(split) == 2 and all(60 <= n <= 68 for n in split.values()), split
    finally:
        serve.delete("routing-test")
