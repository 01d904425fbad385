"""Online learning under preference shifts (SAO.md section 5): training on ``style_preference`` while
the preferred writing style shifts at chosen trainer steps, and how many steps a run needs to recover.

    style_warm_start     the version-0 policy for style_preference (SFT on demonstrations in every style)
    shift_options        the environment options that put the shifts at given steps (for every reader,
                         or per persona), with the graded reward and the closing tag when asked
    style_config         the style_preference config those options give (its tasks, its demonstrations)
    online_settings      the run settings of such a run (a reply that runs out of tokens is not bootstrapped)
    online_pipeline      the pipeline of a run on style_preference with those shifts
    smooth, recovery     the reward curve's trailing mean and the recovery after one shift

Used by the ``online_shift`` flow (one run) and ``sao bench online`` (methods side by side).

Recovery after a shift at step S (``recovery``): the pre-shift reward is the mean batch reward of steps
S - ``pre_window`` .. S - 1; the threshold is ``fraction`` of it; after the shift the smoothed reward
first falls below the threshold (the dip: the new preference reaches the batches), and the run has
recovered at the first later step at which the smoothed reward is back at or above it. Steps to
recover = that step - S; None when it does not get back before ``end``; 0 when it never dips.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sao.config import RunConfig
from sao.pipeline import PipelineConfig

__all__ = ["online_pipeline", "online_settings", "recovery", "shift_options", "shift_steps", "smooth", "style_config",
           "style_tasks", "style_warm_start"]


def style_warm_start(path: str | Path, seed: int = 0, steps: int = 120, style=None) -> Path:
    """The style_preference version-0 policy at ``path`` (made by SFT unless it is there already), on
    the tasks and reply format of ``style`` (a :class:`~sao.envs.style_preference.StylePreferenceConfig`;
    default the plain one)."""
    from sao.envs.style_preference import StylePreferenceConfig
    from sao.models.policy import read_policy_metadata
    from sao.train.sft import SFTConfig, sft_warm_start

    path = Path(path)
    if (path / "config.json").exists() and read_policy_metadata(path) is not None:
        return path
    config = SFTConfig(env="style_preference", target_success=None, max_steps=steps, warmup_steps=min(20, steps),
                       eval_every=max(1, steps // 3), validation_tasks=8, seed=seed,
                       style=style or StylePreferenceConfig())
    return sft_warm_start(config, path).path


def style_tasks(path: str | Path, style=None):
    """(the training tasks of style_preference, the task file they were written to); ``style`` as in
    :func:`style_warm_start`."""
    from sao.envs.base import Split, write_tasks
    from sao.envs.style_preference import generate_tasks

    tasks = generate_tasks(style)
    written = write_tasks(Path(path), tasks)
    return [t for t in tasks if t.split is Split.TRAIN], written


def _styles_from(first: int, phases: int) -> list[str]:
    """``phases`` styles in the schedule's default order (cycling after four), from the ``first``-th."""
    from sao.envs.style_preference import ShiftSchedule, Style

    order = list(ShiftSchedule().styles) + [s for s in Style if s not in ShiftSchedule().styles]
    return [str(order[(first + i) % len(order)]) for i in range(phases)]


def _check_steps(shifts: Sequence[int], who: str = "") -> None:
    if list(shifts) != sorted(set(shifts)) or any(s <= 0 for s in shifts):
        raise ValueError(f"shifts{who} must be increasing positive steps, got {list(shifts)}")


def shift_steps(shifts: Sequence[int] | Mapping[str, Sequence[int | tuple[int, str]]]) -> list[int]:
    """Every shift's step, of every reader (a shift is a step or ``(step, style)``)."""
    every = [shift for steps in shifts.values() for shift in steps] if isinstance(shifts, Mapping) else shifts
    return [shift[0] if isinstance(shift, tuple) else shift for shift in every]


def _persona_schedule(index: int, name: str, shifts: Sequence[int | tuple[int, str]]) -> dict[str, Any]:
    """The schedule of the ``index``-th persona: it starts at the ``index``-th style; a shift given as
    ``(step, style)`` moves to that style, one given as a step to the next style in the default order."""
    from sao.envs.style_preference import Style

    steps = shift_steps(shifts)
    _check_steps(steps, f" of persona {name!r}")
    order = _styles_from(0, len(Style))
    styles = _styles_from(index, 1)
    for shift in shifts:
        if not isinstance(shift, tuple):
            styles.append(order[(order.index(styles[-1]) + 1) % len(order)])
            continue
        step, style = shift
        if style not in {str(s) for s in Style}:
            raise ValueError(f"the shift of persona {name!r} at step {step} names style {style!r}, "
                             f"not one of {', '.join(str(s) for s in Style)}")
        if style == styles[-1]:
            raise ValueError(f"the shift of persona {name!r} at step {step} moves to {style!r}, "
                             "the style it already prefers")
        styles.append(style)
    return {"styles": styles, "shift_steps": steps}


