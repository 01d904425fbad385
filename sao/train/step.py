"""One update: advantages, one actor step, K critic steps (SAO.md sections 1-3).

Per batch of trajectories:

1. critic values at action positions, ``V(s_end)`` for budget ends (no gradient);
2. advantages by the configured estimator: skip-observation GAE (``lam_policy`` length-adaptive for
   the policy, ``lam_critic`` for the critic's returns), group-normalised, or reward minus a running mean;
3. one actor step: current log-probabilities under the distribution the rollout recorded, the DIS (or
   PPO-clip) loss over micro-batches formed by a token budget, gradients accumulated with the whole
   batch's denominator and summed across data-parallel workers;
4. K critic steps on the same returns.

MoE routing replay (R3, ``UpdateConfig.routing_replay``): where the batch carries the rollout's routing
record, the actor's forward uses the recorded experts with routing weights from the live router
(:func:`sao.models.routing.replay_routing`); positions without a record (the last token, trailing
observations, padding, old rows) route live. Observation tokens are replayed like every other input:
their recorded routing is the one the rollout's context for the following action tokens was built
with. The critic routes live (its router is its own). :func:`routing_metrics` reports how often the
live router disagrees with the record and what DIS keeps under each routing.

A sampled token that the current policy's top-k / top-p filter excludes has probability 0 under the
sampling distribution: its log-probability is replaced by :data:`FILTERED_LOGPROB`, which puts rho
below any DIS interval (the token is masked) and passes no gradient.

Device: the :class:`Learner` trains where its models are (:mod:`sao.train.device`); every batch is moved
there, every tensor of the update is made there, and metrics come back as Python floats. With ``bf16``
the forward passes run under CUDA bf16 autocast; logits and values are cast to float32 before the
log-probabilities, advantages and losses, and the weights and optimiser state stay float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from sao.algos.advantages import (
    RunningMeanBaseline,
    broadcast_to_actions,
    grpo_advantages,
    length_adaptive_lambda,
    skip_observation_gae,
    success_advantages,
)
from sao.algos.dis import dis_weights
from sao.algos.losses import dis_policy_loss, ppo_clip_loss, value_loss
from sao.algos.masked import LossAggregation, aggregate, masked_mean, masked_whiten
from sao.algos.sampling import sampling_logprobs
from sao.models.critic import Critic
from sao.models.routing import ReplayStats, moe_routers, replay_routing
from sao.models.trimmed import decoder_at, supports_decoder_at
from sao.train.batch import TrainBatch, completion_positions, split_by_token_budget
from sao.train.config import AdvantageEstimator, PolicyLossKind, UpdateConfig
from sao.train.device import autocast

__all__ = ["FILTERED_LOGPROB", "LENGTH_BUCKETS", "PLAIN_HEAD_MODEL_TYPES", "Learner", "critic_returns", "critic_values",
           "explained_variance", "forward_mask", "lr_factor", "policy_logprobs", "scoring_logits", "whiten_over_the_batch"]

FILTERED_LOGPROB = -1.0e4
# Upper bounds (action tokens) of the length buckets the kept fraction is reported by.
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# Causal LMs whose logits are their output layer applied to the decoder's last hidden state and nothing
# else (no soft-capping or scaling): their logits are computed at the scoring positions only.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def forward_mask(batch: TrainBatch) -> torch.Tensor | None:
    """The attention mask the trainer's forward passes give the models: None when every row is padded at
    its end only (what :func:`sao.train.batch.collate` and ``select`` make), else ``batch.attention_mask``.

    In a causal model a right-padded row's real tokens attend to real tokens only, with or without the
    mask; the pad positions' outputs score nothing. Without a mask the attention runs causal without a
    (B, 1, L, L) mask, which on CPU is the faster kernel path (about 3% of the SAO update on the peer
    single-turn shape; the values agree to float32 rounding, tested)."""
    mask = batch.attention_mask
    if mask.shape[1] < 2 or bool((mask[:, 1:] <= mask[:, :-1]).all()):
        return None
    return mask


def scoring_logits(policy: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """(B, T, V) float32 logits at the input positions that score each completion token.

    For a :data:`PLAIN_HEAD_MODEL_TYPES` model the output layer runs at those positions only (the
    prompt's positions score nothing; the output layer is a quarter of the tiny policy's work per
    token), and on right-padded rows so does its last decoder layer where
    :func:`~sao.models.trimmed.decoder_at` supports the model (not while its routing is recorded; a
    replayed routing is replayed there); any other model runs its whole forward and the positions are gathered from its logits.
    All give the same values to float rounding (tested)."""
    positions = completion_positions(batch)
    config = getattr(policy, "config", None)
    if getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES and hasattr(policy, "get_decoder"):
        decoder, mask = policy.get_decoder(), forward_mask(batch)
        if mask is None and supports_decoder_at(decoder):
            scoring = decoder_at(decoder, batch.input_ids, positions)
        else:
            hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, use_cache=False).last_hidden_state
            scoring = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        # The output layer in float32 even under bf16 autocast: its logits decide the DIS ratio against the
        # engine's log-probabilities, and bf16 would round a logit of 16-32 to steps of 0.125-0.25.
        with torch.autocast(scoring.device.type, enabled=False):
            return policy.get_output_embeddings()(scoring.float())
    logits = policy(input_ids=batch.input_ids, attention_mask=forward_mask(batch), use_cache=False).logits.float()
    return logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def policy_logprobs(policy: torch.nn.Module, batch: TrainBatch, *, entropy: bool = False,
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log pi_theta of each completion token, under the distribution the rollout recorded; with
    ``entropy``, also (B, T) that distribution's entropy at each action token (0 elsewhere)."""
    scoring = scoring_logits(policy, batch)  # (B, T, V)
    positions = completion_positions(batch)
    targets = batch.input_ids.gather(1, (positions + 1).clamp(max=batch.input_ids.shape[1] - 1))
    sampled = sampling_logprobs(scoring, batch.temperature.unsqueeze(-1), batch.top_k.unsqueeze(-1),
                                batch.top_p.unsqueeze(-1))
    if bool(batch.raw_logprobs.any()):
        raw = torch.log_softmax(scoring, dim=-1)
        sampled = torch.where(batch.raw_logprobs.view(-1, 1, 1), raw, sampled)
    logp = sampled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    filtered = batch.action_mask & ~torch.isfinite(logp)
    logp = torch.where(filtered, torch.full_like(logp, FILTERED_LOGPROB), logp)
    logp = torch.where(batch.action_mask, logp, torch.zeros_like(logp))
    if not entropy:
        return logp
    finite = torch.isfinite(sampled)  # tokens top-k / top-p leave out have probability 0: no term
    terms = torch.where(finite, sampled.exp() * torch.where(finite, sampled, torch.zeros_like(sampled)), 0.0)
    return logp, torch.where(batch.action_mask, -terms.sum(-1), torch.zeros_like(logp))


