"""TrajectoryRecord: coercion of producer input, type errors naming the field, row round trip."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import numpy as np
import pytest

from sao.lake.records import (
    RecordTypeError,
    Segment,
    Timings,
    TrainStepRecord,
    TrajectoryRecord,
    json_safe,
)
from sao.lake.synthetic import make_trajectories
from schemas.trajectories import SegmentKind


@pytest.fixture
def record() -> TrajectoryRecord:
    return make_trajectories(1, seed=3, num_tokens=12, prompt_tokens=4, policy_versions=(2, 5))[0]


def test_lists_become_typed_numpy_arrays(record):
    built = dataclasses.replace(
        record,
        completion_ids=list(range(12)),
        action_mask=[1] * 12,
        logprobs=[-1] * 12,
        prompt_ids=[],
    )
    assert built.completion_ids.dtype == np.int32
    assert built.action_mask.dtype == np.bool_ and built.action_mask.all()
    assert built.logprobs.dtype == np.float32
    assert built.prompt_ids.dtype == np.int32 and built.prompt_ids.size == 0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("completion_ids", [1.5, 2.0], "completion_ids: needs integer token ids"),
        ("prompt_ids", [[1, 2]], "prompt_ids: needs a 1-D sequence"),
        ("prompt_ids", [2**40], "prompt_ids: has ids outside the int32 range"),
        ("action_mask", [0, 2], "action_mask: needs booleans"),
        ("logprobs", ["a"], "logprobs: needs numbers"),
        ("trajectory_id", 7, "trajectory_id: needs a str"),
        ("reward", "1", "reward: needs a number"),
        ("num_turns", 1.0, "num_turns: needs an int"),
        ("segments", ({"kind": "action"},), r"segments\[0\]: needs a Segment"),
        ("routed_experts", np.zeros((3, 2)), r"routed_experts: needs shape \(tokens, layers >= 1, top_k >= 1\)"),
        ("routed_experts", np.full((3, 2, 2), 256), r"routed_experts: has expert ids outside \[0, 255\]"),
        ("routed_experts", np.zeros((3, 2, 2), np.float32), "routed_experts: needs integer expert ids"),
    ],
)
def test_wrong_types_raise_naming_the_field(record, field, value, match):
    with pytest.raises(RecordTypeError, match=match) as error:
        dataclasses.replace(record, **{field: value})
    assert error.value.field.split("[")[0] == field


def test_naive_timestamps_are_refused():
    naive = dt.datetime(2026, 1, 1)
    with pytest.raises(RecordTypeError, match="timings.created_at"):
        Timings(naive, naive, naive, 0.0, 0.0)


def test_derived_columns_by_hand(record):
    # Segments of the synthetic record: action (version 2), observation, action (version 5).
    assert [s.kind for s in record.segments] == ["action", "observation", "action"]
    assert record.min_policy_version == 2 and record.max_policy_version == 5
    assert record.num_action_tokens == int(record.action_mask.sum())
    no_actions = dataclasses.replace(
        record, segments=(Segment(SegmentKind.OBSERVATION, 0, 12, None),), action_mask=[False] * 12
    )
    assert no_actions.min_policy_version is None and no_actions.num_action_tokens == 0


def test_to_row_from_row_round_trip(record):
    row = record.to_row()
    again = TrajectoryRecord.from_row(
        json.loads(json.dumps(json_safe(row)))
        | {
            "timings": record.timings.to_row()  # JSON turns datetimes into strings; give them back
        }
    )
    assert again.to_row() == row


def test_routing_round_trips_through_its_binary_column(record):
    # Expert ids of 3 tokens, 2 layers, top-2: entry t is layer 0's two ids then layer 1's.
    routed = np.array([[[1, 7], [0, 2]], [[3, 4], [5, 6]], [[7, 0], [1, 1]]])
    row = dataclasses.replace(record, routed_experts=routed).to_row()
    assert row["routed_experts"] == [bytes([1, 7, 0, 2]), bytes([3, 4, 5, 6]), bytes([7, 0, 1, 1])]
    assert row["router_top_k"] == 2
    again = TrajectoryRecord.from_row(row)
    assert again.routed_experts.dtype == np.uint8 and np.array_equal(again.routed_experts, routed)
    assert record.to_row()["routed_experts"] is None and TrajectoryRecord.from_row(record.to_row()).routed_experts is None


def test_from_row_names_the_missing_field(record):
    row = record.to_row()
    del row["worker_id"]
    with pytest.raises(RecordTypeError, match="worker_id: is missing"):
        TrajectoryRecord.from_row(row)
    row = record.to_row()
    del row["sampling"]["seed"]
    with pytest.raises(RecordTypeError, match="sampling.seed: is missing"):
        TrajectoryRecord.from_row(row)


def test_json_safe_writes_non_finite_floats_as_strings():
    value = {
        "a": float("nan"),
        "b": [float("inf"), -float("inf"), 1.5],
        "c": np.float32(-0.5),
        "d": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        "e": np.bool_(True),
    }
    text = json.dumps(json_safe(value), allow_nan=False)
    assert json.loads(text) == {
        "a": "NaN",
        "b": ["Infinity", "-Infinity", 1.5],
        "c": -0.5,
        "d": "2026-01-01T00:00:00+00:00",
        "e": True,
    }


def test_train_step_row_sorts_maps_and_counts_ids():
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    row = TrainStepRecord(
        "run-0", 3, 1, 2, 10, ["a", "b"], now, now, {"z": 1, "a": 2.5}, {"torch": 7}
    ).to_row()
    assert row["num_trajectories"] == 2
    assert row["metrics"] == [("a", 2.5), ("z", 1.0)]
    assert row["seeds"] == [("torch", 7)]
