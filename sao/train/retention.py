"""Checkpoint retention: keep what replay needs, delete the rest.

A checkpoint holds three parts (:mod:`sao.train.checkpoint`): the policy weights, the critic, and the
trainer state (optimisers, schedulers, running-mean window). Who needs what:

- **trajectory replay** of a trajectory needs the *policy weights* of every version named in its
  segments;
- **step replay** of step N (``policy_version_before = v``) needs the *full state* of some version
  ``k <= v``: it loads k and re-runs the recorded steps k .. N (each checked against its recorded
  hash), so N stays replayable whatever was pruned after k;
- **resume** needs the full state of the newest version.

:class:`RetentionConfig` therefore keeps the full state of version 0 (the start of every replay
chain, and the pretrained critic), of the newest ``keep_last`` versions and of every ``keep_every``-th
version (a replay chain is then at most ``keep_every`` steps long), and prunes the critic and trainer
state of the others. Policy weights are kept for every version by default. With
``keep_policy_weights=False`` the weights of a version are deleted only when no stored trajectory of
the run names it in a segment (``segments.policy_version``, which bounds
``min/max_policy_version``), it is not kept in full, and it is more than ``policy_grace`` versions
behind the newest: a rollout still in flight may hold such a version, and its trajectory arrives
later. No recorded step loses its replay either way: its chain starts at a version kept in full.

:func:`apply_retention` runs after every committed step when ``TrainConfig.retention`` is set; without
it every checkpoint is kept whole (the default).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.compute as pc

from sao.lake.store import Lake, sql_literal
from sao.train.checkpoint import complete_versions, prune_checkpoint, pruned_parts
from schemas import trajectories

__all__ = ["RetentionConfig", "RetentionPlan", "apply_retention", "plan_retention", "referenced_versions"]

_STATE_PARTS = ("critic", "trainer_state")


@dataclasses.dataclass(frozen=True)
class RetentionConfig:
    """Which checkpoint parts to keep (see the module docstring).

    Attributes:
        keep_last: newest versions kept in full (>= 1: resume loads the newest).
        keep_every: also keep in full every version divisible by this (0: none but version 0 and
            the newest); it bounds the length of a step replay's chain.
        keep_policy_weights: keep every version's policy weights (trajectory replay of any stored
            or still in-flight trajectory); False deletes unreferenced ones.
        policy_grace: with ``keep_policy_weights=False``, versions within this many of the newest keep
            their weights even when no stored trajectory names them yet.
    """

    keep_last: int = 4
    keep_every: int = 10
    keep_policy_weights: bool = True
    policy_grace: int = 16

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"RetentionConfig.keep_last must be >= 1 (resume loads the newest), got {self.keep_last}")
        if self.keep_every < 0:
            raise ValueError(f"RetentionConfig.keep_every must be >= 0, got {self.keep_every}")
        if self.policy_grace < 0:
            raise ValueError(f"RetentionConfig.policy_grace must be >= 0, got {self.policy_grace}")


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    """What retention keeps and deletes, by version.

    Attributes:
        keep_full: versions whose every part is kept (of those the plan looked at: above its ``after``).
        prune_state: versions losing their critic and trainer state (weights kept).
        prune_policy: versions losing their weights too.
        referenced: versions named by a stored trajectory (only looked up when weights may go).
        settled: every version up to this one is decided for good once the plan is applied (out of the
            newest ``keep_last`` and, when weights may go, of the ``policy_grace`` window): the next
            plan may start after it.
    """

    keep_full: tuple[int, ...]
    prune_state: tuple[int, ...]
    prune_policy: tuple[int, ...]
    referenced: tuple[int, ...] = ()
    settled: int = -1


def referenced_versions(lake: Lake, run_id: str, *, after: int = -1) -> set[int]:
    """Policy versions named by the segments of the run's stored trajectories (latest snapshot); with
    ``after``, only the trajectories sampled in part by a later version are read (the files'
    ``max_policy_version`` statistics skip the rest), so versions up to ``after`` may be missing."""
    predicate = f"run_id = {sql_literal(run_id)}" + (f" AND max_policy_version > {int(after)}" if after >= 0 else "")
    table = lake.read(trajectories.NAME, columns=["segments"], predicate=predicate)
    segments = pc.list_flatten(table["segments"])
    versions = pc.unique(pc.struct_field(segments, "policy_version").drop_null())
    return {int(v) for v in versions.to_pylist()}


def plan_retention(lake: Lake, run_id: str, checkpoint_root: str | Path, config: RetentionConfig, *,
                   after: int = -1) -> RetentionPlan:
    """Decide, without deleting anything, what :func:`apply_retention` would delete. With ``after``
    (an earlier applied plan's ``settled``), only the versions above it are looked at: the trainer,
    which applies retention after every step, checks each version a bounded number of times instead of
    every version at every step."""
    versions = complete_versions(checkpoint_root, after=after)
    if not versions:
        return RetentionPlan((), (), (), settled=after)
    newest = versions[-1]
    settled = newest - config.keep_last
    if not config.keep_policy_weights:
        settled = min(settled, newest - config.policy_grace - 1)
    settled = max(after, settled)
    full = {0, *range(newest - config.keep_last + 1, newest + 1)}
    if config.keep_every:
        full |= {v for v in versions if v % config.keep_every == 0}
    keep_full = tuple(v for v in versions if v in full)
    prune_state = tuple(v for v in versions if v not in full
                        and set(_STATE_PARTS) - set(pruned_parts(checkpoint_root, v)))
    if config.keep_policy_weights:
        return RetentionPlan(keep_full, prune_state, (), settled=settled)
    referenced = referenced_versions(lake, run_id, after=after)
    prune_policy = tuple(
        v for v in versions
        if v not in full and v not in referenced and v < newest - config.policy_grace
        and "policy" not in pruned_parts(checkpoint_root, v))
    return RetentionPlan(keep_full, prune_state, prune_policy, tuple(sorted(referenced)), settled)


def apply_retention(lake: Lake, run_id: str, checkpoint_root: str | Path, config: RetentionConfig, *,
                    dry_run: bool = False, after: int = -1) -> RetentionPlan:
    """Delete what :func:`plan_retention` selects (nothing with ``dry_run``); returns the plan."""
    plan = plan_retention(lake, run_id, checkpoint_root, config, after=after)
    if not dry_run:
        for version in plan.prune_state:
            prune_checkpoint(checkpoint_root, version, _STATE_PARTS)
        for version in plan.prune_policy:
            prune_checkpoint(checkpoint_root, version, ("policy",))
    return plan
