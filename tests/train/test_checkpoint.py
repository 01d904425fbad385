"""Checkpoints: their layout (what the audit asks about a registered version), where a resumed run
registers its version, and a kill in the middle of replacing the version-0 critic (value pretraining)."""

import shutil
from pathlib import Path

import pytest
import torch

from sao.models.critic import Critic
from sao.models.policy import load_policy
from sao.train.checkpoint import (
    CheckpointMovedError,
    RegisteredState,
    checkpoint_dir,
    checkpoint_root_of,
    load_checkpoint,
    prune_checkpoint,
    registered_location,
    replace_critic,
    save_checkpoint,
    verify_registered,
    weights_hash,
)
from sao.train.checkpoint import policy_dir as version_policy_dir  # the fixture is `policy_dir`


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
    replace_critic(tmp_path, 0, critic, files={"report.json": "{}\n"})
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("critic")) == ["critic"]
    assert (path / "critic" / "report.json").read_text() == "{}\n"  # swapped in with the critic it reports
    again = load_checkpoint(tmp_path, 0).critic
    assert torch.equal(next(again.parameters()), next(critic.parameters()))


def test_the_root_of_a_registered_version_directory():
    assert checkpoint_root_of("/runs/a/checkpoints/v000003") == Path("/runs/a/checkpoints")
    assert checkpoint_root_of("file:///runs/a/checkpoints/v1000000") == Path("/runs/a/checkpoints")
    assert checkpoint_root_of("/runs/a/sft") is None  # a bare policy directory (version 0 from the warm start)
    assert checkpoint_root_of("s3://bucket/checkpoints/v000003") is None
    assert checkpoint_root_of("/runs/a/checkpoints/v12") is None


def test_each_state_of_a_registered_checkpoint(tmp_path, policy_dir, tokenizer):
    policy = load_policy(policy_dir)
    digest = weights_hash(policy)
    save_checkpoint(tmp_path, 1, policy, tokenizer, trainer_state={})
    save_checkpoint(tmp_path, 2, policy, tokenizer, trainer_state={})
    version_dir = str(checkpoint_dir(tmp_path, 1))
    assert verify_registered(version_dir, 1, digest) == (RegisteredState.VERIFIED, "")
    assert verify_registered(str(policy_dir), 0, digest)[0] is RegisteredState.VERIFIED  # a bare policy
    assert verify_registered(version_dir, 1, "0" * 64)[0] is RegisteredState.HASH_DIFFERS
    assert verify_registered(str(tmp_path / "v000009"), 9, digest)[0] is RegisteredState.MISSING
    assert verify_registered("s3://bucket/v000001", 1, digest)[0] is RegisteredState.NOT_LOCAL
    (checkpoint_dir(tmp_path, 1) / "COMPLETE").unlink()
    assert verify_registered(version_dir, 1, digest)[0] is RegisteredState.INCOMPLETE
    prune_checkpoint(tmp_path, 2, ("policy",))
    assert not version_policy_dir(tmp_path, 2).exists()
    assert verify_registered(str(checkpoint_dir(tmp_path, 2)), 2, digest)[0] is RegisteredState.PRUNED


def test_a_registered_version_keeps_its_location_only_when_the_root_reaches_it(tmp_path):
    here = tmp_path / "b" / "checkpoints"
    (here / "v000002").mkdir(parents=True)
    assert registered_location(None, here, 2) == str((here / "v000002").resolve())  # not registered yet
    assert registered_location(str(here / "v000002"), here, 2) == str(here / "v000002")
    (tmp_path / "a").symlink_to(tmp_path / "b")  # the old place, linked to the new one
    recorded = str(tmp_path / "a" / "checkpoints" / "v000002")
    assert registered_location(recorded, here, 2) == recorded  # kept as recorded: its row stays the same
    (tmp_path / "a").unlink()  # moved, with nothing left where the lake says the version is
    with pytest.raises(CheckpointMovedError) as error:
        registered_location(recorded, here, 2)
    message = str(error.value)
    assert f"registered at {recorded}" in message and f"checkpoint root {here.resolve()}" in message
    assert f"ln -s {(tmp_path / 'b').resolve()} {tmp_path / 'a'}" in message  # the folder that moved
    # Rows no trainer of this layout wrote (a remote URI, a relative path, a bare policy directory) are
    # left to the ledger, which compares them with the new row as they are.
    for other in ("s3://bucket/checkpoints/v000002", "ckpt/v000002", str(tmp_path / "sft")):
        assert registered_location(other, here, 2) == str((here / "v000002").resolve())
