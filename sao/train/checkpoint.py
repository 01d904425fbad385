"""Checkpoints of every policy version: what resume, step replay and trajectory replay load.

Layout under a run's checkpoint root::

    v000000/policy/          Hugging Face directory (safetensors weights, tokenizer, sao_policy.json)
    v000000/critic/          critic backbone + value head (absent for algorithms without a critic)
    v000000/trainer_state.pt optimiser and scheduler states, the running-mean window, and the CPU RNG
                             state (kept for inspection: each step seeds its RNG from its recorded seeds)
    v000000/COMPLETE         written last: a directory without it is an interrupted save
    v000000/PRUNED           written by retention (:mod:`sao.train.retention`) before it deletes parts
                             of a complete checkpoint: the JSON list of what is gone

A pruned checkpoint keeps its policy weights unless ``PRUNED`` lists ``policy``; loading a part it
lists raises :class:`CheckpointPrunedError` (never a silent fresh optimiser).

``weights_hash`` is a SHA-256 over the policy's tensors (names sorted, dtype, shape and bytes): two
checkpoints with the same hash hold bit-identical weights, which is what step replay compares.

Devices: a checkpoint holds CPU tensors whatever device the models trained on (the safetensors files
are written from CPU copies; the trainer state's tensors are moved to CPU before ``torch.save``), and
:func:`load_checkpoint` loads everything on CPU (``map_location="cpu"``). The trainer moves the models
to its device after loading, and AdamW's state follows them when it is loaded into the optimisers.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from sao.models.critic import Critic, load_critic, save_critic
from sao.models.policy import load_policy, save_policy
from sao.train.device import to_cpu

__all__ = [
    "PRUNABLE_PARTS",
    "Checkpoint",
    "CheckpointMovedError",
    "CheckpointPrunedError",
    "RegisteredState",
    "checkpoint_dir",
    "checkpoint_root_of",
    "complete_versions",
    "critic_dir",
    "has_full_state",
    "is_complete",
    "latest_complete",
    "load_checkpoint",
    "policy_dir",
    "prune_checkpoint",
    "pruned_parts",
    "registered_location",
    "replace_critic",
    "save_checkpoint",
    "verify_registered",
    "weights_hash",
]

hf_logging.disable_progress_bar()  # a checkpoint per version: no progress bar per save and load

_COMPLETE = "COMPLETE"
_PRUNED = "PRUNED"
_STATE = "trainer_state.pt"
_POLICY = "policy"
_CRITIC = "critic"
# What retention may delete, and the path of each part inside a version's directory.
PRUNABLE_PARTS: dict[str, str] = {"policy": _POLICY, "critic": _CRITIC, "trainer_state": _STATE}


class CheckpointPrunedError(RuntimeError):
    """A part of a checkpoint that retention deleted was asked for."""


class CheckpointMovedError(RuntimeError):
    """A resumed run's checkpoint root is not where the lake registered the run's checkpoints."""


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


def _is_version_dir(name: str) -> bool:
    """Whether ``name`` is a version directory's name (:func:`checkpoint_dir`)."""
    return len(name) >= 7 and name[0] == "v" and name[1:].isdigit()


def _local_path(checkpoint_uri: str) -> Path | None:
    """The local path of a registered checkpoint URI (plain or ``file://``); None for a remote one."""
    if "://" in checkpoint_uri and not checkpoint_uri.startswith("file://"):
        return None
    return Path(checkpoint_uri.removeprefix("file://"))


def checkpoint_root_of(checkpoint_uri: str) -> Path | None:
    """The checkpoint root holding ``checkpoint_uri`` when it is a local version directory of this
    layout (``<root>/v000003``, as ``policy_versions`` records it); None otherwise (a remote URI, a
    bare policy directory)."""
    path = _local_path(checkpoint_uri)
    return path.parent if path is not None and _is_version_dir(path.name) else None


def registered_location(recorded_uri: str | None, root: str | Path, version: int) -> str:
    """The location to register version ``version`` of a run whose checkpoints are under ``root``:
    ``recorded_uri`` (its ``policy_versions`` row) when that names the same directory, directly or
    through a link; else the resolved path of :func:`checkpoint_dir` (the version has no row yet, or
    its row names no absolute version directory: then the ledger compares the two rows).

    Raises:
        CheckpointMovedError: the version is registered somewhere else (the run's folder was moved or
            copied, or the run resumes on another machine): the lake records where each version's
            checkpoint is, and resume, replay and ``sao lake check`` read it there.
    """
    here = checkpoint_dir(root, version).resolve()
    if recorded_uri is None:
        return str(here)
    recorded = _local_path(recorded_uri)
    if recorded is not None and (recorded == here or recorded.resolve() == here):
        return recorded_uri
    if recorded is None or not recorded.is_absolute() or checkpoint_root_of(recorded_uri) is None:
        return str(here)  # not a version directory a trainer registered: the ledger compares the rows as they are
    was, now = recorded.parent, here.parent
    while was.name == now.name and was.parent != was and now.parent != now:  # the folder that moved
        was, now = was.parent, now.parent
    link = f"; or, if {was} is gone, link it to where it is now: ln -s {now} {was}"
    raise CheckpointMovedError(
        f"version {version} of this run is registered at {recorded_uri}, not under this run's checkpoint root "
        f"{here.parent}: the lake records where each version's checkpoint is, and resume, replay and "
        f"`sao lake check` read it there. Run from where the run started (workdir is relative to the "
        f"current directory){link}")


