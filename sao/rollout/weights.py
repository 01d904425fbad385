"""Weight publication through the Ray object store.

The trainer puts a state dict into the object store once per version and tells the broker, a small
named (async) actor. Every rollout replica keeps one request open at the broker that returns as soon as
a newer version is published (or after a wait limit, to start again); it then fetches the weights
(zero-copy for tensors on the same node) and hands them to its engine, which swaps them in between
decode steps. Nothing polls on a timer, so an idle run costs the replicas nothing. Replicas acknowledge the version they run, so the publisher can measure how long a
version takes to reach all of them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

__all__ = ["WeightBroker", "WeightSubscriber", "broker_name", "get_or_create_broker", "publish_weights"]

log = logging.getLogger(__name__)


def broker_name(app_name: str) -> str:
    return f"{app_name}-weights"


class _Signal:
    """Wakes the broker's current waiters at once; a wait that starts later waits for the next wake."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    async def wait(self, timeout_s: float) -> None:
        """Until the next :meth:`wake`, or ``timeout_s``."""
        if self._event is None:
            self._event = asyncio.Event()
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except TimeoutError:
            pass

    def wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None


class WeightBroker:
    """Holds the newest (version, object ref), the versions replicas report, and how many
    trajectories the trainer has passed over without training on them (a Ray actor; the rollout
    driver's staleness gate gives their places back: :mod:`sao.rollout.staleness`)."""

    def __init__(self) -> None:
        self._version = -1
        self._skipped = 0
        self._refs: list = []
        self._published_at: dict[int, float] = {}
        self._acks: dict[str, tuple[int, float]] = {}
        self._newer = _Signal()  # on each publish and reset
        self._stop_requested = False
        self._commits = 0  # trajectory commits announced since the last reset
        self._committed = _Signal()  # on each announced commit, stop request and reset
        self._demands = 0  # waits for rows the trainer has announced (see wait_demand)
        self._wanted = 0  # rows the trainer waits for in its newest wait
        self._demanded = _Signal()  # on each announced wait for rows, and reset

    async def publish(self, version: int, refs: list) -> int:
        """Announce ``version``.

        Publishing the version already announced again is allowed and replaces its weights: a resumed
        trainer re-publishes the version it resumed at, which the run has just :meth:`reset` the broker
        to. An older version is refused."""
        if version < self._version:
            raise ValueError(f"version {version} is older than the published version {self._version}")
        if version == self._version and self._refs and version in self._published_at:
            self._refs = refs  # the same version again: replicas already run it; keep the first time
            return version
        self._version, self._refs = version, refs
        self._published_at[version] = time.time()
        self._newer.wake()
        return version

    async def reset(self, version: int) -> None:
        """Start over at ``version`` (a run starting or resuming with this app name): nothing published,
        no acknowledgements. Waiting replicas are woken to look again."""
        self._version, self._refs = version, []
        self._skipped = 0
        self._stop_requested = False
        self._commits = 0
        self._committed.wake()
        self._demands = self._wanted = 0
        self._demanded.wake()
        self._published_at.clear()
        self._acks.clear()
        self._newer.wake()

    async def wait_newer(self, version: int, timeout_s: float) -> tuple[int, list]:
        """The newest (version, refs) as soon as it is newer than ``version``, or after ``timeout_s``."""
        if self._version <= version:
            await self._newer.wait(timeout_s)
        return self._version, self._refs

    async def wait_version(self, version: int, timeout_s: float) -> int:
        """The newest version as soon as it is newer than ``version``, or after ``timeout_s`` (the rollout
        driver waits here while its gate is closed, instead of asking again and again)."""
        return (await self.wait_newer(version, timeout_s))[0]

    def rows_committed(self) -> None:
        """The rollout writer committed trajectories: a trainer waiting for its batch looks at once."""
        self._commits += 1
        self._committed.wake()

    async def wait_committed(self, seen: int, timeout_s: float, wanted: int = 0) -> int:
        """The count of announced commits as soon as it exceeds ``seen`` (or a stop is requested), or
        after ``timeout_s``: the trainer waits here for its batch between reads of the lake. ``wanted``:
        the rows it still needs, passed on to the rollout writer while it waits (:meth:`wait_demand`)."""
        if self._commits <= seen and not self._stop_requested:
            if wanted > 0:
                self._demands += 1
                self._wanted = wanted
                self._demanded.wake()
            await self._committed.wait(timeout_s)
        return self._commits

    async def wait_demand(self, seen: int, timeout_s: float) -> tuple[int, int]:
        """(waits announced, rows wanted in the newest) as soon as the trainer has announced a wait for
        rows beyond the first ``seen``, or after ``timeout_s``: the pipeline waits here beside the rollout
        writer and asks it to commit the rows the trainer waits for the moment it holds them
        (:meth:`sao.lake.writer.TrajectoryWriter.demand`), instead of at its batch size or age."""
        if self._demands <= seen:
            await self._demanded.wait(timeout_s)
        return self._demands, self._wanted

    def latest(self) -> tuple[int, list]:
        return self._version, self._refs

    def latest_version(self) -> int:
        return self._version

    def add_skipped(self, count: int) -> None:
        """The trainer passed over ``count`` more trajectories (too stale when it reached them, or
        without an action token). Reported the moment it sees them, while it waits for its batch: the
        driver's gate gives their places back, and a batch that lacks them can still fill."""
        if count < 0:
            raise ValueError(f"a skipped count is never negative, got {count}")
        self._skipped += count

    def skipped_total(self) -> int:
        """Trajectories the trainer passed over since the last :meth:`reset` (a count that only grows,
        also across trainer restarts)."""
        return self._skipped

    def request_stop(self) -> None:
        """Ask the run's trainer to stop after the step it is in (a Ctrl-C of the run: the trainer
        polls :meth:`stop_requested` between steps and while it waits for a batch)."""
        self._stop_requested = True
        self._committed.wake()

    def stop_requested(self) -> bool:
        return self._stop_requested

    def ack(self, replica_id: str, version: int) -> None:
        self._acks[replica_id] = (version, time.time())

    def replica_versions(self) -> dict[str, int]:
        return {replica: version for replica, (version, _) in self._acks.items()}

    def publish_latency(self, version: int, replicas: int) -> float | None:
        """Seconds from publication of ``version`` until ``replicas`` replicas run it (None if not yet)."""
        published = self._published_at.get(version)
        reached = sorted(at for v, at in self._acks.values() if v >= version)
        if published is None or len(reached) < replicas:
            return None
        return reached[replicas - 1] - published


