"""The fast Arrow builder equals the row-by-row reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sao.lake.columnar import records_to_arrow, records_to_arrow_reference
from sao.lake.records import Segment
from sao.lake.synthetic import make_trajectories
from schemas.trajectories import RECORD_SCHEMA, SegmentKind


def _mixed_records():
    records = make_trajectories(6, seed=11, num_tokens=30, turns=3, policy_versions=(0, 1, 2))
    records[1] = dataclasses.replace(
        records[1], token_rewards=np.linspace(0, 1, 30, dtype=np.float32)
    )
    records[2] = dataclasses.replace(  # an error trajectory with no tokens at all
        records[2], completion_ids=[], action_mask=[], logprobs=[], segments=(), prompt_ids=[]
    )
    records[3] = dataclasses.replace(
        records[3],
        segments=(Segment(SegmentKind.ACTION, 0, 30, None),),  # invalid, still convertible
    )
    rng = np.random.default_rng(3)
    tokens = len(records[4].prompt_ids) + 29  # MoE routing of every token run but the last
    records[4] = dataclasses.replace(records[4], routed_experts=rng.integers(0, 8, (tokens, 2, 2)))
    records[5] = dataclasses.replace(records[5], routed_experts=rng.integers(0, 64, (5, 3, 1)))  # other shape
    records[0] = dataclasses.replace(records[0], routed_experts=np.zeros((0, 2, 2), np.uint8))  # nothing run
    return records


@pytest.mark.parametrize(
    "records", [_mixed_records(), make_trajectories(1, seed=2), []], ids=["mixed", "one", "none"]
)
def test_fast_builder_equals_reference(records):
    fast = records_to_arrow(records)
    assert fast.schema.equals(RECORD_SCHEMA, check_metadata=True)
    assert fast.equals(records_to_arrow_reference(records), check_metadata=True)


def test_lists_keep_each_record_boundary():
    records = _mixed_records()
    table = records_to_arrow(records)
    assert table["completion_ids"].to_pylist()[2] == []
    assert table["token_rewards"].to_pylist()[0] is None
    assert table["completion_ids"].to_pylist()[5] == records[5].completion_ids.tolist()
    assert table["min_policy_version"].to_pylist()[3] is None
    routing = table["routed_experts"].to_pylist()
    assert routing[1] is None and table["router_top_k"].to_pylist()[1] is None
    assert routing[0] == [] and table["router_top_k"].to_pylist()[0] == 2
    assert routing[5] == [bytes(row) for row in records[5].routed_experts.reshape(5, 3)]
    assert table["router_top_k"].to_pylist()[5] == 1
