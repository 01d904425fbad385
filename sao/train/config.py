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
========================  =======================  ===============

Defaults are the paper's settings where they transfer (DIS interval of the math setting, K = 2 critic
updates, lam_critic = 1, alpha = 1.5, gamma = 1); learning rates are ours (the paper's 1e-6 / 5e-6 are
for a 30B model).
"""

from __future__ import annotations

import dataclasses
import enum

from sao.algos.dis import check_interval
from sao.algos.masked import LossAggregation

__all__ = ["AdvantageEstimator", "Algorithm", "PolicyLossKind", "UpdateConfig"]


class Algorithm(enum.StrEnum):
    SAO = "sao"
    GRPO = "grpo"
    GRPO_DIS = "grpo_dis"
    PPO_ASYNC = "ppo_async"
    RUNNING_MEAN = "running_mean"


class AdvantageEstimator(enum.StrEnum):
    CRITIC_GAE = "critic_gae"
    GROUP = "group"
    RUNNING_MEAN = "running_mean"


class PolicyLossKind(enum.StrEnum):
    DIS = "dis"
    PPO_CLIP = "ppo_clip"


_PRESETS: dict[Algorithm, tuple[AdvantageEstimator, PolicyLossKind]] = {
    Algorithm.SAO: (AdvantageEstimator.CRITIC_GAE, PolicyLossKind.DIS),
    Algorithm.GRPO: (AdvantageEstimator.GROUP, PolicyLossKind.PPO_CLIP),
    Algorithm.GRPO_DIS: (AdvantageEstimator.GROUP, PolicyLossKind.DIS),
    Algorithm.PPO_ASYNC: (AdvantageEstimator.CRITIC_GAE, PolicyLossKind.PPO_CLIP),
    Algorithm.RUNNING_MEAN: (AdvantageEstimator.RUNNING_MEAN, PolicyLossKind.DIS),
}


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """One actor update (and its critic updates) on one batch of trajectories.

    Attributes:
        algorithm: preset choosing the advantage estimator and the policy loss (table above).
        eps_low, eps_high: DIS interval (1 - eps_low, 1 + eps_high); paper math setting (0.3, 5.0).
        clip_low, clip_high: PPO clip range for the ``ppo_clip`` loss.
        detach_weight: DIS in the REINFORCE form (True, the paper's) or the ratio form.
        aggregation: loss denominator, ``token`` (all action tokens of the batch) or ``sequence``.
        gamma: discount per action token.
        lam_critic: GAE lambda for the critic's targets (paper 1.0).
        alpha: length-adaptive lambda for the policy advantage, ``1 - 1/(alpha * l)`` (paper 1.5).
        critic_updates: K critic optimiser steps per actor step (paper 2).
        lr_policy, lr_critic: AdamW learning rates.
        warmup_steps_critic, warmup_steps_policy: linear warm-up of the learning rate, in optimiser steps.
        weight_decay: AdamW weight decay for both models.
        adam_eps: AdamW epsilon for both models.
        max_grad_norm: gradient clipping (None = off).
        value_clip: PPO-style value clipping range (None = off).
        whiten_advantages: normalise policy advantages over the batch's action tokens.
        group_scale_by_std: GRPO divides by the group's std (False: mean baseline only).
        running_mean_window: window of the running-mean baseline (paper comparison 8).
        reward_range: (low, high) to monitor values outside it.
        bootstrap_reasons: termination reasons after which the return is V(s_end) rather than 0. The
            paper bootstraps budget ends; where a budget is far above what a good answer needs (the
            math demo: 96 tokens for a 25-token answer), treating ``length`` as a failure (value 0)
            stops an optimistic critic from rewarding answers that never end.
        token_budget: most (sequences x padded length) tokens in one micro-batch.
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
    critic_updates: int = 2
    lr_policy: float = 2e-4
    lr_critic: float = 5e-4
    warmup_steps_critic: int = 10
    warmup_steps_policy: int = 0
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    value_clip: float | None = None
    whiten_advantages: bool = False
    group_scale_by_std: bool = True
    running_mean_window: int = 8
    reward_range: tuple[float, float] = (0.0, 1.0)
    bootstrap_reasons: tuple[str, ...] = ("length", "turns", "timeout", "cancelled", "error")
    token_budget: int = 8192
    routing_replay: bool | None = None
    routing_metrics: bool = True
    routing_compare_every: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
        object.__setattr__(self, "aggregation", LossAggregation(self.aggregation))
        object.__setattr__(self, "reward_range", tuple(self.reward_range))
        object.__setattr__(self, "bootstrap_reasons", tuple(self.bootstrap_reasons))
        allowed = ("length", "turns", "timeout", "cancelled", "error")
        unknown = [r for r in self.bootstrap_reasons if r not in allowed]
        if unknown:
            raise ValueError(f"bootstrap_reasons {unknown} are not among {allowed} ('stop' always ends with 0)")
        check_interval(self.eps_low, self.eps_high)
        if self.critic_updates < 0:
            raise ValueError(f"critic_updates must be >= 0, got {self.critic_updates}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam_critic <= 1.0:
            raise ValueError(f"lam_critic must lie in [0, 1], got {self.lam_critic}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
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
