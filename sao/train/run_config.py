"""The run's configuration, stored next to its checkpoints: what step and trajectory replay read.

A replayed step must run with the settings the step ran with (the algorithm and its learning rates,
the token budget that fixed the micro-batch split, the seed, the thread count, deterministic kernels),
and a replayed trajectory must find its task and the rules of its environment. None of that is in the
lake, so :func:`write_run_config` stores the run's :class:`~sao.train.config.TrainConfig` as JSON at
``<checkpoint_root>/run_config.json`` when the run is prepared (``prepare_run``) and when a trainer
starts; :func:`read_run_config` rebuilds it. Choices:

- **One file per run, at the checkpoint root**, not a copy per checkpoint: the settings that decide
  an update may not change within a run, so one copy is the truth for every step. A trainer that
  starts (or resumes) with different replay-relevant settings (:data:`REPLAY_FIELDS`) is refused
  with :class:`RunConfigError` naming each field: continue with the recorded settings, or start a
  new run. Other fields (lake location, step count, timeouts, workers, publishing) may change.
- **No secrets**: the lake's ``storage_options`` (credentials) are never written; only its root.
- A missing, unreadable or foreign file is a :class:`RunConfigError`, never a guessed default.

The number of Ray Train workers is not replay-relevant here, but it changes float summation order:
steps of a multi-worker run replay (in one process) within float tolerance, not bit for bit; the step
records its world size (``batch/world_size``) and replay says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from sao.lake.config import LakeConfig
from sao.models.critic import CriticConfig
from sao.train.checkpoint import checkpoint_root_of
from sao.train.config import ReplayContext, TrainConfig, UpdateConfig
from sao.train.retention import RetentionConfig

__all__ = [
    "FORMAT",
    "REPLAY_FIELDS",
    "RUN_CONFIG_FILE",
    "RunConfigError",
    "read_run_config",
    "run_config_path",
    "stored_max_staleness",
    "stored_run_config",
    "write_run_config",
]

RUN_CONFIG_FILE = "run_config.json"
FORMAT = 1
REPLAY_FIELDS = ("run_id", "update", "seed", "deterministic", "torch_threads", "rollout")
"""TrainConfig fields a replay depends on; a trainer may not change them within a run."""


class RunConfigError(ValueError):
    """The run's stored configuration is missing, unreadable, or differs from the one given."""


def run_config_path(checkpoint_root: str | Path) -> Path:
    return Path(checkpoint_root) / RUN_CONFIG_FILE


def stored_run_config(checkpoint_uri: str) -> TrainConfig | None:
    """The configuration stored for the run that registered ``checkpoint_uri`` (a version's
    checkpoint directory, :func:`sao.train.checkpoint.checkpoint_root_of`); None when that is not a
    local version directory of a run with a stored configuration (a bare SFT directory, a remote URI).

    Raises:
        RunConfigError: a stored configuration that cannot be read.
    """
    root = checkpoint_root_of(checkpoint_uri)
    if root is None or not run_config_path(root).is_file():
        return None
    return read_run_config(root)


def stored_max_staleness(checkpoint_uri: str) -> int | None:
    """The ``max_staleness`` of :func:`stored_run_config` (None where that is None)."""
    stored = stored_run_config(checkpoint_uri)
    return None if stored is None else stored.max_staleness


def _upgraded(train: dict[str, Any]) -> dict[str, Any]:
    """A stored ``train`` section in this version's form: a run recorded before
    ``UpdateConfig.skip_reasons`` existed trained on every end, so its passes over none."""
    update = train.get("update")
    if isinstance(update, dict) and "skip_reasons" not in update:
        train = {**train, "update": {**update, "skip_reasons": []}}
    return train


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    data = dataclasses.asdict(cfg)
    data["lake"] = {"root": cfg.lake.root}  # storage options may hold credentials: never written
    return json.loads(json.dumps(data))  # enums -> str, tuples -> lists: the form a reread gives


def _places(value: Any) -> Any:
    """``value`` with every absolute path that exists replaced by its real path: a run whose folder was
    moved, and reached from where it was through a link, names the same task file and modules."""
    if isinstance(value, dict):
        return {key: _places(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_places(item) for item in value]
    if isinstance(value, str) and value.startswith("/") and os.path.exists(value):
        return os.path.realpath(value)
    return value


def write_run_config(cfg: TrainConfig) -> Path:
    """Write ``cfg`` to ``<checkpoint_root>/run_config.json``, or check it against the stored one
    (paths compared by where they lead: the stored file keeps the paths it was written with).

    Raises:
        RunConfigError: the stored file belongs to another run or differs in a field of
            :data:`REPLAY_FIELDS`.
    """
    path = run_config_path(cfg.checkpoint_root)
    current = _jsonable(cfg)
    if path.exists():
        stored = _upgraded(_read_json(path)["train"])
        differ = [f"{name}: stored {stored.get(name)!r}, given {current[name]!r}"
                  for name in REPLAY_FIELDS if _places(stored.get(name)) != _places(current[name])]
        if differ:
            raise RunConfigError(
                f"{path} records run {stored.get('run_id')!r} with other settings than this trainer's; "
                "a run's steps must stay replayable with one configuration. Differences: "
                + "; ".join(differ) + ". Resume with the recorded settings, or start a new run "
                "(another run_id and checkpoint_root).")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "train": current}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RunConfigError(f"cannot read the run configuration {path}: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("train"), dict):
        raise RunConfigError(f"{path} is not a run configuration of format {FORMAT}")
    return data


def read_run_config(checkpoint_root: str | Path) -> TrainConfig:
    """The :class:`~sao.train.config.TrainConfig` stored at ``checkpoint_root`` (its lake has the
    recorded root and no storage options).

    Raises:
        RunConfigError: no file (the run was prepared before run configurations were stored, or
            the checkpoints moved without it), an unreadable one, or unknown fields.
    """
    path = run_config_path(checkpoint_root)
    if not path.exists():
        raise RunConfigError(
            f"no run configuration at {path}: replay needs the settings the run trained with, which "
            "prepare_run writes there (runs prepared before it did cannot be replayed exactly)")
    train = dict(_upgraded(_read_json(path)["train"]))
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(train) - known)
    if unknown:
        raise RunConfigError(f"{path} has fields this version does not know: {unknown}")
    try:
        train["lake"] = LakeConfig(root=train["lake"]["root"])
        train["update"] = UpdateConfig(**train["update"])
        train["rollout"] = ReplayContext(**train.get("rollout") or {})
        if train.get("retention") is not None:
            train["retention"] = RetentionConfig(**train["retention"])
        if train.get("critic") is not None:  # absent: recorded before it was a setting, the default setup
            train["critic"] = CriticConfig(**train["critic"])
        return TrainConfig(**train)
    except (KeyError, TypeError, ValueError) as error:
        raise RunConfigError(f"{path} does not hold a valid TrainConfig: {error}") from None
