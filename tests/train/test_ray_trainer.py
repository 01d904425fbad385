"""Ray Train: two data-parallel workers give the same update as one; the config Ray Train's controller sees."""

import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from sao.lake.config import LakeConfig
from sao.lake.store import Lake
from sao.train.checkpoint import load_checkpoint
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.loop import prepare_run, run_training
from sao.train.ray_trainer import fit, unsealed
from tests.train.test_loop import make_config, roll_out


def _load(path):
    """A checkpoint directory moved out of its root."""
    shutil.copytree(path, path.parent / "moved" / "v000001")
    return load_checkpoint(path.parent / "moved", 1)


@pytest.mark.ray
def test_two_workers_give_the_same_update_as_one(tmp_path, policy_dir, tokenizer, ray_session):
    # adam_eps = 1 makes the first Adam step about lr * g: linear in the gradient, so a comparison of
    # weights is a comparison of gradients (with eps 1e-8 every step is lr * sign(g)).
    update = UpdateConfig(adam_eps=1.0, lr_policy=1e-2, lr_critic=1e-2, token_budget=4096)
    one = make_config(tmp_path, policy_dir, update=update, total_steps=1, batch_size=6)
    prepare_run(one)
    roll_out(policy_dir, tokenizer, Lake.open(one.lake), one.run_id, 6)
    # The second run reads a copy of the same lake and writes the same checkpoint root (a checkpoint
    # path is part of the version's ledger row), after the first run's version 1 is set aside.
    shutil.copytree(tmp_path / "lake", tmp_path / "lake-two")
    run_training(one)
    shutil.copytree(tmp_path / "ckpt" / "v000001", tmp_path / "one-v1")
    two = TrainConfig(**{**one.__dict__, "lake": LakeConfig(root=str(tmp_path / "lake-two")), "num_workers": 2})
    fit(two)
    a = _load(tmp_path / "one-v1")
    b = load_checkpoint(one.checkpoint_root, 1)
    base = load_checkpoint(one.checkpoint_root, 0).policy
    moved = 0.0
    for (name, pa_), pb, p0 in zip(a.policy.named_parameters(), b.policy.parameters(), base.parameters(), strict=True):
        assert torch.allclose(pa_, pb, rtol=1e-5, atol=1e-9), name
        moved = max(moved, float((pa_ - p0).abs().max()))
    assert moved > 1e-6  # the update did something
    for (name, ca), cb in zip(a.critic.named_parameters(), b.critic.parameters(), strict=True):
        assert torch.allclose(ca, cb, rtol=1e-5, atol=1e-9), name
    steps = Lake.open(two.lake).read("train_steps").to_pylist()
    assert dict(steps[0]["metrics"])["batch/world_size"] == 2.0


def test_ray_trains_controller_gets_a_config_it_unpickles_without_the_training_stack(tmp_path, policy_dir,
                                                                                     monkeypatch):
    captured = {}

    class Trainer:  # stands in for TorchTrainer: what fit() hands Ray Train
        def __init__(self, train_func, *, train_loop_config, **options):
            captured.update(train_loop_config)

        def fit(self):
            return "fitted"

    monkeypatch.setattr("ray.train.torch.TorchTrainer", Trainer)
    cfg = make_config(tmp_path, policy_dir)
    assert fit(cfg, max_steps=3) == "fitted"
    assert set(captured) == {"sealed"} and isinstance(captured["sealed"], bytes)
    assert unsealed(captured) == {"config": cfg, "gpu": False, "max_steps": 3}
    # what Ray Train's controller process unpickles imports neither this package nor transformers
    code = ("import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sao', 'transformers', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(captured), capture_output=True, check=True)
    assert out.stdout.decode().strip() == "[]"
