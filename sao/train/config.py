"""Typed configuration of the update step: the algorithm is a choice here, not a fork of the loop.

Two axes make every algorithm the benchmarks compare:

========================  =======================  ===============
preset (``Algorithm``)    advantage estimator      policy loss
========================  =======================  ===============
``sao``                   critic + skip-obs GAE    DIS
``grpo``                  group-normalised         PPO clip
``grpo_dis``              group-normalised         DIS
``ppo_async``             critic + skip-obs GAE    PPO clip
``running_mean``          reward - running mean    DIS
``self_imitation``        1 if success, else 0     DIS
========================  =======================  ===============

``self_imitation`` is a control, not a method of SAO.md: fine-tuning on the policy's own successful
rollouts (a reward at least ``imitation_threshold``), with DIS correcting for their staleness.

Defaults are the paper's settings where they transfer (DIS interval of the math setting, K = 2 critic
updates, lam_critic = 1, alpha = 1.5, gamma = 1); learning rates are ours (the paper's 1e-6 / 5e-6 are
for a 30B model).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

from sao.algos.dis import check_interval
from sao.algos.masked import LossAggregation
from sao.lake.config import LakeConfig
from sao.lake.store import is_valid_run_id
from sao.models.critic import CriticConfig
from sao.train.algorithm import Algorithm
from sao.train.batch import BOOTSTRAP_REASONS, END_REASONS, SKIP_REASONS
from sao.train.device import DeviceSetting, check_settings
from sao.train.retention import RetentionConfig
from schemas.trajectories import RUN_ID_PATTERN

__all__ = ["AdvantageEstimator", "Algorithm", "PolicyLossKind", "ReplayContext", "TrainConfig", "UpdateConfig",
           "check_gpus_per_worker"]


class AdvantageEstimator(enum.StrEnum):
    CRITIC_GAE = "critic_gae"
    GROUP = "group"
    RUNNING_MEAN = "running_mean"
    SUCCESS = "success"


class PolicyLossKind(enum.StrEnum):
    DIS = "dis"
    PPO_CLIP = "ppo_clip"


# The default token budgets (``UpdateConfig.token_budget`` None): in three sweeps of `sao bench update`
# (the peer single-turn shape twice, one with completions up to 160 tokens) 2,048 was the fastest on one
# torch thread (3,072 took 1.01-1.04x its time) and 3,072 on two (2,048 took 1.00-1.06x its time);
# docs/results/update.json, update-long.json and the update section of docs/RESULTS.md.
TOKEN_BUDGET_ONE_THREAD = 2048
TOKEN_BUDGET = 3072


_PRESETS: dict[Algorithm, tuple[AdvantageEstimator, PolicyLossKind]] = {
    Algorithm.SAO: (AdvantageEstimator.CRITIC_GAE, PolicyLossKind.DIS),
    Algorithm.GRPO: (AdvantageEstimator.GROUP, PolicyLossKind.PPO_CLIP),
    Algorithm.GRPO_DIS: (AdvantageEstimator.GROUP, PolicyLossKind.DIS),
    Algorithm.PPO_ASYNC: (AdvantageEstimator.CRITIC_GAE, PolicyLossKind.PPO_CLIP),
    Algorithm.RUNNING_MEAN: (AdvantageEstimator.RUNNING_MEAN, PolicyLossKind.DIS),
    Algorithm.SELF_IMITATION: (AdvantageEstimator.SUCCESS, PolicyLossKind.DIS),
}


def check_gpus_per_worker(gpus: float) -> None:
    """A trainer worker's GPUs: a fraction in (0, 1] shares one, more must be whole GPUs."""
    if gpus <= 0 or (gpus > 1 and gpus != int(gpus)):
        raise ValueError(f"gpus_per_worker must be a fraction in (0, 1] or a whole number, got {gpus}")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """One actor update (and its critic updates) on one batch of trajectories.

    Attributes:
        algorithm: preset choosing the advantage estimator and the policy loss: ``sao`` (critic and
            skip-observation GAE, DIS), ``grpo`` (group-normalised, PPO clip), ``grpo_dis``
            (group-normalised, DIS), ``ppo_async`` (critic and GAE, PPO clip), ``running_mean`` (reward
            minus a running mean, DIS), ``self_imitation`` (1 for a success, else 0, DIS).
        eps_low, eps_high: DIS interval (1 - eps_low, 1 + eps_high); paper math setting (0.3, 5.0).
        clip_low, clip_high: PPO clip range for the ``ppo_clip`` loss.
        detach_weight: DIS in the REINFORCE form (True, the paper's) or the ratio form.
        aggregation: loss denominator, ``token`` (all action tokens of the batch) or ``sequence``.
        gamma: discount per action token.
        lam_critic: GAE lambda for the critic's targets (paper 1.0).
        alpha: length-adaptive lambda for the policy advantage, ``1 - 1/(alpha * l)`` (paper 1.5).
        lam_policy: a fixed GAE lambda for the policy advantage in place of the length-adaptive rule
            (None, the default and SAO.md's: the rule with ``alpha``); an ablation of the rule.
        critic_updates: K critic optimiser steps per actor step (paper 2).
        lr_policy, lr_critic: AdamW learning rates.
        warmup_steps_critic, warmup_steps_policy: linear warm-up of the learning rate, in optimiser steps.
        cosine_steps_policy: after its warm-up, the policy's learning rate follows a cosine from
            ``lr_policy`` down to ``lr_policy * lr_final_ratio`` over this many optimiser steps and stays
            there (0: constant after the warm-up).
        lr_final_ratio: the end of ``cosine_steps_policy``'s decay, as a fraction of ``lr_policy``.
        weight_decay: AdamW weight decay for both models.
        adam_eps: AdamW epsilon for both models.
        adam_beta2: AdamW's second-moment decay for both models (0.95 forgets old gradient scales
            faster than the default 0.999).
        entropy_coef: the actor's loss subtracts this times the mean entropy of the sampling
            distribution at its action tokens (aggregated as the policy loss is; reported as
            ``actor/entropy``). 0, the default and the paper's, adds nothing and computes nothing.
        max_grad_norm: gradient clipping (None = off).
        value_clip: PPO-style value clipping (None = off): each value a critic step trains is clipped to
            within this of its value before the update's first critic step, and the larger of the
            clipped and unclipped squared errors is taken (reported as ``critic/value_clip_frac``).
        whiten_advantages: normalise policy advantages over the batch's action tokens.
        advantage_floor: a diagnostic (None: off, SAO.md's update): policy advantages below it are raised
            to it (after whitening); 0 trains on the positive advantages only, so a failed episode's
            tokens are never pushed down.
        group_scale_by_std: GRPO divides by the group's std (False: mean baseline only).
        running_mean_window: window of the running-mean baseline (paper comparison 8).
        imitation_threshold: the reward at which ``self_imitation`` counts a trajectory a success (1.0:
            the math environments' full reward).
        reward_range: (low, high) to monitor values outside it.
        bootstrap_reasons: termination reasons after which the return is V(s_end) rather than 0.
            SAO.md bootstraps the budget ends (``length``, ``turns``, ``timeout``); where a budget is
            far above what a good answer needs (the math demo: 96 tokens for a 25-token answer),
            treating ``length`` as a failure (value 0) stops an optimistic critic from rewarding
            answers that never end.
        skip_reasons: termination reasons whose trajectories the trainer stores but does not train
            on (value pretraining neither); the reader passes over them and each step counts them in
            ``batch/cut_short_skipped``. SAO.md: ``cancelled`` and ``error`` ends, cut short by the
            system rather than by a budget the policy spent. Empty (with these reasons in
            ``bootstrap_reasons``) trains on them, bootstrapped.
        oracle_values: a diagnostic of the critic (:mod:`sao.train.oracle`, built-in math_tool tasks
            only): the policy's advantages use the values the tasks' demonstrations give (the chance
            that the current policy completes the demonstration from a state on its path, 0 off it)
            in place of the critic's, which is still trained and reported.
        token_budget: most (sequences x padded length) tokens in one micro-batch. None (the default):
            :data:`TOKEN_BUDGET_ONE_THREAD` when the update runs on one torch thread (an asynchronous
            run's trainer), else :data:`TOKEN_BUDGET` (:meth:`micro_batch_tokens`): the fastest budgets
            of those `sao bench update` sweeps on CPU at one and two torch threads (smaller micro-batches
            pad less and keep the attention's blocks short, until each one's fixed cost wins;
            docs/RESULTS.md, section ``update``). Replay runs on the run's thread count, so it splits a
            batch as the run did. On a GPU a larger budget usually fills the device better.
        routing_replay: R3 (:mod:`sao.models.routing`): the actor's forward routes every token the
            rollout recorded a routing for to the recorded experts (weights from the live router, which
            keeps its gradient). None: on for a mixture-of-experts policy, a no-op for a dense one; False:
            the forward routes live, exactly as without a record. The critic never replays (its router is
            its own; the rollout's routing describes the policy's).
        routing_metrics: with a routing record in the batch, report ``routing/*`` metrics: the fraction
            of recorded tokens whose recomputed top-k differs from the recorded one (per layer and per
            staleness) and the DIS kept fraction with and without replay. Changes no update.
        routing_compare_every: every this many actor steps (0: never), also run each micro-batch under
            the routing the step does not use (one extra no-grad forward, about a third of the actor's
            cost), for the kept fraction under both; other steps report the step's own routing only.
        critic_beside_actor: run the critic steps after the first (K - 1 of them) on a second thread while
            the actor step runs: the two touch disjoint models and optimisers and each runs the same
            kernels on the same number of torch threads as when they run one after the other, so the
            result is bit for bit the same (tested); only the wall time changes. Off by default: in an
            asynchronous run on 2 cores it took the core the replicas generate on, and SAO single-turn
            fell from 0.73x to 0.61x TRL's completions/s, its trainer waiting 0.91 s a step for rollouts
            (docs/RESULTS.md, section ``peer-beside``). Refused with data-parallel peers.
    """

    algorithm: Algorithm = Algorithm.SAO
    eps_low: float = 0.3
    eps_high: float = 5.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    detach_weight: bool = True
    aggregation: LossAggregation = LossAggregation.TOKEN
    gamma: float = 1.0
    lam_critic: float = 1.0
    alpha: float = 1.5
    lam_policy: float | None = None
    critic_updates: int = 2
    lr_policy: float = 2e-4
    lr_critic: float = 5e-4
    warmup_steps_critic: int = 10
    warmup_steps_policy: int = 0
    cosine_steps_policy: int = 0
    lr_final_ratio: float = 0.1
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    adam_beta2: float = 0.999
    entropy_coef: float = 0.0
    max_grad_norm: float | None = 1.0
    value_clip: float | None = None
    whiten_advantages: bool = False
    advantage_floor: float | None = None
    group_scale_by_std: bool = True
    running_mean_window: int = 8
    imitation_threshold: float = 1.0
    reward_range: tuple[float, float] = (0.0, 1.0)
    bootstrap_reasons: tuple[str, ...] = BOOTSTRAP_REASONS
    skip_reasons: tuple[str, ...] = SKIP_REASONS
    oracle_values: bool = False
    token_budget: int | None = None
    routing_replay: bool | None = None
    routing_metrics: bool = True
    routing_compare_every: int = 10
    critic_beside_actor: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
        object.__setattr__(self, "aggregation", LossAggregation(self.aggregation))
        object.__setattr__(self, "reward_range", tuple(self.reward_range))
        object.__setattr__(self, "bootstrap_reasons", tuple(self.bootstrap_reasons))
        object.__setattr__(self, "skip_reasons", tuple(self.skip_reasons))
        for name in ("bootstrap_reasons", "skip_reasons"):
            unknown = [r for r in getattr(self, name) if r not in END_REASONS]
            if unknown:
                raise ValueError(f"{name} {unknown} are not among {END_REASONS} ('stop' always ends with 0 "
                                 "and is always trained on)")
        both = sorted(set(self.bootstrap_reasons) & set(self.skip_reasons))
        if both:
            raise ValueError(f"{both} are in both bootstrap_reasons and skip_reasons: a skipped trajectory "
                             "is not trained on, so it has no return to bootstrap")
        check_interval(self.eps_low, self.eps_high)
        if self.critic_updates < 0:
            raise ValueError(f"critic_updates must be >= 0, got {self.critic_updates}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam_critic <= 1.0:
            raise ValueError(f"lam_critic must lie in [0, 1], got {self.lam_critic}")
        if self.lam_policy is not None and not 0.0 <= self.lam_policy <= 1.0:
            raise ValueError(f"lam_policy must lie in [0, 1] or be None (the length-adaptive rule), "
                             f"got {self.lam_policy}")
        for name in ("warmup_steps_policy", "warmup_steps_critic", "cosine_steps_policy"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.lr_final_ratio <= 1.0:
            raise ValueError(f"lr_final_ratio must lie in [0, 1], got {self.lr_final_ratio}")
        if not 0.0 <= self.adam_beta2 < 1.0:
            raise ValueError(f"adam_beta2 must lie in [0, 1), got {self.adam_beta2}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (a bonus for entropy), got {self.entropy_coef}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 or None (off), got {self.value_clip}")
        if self.advantage_floor is not None and not math.isfinite(self.advantage_floor):
            raise ValueError(f"advantage_floor must be finite or None, got {self.advantage_floor}")
        if not math.isfinite(self.imitation_threshold):
            raise ValueError(f"imitation_threshold must be a finite reward, got {self.imitation_threshold}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.oracle_values and self.advantage_estimator is not AdvantageEstimator.CRITIC_GAE:
            raise ValueError(f"oracle_values replaces a critic's values; algorithm {self.algorithm.value!r} has none")
        if self.routing_compare_every < 0:
            raise ValueError(f"routing_compare_every must be >= 0 (0: never), got {self.routing_compare_every}")

    @property
    def advantage_estimator(self) -> AdvantageEstimator:
        return _PRESETS[self.algorithm][0]

    @property
    def policy_loss(self) -> PolicyLossKind:
        return _PRESETS[self.algorithm][1]

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator is AdvantageEstimator.CRITIC_GAE

    def micro_batch_tokens(self, threads: int) -> int:
        """The token budget of a micro-batch for an update on ``threads`` torch threads:
        ``token_budget``, or when None the default for that thread count."""
        if self.token_budget is not None:
            return self.token_budget
        return TOKEN_BUDGET_ONE_THREAD if threads <= 1 else TOKEN_BUDGET


@dataclasses.dataclass(frozen=True)
class ReplayContext:
    """What the run's rollouts used that a trajectory does not record, for trajectory replay.

    Stored as ``TrainConfig.rollout``: the key ``"rollout"`` of ``run_config.json`` (the class name is
    not stored). Not the Serve app's settings (:class:`sao.rollout.serve.RolloutConfig`).

    Attributes:
        tasks_path: the JSON Lines task file (:func:`sao.envs.base.read_tasks`) the rollouts drew
            from; trajectory replay finds a trajectory's task there to re-score it. None: unknown
            (replay then needs ``--tasks``).
        env_options: per environment name, the options ``make_env(name, **options)`` was given.
        max_turns: the agent loop's turn budget (``AgentConfig.max_turns``); None: unknown, so a
            ``turns`` end by the agent's budget cannot be checked.
    """

    tasks_path: str | None = None
    env_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"ReplayContext.max_turns must be >= 1 or None, got {self.max_turns}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        run_id: the run (partition of every table); a re-run with the same id resumes.
        lake: where the tables live.
        checkpoint_root: where every version's checkpoint goes.
        policy_path: the version-0 policy (SFT warm start) directory.
        critic_path: a pretrained critic directory; None builds one from the policy.
        critic: how a critic built from the policy is set up (which of its parts train); a critic loaded
            from a directory or a checkpoint keeps the setup it was saved with.
        update: the algorithm and its settings.
        batch_size: trajectories per actor update.
        max_staleness: most versions a trajectory may lag when trained on.
        total_steps: actor updates of the run (a resumed run continues to this count).
        seed: torch seed of the run.
        deterministic: ``torch.use_deterministic_algorithms`` (bit-exact replay on CPU).
        torch_threads: intra-op threads per worker.
        wait_timeout_s: longest wait for a batch to arrive before the run fails.
        poll_s: longest wait between two looks for new trajectories while waiting for a batch: the
            rollout writer announces each commit at the run's weight broker and the trainer looks at
            once; without a broker (``app_name`` None) the lake is polled at this interval.
        app_name: rollout app whose replicas receive new weights (None: do not publish).
        num_workers: Ray Train workers (data parallel; gradients are summed across them).
        cpus_per_worker: Ray CPUs per worker (fractions leave room for dataset reads and rollouts).
        device: where the workers train (:mod:`sao.train.device`): ``cpu``, ``cuda`` (one GPU per Ray
            Train worker, an error where the Ray cluster has none) or ``auto`` (GPUs when the Ray cluster
            has them when the trainer starts). Value pretraining follows it too. Replay always runs on CPU.
        gpus_per_worker: GPUs Ray gives each worker that trains on GPUs; below 1 a worker shares its GPU
            (with a vLLM replica on a one-GPU machine, say: then give each its share of memory).
        rollout_gpus: GPUs the run's rollout replicas hold on the same Ray cluster (``rollout.gpus`` x
            ``rollout.num_replicas``): they are not counted as the trainer's (:func:`sao.train.device.use_gpu`).
        bf16: bf16 autocast around the forward passes on CUDA; weights, gradients and optimiser state
            stay float32. Refused on CPU.
        resources_per_worker: custom Ray resources per worker, e.g. ``{"trainer": 1}`` (placement on the
            nodes started with them); empty: any node with the CPUs.
        report_interval_s: on Ray Train, steps are reported to it (``ray.train.report``) at most this
            often, and the last step always. Its controller takes a report when it polls the workers
            (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default) and the next report blocks
            until it has: reporting every step stalled each step by about 1.2 s. The lake has every step.
        rollout: what the rollouts used that trajectories do not record (task file, environment
            options, turn budget), stored for trajectory replay.
        retention: which old checkpoints to prune after each step (None: keep every part of every one).
        compact_every: compact the run every this many steps (0: never): the ledger tables
            (``train_steps``, ``policy_versions``) and the run's partition of ``trajectories`` and
            ``rollout_tasks`` (:func:`sao.lake.maintenance.compact_run`). Every Delta read, refresh and
            commit costs in proportion to a table's files, and a step adds a few to each; what that
            cost over a long run, with and without, is in docs/RESULTS.md (`sao bench longrun`).
    """

    run_id: str
    lake: LakeConfig
    checkpoint_root: str
    policy_path: str
    critic_path: str | None = None
    critic: CriticConfig = CriticConfig()
    update: UpdateConfig = UpdateConfig()
    batch_size: int = 16
    max_staleness: int = 4
    total_steps: int = 20
    seed: int = 0
    deterministic: bool = True
    torch_threads: int = 1
    wait_timeout_s: float = 900.0
    poll_s: float = 0.1
    app_name: str | None = "rollout"
    num_workers: int = 1
    cpus_per_worker: float = 0.5
    device: DeviceSetting = "auto"
    gpus_per_worker: float = 1.0
    rollout_gpus: float = 0.0
    bf16: bool = False
    resources_per_worker: dict[str, float] = dataclasses.field(default_factory=dict)
    report_interval_s: float = 5.0
    rollout: ReplayContext = ReplayContext()
    retention: RetentionConfig | None = None
    compact_every: int = 50

    def __post_init__(self) -> None:
        if not is_valid_run_id(self.run_id):
            raise ValueError(f"run_id {self.run_id!r} is not a valid run id: it must match {RUN_ID_PATTERN}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {self.total_steps}")
        if self.compact_every < 0:
            raise ValueError(f"compact_every must be >= 0, got {self.compact_every}")
        check_settings(self.device, self.bf16)
        check_gpus_per_worker(self.gpus_per_worker)