def shift_options(shifts: Sequence[int] | Mapping[str, Sequence[int | tuple[int, str]]], *, graded: bool = False,
                  answer_tag: bool = False, warm_start_bias: int = 0) -> dict[str, dict[str, Any]]:
    """``env_options`` of style_preference with the preference shifting at trainer steps ``shifts``
    (the styles in the schedule's default order, cycling after four phases). A mapping of persona to
    its shifts names the personas in the prompts instead and gives each its own schedule: the i-th
    persona starts at the i-th style, so the readers want different styles from the start and change
    at their own steps, each shift to the next style in the default order (a step) or to a named one
    (``(step, style)``). ``graded``, ``answer_tag`` and ``warm_start_bias`` (readers only):
    :class:`StyleJudge.graded <sao.envs.style_preference.StyleJudge>` and the
    :class:`~sao.envs.style_preference.StylePreferenceConfig` options of those names."""
    judge: dict[str, Any] = {}
    options: dict[str, Any] = {"judge": judge}
    if isinstance(shifts, Mapping):
        if not shifts:
            raise ValueError("shifts per persona: name at least one persona")
        options["personas"] = list(shifts)
        judge["persona_schedules"] = {name: _persona_schedule(i, name, steps)
                                      for i, (name, steps) in enumerate(shifts.items())}
    else:
        _check_steps(shifts)
        judge["schedule"] = {"styles": _styles_from(0, len(shifts) + 1), "shift_steps": list(shifts)}
    if graded:
        judge["graded"] = True
    if answer_tag:
        options["answer_tag"] = True
    if warm_start_bias:
        if not isinstance(shifts, Mapping):
            raise ValueError("warm_start_bias favours each reader's first style: name the readers in the shifts")
        options["warm_start_bias"] = warm_start_bias
    return {"style_preference": options}


def style_config(options: dict[str, dict[str, Any]]):
    """The :class:`~sao.envs.style_preference.StylePreferenceConfig` of :func:`shift_options`' options."""
    from sao.envs import make_env

    return make_env("style_preference", **options["style_preference"]).config


def online_settings(settings: RunConfig) -> RunConfig:
    """``settings`` for a style_preference run: a reply that runs out of tokens is not bootstrapped.
    The judge scores every reply when it ends, so a ``length`` end is the episode's outcome (and with
    ``answer_tag`` a failure, scored 0), not a budget cut before an outcome: valuing it at V(s_end), as
    SAO.md's rule for budget truncations would, tells the critic's methods that running on is as good
    as finishing, and they learn replies that never close (measured: a quarter of SAO's replies ran
    to the budget). The other budget ends keep their bootstrap."""
    reasons = [reason for reason in settings.algorithm.bootstrap_reasons if reason != "length"]
    return settings.with_values({"algorithm.bootstrap_reasons": reasons})


def online_pipeline(settings: RunConfig, policy_path: str | Path,
                    shifts: Sequence[int] | Mapping[str, Sequence[int | tuple[int, str]]],
                    tasks_file: str | Path, max_tokens: int = 64, *, graded: bool = False,
                    answer_tag: bool = False, warm_start_bias: int = 0) -> PipelineConfig:
    """The pipeline of a style_preference run with shifts at ``shifts`` (:func:`shift_options`, with
    ``graded``, ``answer_tag`` and ``warm_start_bias``) and ``settings`` as :func:`online_settings` adjusts them: one turn
    per episode, the shift schedule in the rollouts' environment options and in the run's stored
    settings (so a trajectory replay rewards under the same preference)."""
    from sao import runs
    from sao.rollout.agent import AgentConfig
    from sao.train.run_config import ReplayContext

    options = shift_options(shifts, graded=graded, answer_tag=answer_tag, warm_start_bias=warm_start_bias)
    config = runs.pipeline_config(online_settings(settings), policy_path)
    context = ReplayContext(tasks_path=str(Path(tasks_file).resolve()), env_options=options, max_turns=1)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, rollout=context),
                               agent=AgentConfig(max_tokens=max_tokens, max_turns=1), env_options=options)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean: element s is the mean of ``values[max(0, s - window + 1) : s + 1]``."""
    out, total = [], 0.0
    for s, value in enumerate(values):
        total += value
        if s >= window:
            total -= values[s - window]
        out.append(total / min(s + 1, window))
    return out


def recovery(rewards: Sequence[float], window: int, shift: int, end: int, pre_window: int,
             fraction: float) -> dict[str, Any]:
    """Recovery after the shift at step ``shift``, searched up to step ``end`` (exclusive: the next shift
    or the end of the run), by the definitions of the module docstring."""
    smoothed = smooth(rewards, window)
    pre = statistics.fmean(rewards[max(0, shift - pre_window):shift])
    threshold = fraction * pre
    dip = next((s for s in range(shift, end) if smoothed[s] < threshold), None)
    recovered = None if dip is None else next((s for s in range(dip + 1, end) if smoothed[s] >= threshold), None)
    if dip is None:
        recovered = shift
    post = smoothed[shift:end]
    return {"shift": shift, "pre_shift_reward": pre, "threshold": threshold, "dip_step": dip,
            "min_smoothed": min(post) if post else None, "recovered_step": recovered,
            "steps_to_recover": None if recovered is None else recovered - shift}
