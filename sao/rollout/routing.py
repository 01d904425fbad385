"""How a handle spreads rollouts over the rollout replicas: to the replica with the fewest requests this
handle has sent it that have not finished.

Serve's default router picks the shorter queue of two replicas from a cache that each replica's answer
overwrites with its own count at the moment it accepted a request. A driver sends a synchronous batch
all at once, and those answers lag the requests still in transit, so the cache says a loaded replica is
almost empty: measured on the peer benchmark's synchronous batch (128 rollouts, 2 replicas of 64 slots),
the split was as uneven as 38 and 90, and the requests beyond a replica's 64 slots waited for slots to
free while the other replica had slots idle. This router counts what it sent and what finished (Serve
calls both hooks for every request it sends, accepted or not) and never consults the lagging counts:
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

import collections
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
CHOICE_TTL_S = 1.0  # a choice that no send has followed within this long no longer counts


class LeastOutstandingRouter(FIFOMixin, RequestRouter):
    """Routes each request to the replica with the fewest of this handle's unfinished requests (ties:
    at random), in arrival order.

    Serve chooses replicas for several queued requests before it sends any of them, so a choice counts
    at once (a burst would otherwise all go to the replica that was emptiest before it); the send that
    follows takes its place. A choice that no send follows within :data:`CHOICE_TTL_S` (the router
    dropped it: a cancelled request, a replica that stopped answering) stops counting.
    """

    def initialize_state(self, **kwargs) -> None:
        self._sent: collections.Counter[ReplicaID] = collections.Counter()  # sent, not finished
        self._chosen: dict[ReplicaID, collections.deque[float]] = collections.defaultdict(collections.deque)

    def _load(self, replica_id: ReplicaID, now: float) -> int:
        chosen = self._chosen[replica_id]
        while chosen and now - chosen[0] > CHOICE_TTL_S:
            chosen.popleft()
        return self._sent[replica_id] + len(chosen)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        now = time.monotonic()
        load = {r.replica_id: self._load(r.replica_id, now) for r in candidate_replicas}
        open_ = [r for r in candidate_replicas if load[r.replica_id] < r.max_ongoing_requests]
        if not open_:
            return []  # every replica is full with this handle's requests: the router backs off and retries
        fewest = min(load[r.replica_id] for r in open_)
        chosen = random.choice([r for r in open_ if load[r.replica_id] == fewest])
        self._chosen[chosen.replica_id].append(now)
        return [[chosen]]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._sent[replica_id] += 1
        if self._chosen[replica_id]:
            self._chosen[replica_id].popleft()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._sent[replica_id] > 0:
            self._sent[replica_id] -= 1
