"""Validation rules (:mod:`sao.lake.validate.rules`): each rule by hand on a six-token trajectory,
through both the reference and the fast path.

The base trajectory (n = 6, newest registered version 1):

    position     0     1     2     3     4     5
    segment      action v0 ------- obs   action v1 -
    action_mask  T     T     T     F     T     T
    logprobs   -0.5  -1.0  -0.25  0.0  -2.0  -0.125
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import numpy as np
import pytest

from sao.lake.columnar import records_to_arrow
from sao.lake.config import SizeLimits
from sao.lake.records import RecordedSampling, Segment, Timings, TrajectoryRecord
from sao.lake.validate import NO_VERSION, Rule, Violation, validate_record, validate_table
from schemas.trajectories import SegmentKind

A, OBS = SegmentKind.ACTION, SegmentKind.OBSERVATION
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def base() -> TrajectoryRecord:
    return TrajectoryRecord(
        trajectory_id="t-1",
        run_id="run-0",
        task_id="task-1",
        env_name="math_tool",
        prompt_ids=[5, 6],
        completion_ids=[10, 11, 12, 13, 14, 15],
        action_mask=[True, True, True, False, True, True],
        logprobs=[-0.5, -1.0, -0.25, 0.0, -2.0, -0.125],
        logprob_kind="sampling",
        segments=(Segment(A, 0, 3, 0), Segment(OBS, 3, 4, None), Segment(A, 4, 6, 1)),
        reward=1.0,
        termination_reason="stop",
        num_turns=2,
        sampling=RecordedSampling(1.0, 1.0, None, 16, 7),
        tokenizer_version="tok@1",
        chat_template_version="chat@1",
        engine_name="torch",
        engine_version="2.13",
        worker_id="w0",
        timings=Timings(T0, T0, T0 + dt.timedelta(seconds=1), 0.5, 0.25),
    )


def with_(**changes: Any) -> TrajectoryRecord:
    return dataclasses.replace(base(), **changes)


def lp(**at: float) -> list[float]:
    values = [-0.5, -1.0, -0.25, 0.0, -2.0, -0.125]
    for key, value in at.items():
        values[int(key[1:])] = value
    return values


# (record, expected violation: rule, field, position, message), every message written out by hand.
CASES: dict[str, tuple[TrajectoryRecord, tuple[Rule, str, int | None, str]]] = {
    "run_id": (
        with_(run_id="run/0"),
        (
            Rule.RUN_ID_INVALID,
            "run_id",
            None,
            "run_id 'run/0' must match [A-Za-z0-9][A-Za-z0-9._-]{0,127}",
        ),
    ),
    "id_empty": (
        with_(trajectory_id=""),
        (Rule.ID_EMPTY, "trajectory_id", None, "trajectory_id is empty"),
    ),
    "termination": (
        with_(termination_reason="crashed"),
        (
            Rule.TERMINATION_REASON,
            "termination_reason",
            None,
            "termination_reason = 'crashed' is not one of stop, length, turns, timeout, cancelled, error",
        ),
    ),
    "logprob_kind": (
        with_(logprob_kind="greedy"),
        (
            Rule.LOGPROB_KIND,
            "logprob_kind",
            None,
            "logprob_kind = 'greedy' is not one of sampling, raw",
        ),
    ),
    "length_mask": (
        with_(action_mask=[True] * 5),
        (
            Rule.LENGTH_MISMATCH,
            "action_mask",
            None,
            "action_mask has 5 entries but completion_ids has 6",
        ),
    ),
    "length_logprobs": (
        with_(logprobs=[-1.0] * 7),
        (Rule.LENGTH_MISMATCH, "logprobs", None, "logprobs has 7 entries but completion_ids has 6"),
    ),
    "length_token_rewards": (
        with_(token_rewards=[0.0] * 2),
        (
            Rule.LENGTH_MISMATCH,
            "token_rewards",
            None,
            "token_rewards has 2 entries but completion_ids has 6",
        ),
    ),
    "token_negative": (
        with_(completion_ids=[10, 11, -3, 13, 14, 15]),
        (Rule.TOKEN_ID_NEGATIVE, "completion_ids", 2, "completion_ids[2] = -3 is negative"),
    ),
    "segment_kind": (
        with_(segments=(Segment(A, 0, 3, 0), Segment("tool", 3, 4, None), Segment(A, 4, 6, 1))),
        (
            Rule.SEGMENT_KIND,
            "segments[1].kind",
            1,
            "segments[1].kind = 'tool' is not one of action, observation",
        ),
    ),
    "action_without_version": (
        with_(segments=(Segment(A, 0, 3, None), Segment(OBS, 3, 4, None), Segment(A, 4, 6, 1))),
        (
            Rule.SEGMENT_VERSION,
            "segments[0].policy_version",
            0,
            "segments[0] is an action segment without a policy_version",
        ),
    ),
    "observation_with_version": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(OBS, 3, 4, 0), Segment(A, 4, 6, 1))),
        (
            Rule.SEGMENT_VERSION,
            "segments[1].policy_version",
            1,
            "segments[1] has kind 'observation' but carries policy_version 0; "
            "only actions have one",
        ),
    ),
    "version_negative": (
        with_(segments=(Segment(A, 0, 3, -1), Segment(OBS, 3, 4, None), Segment(A, 4, 6, 1))),
        (
            Rule.POLICY_VERSION_NEGATIVE,
            "segments[0].policy_version",
            0,
            "segments[0].policy_version = -1 is negative",
        ),
    ),
    "version_ahead": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(OBS, 3, 4, None), Segment(A, 4, 6, 2))),
        (
            Rule.POLICY_VERSION_AHEAD,
            "segments[2].policy_version",
            2,
            "segments[2].policy_version = 2 is ahead of the newest registered version 1",
        ),
    ),
    "segment_empty": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(OBS, 3, 3, None), Segment(A, 3, 6, 1))),
        (Rule.SEGMENT_BOUNDS, "segments[1]", 3, "segments[1] = [3, 3) is empty or outside [0, 6)"),
    ),
    "segment_outside": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(OBS, 3, 4, None), Segment(A, 4, 7, 1))),
        (Rule.SEGMENT_BOUNDS, "segments[2]", 4, "segments[2] = [4, 7) is empty or outside [0, 6)"),
    ),
    "segment_gap": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(A, 4, 6, 1))),
        (Rule.SEGMENT_GAP, "segments[1].start", 3, "tokens [3, 4) are covered by no segment"),
    ),
    "segment_gap_at_end": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(OBS, 3, 4, None))),
        (Rule.SEGMENT_GAP, "segments", 4, "tokens [4, 6) are covered by no segment"),
    ),
    "segment_overlap": (
        with_(segments=(Segment(A, 0, 3, 0), Segment(OBS, 2, 4, None), Segment(A, 4, 6, 1))),
        (
            Rule.SEGMENT_OVERLAP,
            "segments[1].start",
            2,
            "segments[1] starts at 2, inside the previous segment which ends at 3",
        ),
    ),
    "mask_mismatch": (
        with_(action_mask=[True, True, True, True, True, True], logprobs=lp(p3=-0.5)),
        (
            Rule.ACTION_MASK_MISMATCH,
            "action_mask",
            3,
            "action_mask[3] = True but the segments make token 3 an observation",
        ),
    ),
    "logprob_nan": (
        with_(logprobs=lp(p1=float("nan"))),
        (Rule.LOGPROB_NOT_FINITE, "logprobs", 1, "logprobs[1] = nan is not finite"),
    ),
    "logprob_positive": (
        with_(logprobs=lp(p5=0.5)),
        (Rule.LOGPROB_POSITIVE, "logprobs", 5, "logprobs[5] = 0.5 is positive"),
    ),
    "logprob_at_observation": (
        with_(logprobs=lp(p3=-0.75)),
        (
            Rule.LOGPROB_AT_OBSERVATION,
            "logprobs",
            3,
            "logprobs[3] = -0.75 is not 0.0 at an observation position",
        ),
    ),
    "reward": (
        with_(reward=float("inf")),
        (Rule.REWARD_NOT_FINITE, "reward", None, "reward = inf is not finite"),
    ),
    "token_reward": (
        with_(token_rewards=[0, 0, float("nan"), 0, 0, 1]),
        (Rule.REWARD_NOT_FINITE, "token_rewards", 2, "token_rewards[2] = nan is not finite"),
    ),
    "num_turns": (
        with_(num_turns=-1),
        (Rule.NUM_TURNS_NEGATIVE, "num_turns", None, "num_turns = -1 is negative"),
    ),
    "sampling": (
        with_(sampling=RecordedSampling(1.0, 1.5, None, 16, 7)),
        (Rule.SAMPLING_INVALID, "sampling.top_p", None, "top_p = 1.5 must lie in (0, 1]"),
    ),
    "top_k": (
        with_(sampling=RecordedSampling(1.0, 1.0, 0, 16, 7)),
        (
            Rule.SAMPLING_INVALID,
            "sampling.top_k",
            None,
            "top_k = 0 must be >= 1 (null disables it)",
        ),
    ),
    "timings": (
        with_(timings=Timings(T0, T0 - dt.timedelta(seconds=1), T0, 0.5, 0.25)),
        (Rule.TIMINGS_INVALID, "timings.started_at", None, "started_at is before created_at"),
    ),
    "routing_too_long": (  # 2 prompt + 6 completion tokens: at most 8 routed tokens
        with_(routed_experts=np.zeros((9, 2, 2), np.uint8)),
        (
            Rule.ROUTING_INVALID,
            "routed_experts",
            None,
            "routed_experts has 9 entries, more than the 8 tokens of prompt_ids and completion_ids",
        ),
    ),
    "payload_too_large": (
        with_(task_id="t" * 5000),
        (
            Rule.PAYLOAD_TOO_LARGE,
            "task_id",
            None,
            "task_id has 5000 bytes, over the limit of 4096 (SizeLimits.max_string_bytes)",
        ),
    ),
}


def test_the_base_trajectory_is_valid():
    assert validate_record(base(), 1) == []
    assert validate_table(records_to_arrow([base()]), [1]) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_by_hand(name):
    record, (rule, field, position, message) = CASES[name]
    expected = [Violation(0, rule, field, position, message)]
    assert validate_record(record, 1) == expected
    assert validate_table(records_to_arrow([record]), [1]) == expected


def test_every_rule_has_a_hand_case():
    covered = {rule for _, (rule, *_rest) in CASES.values()} | {Rule.TYPE}
    assert covered == set(Rule)


@pytest.mark.parametrize(
    ("limits", "field", "message"),
    [
        (SizeLimits(max_tokens=5), "completion_ids", "completion_ids has 6 tokens, over the limit of 5 (SizeLimits.max_tokens)"),
        (SizeLimits(max_tokens=1), "prompt_ids", "prompt_ids has 2 tokens, over the limit of 1 (SizeLimits.max_tokens)"),
        (SizeLimits(max_segments=2), "segments", "segments has 3 entries, over the limit of 2 (SizeLimits.max_segments)"),
    ],
)  # fmt: skip
def test_size_limits_are_configurable(limits, field, message):
    expected = [Violation(0, Rule.PAYLOAD_TOO_LARGE, field, None, message)]
    assert validate_record(base(), 1, limits=limits) == expected
    assert validate_table(records_to_arrow([base()]), [1], limits) == expected


@pytest.mark.parametrize(("field", "value", "limits", "message"), [
    ("error", "e" * 70_000, SizeLimits(), "error has 70000 bytes, over the limit of 65536 (SizeLimits.max_text_bytes)"),
    ("agent_info", '{"log": "%s"}' % ("x" * 9), SizeLimits(max_text_bytes=10),
     "agent_info has 20 bytes, over the limit of 10 (SizeLimits.max_text_bytes)"),
    ("episode_id", "p" * 5000, SizeLimits(), "episode_id has 5000 bytes, over the limit of 4096 (SizeLimits.max_string_bytes)"),
])  # fmt: skip
def test_the_nullable_text_fields_are_bounded_too(field, value, limits, message):
    # A runaway agent's info or a huge exception message bloated the table unchecked before.
    part = {"episode_part": 0} if field == "episode_id" else {}
    record = with_(**{field: value}, **part)
    expected = [Violation(0, Rule.PAYLOAD_TOO_LARGE, field, None, message)]
    assert validate_record(record, 1, limits=limits) == expected
    assert validate_table(records_to_arrow([record]), [1], limits) == expected
    assert validate_record(with_(**{field: value[:8]}, **part), 1, limits=limits) == []


def test_routing_of_every_token_but_the_last_is_valid():
    assert validate_record(with_(routed_experts=np.ones((7, 2, 2), np.uint8)), 1) == []
    assert validate_table(records_to_arrow([with_(routed_experts=np.ones((7, 2, 2), np.uint8))]), [1]) == []


def test_no_registered_version_makes_every_version_ahead():
    message = "segments[0].policy_version = 0 but run 'run-0' has no registered policy version"
    expected = [Violation(0, Rule.POLICY_VERSION_AHEAD, "segments[0].policy_version", 0, message)]
    assert validate_record(base(), None) == expected
    assert validate_table(records_to_arrow([base()]), [NO_VERSION]) == expected


def test_several_rules_on_one_record_come_in_rule_order():
    record = with_(termination_reason="oops", logprobs=lp(p0=1.0), num_turns=-2)
    rules = [v.rule for v in validate_table(records_to_arrow([record]), [1])]
    assert rules == [Rule.TERMINATION_REASON, Rule.LOGPROB_POSITIVE, Rule.NUM_TURNS_NEGATIVE]
    assert [v.rule for v in validate_record(record, 1)] == rules
