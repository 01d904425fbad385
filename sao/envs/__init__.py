"""Task environments: math with a sandboxed Python tool, style preference with scheduled shifts, and
``dataset``: the user's tasks from files, scored by the user's reward functions.

Modules: ``base`` (the :class:`~sao.envs.base.Environment` protocol, :class:`~sao.envs.base.Task`,
dataset files), ``math_tool``, ``style_preference``, ``dataset``, ``sandbox`` (the Python tool), ``latency``
(injected heavy-tailed tool delays).

:func:`make_env` builds an environment by name from keyword options, which are the fields of that
environment's config (nested configs may be given as dicts). An environment whose reward depends on
the trainer's step (``style_preference``: its preference shifts) also takes ``trainer_step``;
:func:`takes_trainer_step` says which do, so the rollout replica (the version its engine runs when an
episode starts) and trajectory replay (the trajectory's ``min_policy_version``) can pass it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from sao.envs.base import Environment
from sao.envs.dataset import DatasetEnv, DatasetEnvConfig
from sao.envs.math_tool import MathToolConfig, MathToolEnv
from sao.envs.style_preference import StylePreferenceConfig, StylePreferenceEnv

__all__ = ["ENVIRONMENTS", "make_env", "takes_trainer_step"]

# name -> (config class, environment class)
ENVIRONMENTS: dict[str, tuple[type, type]] = {
    MathToolEnv.name: (MathToolConfig, MathToolEnv),
    StylePreferenceEnv.name: (StylePreferenceConfig, StylePreferenceEnv),
    DatasetEnv.name: (DatasetEnvConfig, DatasetEnv),
}


def _build_config(config_class: type, options: dict[str, Any]) -> Any:
    """``config_class(**options)``, turning dicts into the nested dataclass a field expects."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"{config_class.__name__} has no field(s) {unknown}; fields: {sorted(fields)}")
    values = {}
    for name, value in options.items():
        default = fields[name].default
        if isinstance(value, dict) and dataclasses.is_dataclass(default):
            value = _build_config(type(default), value)
        values[name] = value
    return config_class(**values)


def _classes(name: str) -> tuple[type, type]:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]


def takes_trainer_step(name: str) -> bool:
    """Whether environment ``name`` is built with the trainer's step (its constructor's
    ``trainer_step``). Raises ``ValueError`` for an unknown name."""
    return "trainer_step" in inspect.signature(_classes(name)[1]).parameters


def make_env(name: str, **options: Any) -> Environment:
    """A new environment instance (one per episode). Raises ``ValueError`` for an unknown name or option."""
    config_class, env_class = _classes(name)
    extra = {}
    if takes_trainer_step(name) and "trainer_step" in options:
        extra["trainer_step"] = int(options.pop("trainer_step"))
    return env_class(_build_config(config_class, options), **extra)
