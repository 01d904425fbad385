"""make_env: environments by name, options as config fields (what the rollout replicas call)."""

from __future__ import annotations

import pytest

from sao.envs import ENVIRONMENTS, make_env, takes_trainer_step
from sao.envs.base import Environment
from sao.envs.latency import LatencyKind
from sao.envs.math_tool import MathToolEnv
from sao.envs.style_preference import StylePreferenceEnv


def test_every_registered_environment_builds_and_follows_the_protocol():
    for name in ENVIRONMENTS:
        env = make_env(name)
        assert isinstance(env, Environment)
        assert env.name == name


def test_options_are_config_fields_and_nested_dicts_become_configs():
    env = make_env("math_tool", max_tool_calls=5, latency={"kind": "pareto", "pareto_alpha": 2.0})
    assert isinstance(env, MathToolEnv)
    assert env.config.max_tool_calls == 5
    assert env.config.latency.kind is LatencyKind.PARETO and env.config.latency.pareto_alpha == 2.0


def test_style_env_takes_the_trainer_step():
    env = make_env("style_preference", trainer_step=200, judge={"min_markers": 1})
    assert isinstance(env, StylePreferenceEnv)
    assert env.trainer_step == 200 and env.config.judge.min_markers == 1


def test_only_step_dependent_environments_take_the_trainer_step():
    assert takes_trainer_step("style_preference") and not takes_trainer_step("math_tool")
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        takes_trainer_step("chess")
    with pytest.raises(ValueError, match="trainer_step"):  # never swallowed by an environment without one
        make_env("math_tool", trainer_step=3)


def test_unknown_name_or_option_is_named():
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        make_env("chess")
    with pytest.raises(ValueError, match="max_turnz"):
        make_env("math_tool", max_turnz=3)
