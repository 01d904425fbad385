"""Checkpoints of every policy version: what resume, step replay and trajectory replay load.

Layout under a run's checkpoint root::

    v000000/policy/          Hugging Face directory (safetensors weights, tokenizer, sao_policy.json)
    v000000/critic/          critic backbone + value head (absent for algorithms without a critic)
    v000000/trainer_state.pt optimiser and scheduler states, the running-mean window, RNG states
    v000000/COMPLETE         written last: a directory without it is an interrupted save

``weights_hash`` is a SHA-256 over the policy's tensors (names sorted, dtype, shape and bytes): two
checkpoints with the same hash hold bit-identical weights, which is what step replay compares.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from sao.models.critic import Critic, load_critic, save_critic
from sao.models.policy import load_policy, save_policy

__all__ = ["Checkpoint", "checkpoint_dir", "latest_complete", "load_checkpoint", "save_checkpoint", "weights_hash"]

hf_logging.disable_progress_bar()  # a checkpoint per version: no progress bar per save and load

_COMPLETE = "COMPLETE"
_STATE = "trainer_state.pt"


def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of a model's state dict: sorted names, dtypes, shapes and raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(str(data.dtype).encode())
        digest.update(str(tuple(data.shape)).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def checkpoint_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


@dataclasses.dataclass
class Checkpoint:
    """What a checkpoint directory holds once loaded."""

    version: int
    path: Path
    policy: torch.nn.Module
    critic: Critic | None
    trainer_state: dict | None


def save_checkpoint(root: str | Path, version: int, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                    critic: Critic | None = None, trainer_state: dict | None = None) -> tuple[Path, str]:
    """Write version ``version``; returns (directory, weights_hash). Overwrites an interrupted save."""
    path = checkpoint_dir(root, version)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    save_policy(policy, path / "policy", tokenizer, policy_version=version)
    if critic is not None:
        save_critic(critic, path / "critic")
    state = {"trainer": trainer_state, "torch_rng": torch.get_rng_state()}
    torch.save(state, path / _STATE)
    (path / _COMPLETE).write_text(f"{version}\n")
    return path, weights_hash(policy)


def load_checkpoint(root: str | Path, version: int, *, with_critic: bool = True) -> Checkpoint:
    """Load version ``version``; raises ``FileNotFoundError`` naming what is missing."""
    path = checkpoint_dir(root, version)
    if not (path / _COMPLETE).exists():
        raise FileNotFoundError(f"checkpoint of version {version} at {path} is missing or incomplete")
    policy = load_policy(path / "policy")
    critic = load_critic(path / "critic") if with_critic and (path / "critic").exists() else None
    state = torch.load(path / _STATE, weights_only=False)
    return Checkpoint(version=version, path=path, policy=policy, critic=critic, trainer_state=state["trainer"])


def latest_complete(root: str | Path) -> int | None:
    """Newest version with a complete checkpoint under ``root`` (None when there is none)."""
    root = Path(root)
    if not root.exists():
        return None
    versions = [int(p.name[1:]) for p in root.iterdir() if p.name.startswith("v") and (p / _COMPLETE).exists()]
    return max(versions) if versions else None
