"""What a user sets for a training run: one typed place for the defaults that the CLI, the Prefect
flows and the demo share. Component settings live beside their components (``UpdateConfig``,
``TrainConfig``, ``AgentConfig``, ``LakeConfig``, ``RayConfig``); :class:`RunSettings` picks the few a
run needs and builds them, so each default is written once.

Defaults run on a laptop (2 cores): the math_tool task, the tiny policy, a local Ray, a ``./lake``
folder, run files under ``./runs/<run_id>``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sao.lake.config import LakeConfig
from sao.rollout.agent import AgentConfig
from sao.runtime import RayConfig
from sao.train.config import Algorithm, UpdateConfig
from schemas.trajectories import RUN_ID_PATTERN

__all__ = ["RunSettings"]


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """A training run.

    Attributes:
        run_id: names the run in every table; re-running with the same id resumes it.
        workdir: run files go to ``<workdir>/<run_id>/`` (SFT policy, checkpoints, plots).
        lake_root: the lake: a folder or an ``s3://bucket/prefix`` URI.
        storage_options: object-store options for an ``s3://`` lake (credentials come from the
            environment or the provider's chain when omitted; they are never written to the lake).
        ray_address: None starts a local Ray; ``"auto"`` or ``"ray://host:10001"`` joins a cluster.
        algorithm: ``sao`` or a baseline (``grpo``, ``grpo_dis``, ``ppo_async``, ``running_mean``).
        steps: actor updates.
        batch_size: trajectories per update.
        max_staleness: versions a trajectory may lag when trained on.
        lr_policy: policy learning rate.
        bootstrap_reasons: ends bootstrapped with V(s_end); the math demo treats running out of
            tokens or turns as failure (its budgets are four times what an answer needs).
        num_replicas: Serve rollout replicas.
        trainer_workers: Ray Train workers.
        replica_resources, trainer_resources: custom Ray resources each rollout replica / trainer
            worker needs (placement on a cluster: docs/SCALING.md); empty: any node with the CPUs.
        max_in_flight: trajectories generated at once.
        group_size: rollouts per task, launched together (GRPO's groups; 1 for SAO).
        synchronous: synchronous RL, the comparison baseline (needs ``max_staleness`` 0): one batch per
            version, each rollout sampled by the trainer's current policy
            (:class:`sao.pipeline.PipelineConfig`).
        eval_tasks: held-out tasks for the accuracy before and after.
        value_samples: version-0 rollouts value pretraining fits the critic on before the first step
            (0 skips value pretraining; the paper used about 6k).
        sft_seed: seed of the SFT warm start.
        seed: seed of the run (task order, sampling, torch).
    """

    run_id: str = "demo"
    workdir: str = "runs"
    lake_root: str = "lake"
    storage_options: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)  # never in a repr
    ray_address: str | None = None
    algorithm: Algorithm = Algorithm.SAO
    steps: int = 150
    batch_size: int = 32
    max_staleness: int = 2
    lr_policy: float = 2e-4
    bootstrap_reasons: tuple[str, ...] = ("timeout", "cancelled", "error")
    num_replicas: int = 2
    trainer_workers: int = 1
    replica_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    trainer_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    max_in_flight: int = 64
    group_size: int = 1
    synchronous: bool = False
    eval_tasks: int = 300
    value_samples: int = 256
    sft_seed: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or re.fullmatch(RUN_ID_PATTERN, self.run_id) is None:
            # It names a folder under workdir (and a partition): '../x' or '/x' would leave both.
            raise ValueError(f"run_id {self.run_id!r} is not a valid run id: it must match {RUN_ID_PATTERN}")
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
        object.__setattr__(self, "bootstrap_reasons", tuple(self.bootstrap_reasons))
        for name in ("batch_size", "num_replicas", "trainer_workers", "max_in_flight", "eval_tasks", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of group_size {self.group_size}")
        if self.synchronous and self.max_staleness != 0:
            raise ValueError(f"synchronous runs need max_staleness 0, got {self.max_staleness}")
        if self.value_samples != 0 and self.value_samples < 2:
            raise ValueError(f"value_samples must be 0 (no value pretraining) or >= 2, got {self.value_samples}")

    @property
    def run_dir(self) -> Path:
        return Path(self.workdir) / self.run_id

    @property
    def sft_dir(self) -> Path:
        return self.run_dir / "sft"

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def plots_dir(self) -> Path:
        return self.run_dir / "plots"

    def public(self) -> dict[str, object]:
        """The settings as a dict for results, artifacts and logs: everything but ``storage_options``
        (they may hold credentials)."""
        data = dataclasses.asdict(self)
        del data["storage_options"]
        return data

    def lake(self) -> LakeConfig:
        return LakeConfig(root=self.lake_root, storage_options=dict(self.storage_options))

    def ray(self) -> RayConfig:
        return RayConfig(address=self.ray_address)

    def update(self) -> UpdateConfig:
        return UpdateConfig(algorithm=self.algorithm, lr_policy=self.lr_policy,
                            bootstrap_reasons=self.bootstrap_reasons)

    def agent(self) -> AgentConfig:
        return AgentConfig(max_tokens=96, max_turns=4)