def get_or_create_broker(app_name: str):
    """The broker actor of a Serve app (created on first use, detached so it outlives a driver)."""
    import ray

    actor = ray.remote(num_cpus=0)(WeightBroker)
    return actor.options(name=broker_name(app_name), get_if_exists=True, lifetime="detached").remote()


def publish_weights(broker, version: int, weights: Mapping[str, torch.Tensor]) -> float:
    """Put ``weights`` into the object store and announce them (:meth:`WeightBroker.publish`); returns
    seconds spent."""
    import ray

    start = time.perf_counter()
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights.items()}
    ref = ray.put(state)
    ray.get(broker.publish.remote(version, [ref]))
    return time.perf_counter() - start


class WeightSubscriber:
    """Waits at the broker from a replica and applies newer weights through ``apply(version, weights)``.

    Args:
        wait_s: longest one request to the broker waits for a newer version before it is renewed.
        apply_timeout_s: longest wait for the engine to run a version handed to it (the engine's own
            longest weight update: a vLLM reload of a large model takes minutes); after it, the
            version is handed again. Shorter than the update itself, it was applied twice (a second
            staged copy and reload of the same weights).
    """

    def __init__(self, broker, replica_id: str, current_version: Callable[[], int],
                 apply: Callable[[int, Mapping[str, torch.Tensor]], None], wait_s: float = 1.0,
                 apply_timeout_s: float = 60.0) -> None:
        self._broker = broker
        self._replica_id = replica_id
        self._current_version = current_version
        self._apply = apply
        self._wait_s = wait_s
        self._apply_timeout_s = apply_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-subscriber", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        acked = -1
        while not self._stop.is_set():
            try:
                running = self._current_version()
                if running != acked:
                    self._broker.ack.remote(self._replica_id, running)
                    acked = running
                version, refs = ray.get(self._broker.wait_newer.remote(running, self._wait_s))
                if version > self._current_version() and refs:
                    self._apply(version, ray.get(refs[0]))
                    self._wait_applied(version)
            except Exception:  # the broker may be restarting; try again shortly
                log.exception("weight subscriber request failed")
                self._stop.wait(self._wait_s)

    def _wait_applied(self, version: int) -> None:
        """Until the engine runs ``version`` (it swaps between decode steps), so the ack is prompt."""
        deadline = time.monotonic() + self._apply_timeout_s
        while self._current_version() < version and not self._stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        if self._current_version() < version and not self._stop.is_set():
            log.warning("replica %s: version %d is not running %.0f s after it was handed to the engine; handing "
                        "it again", self._replica_id, version, self._apply_timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._wait_s + 5)
