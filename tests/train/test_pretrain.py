"""Value pretraining: the critic fitted on version-0 trajectories predicts held-out returns better."""

import asyncio
import dataclasses
import json

import pytest
import torch

from sao.envs import make_env
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.config import WriterConfig
from sao.lake.reader import read_trajectories
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from sao.models.policy import load_policy
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.torch_engine import TorchEngine
from sao.train.checkpoint import checkpoint_dir, load_checkpoint
from sao.train.config import UpdateConfig
from sao.train.loop import TRAIN_COLUMNS, prepare_run, run_training
from sao.train.pretrain import (
    REPORT_FILE,
    PretrainConfig,
    ValueTarget,
    fit_critic,
    monte_carlo_returns,
    pretrain_value,
    value_metrics,
)
from sao.train.replay import replay_steps
from sao.train.step import Learner
from schemas.vocabulary import TerminationReason
from tests.train.test_loop import make_config

pytestmark = pytest.mark.usefixtures("one_thread")


def judged(task):
    """A judge the critic can learn from the prompt: word problems pay 1, bare expressions 0."""
    return 1.0 if "How many" in task.prompt else 0.0


def version_zero_rollouts(policy_dir, tokenizer, lake, run_id, count, seed=0, ends=None):
    """``count`` real rollouts of the version-0 policy, rewarded by :func:`judged`, written to the lake
    (with ``ends``, their termination reasons replaced by these, in order)."""
    engine = TorchEngine(load_policy(policy_dir))
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env), AgentConfig(max_tokens=24, max_turns=2))
    tasks = generate_tasks(MathToolConfig(num_train=count, num_heldout=0, seed=seed))

    async def many():
        return await asyncio.gather(*[loop.run(t, run_id=run_id, seed=i) for i, t in enumerate(tasks)])

    records = [dataclasses.replace(r, reward=judged(t)) for r, t in zip(asyncio.run(many()), tasks, strict=True)]
    if ends is not None:
        records = [dataclasses.replace(r, termination_reason=TerminationReason(end),
                                       error="RuntimeError: replica died" if end == "error" else None)
                   for r, end in zip(records, ends, strict=True)]
    engine.close()
    loop.close()
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)
    return records


UPDATE = UpdateConfig(token_budget=4096, lr_critic=2e-3, warmup_steps_critic=2)




@pytest.fixture
def run(tmp_path, policy_dir, tokenizer):
    cfg = make_config(tmp_path, policy_dir, update=UPDATE, total_steps=1)
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    version_zero_rollouts(policy_dir, tokenizer, lake, cfg.run_id, 40)
    return cfg, lake


def test_monte_carlo_returns_are_the_reward_to_go_over_actions_only():
    from sao.train.batch import collate

    row = {"trajectory_id": "t", "task_id": "a", "prompt_ids": [1, 2], "completion_ids": [5, 6, 7, 8, 9],
           "action_mask": [True, True, False, False, True], "logprobs": [-1.0, -1.0, 0.0, 0.0, -1.0],
           "reward": 2.0, "termination_reason": "length", "min_policy_version": 0, "logprob_kind": "sampling",
           "sampling": {"temperature": 1.0, "top_k": None, "top_p": 1.0}}
    returns = monte_carlo_returns(collate([row], trainer_version=0), gamma=0.5)
    # actions at 0, 1, 4; reward on the last; no bootstrap even though the end is a budget end
    assert returns[0].tolist() == [0.5, 1.0, 0.0, 0.0, 2.0]


def test_fitting_the_critic_reduces_held_out_value_loss(run):
    cfg, lake = run
    rows = read_trajectories(lake, run_id=cfg.run_id, columns=list(TRAIN_COLUMNS)).to_pylist()
    train, heldout = rows[:32], rows[32:]
    checkpoint = load_checkpoint(cfg.checkpoint_root, 0)
    learner = Learner(UPDATE, checkpoint.policy, checkpoint.critic)
    attention = {n: p.detach().clone() for n, p in learner.critic.named_parameters() if ".self_attn." in n}
    before = value_metrics(learner.critic, heldout, UPDATE)
    steps, metrics = fit_critic(learner, lambda epoch: (train[i:i + 8] for i in range(0, len(train), 8)), 4,
                                ValueTarget.MONTE_CARLO)
    after = value_metrics(learner.critic, heldout, UPDATE)
    assert steps == 16 and learner.critic_steps == 16 and learner.policy_steps == 0
    assert after[0] < 0.5 * before[0], (before, after)
    assert after[1] > before[1]
    for name, parameter in learner.critic.named_parameters():  # frozen attention stays frozen
        if name in attention:
            assert torch.equal(parameter, attention[name]), name


def test_lambda_return_targets_use_the_critics_own_values(run):
    cfg, lake = run
    rows = read_trajectories(lake, run_id=cfg.run_id, columns=list(TRAIN_COLUMNS)).to_pylist()
    checkpoint = load_checkpoint(cfg.checkpoint_root, 0)
    learner = Learner(UPDATE, checkpoint.policy, checkpoint.critic)
    steps, metrics = fit_critic(learner, lambda epoch: [rows[:8]], 2, ValueTarget.LAMBDA_RETURN)
    assert steps == 2 and "critic/value_mean_before" in metrics and metrics["critic/loss"] > 0


@pytest.mark.slow
@pytest.mark.ray
def test_pretraining_through_ray_data_and_ray_train_becomes_the_version_zero_critic(run, ray_session, policy_dir,
                                                                                     tokenizer):
    cfg, lake = run
    version_zero_rollouts(policy_dir, tokenizer, lake, cfg.run_id, 2, seed=3,
                          ends=["cancelled", "error"])  # stored, left out as RL leaves them out
    old_critic = load_checkpoint(cfg.checkpoint_root, 0).critic
    report = pretrain_value(cfg, PretrainConfig(num_samples=50, heldout_fraction=0.25, epochs=4, batch_size=8))
    assert (report.num_train, report.num_heldout, report.optimizer_steps) == (30, 10, 16)
    assert report.trajectories_version == lake.version("trajectories")
    assert report.loss_after < 0.5 * report.loss_before
    assert report.explained_variance_after > report.explained_variance_before
    written = json.loads((checkpoint_dir(cfg.checkpoint_root, 0) / "critic" / REPORT_FILE).read_text())
    assert written["loss_after"] == report.loss_after
    # The training loop starts from the pretrained critic, and step 0 still replays bit for bit.
    new_critic = load_checkpoint(cfg.checkpoint_root, 0).critic
    assert not torch.equal(new_critic.value_head.weight, old_critic.value_head.weight)
    run_training(cfg)
    assert replay_steps(lake, cfg.run_id, 0).ok
    with pytest.raises(ValueError, match="has trained already"):
        pretrain_value(cfg, PretrainConfig(num_samples=40))
