"""The Ray Serve rollout app: N replicas, each an engine plus the agent loop, fed by deployment handles.

Build it with :func:`build_rollout_app` and run it with :func:`start_rollout_app` (Serve without an HTTP
proxy; the driver and the trainer talk to it through handles). Each replica:

* loads the policy and tokenizer from ``RolloutConfig.policy_path`` (a Hugging Face directory);
* decodes concurrent rollouts together in one :class:`~sao.rollout.torch_engine.TorchEngine`;
* polls the app's weight broker and swaps newer weights in between decode steps;
* answers ``rollout(task, run_id, trajectory_id, seed) -> TrajectoryRecord``, ``generate(prompt_ids,
  sampling) -> Generation`` (raw, for benchmarks), ``health()`` and ``version()``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from ray import serve
from ray.serve import Application

from sao.envs.base import Task
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.engine import Generation, SamplingParams
from sao.rollout.torch_engine import TorchEngine, TorchEngineConfig
from sao.rollout.weights import WeightSubscriber, get_or_create_broker

__all__ = ["RolloutConfig", "RolloutReplica", "build_rollout_app", "rollout_handle", "start_rollout_app"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The rollout app.

    Attributes:
        policy_path: Hugging Face directory of the policy (weights, config, tokenizer).
        app_name: Serve application name; also names the weight broker.
        initial_version: policy version of the weights at ``policy_path``.
        num_replicas: engine replicas.
        cpus_per_replica: Ray CPUs reserved per replica (fractions share cores).
        torch_threads: intra-op threads of each replica's engine.
        max_ongoing_requests: rollouts one replica accepts at once (decoded together).
        engine: torch engine settings.
        agent: agent-loop budgets and sampling.
        env_options: keyword options per environment name, passed to its constructor.
        weight_poll_s: how often a replica asks the broker for newer weights.
    """

    policy_path: str
    app_name: str = "rollout"
    initial_version: int = 0
    num_replicas: int = 2
    cpus_per_replica: float = 0.5
    torch_threads: int = 1
    max_ongoing_requests: int = 256
    engine: TorchEngineConfig = TorchEngineConfig()
    agent: AgentConfig = AgentConfig()
    env_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    weight_poll_s: float = 0.02

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica}")


class RolloutReplica:
    """One Serve replica (see the module docstring)."""

    def __init__(self, config: RolloutConfig) -> None:
        from sao.envs import make_env
        from sao.models.policy import load_policy
        from sao.models.tokenizer import load_tokenizer

        torch.set_num_threads(config.torch_threads)
        self.config = config
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests)
            self.replica_id = f"local-{os.getpid()}"
        policy = load_policy(config.policy_path)
        tokenizer = load_tokenizer(config.policy_path)
        self.engine = TorchEngine(policy, version=config.initial_version, config=config.engine)
        options = config.env_options
        self.agent = AgentLoop(self.engine, tokenizer, lambda task: make_env(task.env, **options.get(task.env, {})),
                               config.agent, worker_id=self.replica_id)
        self.subscriber = WeightSubscriber(get_or_create_broker(config.app_name), self.replica_id,
                                           lambda: self.engine.version, self.engine.load_weights,
                                           interval_s=config.weight_poll_s)

    async def rollout(self, task: Task, run_id: str, trajectory_id: str, seed: int | None = None):
        return await self.agent.run(task, run_id, trajectory_id, seed)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        """One raw generation call (no agent loop): benchmarks and evaluation."""
        return await self.engine.generate(prompt_ids, sampling)

    def version(self) -> int:
        return self.engine.version

    def health(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "version": self.engine.version, "in_flight": self.engine.in_flight,
                "weight_updates": self.engine.weight_updates_applied}

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine thread died is replaced."""
        if not self.engine._thread.is_alive():
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        for closer in (getattr(self, "subscriber", None), getattr(self, "engine", None), getattr(self, "agent", None)):
            if closer is not None:
                closer.close()


def build_rollout_app(config: RolloutConfig) -> Application:
    """A Serve application of ``config.num_replicas`` rollout replicas."""
    deployment = serve.deployment(
        RolloutReplica,
        name="RolloutReplica",
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.cpus_per_replica},
        health_check_period_s=5,
    )
    return deployment.bind(config)


def start_rollout_app(config: RolloutConfig):
    """Start Serve (no HTTP proxy) and deploy the app; returns its deployment handle."""
    serve.start(proxy_location="Disabled")
    return serve.run(build_rollout_app(config), name=config.app_name, route_prefix=None)


def rollout_handle(app_name: str = "rollout"):
    """The handle of a running rollout app (from any driver connected to the same Ray)."""
    return serve.get_deployment_handle("RolloutReplica", app_name=app_name)
