"""The Ray Serve rollout app: N replicas, each an engine plus the agent loop, fed by deployment handles.

Build it with :func:`build_rollout_app` and run it with :func:`start_rollout_app` (Serve without an HTTP
proxy; the driver and the trainer talk to it through handles). Each replica:

* loads the policy and tokenizer from ``RolloutConfig.policy_path`` (a Hugging Face directory);
* decodes concurrent rollouts together in one engine, built by :func:`build_engine` from
  ``RolloutConfig.engine``: a :class:`~sao.rollout.torch_engine.TorchEngineConfig` gives the torch
  engine, run in a child process (:mod:`sao.rollout.engine_process`) unless ``engine_process=False``
  (with ``engine.cpus`` the engine thread runs on those CPUs and the replica's own threads on the
  others, :mod:`sao.rollout.cpus`); a :class:`~sao.rollout.vllm_engine.VLLMEngineConfig` gives vLLM's
  ``AsyncLLM`` (:mod:`sao.rollout.vllm_engine`), whose replicas run in the Python of
  ``RolloutConfig.python`` (the vLLM environment: Ray's per-actor ``py_executable``, docs/VLLM.md);
* waits at the app's weight broker for newer weights and swaps them in between decode steps;
* builds a fresh environment per episode from ``env_options``; an environment whose reward depends on
  the trainer's step (:func:`sao.envs.takes_trainer_step`: ``style_preference``) is given the version
  the engine runs when the episode starts, which is the number of trainer steps done (one version per
  step). The first action token is sampled by that version or, if new weights land in between, a
  later one: the trajectory's ``min_policy_version`` (what trajectory replay re-scores with) is never
  smaller than the step its reward was observed at;
* runs every episode as an agent on its chat endpoint (:mod:`sao.rollout.chat_endpoint`, in process and on
  127.0.0.1 only, started on the first episode; :mod:`sao.rollout.user_agent` makes the records): an
  agent of one's own where the environment names one (``env.agent``), else the environment's own
  (:mod:`sao.rollout.env_agent`, whose records are the agent loop's, token for token);
* answers ``rollout(task, run_id, trajectory_id, seed) -> list[TrajectoryRecord]`` (one trajectory, or
  the parts of an episode its agent split by rewriting its history), ``rollout_stream(requests)`` (several
  rollouts in one request, their records streamed back as each finishes), ``generate(prompt_ids,
  sampling) -> Generation`` (raw, for benchmarks), ``health()`` and ``version()``.

The handle :func:`start_rollout_app` and :func:`rollout_handle` return is a :class:`RolloutClient`: its
requests go by value over Serve's gRPC channel (:func:`by_value`), and its ``rollout.remote(...)`` gathers
the rollouts started in one turn of the event loop into one ``rollout_stream`` request per replica
(:class:`RolloutBatcher`). Serve's cost is per request; measured on 128 single-turn rollouts over 2
replicas on 2 cores (7 batches), a batch took 1.2 s as one actor task per rollout, 0.85-1.0 s by value,
and 0.66-0.76 s batched by value, with the driver's CPU 3.4 s, 1.3-1.6 s and 0.5 s and each replica's
2.1 s, 1.4-1.7 s and 0.8 s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import pickle
import time
from typing import Any

import torch
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from sao.envs import make_env, takes_trainer_step
from sao.envs.base import Environment, Task
from sao.lake.records import TrajectoryRecord
from sao.rollout.agent import AgentConfig
from sao.rollout.chat_endpoint import ChatEndpoint
from sao.rollout.cpus import keep_process_off
from sao.rollout.engine import Engine, Generation, SamplingParams
from sao.rollout.engine_process import TorchEngineProcess
from sao.rollout.env_agent import environment_agent, tool_schema
from sao.rollout.routing import ROUTER_PATH
from sao.rollout.torch_engine import TorchEngine, TorchEngineConfig
from sao.rollout.user_agent import UserAgentRunner
from sao.rollout.vllm_engine import VLLMEngineConfig
from sao.rollout.weights import WeightSubscriber, get_or_create_broker

__all__ = ["RolloutBatcher", "RolloutClient", "RolloutConfig", "RolloutReplica", "build_engine", "build_rollout_app",
           "by_value", "rollout_handle", "start_rollout_app"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The rollout app.

    Attributes:
        policy_path: Hugging Face directory of the policy (weights, config, tokenizer).
        app_name: Serve application name; also names the weight broker.
        initial_version: policy version of the weights at ``policy_path``.
        num_replicas: engine replicas.
        cpus_per_replica: Ray CPUs reserved per replica (fractions share cores).
        gpus_per_replica: Ray GPUs per replica (0: none; the vLLM engine on a GPU needs one, or a share of
            one beside the trainer, with ``gpu_memory_utilization`` to match).
        resources_per_replica: custom Ray resources each replica needs, e.g. ``{"rollout": 1}``: replicas
            then run only on nodes started with that resource (``ray start --resources``), which is how
            rollouts and the trainer are kept on different nodes. Empty: any node with the CPUs.
        torch_threads: intra-op threads of each replica's engine (unless ``engine.threads`` sets them).
        max_ongoing_requests: requests one replica accepts at once (Serve counts requests; a driver's
            :class:`RolloutBatcher` sends several rollouts in one, at most ``max_in_flight`` in all).
        engine: the engine and its settings: :class:`~sao.rollout.torch_engine.TorchEngineConfig` (the
            torch engine) or :class:`~sao.rollout.vllm_engine.VLLMEngineConfig` (vLLM; its
            ``logprob_kind`` must be the agent's).
        agent: agent-loop budgets and sampling.
        env_options: keyword options per environment name, passed to its constructor.
        weight_wait_s: longest a replica's request to the weight broker waits for a newer version (it
            returns as soon as one is published) before it is renewed.
        version_wait_s: longest a rollout that asks for a minimum policy version (synchronous runs)
            waits for this replica to run it before the request fails.
        engine_process: run the engine in a child process of the replica (it decodes about twice as
            fast there: see :mod:`sao.rollout.engine_process`); False keeps it in the replica's process.
        access_log: Serve's log line per request (off by default: at thousands of short generate calls a
            second its cost is measurable, and the lake records every rollout anyway).
        python: the Python executable the replicas run in (Ray's ``py_executable``): an environment with
            vLLM and this project for the vLLM engine (``make vllm-env``). None: the driver's own.
        request_router: the Serve request router every handle of the app routes with (an import path):
            by default :class:`~sao.rollout.routing.LeastOutstandingRouter`, which splits a burst of
            rollouts evenly over the replicas; None: Serve's default (power of two choices).
    """

    policy_path: str
    app_name: str = "rollout"
    initial_version: int = 0
    num_replicas: int = 2
    cpus_per_replica: float = 0.5
    gpus_per_replica: float = 0.0
    resources_per_replica: dict[str, float] = dataclasses.field(default_factory=dict)
    torch_threads: int = 1
    max_ongoing_requests: int = 256
    engine: TorchEngineConfig | VLLMEngineConfig = TorchEngineConfig()
    agent: AgentConfig = AgentConfig()
    env_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    weight_wait_s: float = 1.0
    version_wait_s: float = 60.0
    engine_process: bool = True
    access_log: bool = False
    python: str | None = None
    request_router: str | None = ROUTER_PATH

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica}")
        if self.gpus_per_replica < 0:
            raise ValueError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")
        for name, amount in self.resources_per_replica.items():
            if name in ("CPU", "GPU") or not amount > 0:
                raise ValueError(f"resources_per_replica[{name!r}] = {amount}: give a custom resource name (CPUs "
                                 "are cpus_per_replica) and a positive amount")
        if isinstance(self.engine, VLLMEngineConfig) and self.engine.logprob_kind.value != self.agent.logprob_kind:
            raise ValueError(f"the vLLM engine records {self.engine.logprob_kind.value!r} log-probabilities and the "
                             f"agent asks for {self.agent.logprob_kind!r}: give both the same kind")