def policy_dir(root: str | Path, version: int) -> Path:
    """The Hugging Face directory of version ``version``'s policy (what engines and evaluation load)."""
    return checkpoint_dir(root, version) / _POLICY


def critic_dir(root: str | Path, version: int) -> Path:
    """The directory of version ``version``'s critic (absent for algorithms without one)."""
    return checkpoint_dir(root, version) / _CRITIC


def is_complete(root: str | Path, version: int) -> bool:
    """Whether version ``version``'s save finished (its ``COMPLETE`` marker is written last)."""
    return (checkpoint_dir(root, version) / _COMPLETE).exists()


@dataclasses.dataclass
class Checkpoint:
    """What a checkpoint directory holds once loaded."""

    version: int
    path: Path
    policy: torch.nn.Module
    critic: Critic | None
    trainer_state: dict | None
    pruned: tuple[str, ...] = ()


def save_checkpoint(root: str | Path, version: int, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                    critic: Critic | None = None, trainer_state: dict | None = None) -> tuple[Path, str]:
    """Write version ``version``; returns (directory, weights_hash). Overwrites an interrupted save.
    The models and ``trainer_state`` may be on any device; what is written is on CPU."""
    path = checkpoint_dir(root, version)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    save_policy(policy, path / _POLICY, tokenizer, policy_version=version)
    if critic is not None:
        save_critic(critic, path / _CRITIC)
    state = {"trainer": to_cpu(trainer_state), "torch_rng": torch.get_rng_state()}
    torch.save(state, path / _STATE)
    (path / _COMPLETE).write_text(f"{version}\n")
    return path, weights_hash(policy)


def pruned_parts(root: str | Path, version: int) -> tuple[str, ...]:
    """Parts of version ``version`` that retention deleted (empty for an intact checkpoint)."""
    marker = checkpoint_dir(root, version) / _PRUNED
    return tuple(json.loads(marker.read_text())) if marker.exists() else ()


def load_checkpoint(root: str | Path, version: int, *, with_critic: bool = True, with_state: bool = True,
                    require_state: bool = False) -> Checkpoint:
    """Load version ``version`` on CPU (see the module docstring); raises ``FileNotFoundError`` naming
    what is missing.

    ``with_state=False`` skips the trainer state (trajectory replay needs the weights only). With
    ``require_state``, a checkpoint whose trainer state (or, ``with_critic``, critic) retention pruned
    raises :class:`CheckpointPrunedError` instead of loading without it (resume and step replay).
    """
    path = checkpoint_dir(root, version)
    if not (path / _COMPLETE).exists():
        raise FileNotFoundError(f"checkpoint of version {version} at {path} is missing or incomplete")
    pruned = pruned_parts(root, version)
    needed = ["policy"] + (["trainer_state"] if require_state else []) + (
        ["critic"] if require_state and with_critic else [])
    gone = [part for part in needed if part in pruned]
    if gone:
        raise CheckpointPrunedError(
            f"checkpoint of version {version} at {path}: retention deleted {gone} (PRUNED lists {list(pruned)})")
    policy = load_policy(path / _POLICY)
    _restore_critic(path)
    critic = load_critic(path / _CRITIC) if with_critic and (path / _CRITIC).exists() else None
    state = None
    if with_state and (path / _STATE).exists():
        state = torch.load(path / _STATE, weights_only=False, map_location="cpu")["trainer"]
    return Checkpoint(version=version, path=path, policy=policy, critic=critic, trainer_state=state, pruned=pruned)


def has_full_state(root: str | Path, version: int, *, with_critic: bool = True) -> bool:
    """Whether version ``version`` is complete and holds what resume needs (policy, trainer state
    and, ``with_critic``, the critic)."""
    path = checkpoint_dir(root, version)
    pruned = pruned_parts(root, version)
    needed = ("policy", "trainer_state") + (("critic",) if with_critic else ())
    return (path / _COMPLETE).exists() and not set(needed) & set(pruned)


