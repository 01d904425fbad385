"""How a handle spreads rollouts over the rollout replicas: to the replica with the fewest requests this
handle has sent it that have not finished.

Serve's default router picks the shorter queue of two replicas from a cache that each replica's answer
overwrites with its own count at the moment it accepted a request. A driver sends a synchronous batch
all at once, and those answers lag the requests still in transit, so the cache says a loaded replica is
almost empty: measured on the peer benchmark's synchronous batch (128 rollouts, 2 replicas of 64 slots),
the split was as uneven as 38 and 90, and the requests beyond a replica's 64 slots waited for slots to
free while the other replica had slots idle. This router counts what it sent and what finished (Serve
calls both hooks for every request it sends, accepted or not; the completion hook runs on the router's
thread shortly after the caller has the result) and never consults the lagging counts:
the same batches split 64 / 64, and a test's bursts of 128 split within 60-68 (tests/rollout/
test_routing.py). On 2 shared CPU cores this made no measurable difference to throughput (the CPU an
idle replica leaves goes to the busy one; docs/HISTORY.md); it matters where each replica has its own
hardware, and the busiest one sets a synchronous batch's time.

It is a Serve request router (``RequestRouterConfig.request_router_class``), so every handle of the
deployment uses it; each handle counts its own requests, as Serve's default router does. A replica that
holds ``max_ongoing_requests`` of this handle's requests is not chosen (the request waits, as with the
default router, rather than being sent to be refused).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import random
import time

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

__all__ = ["ROUTER_PATH", "LeastOutstandingRouter"]

ROUTER_PATH = "sao.rollout.routing.LeastOutstandingRouter"
CHOICE_TTL_S = 10.0  # a choice that no send has followed within this long no longer counts (a backstop)


@dataclasses.dataclass
class _Choice:
    """A replica chosen for a request that has not been sent yet."""

    replica_id: ReplicaID
    request: PendingRequest | None
    at: float

    @property
    def future(self) -> asyncio.Future | None:
        """The request's routing future (None for a choice made for no request)."""
        return self.request.future if self.request is not None else None

    def dropped(self, now: float) -> bool:
        """Whether the choice no longer stands: its request was cancelled, or it is older than the TTL."""
        return now - self.at > CHOICE_TTL_S or (self.future is not None and self.future.cancelled())

    def given(self) -> ReplicaID | None:
        """The replica Serve gave the choice's request (the send to it follows), or None while it has none.

        It need not be the replica chosen: Serve hands each replica chosen to the oldest request still
        waiting, which may be another request than the one it was chosen for (``FIFOMixin``).
        """
        future = self.future
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result().replica_id

    def counts_on(self) -> ReplicaID:
        """The replica the choice loads: the one its request was given, else the one chosen."""
        return self.given() or self.replica_id


class LeastOutstandingRouter(FIFOMixin, RequestRouter):
    """Routes each request to the replica with the fewest of this handle's unfinished requests (ties:
    at random), in arrival order.

    Serve chooses replicas for several queued requests before it sends any of them, so a choice counts
    at once (a burst would otherwise all go to the replica that was emptiest before it), until the send
    that follows takes its place. A choice is kept per request: when Serve asks again for the same
    request (the replica it was given turned out full, or its queue-length probe failed), the new choice
    replaces the old one. A choice stops counting when its request is cancelled, or, as a backstop for a
    send that never came, after :data:`CHOICE_TTL_S` (long: on a loaded machine a send can follow its
    choice late, and a burst's early choices must not stop counting while its later ones are made).
    """

    def initialize_state(self, **kwargs) -> None:
        self._sent: collections.Counter[ReplicaID] = collections.Counter()  # sent, not finished
        self._chosen: dict[int, _Choice] = {}  # by request (id of its PendingRequest), in choice order
        self._unnamed = itertools.count(-1, -1)  # keys of choices made for no request

    def _load(self, replica_id: ReplicaID) -> int:
        return self._sent[replica_id] + sum(1 for c in self._chosen.values() if c.counts_on() == replica_id)

    def _drop_stale(self, now: float) -> None:
        for key in [key for key, choice in self._chosen.items() if choice.dropped(now)]:
            del self._chosen[key]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        now = time.monotonic()
        key = id(pending_request) if pending_request is not None else next(self._unnamed)
        self._chosen.pop(key, None)  # asked again for the same request: its earlier choice was not sent
        self._drop_stale(now)
        load = {r.replica_id: self._load(r.replica_id) for r in candidate_replicas}
        open_ = [r for r in candidate_replicas if load[r.replica_id] < r.max_ongoing_requests]
        if not open_:
            return []  # every replica is full with this handle's requests: the router backs off and retries
        fewest = min(load[r.replica_id] for r in open_)
        chosen = random.choice([r for r in open_ if load[r.replica_id] == fewest])
        self._chosen[key] = _Choice(chosen.replica_id, pending_request, now)
        return [[chosen]]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._sent[replica_id] += 1
        # The request sent is one that Serve gave this replica; any one of their choices stands for it
        # (they count alike, on this replica). Without one, the oldest choice of this replica made for no
        # request goes; a choice whose request is still waiting for a replica stays.
        given = [key for key, choice in self._chosen.items() if choice.given() == replica_id]
        sent = given or [key for key, choice in self._chosen.items()
                         if choice.request is None and choice.replica_id == replica_id]
        if sent:
            del self._chosen[sent[0]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._sent[replica_id] > 0:
            self._sent[replica_id] -= 1