def critic_values(critic: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (B, T) float32: V of the state each completion token was sampled in; ``v_end`` (B,):
    the value after the last token. A :class:`~sao.models.critic.Critic` on right-padded rows runs its
    last layer at those T + 1 positions only (:meth:`~sao.models.critic.Critic.values_at`)."""
    mask = forward_mask(batch)
    if isinstance(critic, Critic) and mask is None:
        width = batch.action_mask.shape[1]
        read = critic.values_at(batch.input_ids, completion_positions(batch, width + 1))  # (B, T + 1)
        values, v_end = read[:, :width], read.gather(1, batch.completion_lens.unsqueeze(-1)).squeeze(-1)
    else:
        all_values = critic(input_ids=batch.input_ids, attention_mask=mask).float()  # (B, L)
        values = all_values.gather(1, completion_positions(batch))
        last = (batch.prompt_lens + batch.completion_lens - 1).unsqueeze(-1)
        v_end = all_values.gather(1, last).squeeze(-1)
    return torch.where(batch.action_mask, values, torch.zeros_like(values)), v_end


@torch.no_grad()
def explained_variance(target: torch.Tensor, predicted: torch.Tensor) -> float | None:
    """``1 - Var(target - predicted) / Var(target)`` over the given elements (float64; None when the
    targets do not vary): 1 for a perfect prediction, 0 for the targets' mean, below 0 for worse."""
    target, predicted = target.double(), predicted.double()
    spread = float(target.var(unbiased=False))
    return None if spread <= 1e-12 else 1.0 - float((target - predicted).var(unbiased=False)) / spread


@torch.no_grad()
def critic_returns(batch: TrainBatch, values: torch.Tensor, v_end: torch.Tensor, config: UpdateConfig) -> torch.Tensor:
    """(B, T) the critic's targets: skip-observation GAE returns with ``lam_critic``, bootstrapped with
    ``v_end`` where the row's end bootstraps. Each row's returns depend on its own values only."""
    bootstrap = torch.where(batch.bootstrap, v_end, torch.zeros_like(v_end))
    _, returns = skip_observation_gae(batch.rewards, values, batch.action_mask, bootstrap, config.gamma,
                                      config.lam_critic)
    return returns


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def whiten_over_the_batch(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_whiten` over the whole batch: with data-parallel workers, each holding a shard of
    it, the mean and the variance are summed across them, so every worker scales by the batch's
    statistics, as one worker with the whole batch would."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return masked_whiten(values, mask, reduce=_all_reduce_sum if distributed else None)


def _sum_gradients_across_workers(module: torch.nn.Module) -> None:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    for param in module.parameters():
        if param.requires_grad:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)


def lr_factor(step: int, warmup_steps: int, cosine_steps: int = 0, final_ratio: float = 1.0) -> float:
    """The learning rate of optimiser step ``step`` (from 0) as a fraction of the peak: a linear
    warm-up over ``warmup_steps`` (step ``s`` below it gets ``(s + 1) / warmup_steps``), then, with
    ``cosine_steps``, a cosine from 1 down to ``final_ratio`` over that many steps, held at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if cosine_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / cosine_steps)
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, cosine_steps: int = 0,
              final_ratio: float = 1.0) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, cosine_steps, final_ratio))


@dataclasses.dataclass
class Learner:
    """The models, optimisers and state that one update changes.

    ``critic`` is None for estimators without a critic. ``running_mean`` is the baseline's state for
    the ``running_mean`` estimator (saved with checkpoints so a replayed step sees the same window).
    The update runs on the models' device (:attr:`device`; policy and critic on the same one, placed
    before the Learner is made, so that the optimisers hold the placed parameters); ``bf16``: CUDA bf16
    autocast around the forward passes (refused on CPU).
    """

    config: UpdateConfig
    policy: torch.nn.Module
    critic: torch.nn.Module | None = None
    bf16: bool = False
    policy_optimizer: torch.optim.Optimizer = dataclasses.field(init=False)
    critic_optimizer: torch.optim.Optimizer | None = dataclasses.field(init=False, default=None)
    running_mean: RunningMeanBaseline = dataclasses.field(init=False)
    policy_values: Callable[[Sequence[Mapping], TrainBatch], tuple[torch.Tensor, torch.Tensor]] | None = (
        dataclasses.field(init=False, default=None))
    """``UpdateConfig.oracle_values``: ``(rows, batch) -> (values (B, T), v_end (B,))`` that the policy's
    advantages use in place of the critic's (:class:`sao.train.oracle.DemonstrationOracle`)."""

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg.uses_critic and self.critic is None:
            raise ValueError(f"algorithm {cfg.algorithm.value!r} needs a critic, got critic=None")
        if self.critic is not None and _device_of(self.critic) != self.device:
            raise ValueError(f"the policy is on {self.device} but the critic on {_device_of(self.critic)}: "
                             "place both on the training device before making the Learner")
        autocast(self.device, self.bf16)  # bf16 on a CPU is refused here, before any step
        betas = (0.9, cfg.adam_beta2)
        self.policy_optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=cfg.lr_policy,
            weight_decay=cfg.weight_decay, eps=cfg.adam_eps, betas=betas)
        self.policy_scheduler = _schedule(self.policy_optimizer, cfg.warmup_steps_policy, cfg.cosine_steps_policy,
                                          cfg.lr_final_ratio)
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(
                [p for p in self.critic.parameters() if p.requires_grad], lr=cfg.lr_critic,
                weight_decay=cfg.weight_decay, eps=cfg.adam_eps, betas=betas)
            self.critic_scheduler = _schedule(self.critic_optimizer, cfg.warmup_steps_critic)
        self.running_mean = RunningMeanBaseline(cfg.running_mean_window)
        self.has_routers = bool(moe_routers(self.policy))
        self.critic_steps = 0
        self.policy_steps = 0

    @property
    def device(self) -> torch.device:
        """Where the models are, and so where every update runs."""
        return _device_of(self.policy)

    def _forward(self) -> contextlib.AbstractContextManager:
        """The context of a forward pass: bf16 autocast with ``bf16``, else nothing."""
        return autocast(self.device, self.bf16)

    # ----- state for checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "policy_optimizer": self.policy_optimizer.state_dict(),
            "policy_scheduler": self.policy_scheduler.state_dict(),
            "running_mean": list(self.running_mean._recent),
            "critic_steps": self.critic_steps,
            "policy_steps": self.policy_steps,
        }
        if self.critic_optimizer is not None:
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
            state["critic_scheduler"] = self.critic_scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (tensors may be on any device: AdamW's moments follow their
        parameters to the training device; its step counts stay on CPU, where AdamW keeps them)."""
        self.policy_optimizer.load_state_dict(state["policy_optimizer"])
        self.policy_scheduler.load_state_dict(state["policy_scheduler"])
        self.running_mean._recent.clear()
        self.running_mean.update(state["running_mean"])
        self.critic_steps = int(state["critic_steps"])
        self.policy_steps = int(state["policy_steps"])
        if self.critic_optimizer is not None:
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
            self.critic_scheduler.load_state_dict(state["critic_scheduler"])

    # ----- the update ---------------------------------------------------------------------------

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[list[int], TrainBatch]]:
        for rows in split_by_token_budget(batch, self.config.micro_batch_tokens(torch.get_num_threads())):
            yield rows, batch.select(rows)

    def _denominator(self, batch: TrainBatch) -> float:
        local = batch.action_mask.sum() if self.config.aggregation is LossAggregation.TOKEN else torch.tensor(
            batch.action_mask.shape[0], device=batch.device)
        return float(_all_reduce_sum(local.to(torch.float64).clone()))

    @torch.no_grad()
    def advantages(self, batch: TrainBatch, sequence_advantages: torch.Tensor | None = None,
                   policy_values: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """Policy advantages (B, T), critic returns (B, T) or None, and value metrics.

        ``sequence_advantages`` (B,) overrides the group / running-mean estimate: with several
        data-parallel workers those are computed over the whole batch (a group may span shards) and
        each worker passes its rows. All three on :attr:`device`, where ``batch`` is moved.
        """
        batch = batch.to(self.device)
        values = None
        if self.config.advantage_estimator is AdvantageEstimator.CRITIC_GAE:
            values = torch.zeros(batch.action_mask.shape, device=batch.device)
            v_end = torch.zeros(batch.action_mask.shape[0], device=batch.device)
            for rows, mb in self._micro_batches(batch):
                with self._forward():
                    mb_values, mb_end = critic_values(self.critic, mb)
                values[rows, : mb_values.shape[1]] = mb_values.float()
                v_end[rows] = mb_end.float()
            values = (values, v_end)
        return self._advantages_from(batch, values, sequence_advantages, policy_values)

    @torch.no_grad()
    def _advantages_from(self, batch: TrainBatch, values: tuple[torch.Tensor, torch.Tensor] | None,
                         sequence_advantages: torch.Tensor | None,
                         policy_values: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """:meth:`advantages` given the critic's ``(values (B, T), v_end (B,))`` before the update
        (the critic estimator) or None (the others); ``policy_values``: the values the policy's
        advantages use instead (the critic's returns still come from its own)."""
        cfg = self.config
        metrics: dict[str, float] = {}
        estimator = cfg.advantage_estimator
        if policy_values is not None and estimator is not AdvantageEstimator.CRITIC_GAE:
            raise ValueError(f"policy_values replace a critic's values; estimator {estimator.value!r} has none")
        if estimator is AdvantageEstimator.CRITIC_GAE:
            values, v_end = values
            returns = critic_returns(batch, values, v_end, cfg)
            action = batch.action_mask
            low, high = cfg.reward_range
            metrics |= {
                "critic/value_mean_before": float(masked_mean(values, action)),
                "critic/frac_outside_reward_range": float((action & ((values < low) | (values > high))).sum())
                / max(int(action.sum()), 1),
                "critic/bootstrap_frac": float(batch.bootstrap.float().mean()),
            }
            # how much of the targets' spread the values explain (absent when the targets do not vary)
            explained = {"critic/explained_variance": explained_variance(returns[action], values[action])}
            if policy_values is not None:  # the oracle's values for the policy; the critic's error from them
                oracle, v_end = policy_values
                metrics |= {"oracle/value_mean": float(masked_mean(oracle, action)),
                            "oracle/critic_abs_error": float(masked_mean((values - oracle).abs(), action))}
                explained["oracle/explained_variance"] = explained_variance(returns[action], oracle[action])
                values = oracle
            metrics |= {name: value for name, value in explained.items() if value is not None}
            bootstrap = torch.where(batch.bootstrap, v_end, torch.zeros_like(v_end))
            lam_policy = (length_adaptive_lambda(batch.num_action_tokens, cfg.alpha) if cfg.lam_policy is None
                          else cfg.lam_policy)
            advantages, _ = skip_observation_gae(batch.rewards, values, batch.action_mask, bootstrap, cfg.gamma,
                                                 lam_policy)
        else:
            returns = None
            if sequence_advantages is None:
                sequence_advantages = self.sequence_advantages(batch.scalar_rewards, batch.group_ids)
            per_sequence = sequence_advantages.to(batch.device)
            advantages = broadcast_to_actions(per_sequence, batch.action_mask)
        if cfg.whiten_advantages:
            advantages = whiten_over_the_batch(advantages, batch.action_mask)
        if cfg.advantage_floor is not None:
            raised = batch.action_mask & (advantages < cfg.advantage_floor)
            metrics["actor/advantage_floored_frac"] = float(raised.sum()) / max(int(batch.action_mask.sum()), 1)
            advantages = torch.where(raised, torch.full_like(advantages, cfg.advantage_floor), advantages)
        metrics["actor/advantage_mean"] = float(masked_mean(advantages, batch.action_mask))
        return advantages, returns, metrics

    def sequence_advantages(self, scalar_rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor | None:
        """(B,) per-trajectory advantages of the group / running-mean / success estimators over a whole batch
        (every worker calls this with the same full batch); None for the critic estimator."""
        estimator = self.config.advantage_estimator
        if estimator is AdvantageEstimator.GROUP:
            return grpo_advantages(scalar_rewards, group_ids, scale_by_std=self.config.group_scale_by_std)
        if estimator is AdvantageEstimator.RUNNING_MEAN:
            return self.running_mean.advantages(scalar_rewards)
        if estimator is AdvantageEstimator.SUCCESS:
            return success_advantages(scalar_rewards, self.config.imitation_threshold)
        return None

    def update(self, batch: TrainBatch, sequence_advantages: torch.Tensor | None = None,
               policy_values: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
        """One actor step and K critic steps on ``batch`` (this worker's shard of it), on :attr:`device`.

        With a critic and K >= 1 the first critic step's forward passes give the values the advantages
        use: that step runs first, on the critic as it was before the update, and its forward with
        gradients gives the same values as a separate no-gradient forward would (tested), so the
        separate forward is not run. The actor step does not depend on the critic's steps, so the order
        changes no result, and the later critic steps may run beside the actor step on a second thread
        (:attr:`critic_beside_actor`). ``policy_values`` (``oracle_values``): the values the policy's
        advantages use instead of the critic's; the critic's own targets still come from its values."""
        started = time.perf_counter()
        batch = batch.to(self.device)
        critic_metrics: dict[str, float] = {}
        values: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.config.advantage_estimator is AdvantageEstimator.CRITIC_GAE and self.config.critic_updates > 0:
            critic_metrics, values = self._critic_step(batch, None)
            advantages, returns, metrics = self._advantages_from(batch, values, sequence_advantages, policy_values)
            remaining = self.config.critic_updates - 1
        else:
            advantages, returns, metrics = self.advantages(batch, sequence_advantages, policy_values)
            remaining = self.config.critic_updates if returns is not None else 0
        critic_s = time.perf_counter() - started

        def critic_steps() -> tuple[dict[str, float], float]:
            step_started, step_metrics = time.perf_counter(), critic_metrics
            self._later_critic_steps(batch, returns, remaining, values, step_metrics)
            return step_metrics, time.perf_counter() - step_started

        beside = _Beside(critic_steps) if remaining and self.critic_beside_actor else None
        actor_started = time.perf_counter()
        metrics |= self._actor_step(batch, advantages)
        actor_s = time.perf_counter() - actor_started
        critic_metrics, rest_s = beside.join() if beside is not None else critic_steps()
        metrics |= critic_metrics
        metrics |= {
            "time/actor_s": actor_s,
            "time/critic_s": critic_s + rest_s,
            "batch/trajectories": float(batch.action_mask.shape[0]),
            "batch/action_tokens": float(batch.action_mask.sum()),
            "batch/reward_mean": float(batch.scalar_rewards.mean()),
            "batch/staleness_mean": float(batch.staleness.float().mean()),
            "batch/staleness_max": float(batch.staleness.max()),
        }
        return metrics

    @property
    def critic_beside_actor(self) -> bool:
        """Whether :meth:`update` runs its later critic steps beside the actor step
        (``UpdateConfig.critic_beside_actor``); refused with data-parallel peers."""
        alone = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        if self.config.critic_beside_actor and not alone:
            raise ValueError("critic_beside_actor needs a trainer alone: with data-parallel peers the actor's and "
                             "the critic's gradient all-reduces would run in no fixed order")
        return self.config.critic_beside_actor

    def critic_update(self, batch: TrainBatch, returns: torch.Tensor | None = None,
                      steps: int | None = None) -> dict[str, float]:
        """``steps`` (default K) critic optimiser steps on ``batch`` and no actor step: value
        pretraining (:mod:`sao.train.pretrain`). ``returns`` (B, T) are the targets; None uses the
        critic's own ``lam_critic`` returns, as :meth:`update` does."""
        metrics: dict[str, float] = {}
        batch = batch.to(self.device)
        if returns is None:
            _, returns, metrics = self.advantages(batch)
        if returns is None:
            raise ValueError(f"algorithm {self.config.algorithm.value!r} has no critic to update")
        returns = returns.to(self.device)
        self._later_critic_steps(batch, returns, self.config.critic_updates if steps is None else steps, None,
                                 metrics)
        return metrics

    def _later_critic_steps(self, batch: TrainBatch, returns: torch.Tensor, steps: int,
                            before: tuple[torch.Tensor, torch.Tensor] | None, metrics: dict[str, float]) -> None:
        """``steps`` critic steps towards ``returns``, their last step's metrics merged into ``metrics``.
        ``before``: the values the critic gave before this update's first step (the one that computed the
        advantages), which ``value_clip`` clips against; None: the first of these steps' own."""
        for _ in range(steps):
            # The values a step saw are kept only where a later step clips against them.
            keep = before is None and self.config.value_clip is not None
            step_metrics, seen = self._critic_step(batch, returns, before, keep_values=keep)
            before = seen if keep else before
            metrics |= step_metrics

    @property
    def replays_routing(self) -> bool:
        """Whether the actor's forward replays recorded routing (``routing_replay``, None: MoE policy)."""
        replay = self.config.routing_replay
        return self.has_routers if replay is None else replay and self.has_routers

    def _routing(self, mb: TrainBatch, replay: bool) -> contextlib.AbstractContextManager[ReplayStats | None]:
        if replay and mb.routed_experts is not None:
            return replay_routing(self.policy, mb.routed_experts, mb.routing_mask)
        return contextlib.nullcontext()

    def _actor_step(self, batch: TrainBatch, advantages: torch.Tensor) -> dict[str, float]:
        cfg = self.config
        self.policy.train()
        self.policy_optimizer.zero_grad(set_to_none=True)
        denominator = self._denominator(batch)
        kept_per_row = torch.zeros(batch.action_mask.shape[0], device=batch.device)
        loss_total = entropy_total = 0.0
        replay = self.replays_routing
        audit = cfg.routing_metrics and self.has_routers and batch.routed_experts is not None
        every = cfg.routing_compare_every
        compare = audit and every > 0 and self.policy_steps % every == 0  # the extra forward, now and then
        routing = _RoutingAudit(batch, replay, compare) if audit and (replay or compare) else None
        for rows, mb in self._micro_batches(batch):
            with self._routing(mb, replay) as stats, self._forward():
                if cfg.entropy_coef:
                    logp, entropy = policy_logprobs(self.policy, mb, entropy=True)
                else:
                    logp = policy_logprobs(self.policy, mb)
            if routing is not None:
                other_logp, other_stats = None, None
                if compare:
                    with torch.no_grad(), self._routing(mb, not replay) as other_stats, self._forward():
                        other_logp = policy_logprobs(self.policy, mb)
                routing.add(rows, mb, logp.detach(), other_logp, stats or other_stats, cfg)
            adv = advantages[rows, : logp.shape[1]]
            if cfg.policy_loss is PolicyLossKind.DIS:
                loss, _ = dis_policy_loss(logp, mb.logp_rollout, adv, mb.action_mask, cfg.eps_low, cfg.eps_high,
                                          detach_weight=cfg.detach_weight, aggregation=cfg.aggregation,
                                          denominator=denominator)
                _, keep = dis_weights(logp.detach(), mb.logp_rollout, mb.action_mask, cfg.eps_low, cfg.eps_high)
            else:
                loss, _ = ppo_clip_loss(logp, mb.logp_rollout, adv, mb.action_mask, cfg.clip_low, cfg.clip_high,
                                        aggregation=cfg.aggregation, denominator=denominator)
                keep = mb.action_mask
            if cfg.entropy_coef:
                bonus = aggregate(entropy, mb.action_mask, cfg.aggregation, denominator)
                loss = loss - cfg.entropy_coef * bonus
                entropy_total += float(bonus.detach())
            loss.backward()
            loss_total += float(loss.detach())
            kept_per_row[rows] = keep.sum(-1).float()
        _sum_gradients_across_workers(self.policy)
        grad_norm = self._clip(self.policy)
        self.policy_optimizer.step()
        self.policy_scheduler.step()
        self.policy_steps += 1
        metrics = {"actor/loss": loss_total, "actor/grad_norm": grad_norm,
                   "actor/lr": self.policy_scheduler.get_last_lr()[0]} | kept_fraction_metrics(batch, kept_per_row)
        if cfg.entropy_coef:
            metrics["actor/entropy"] = entropy_total
        return metrics | (routing.metrics() if routing is not None else {})

    def _critic_step(self, batch: TrainBatch, returns: torch.Tensor | None,
                     before: tuple[torch.Tensor, torch.Tensor] | None = None, keep_values: bool = True,
                     ) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        """One critic optimiser step towards ``returns`` (B, T). ``returns`` None: the update's first
        step, whose targets are the critic's own ``lam_critic`` returns from this very forward (each
        row's returns depend on its own values only, so each micro-batch's are known after its
        forward). Returns its metrics and the values ``(values (B, T), v_end (B,))`` its forwards saw
        (before its optimiser step), which the advantages use. With ``value_clip``, each value is
        clipped to within it of ``before`` (the values before the update's first critic step; None:
        this step's own, so nothing is clipped), PPO style. ``keep_values`` False: the values are not
        kept (None in their place)."""
        cfg = self.config
        self.critic.train()
        self.critic_optimizer.zero_grad(set_to_none=True)
        denominator = self._denominator(batch)
        seen = (torch.zeros(batch.action_mask.shape, device=batch.device),
                torch.zeros(batch.action_mask.shape[0], device=batch.device)) if keep_values else None
        loss_total = 0.0
        value_sum = 0.0
        clipped = 0.0
        for rows, mb in self._micro_batches(batch):
            with self._forward():
                values, v_end = critic_values(self.critic, mb)
            width = values.shape[1]
            now, end_now = values.detach().float(), v_end.detach().float()
            if seen is not None:
                seen[0][rows, :width] = now
                seen[1][rows] = end_now
            target = critic_returns(mb, now, end_now, cfg) if returns is None else returns[rows, :width]
            clip = {}
            if cfg.value_clip is not None:
                clip = {"clip": cfg.value_clip, "old_values": now if before is None else before[0][rows, :width]}
            loss, m = value_loss(values, target, mb.action_mask, aggregation=cfg.aggregation,
                                 denominator=denominator, reward_range=cfg.reward_range, **clip)
            loss.backward()
            loss_total += float(loss.detach())
            actions = float(mb.action_mask.sum())
            value_sum += m["critic/value_mean"] * actions
            clipped += m["critic/value_clip_frac"] * actions
        _sum_gradients_across_workers(self.critic)
        grad_norm = self._clip(self.critic)
        self.critic_optimizer.step()
        self.critic_scheduler.step()
        self.critic_steps += 1
        actions = max(float(batch.action_mask.sum()), 1.0)
        metrics = {"critic/loss": loss_total, "critic/grad_norm": grad_norm, "critic/value_mean": value_sum / actions,
                   "critic/lr": self.critic_scheduler.get_last_lr()[0]}
        if cfg.value_clip is not None:
            metrics["critic/value_clip_frac"] = clipped / actions
        return metrics, seen

    def _clip(self, module: torch.nn.Module) -> float:
        params = [p for p in module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


class _Beside:
    """``work()`` on a thread of its own, started now, with the caller's torch thread count and grad mode
    (both per thread in torch; the steps set their own autocast); :meth:`join` returns its result or
    raises its error."""

    def __init__(self, work: Callable[[], object]) -> None:
        threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
        self._result: object = None
        self._error: BaseException | None = None

        def run() -> None:
            torch.set_num_threads(threads)
            try:
                with torch.set_grad_enabled(grad):
                    self._result = work()
            except BaseException as error:  # re-raised in the caller's thread
                self._error = error

        self._thread = threading.Thread(target=run, name="critic-steps", daemon=True)
        self._thread.start()

    def join(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class _RoutingAudit:
    """Accumulates, over one actor step's micro-batches, the routing metrics (:func:`routing_metrics`)."""

    def __init__(self, batch: TrainBatch, replay: bool, compare: bool) -> None:
        rows, layers = batch.action_mask.shape[0], batch.routed_experts.shape[2]
        self.batch, self.replay, self.compare = batch, replay, compare
        self.disagree = torch.zeros(rows, layers, device=batch.device)
        self.recorded = torch.zeros(rows, layers, device=batch.device)
        self.kept_replay = torch.zeros(rows, device=batch.device)
        self.kept_live = torch.zeros(rows, device=batch.device)

    def add(self, rows: list[int], mb: TrainBatch, logp: torch.Tensor, other_logp: torch.Tensor | None,
            stats: ReplayStats, cfg: UpdateConfig) -> None:
        """One micro-batch: ``logp`` under the step's routing, ``other_logp`` under the other one (None
        on steps that do not compare)."""
        replayed, live = (logp, other_logp) if self.replay else (other_logp, logp)
        for target, values in ((self.kept_replay, replayed), (self.kept_live, live)):
            if values is not None:
                _, keep = dis_weights(values, mb.logp_rollout, mb.action_mask, cfg.eps_low, cfg.eps_high)
                target[rows] = keep.sum(-1).float()
        self.disagree[rows] = stats.disagree
        self.recorded[rows] = stats.recorded

    def metrics(self) -> dict[str, float]:
        metrics = routing_metrics(self.batch, self.disagree, self.recorded, self.kept_replay, self.kept_live,
                                  self.replay)
        if not self.compare:  # only the step's own routing was run
            metrics.pop("routing/kept_frac_live" if self.replay else "routing/kept_frac_replay")
        return metrics


def routing_metrics(batch: TrainBatch, disagree: torch.Tensor, recorded: torch.Tensor, kept_replay: torch.Tensor,
                    kept_live: torch.Tensor, replay: bool) -> dict[str, float]:
    """Routing disagreement and DIS kept fractions under replayed and live routing.

    Args:
        disagree: (B, M) recorded tokens per row whose live top-k set differs from the recorded set, per
            MoE layer (every input position with a record that the layer ran at: prompt, actions and
            observations; the last layer runs where the outputs are read only, :mod:`sao.models.trimmed`).
        recorded: (B, M) the recorded positions each layer ran at, per row.
        kept_replay / kept_live: (B,) action tokens inside the DIS interval with the forward's routing
            replayed / recomputed live.
        replay: whether the update used replay (``routing/replay`` 1.0 or 0.0).

    ``routing/recorded_tokens`` counts the first MoE layer's (every recorded position, unless it is the
    last layer);
    ``routing/disagree_frac`` divides by the recorded tokens summed over layers; the per-layer and
    per-staleness fractions by their own counts; kept fractions by all action tokens (as
    ``actor/kept_frac``).
    """
    layers = disagree.shape[1]
    actions = batch.num_action_tokens.float().sum().clamp(min=1)
    metrics = {
        "routing/replay": float(replay),
        "routing/recorded_tokens": float(recorded[:, 0].sum()) if layers else 0.0,
        "routing/disagree_frac": float(disagree.sum() / recorded.sum().clamp(min=1)),
        "routing/kept_frac_replay": float(kept_replay.sum() / actions),
        "routing/kept_frac_live": float(kept_live.sum() / actions),
    }
    for layer in range(layers):
        metrics[f"routing/disagree_frac/layer_{layer}"] = float(disagree[:, layer].sum()
                                                              / recorded[:, layer].sum().clamp(min=1))
    for staleness in sorted(set(batch.staleness.tolist())):
        rows = batch.staleness == staleness
        metrics[f"routing/disagree_frac/staleness_{staleness}"] = float(
            disagree[rows].sum() / recorded[rows].sum().clamp(min=1))
    return metrics


def kept_fraction_metrics(batch: TrainBatch, kept_per_row: torch.Tensor) -> dict[str, float]:
    """DIS kept fraction overall, per staleness and per length bucket (SAO.md: report the bias)."""
    actions = batch.num_action_tokens.float()
    metrics = {"actor/kept_frac": float(kept_per_row.sum() / actions.sum().clamp(min=1)),
               "actor/all_masked_rows": float(((kept_per_row == 0) & (actions > 0)).sum())}
    for staleness in sorted(set(batch.staleness.tolist())):
        rows = batch.staleness == staleness
        metrics[f"actor/kept_frac/staleness_{staleness}"] = float(
            kept_per_row[rows].sum() / actions[rows].sum().clamp(min=1))
        metrics[f"batch/staleness_count/{staleness}"] = float(rows.sum())
    bucket_of = torch.bucketize(actions, torch.tensor(LENGTH_BUCKETS, dtype=torch.float32, device=actions.device))
    for bucket in sorted(set(bucket_of.tolist())):
        rows = bucket_of == bucket
        label = f"le_{LENGTH_BUCKETS[bucket]}" if bucket < len(LENGTH_BUCKETS) else f"gt_{LENGTH_BUCKETS[-1]}"
        metrics[f"actor/kept_frac/length_{label}"] = float(kept_per_row[rows].sum() / actions[rows].sum().clamp(min=1))
    return metrics
