"""The critic's frozen attention through real SAO updates: attention unchanged, experts and head trained."""

import dataclasses

import pytest
import torch

from sao.models.critic import Critic, CriticConfig
from sao.models.policy import build_policy
from sao.train.batch import collate
from sao.train.config import UpdateConfig
from sao.train.step import Learner

pytestmark = pytest.mark.usefixtures("one_thread")


def rows():
    """Two trajectories of the default tiny policy's vocabulary: a natural end with an observation
    between two action segments, and a truncated one."""
    def row(tid, prompt, completion, mask, reward, reason):
        mask = [bool(m) for m in mask]
        logprobs = [-1.5 if m else 0.0 for m in mask]
        return {"trajectory_id": tid, "task_id": tid, "prompt_ids": prompt, "completion_ids": completion,
                "action_mask": mask, "logprobs": logprobs, "reward": reward, "termination_reason": reason,
                "min_policy_version": 0, "logprob_kind": "sampling",
                "sampling": {"temperature": 1.0, "top_k": None, "top_p": 1.0}}

    return [row("a", [1, 40, 41, 42], [50, 51, 52, 300, 301, 53, 54], [1, 1, 1, 0, 0, 1, 1], 1.0, "stop"),
            row("b", [1, 60, 61], [70, 71, 72, 73, 74], [1, 1, 1, 1, 1], 0.0, "length")]


def test_training_steps_leave_critic_attention_unchanged_and_move_its_experts():
    policy = build_policy(seed=0)
    critic = Critic.from_policy(policy)
    learner = Learner(UpdateConfig(critic_updates=2, warmup_steps_critic=1, eps_low=0.9, eps_high=9.0), policy, critic)
    before = {name: p.detach().clone() for name, p in critic.named_parameters()}
    batch = collate(rows(), trainer_version=0)
    for _ in range(2):
        learner.update(batch)
    assert learner.critic_steps == 4 and learner.policy_steps == 2
    attention = [n for n in before if ".self_attn." in n]
    experts = [n for n in before if ".mlp.experts." in n]
    assert attention and experts
    for name in attention:
        assert not critic.get_parameter(name).requires_grad
        assert torch.equal(critic.get_parameter(name), before[name]), name
    assert all(not torch.equal(critic.get_parameter(n), before[n]) for n in experts)
    assert not torch.equal(critic.value_head.weight, before["value_head.weight"])
    # The frozen tensors have no optimiser state: freezing cuts trainable state.
    optimised = {id(p) for group in learner.critic_optimizer.param_groups for p in group["params"]}
    assert not any(id(critic.get_parameter(n)) in optimised for n in attention)


@pytest.mark.parametrize("setup", [CriticConfig(), CriticConfig(freeze_attention=False, train_embeddings=True,
                                                                  train_norms=True)])
def test_the_run_config_critic_section_sets_up_the_critic_a_run_starts_with(tmp_path, policy_dir, setup):
    from sao.config import RunConfig
    from sao.lake.config import LakeConfig
    from sao.train.config import TrainConfig
    from sao.train.loop import _load_models

    keys = {f"critic.{name}": value for name, value in dataclasses.asdict(setup).items()}
    assert RunConfig().with_values(keys).critic_config() == setup
    cfg = TrainConfig(run_id="c", lake=LakeConfig(root=str(tmp_path / "lake")), checkpoint_root=str(tmp_path / "ckpt"),
                      policy_path=str(policy_dir), critic=setup)
    _, critic, _ = _load_models(cfg, 0)
    trains = {name: p.requires_grad for name, p in critic.backbone.named_parameters()}
    assert {n: t for n, t in trains.items() if ".self_attn." in n} and all(
        t != setup.freeze_attention for n, t in trains.items() if ".self_attn." in n)
    assert all(t == setup.train_embeddings for n, t in trains.items() if "embed_tokens" in n)
    assert all(t == setup.train_norms for n, t in trains.items() if n.endswith("norm.weight") and ".self_attn." not in n)