def prune_checkpoint(root: str | Path, version: int, parts: tuple[str, ...]) -> tuple[str, ...]:
    """Delete ``parts`` (names of :data:`PRUNABLE_PARTS`) of complete version ``version``; returns
    the parts deleted now. ``PRUNED`` is written before anything is deleted, so an interrupted prune
    is never mistaken for an intact checkpoint."""
    unknown = sorted(set(parts) - set(PRUNABLE_PARTS))
    if unknown:
        raise ValueError(f"unknown checkpoint parts {unknown}; known: {sorted(PRUNABLE_PARTS)}")
    path = checkpoint_dir(root, version)
    if not (path / _COMPLETE).exists():
        raise FileNotFoundError(f"checkpoint of version {version} at {path} is missing or incomplete")
    before = pruned_parts(root, version)
    now = tuple(part for part in parts if part not in before)
    if not now:
        return ()
    marker = path / _PRUNED
    tmp = marker.with_name(_PRUNED + ".tmp")
    tmp.write_text(json.dumps(sorted(set(before) | set(now))) + "\n")
    tmp.replace(marker)
    for part in now:
        target = path / PRUNABLE_PARTS[part]
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return now


def replace_critic(root: str | Path, version: int, critic: Critic, files: Mapping[str, str] | None = None) -> Path:
    """Write ``critic`` as the critic of complete version ``version`` (value pretraining writes the
    version-0 critic); the old one is swapped out only once the new one is fully written, ``files``
    (name -> text: value pretraining's report) inside it, so that they appear with it or not at all."""
    path = checkpoint_dir(root, version)
    if not (path / _COMPLETE).exists():
        raise FileNotFoundError(f"checkpoint of version {version} at {path} is missing or incomplete")
    _restore_critic(path)
    fresh, old = path / "critic.new", path / "critic.old"
    for leftover in (fresh, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    save_critic(critic, fresh)
    for name, text in (files or {}).items():
        (fresh / name).write_text(text)
    if (path / "critic").exists():
        (path / "critic").rename(old)
    fresh.rename(path / "critic")
    if old.exists():
        shutil.rmtree(old)
    return path / "critic"


def _restore_critic(path: Path) -> None:
    """A :func:`replace_critic` killed between its two renames leaves the old critic as
    ``critic.old`` and no ``critic``: put the old one back (the new one is redone by whoever wrote it)."""
    if not (path / "critic").exists() and (path / "critic.old").exists():
        (path / "critic.old").rename(path / "critic")


def complete_versions(root: str | Path, *, after: int = -1) -> list[int]:
    """Versions above ``after`` with a complete checkpoint under ``root``, ascending (only those are
    looked into: a caller that keeps track of what it checked before keeps this from growing with the
    run)."""
    root = Path(root)
    try:
        names = os.listdir(root)  # names, not Path objects: the folder holds one entry per version of the run
    except FileNotFoundError:
        return []
    found = (int(name[1:]) for name in names if _is_version_dir(name))
    return sorted(v for v in found if v > after and is_complete(root, v))


def latest_complete(root: str | Path) -> int | None:
    """Newest version with a complete checkpoint under ``root`` (None when there is none)."""
    versions = complete_versions(root)
    return versions[-1] if versions else None


class RegisteredState(enum.StrEnum):
    """What :func:`verify_registered` found at a version's registered checkpoint."""

    VERIFIED = "verified"  # the policy's weights hash equals the recorded one
    PRUNED = "pruned"  # retention deleted the policy weights (PRUNED lists them): nothing to compare
    NOT_LOCAL = "not_local"  # a remote location: cannot be verified from this machine
    INCOMPLETE = "incomplete"  # a policy directory without the COMPLETE marker: an interrupted save
    MISSING = "missing"  # no policy at the location
    HASH_DIFFERS = "hash_differs"  # the weights differ from the recorded hash


def verify_registered(checkpoint_uri: str, version: int, recorded_hash: str) -> tuple[RegisteredState, str]:
    """Check the checkpoint a ``policy_versions`` row registered: (state, detail for a report).

    ``checkpoint_uri`` is a version directory of this layout (``<root>/v000003``) or a bare policy
    directory (version 0 registered from the SFT warm start's directory). Loads the policy to hash it.
    """
    path = _local_path(checkpoint_uri)
    if path is None:
        return RegisteredState.NOT_LOCAL, "not a local path: cannot be verified here"
    if (path / _PRUNED).exists() and "policy" in pruned_parts(path.parent, version):
        return RegisteredState.PRUNED, f"policy weights pruned by retention ({path})"
    if (path / _POLICY).exists() and not (path / _COMPLETE).exists():
        return RegisteredState.INCOMPLETE, "incomplete: no COMPLETE marker"
    directory = next((d for d in (path / _POLICY, path) if (d / "config.json").is_file()), None)
    if directory is None:
        return RegisteredState.MISSING, "no policy there"
    digest = weights_hash(load_policy(directory))
    if digest != recorded_hash:
        return RegisteredState.HASH_DIFFERS, f"recorded {recorded_hash[:16]}..., found {digest[:16]}..."
    return RegisteredState.VERIFIED, ""
