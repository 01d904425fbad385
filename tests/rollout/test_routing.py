"""The rollout app's request router: a burst of requests from one handle lands evenly on the replicas
(Serve's default router split a synchronous batch of 128 as unevenly as 38 and 90; run here with
it, this test fails)."""

import asyncio
import collections
import time
import types

import pytest

from sao.rollout import routing
from sao.rollout.routing import ROUTER_PATH, LeastOutstandingRouter
from sao.rollout.serve import RolloutConfig, deployment_options


class _Clock:
    """``time.monotonic`` for the router, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(routing.time, "monotonic", clock)
    return clock


def _router() -> LeastOutstandingRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = LeastOutstandingRouter(deployment_id=DeploymentID(name="rollout", app_name="test"),
                                    handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    return router


def _request(n: int):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))


REPLICAS = [types.SimpleNamespace(replica_id=name, max_ongoing_requests=64) for name in ("a", "b")]


async def _choose(router: LeastOutstandingRouter, request) -> str:
    [[replica]] = await router.choose_replicas(REPLICAS, request)
    return replica.replica_id


def _give(request, replica_id: str) -> None:
    """Serve hands ``request`` the replica (its routing future's result)."""
    request.future.set_result(next(r for r in REPLICAS if r.replica_id == replica_id))


def test_a_burst_chosen_before_any_send_splits_evenly_however_late_the_sends_come(clock):
    """Sends that come late after their choices (a loaded machine) leave the burst's choices counting: with
    choices timed out after 1 s (the router before), one run of this burst split 65 / 63."""

    async def burst():
        router = _router()
        requests = [_request(n) for n in range(128)]
        chosen = []
        for request in requests:  # Serve chooses for the queued requests, then sends them as it gets to them
            chosen.append(await _choose(router, request))
            clock.now += 0.02  # 2.5 s for the burst's choices
        for request, replica in zip(requests, chosen, strict=True):
            _give(request, replica)
            router.on_send_request(replica)
        return collections.Counter(chosen), router

    split, router = asyncio.run(burst())
    assert split == {"a": 64, "b": 64}
    assert router._load("a") == router._load("b") == 64  # every choice became a send, none counts twice


def test_a_request_chosen_again_replaces_its_earlier_choice(clock):
    async def run():
        router = _router()
        router.on_send_request("b")  # b holds one request: the next choice is a
        request = _request(0)
        assert await _choose(router, request) == "a"
        assert await _choose(router, request) == "a"  # Serve asked again (a full replica, a failed probe)
        return router

    router = asyncio.run(run())
    assert (router._load("a"), router._load("b")) == (1, 1)


def test_a_replica_chosen_for_one_request_and_given_to_an_older_one_counts_where_it_was_given(clock):
    """Serve hands a replica chosen for one request to the oldest request still waiting (``FIFOMixin``),
    whose own choice may have been another replica: that choice counts on the replica given, and the send
    retires it. (Counted on the replica chosen, such choices outlived their sends: one cluster run's
    warm-up of 8 requests left 4 behind, and the next bursts split 66 / 62.)"""

    async def run():
        router = _router()
        older, newer = _request(0), _request(1)
        first = await _choose(router, older)
        second = await _choose(router, newer)
        assert {first, second} == {"a", "b"}
        _give(older, second)  # the choice made for ``newer`` went to ``older``
        assert (router._load(first), router._load(second)) == (0, 2)  # ``older``'s choice now loads ``second``
        router.on_send_request(second)
        assert (router._load(first), router._load(second)) == (0, 2)  # ``newer``'s choice still stands
        assert [c.request for c in router._chosen.values()] == [newer]  # the send retired ``older``'s
        assert await _choose(router, newer) == first  # Serve asks again for ``newer``: its choice is replaced
        _give(newer, first)
        router.on_send_request(first)
        assert not router._chosen and router._sent == {"a": 1, "b": 1}
        router.on_request_completed(first, "i1")
        router.on_request_completed(second, "i0")
        return router

    router = asyncio.run(run())
    assert router._load("a") == router._load("b") == 0 and not router._chosen


def test_a_cancelled_request_and_an_old_choice_stop_counting_and_a_completion_frees_its_replica(clock):
    async def run():
        router = _router()
        cancelled, stranded = _request(0), _request(1)
        await _choose(router, cancelled)
        await _choose(router, stranded)
        assert router._load("a") + router._load("b") == 2
        cancelled.future.cancel()
        await _choose(router, _request(2))  # a choice looks at the others' state first
        assert router._load("a") + router._load("b") == 2
        clock.now += routing.CHOICE_TTL_S + 1  # no send followed ``stranded``'s choice
        replica = await _choose(router, sent := _request(3))
        assert router._load("a") + router._load("b") == 1
        _give(sent, replica)
        router.on_send_request(replica)
        assert router._load(replica) == 1
        router.on_request_completed(replica, "i3")
        return router, replica

    router, replica = asyncio.run(run())
    assert router._load(replica) == 0


def test_the_rollout_app_routes_with_the_balancing_router_unless_told_otherwise():
    assert deployment_options(RolloutConfig(policy_path="p"))["request_router_config"].request_router_class \
        == ROUTER_PATH
    assert "request_router_config" not in deployment_options(RolloutConfig(policy_path="p", request_router=None))


def _wait_for_idle(router: LeastOutstandingRouter, timeout_s: float = 30.0) -> None:
    """Wait until the router counts no request of the handle's as unfinished (its counts return to zero)."""
    deadline = time.monotonic() + timeout_s
    while (loads := {r: router._load(r) for r in router.curr_replicas}) and any(loads.values()):
        assert time.monotonic() < deadline, f"the router still counts unfinished requests: {loads}"
        time.sleep(0.05)


@pytest.mark.ray
def test_a_burst_lands_evenly_on_the_replicas_and_the_counts_return_to_zero(ray_session):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=2, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1},
                      request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH))
    class Slow:
        async def __call__(self) -> str:
            # Longer than a loaded machine takes to send a burst: were some of its requests to finish while
            # the rest were still being sent, the router would rightly favour the replica that freed more.
            await asyncio.sleep(2.0)
            return serve.get_replica_context().replica_id.unique_id

    handle = serve.run(Slow.bind(), name="routing-test", route_prefix=None)
    try:
        [r.result(timeout_s=60) for r in [handle.remote() for _ in range(8)]]  # the handle learns both replicas
        router = handle._router._asyncio_router.request_router  # the handle's own router (Ray 2.60's layout)
        assert isinstance(router, LeastOutstandingRouter)
        for _ in range(3):  # the 128 requests are in flight together, as a synchronous batch's rollouts are
            # Serve runs the completion hooks on the router's thread after the results reach the caller: on
            # a loaded machine a few are still queued when the next burst starts, and those requests rightly
            # count as unfinished. A synchronous batch starts after an update. (A CI run split 71 / 57: from this, or
            # from the choices the router left behind before the fix tested above.)
            _wait_for_idle(router)
            split = collections.Counter(r.result(timeout_s=60) for r in [handle.remote() for _ in range(128)])
            assert len(split) == 2 and all(60 <= n <= 68 for n in split.values()), split
        _wait_for_idle(router)
    finally:
        serve.delete("routing-test")