def build_engine(config: RolloutConfig) -> Engine:
    """The engine of one replica of ``config`` (see the module docstring), at ``config.initial_version``."""
    if isinstance(config.engine, VLLMEngineConfig):
        from sao.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(config.policy_path, version=config.initial_version, config=config.engine)
    from sao.models.policy import load_policy

    engine = config.engine
    if engine.threads is None:
        engine = dataclasses.replace(engine, threads=config.torch_threads)
    if engine.cpus is not None:  # request handling off the engine's CPUs (sao.rollout.cpus)
        keep_process_off(engine.cpus)
    if config.engine_process:
        return TorchEngineProcess(functools.partial(load_policy, config.policy_path),
                                  version=config.initial_version, config=engine)
    return TorchEngine(load_policy(config.policy_path), version=config.initial_version, config=engine)


def update_timeout_s(engine: Engine) -> float:
    """How long ``engine`` may take to run weights handed to it: the vLLM engine's reload timeout
    (``update_timeout_s``: a reload of a large model takes minutes) and a minute for the pause, lock
    and version label around the reload, else a minute (the torch engine swaps between two decode
    steps)."""
    reload_s = getattr(getattr(engine, "config", None), "update_timeout_s", None)
    return 60.0 if reload_s is None else float(reload_s) + 60.0


