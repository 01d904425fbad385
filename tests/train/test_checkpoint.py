"""Checkpoints survive a kill in the middle of replacing the version-0 critic (value pretraining)."""

import shutil

import torch

from sao.models.critic import Critic
from sao.models.policy import load_policy
from sao.train.checkpoint import checkpoint_dir, load_checkpoint, replace_critic, save_checkpoint


def test_a_critic_replacement_killed_between_its_renames_keeps_the_old_critic(tmp_path, policy_dir, tokenizer):
    policy = load_policy(policy_dir)
    critic = Critic.from_policy(policy)
    save_checkpoint(tmp_path, 0, policy, tokenizer, critic, trainer_state={})
    path = checkpoint_dir(tmp_path, 0)
    # What a kill between `critic -> critic.old` and `critic.new -> critic` leaves behind.
    (path / "critic").rename(path / "critic.old")
    shutil.copytree(path / "critic.old", path / "critic.new")
    loaded = load_checkpoint(tmp_path, 0)
    assert loaded.critic is not None and (path / "critic").exists() and not (path / "critic.old").exists()
    for name, tensor in critic.state_dict().items():
        assert torch.equal(tensor, loaded.critic.state_dict()[name])
    # The replacement, run again, completes and leaves nothing beside.
    with torch.no_grad():
        next(critic.parameters()).add_(1.0)
    replace_critic(tmp_path, 0, critic)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("critic")) == ["critic"]
    again = load_checkpoint(tmp_path, 0).critic
    assert torch.equal(next(again.parameters()), next(critic.parameters()))