class RolloutReplica:
    """One Serve replica (see the module docstring)."""

    def __init__(self, config: RolloutConfig) -> None:
        from sao.models.tokenizer import load_tokenizer

        # Only the engine thread runs parallel torch work here: an OpenMP team of more than one thread in
        # this (constructor) thread as well would leave more OpenMP workers than cores, and libgomp then
        # puts workers to sleep after every parallel region, tripling the engine's step time.
        torch.set_num_threads(1)
        self.config = config
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests)
            self.replica_id = f"local-{os.getpid()}"
        tokenizer = load_tokenizer(config.policy_path)
        self.engine = build_engine(config)
        self.endpoint = ChatEndpoint(self.engine, tokenizer)
        self.agents = UserAgentRunner(self.endpoint, config.agent, self.replica_id)
        self._tools = concurrent.futures.ThreadPoolExecutor(config.agent.tool_threads, thread_name_prefix="tool")
        self._version_waits: dict[int, asyncio.Future] = {}  # min_version -> the one wait every request shares
        self.subscriber = WeightSubscriber(get_or_create_broker(config.app_name), self.replica_id,
                                           lambda: self.engine.version, self.engine.load_weights,
                                           wait_s=config.weight_wait_s, apply_timeout_s=update_timeout_s(self.engine))

    def _new_env(self, task: Task) -> Environment:
        """A fresh environment for one episode of ``task`` (see the module docstring)."""
        options = dict(self.config.env_options.get(task.env, {}))
        if takes_trainer_step(task.env):
            options["trainer_step"] = self.engine.version
        return make_env(task.env, **options)

    async def rollout(self, task: Task, run_id: str, trajectory_id: str, seed: int | None = None,
                      min_version: int | None = None) -> list[TrajectoryRecord]:
        """One episode: its trajectory (or its parts, see the module docstring). With ``min_version``, it starts only once this replica's engine runs that
        version or a newer one (synchronous runs: the batch is sampled by the trainer's policy); a
        replica that does not get there within ``version_wait_s`` fails the request."""
        if min_version is not None and self.engine.version < min_version:
            await self._reach_version(min_version)
        env = self._new_env(task)
        spec = self.config.env_options.get(task.env, {}).get("agent")
        agent = self.agents.agent(spec, tuple(env.config.paths)) if spec else environment_agent(
            env, task, self._tools, tool_schema(env, self.agents.endpoint.tokens))
        return await self.agents.run(agent, env, task, run_id, trajectory_id, seed, built_in=not spec)

    async def rollout_stream(self, requests: list[tuple], min_version: int | None = None):
        """Several rollouts in one request (:class:`RolloutBatcher`): ``requests`` are ``(task, run_id,
        trajectory_id, seed)`` tuples; yields, as they finish, lists of ``(index, records, exception)``, one
        entry per rollout that ended since the last yield (``records`` None where :meth:`rollout` raised).
        Cancelling the request cancels every rollout of it still running."""

        async def one(index: int, request: tuple) -> tuple[int, list[TrajectoryRecord] | None, Exception | None]:
            try:
                return index, await self.rollout(*request, min_version=min_version), None
            except Exception as exc:
                return index, None, _sendable(exc)

        pending = {asyncio.ensure_future(one(i, request)) for i, request in enumerate(requests)}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                yield [future.result() for future in done]
        finally:
            for future in pending:
                future.cancel()

    async def _reach_version(self, min_version: int) -> None:
        """Wait until the engine runs ``min_version`` or newer (at most ``version_wait_s``). A synchronous
        batch's rollouts all wait for the same version, so they share one wait that checks the version
        every 2 ms, rather than each checking it (64 requests doing so took the replica's event loop about
        32,000 wake-ups a second while the new weights loaded)."""
        wait = self._version_waits.get(min_version)
        if wait is None:
            wait = asyncio.ensure_future(self._poll_version(min_version))
            self._version_waits[min_version] = wait
            wait.add_done_callback(lambda _: self._version_waits.pop(min_version, None))
        await asyncio.shield(wait)  # a cancelled request leaves the wait to the others

    async def _poll_version(self, min_version: int) -> None:
        deadline = time.monotonic() + self.config.version_wait_s
        while self.engine.version < min_version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.replica_id} runs version {self.engine.version}, "
                                   f"not {min_version}, after {self.config.version_wait_s:.0f} s")
            await asyncio.sleep(0.002)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        """One raw generation call (no agent loop): benchmarks and evaluation."""
        return await self.engine.generate(prompt_ids, sampling)

    def version(self) -> int:
        return self.engine.version

    def health(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "version": self.engine.version, "in_flight": self.engine.in_flight,
                "episode_splits": self.endpoint.splits,
                "weight_updates": self.engine.weight_updates_applied,
                "engine_stats": dataclasses.asdict(self.engine.stats())}

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine thread died is replaced."""
        if not self.engine.healthy():
            raise RuntimeError("the engine is not running")

    def __del__(self) -> None:
        for closer in (getattr(self, "subscriber", None), getattr(self, "engine", None)):
            if closer is not None:
                closer.close()
        if getattr(self, "_tools", None) is not None:
            self._tools.shutdown(wait=False, cancel_futures=True)


def deployment_options(config: RolloutConfig) -> dict:
    """The Serve deployment options of ``config``'s replicas (count, placement, request limits, and the
    Python they run in)."""
    options = {
        "name": "RolloutReplica",
        "num_replicas": config.num_replicas,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.cpus_per_replica, "resources": dict(config.resources_per_replica),
                              **({"num_gpus": config.gpus_per_replica} if config.gpus_per_replica else {})},
        "health_check_period_s": 5,
        "logging_config": {"enable_access_log": config.access_log},
    }
    if config.request_router is not None:
        options["request_router_config"] = RequestRouterConfig(request_router_class=config.request_router)
    if config.python is not None:
        options["ray_actor_options"]["runtime_env"] = {"py_executable": config.python}
    return options


def build_rollout_app(config: RolloutConfig) -> Application:
    """A Serve application of ``config.num_replicas`` rollout replicas."""
    return serve.deployment(RolloutReplica, **deployment_options(config)).bind(config)


def start_rollout_app(config: RolloutConfig) -> RolloutClient:
    """Start Serve (no HTTP proxy) and deploy the app; returns its handle as a :class:`RolloutClient`."""
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_rollout_app(config), name=config.app_name, route_prefix=None)
    return RolloutClient(by_value(handle), config.num_replicas)


def rollout_handle(app_name: str = "rollout", replicas: int | None = None) -> RolloutClient:
    """The handle of a running rollout app, from any driver connected to the same Ray, as a
    :class:`RolloutClient` that splits a burst of rollouts into ``replicas`` requests (None: as many as
    the app has replicas running)."""
    if replicas is None:
        states = serve.status().applications[app_name].deployments["RolloutReplica"].replica_states
        replicas = max(1, states.get("RUNNING", 0))
    return RolloutClient(by_value(serve.get_deployment_handle("RolloutReplica", app_name=app_name)), replicas)


def _sendable(exc: Exception) -> Exception:
    """``exc`` if it pickles (it goes back to the driver), else a ``RuntimeError`` naming it."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class RolloutBatcher:
    """The ``rollout`` method of :class:`RolloutClient`: ``remote(task, run_id, trajectory_id, seed,
    min_version=None)`` returns an awaitable of the rollout's records, as a handle's method does, but
    the rollouts started in one turn of the event loop go to the replicas together, split into at most
    ``replicas`` requests of :meth:`RolloutReplica.rollout_stream`, each of which streams its rollouts'
    records back as they finish. Serve's cost is per request, and a synchronous batch starts all its
    rollouts in one turn: 128 rollouts then cost 2 requests instead of 128.

    Serve's router (:class:`~sao.rollout.routing.LeastOutstandingRouter`) counts a request as one however
    many rollouts it holds: a burst is split evenly over the replicas by this class, and the few
    rollouts started as others finish go where fewer requests run.

    A rollout whose replica fails (the request's stream raises) gets that exception, as from a handle;
    so does every other rollout of the same request still running. Cancelling a rollout's awaitable
    cancels the request once every other rollout of it has finished or is cancelled too (a driver
    cancels all it runs at once); until then the request, the cancelled rollout included, goes on on its
    replica, and the cancelled one's records are dropped, as a cancelled ``DeploymentResponse``'s are.
    """

    def __init__(self, handle, replicas: int) -> None:
        self._stream = handle.options(stream=True)
        self.replicas = replicas
        self._queued: dict[int | None, list[tuple[tuple, asyncio.Future]]] = {}
        self._requests: set[asyncio.Future] = set()

    def remote(self, task: Task, run_id: str, trajectory_id: str, seed: int | None = None,
               min_version: int | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._queued:
            loop.call_soon(self._send)
        self._queued.setdefault(min_version, []).append(((task, run_id, trajectory_id, seed), future))
        return future

    def _send(self) -> None:
        queued, self._queued = self._queued, {}
        for min_version, calls in queued.items():
            calls = [(request, future) for request, future in calls if not future.cancelled()]
            parts = min(self.replicas, len(calls))
            for k in range(parts):
                chunk = calls[k::parts]
                request = asyncio.ensure_future(self._run(chunk, min_version))
                self._requests.add(request)  # held until done (the loop keeps only a weak reference)
                request.add_done_callback(self._requests.discard)

    async def _run(self, chunk: list[tuple[tuple, asyncio.Future]], min_version: int | None) -> None:
        futures = [future for _, future in chunk]
        stream = self._stream.rollout_stream.remote([request for request, _ in chunk], min_version=min_version)

        def on_done(_: asyncio.Future) -> None:  # nothing left to wait for, and something cancelled: stop it
            if all(future.done() for future in futures) and any(future.cancelled() for future in futures):
                stream.cancel()

        for future in futures:
            future.add_done_callback(on_done)
        try:
            async for finished in stream:
                for index, records, exc in finished:
                    if futures[index].done():
                        continue
                    if exc is None:
                        futures[index].set_result(records)
                    else:
                        futures[index].set_exception(exc)
        except asyncio.CancelledError:
            if not all(future.cancelled() for future in futures):
                stream.cancel()
                for future in futures:
                    future.cancel()
                raise
        except Exception as exc:  # the replica failed: every rollout of the request still running gets it
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
        for future in futures:
            if not future.done():
                future.set_exception(RuntimeError("the rollout request ended without this rollout's records"))


class RolloutClient:
    """A rollout app's handle (:func:`by_value`) whose ``rollout`` is a :class:`RolloutBatcher`; every
    other method is the handle's."""

    def __init__(self, handle, replicas: int) -> None:
        self._handle = handle
        self.rollout = RolloutBatcher(handle, replicas)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


def by_value(handle):
    """``handle`` sending its requests to the replicas over Serve's inter-deployment gRPC channel, with the
    arguments and results passed by value, rather than as Ray actor tasks whose results go through the
    object store: a rollout is one small request and a few records back, and the actor-task path's cost
    per request dominated (the figures are in the module docstring). Every replica serves this channel
    (Serve starts it with the replica); a response cannot become an ``ObjectRef``, which nothing here
    asks for."""
    return handle.options(_by_reference=False)
