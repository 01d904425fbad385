"""The fast path (:mod:`sao.lake.validate.vectorised`) on whole batches, and equal to the reference
(:mod:`sao.lake.validate.reference`) on random corruptions of synthetic trajectories."""

from __future__ import annotations

import dataclasses
import datetime as dt

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.lake.columnar import records_to_arrow
from sao.lake.records import RecordedSampling, TrajectoryRecord
from sao.lake.synthetic import make_trajectories
from sao.lake.validate.reference import validate_record
from sao.lake.validate.rules import NO_VERSION, Rule, Violation
from sao.lake.validate.vectorised import validate_table
from tests.lake.validate.test_rules import CASES, base, with_


def _with_column(table, name, values):
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(name), pa.array(values, table.schema.field(name).type))


def test_routing_entries_of_unequal_size_or_a_missing_top_k_are_invalid():
    """Arrow rows no record can produce (a record holds one (R, M, K) array), from another producer."""
    table = records_to_arrow([with_(routed_experts=np.ones((3, 2, 2), np.uint8)), base()])
    uneven = _with_column(table, "routed_experts", [[b"\x01\x02\x03\x04", b"\x01\x02\x03\x04", b"\x01\x02"], None])
    message = ("routed_experts[2] has 2 bytes; every entry must have the same size (4 bytes in entry 0), a "
               "positive multiple of router_top_k = 2")
    assert validate_table(uneven, [1, 1]) == [Violation(0, Rule.ROUTING_INVALID, "routed_experts", 2, message)]
    odd = _with_column(table, "router_top_k", [3, None])
    message = ("routed_experts[0] has 4 bytes; every entry must have the same size (4 bytes in entry 0), a "
               "positive multiple of router_top_k = 3")
    assert validate_table(odd, [1, 1]) == [Violation(0, Rule.ROUTING_INVALID, "routed_experts", 0, message)]
    unpaired = _with_column(table, "router_top_k", [None, 2])
    assert validate_table(unpaired, [1, 1]) == [
        Violation(0, Rule.ROUTING_INVALID, "router_top_k", None,
                  "router_top_k = None must be an int >= 1 beside routed_experts"),
        Violation(1, Rule.ROUTING_INVALID, "router_top_k", None,
                  "router_top_k = 2 without routed_experts (both or neither)"),
    ]


def test_violations_name_their_row_in_the_batch_and_leave_other_rows_alone():
    records = [base(), CASES["logprob_positive"][0], base(), CASES["segment_gap"][0]]
    found = validate_table(records_to_arrow(records), [1, 1, 1, 1])
    assert [(v.row, v.rule) for v in found] == [(1, Rule.LOGPROB_POSITIVE), (3, Rule.SEGMENT_GAP)]


def test_synthetic_trajectories_are_valid():
    records = make_trajectories(50, seed=4, num_tokens=40, turns=3, policy_versions=(0, 1))
    assert validate_table(records_to_arrow(records), np.ones(50, dtype=np.int64)) == []


# Property: on random corruptions the fast path equals the reference ------------------------------

_CORRUPTIONS = st.sampled_from(
    [
        "none",
        "mask_flip",
        "logprob",
        "segment_shift",
        "segment_drop",
        "kind",
        "version",
        "length",
        "token",
        "reward",
        "sampling",
        "timings",
        "swap_segments",
        "empty",
        "scalars",
        "routing",
    ]
)


def _corrupt(record: TrajectoryRecord, how: str, draw: st.DrawFn) -> TrajectoryRecord:
    n = record.completion_ids.size
    t = draw(st.integers(0, max(n - 1, 0)))
    segments = list(record.segments)
    i = draw(st.integers(0, len(segments) - 1)) if segments else 0
    # A column an earlier corruption resized ("length") is indexed within its own size.
    if how == "mask_flip" and np.size(record.action_mask):
        mask = record.action_mask.copy()
        mask[t % mask.size] = ~mask[t % mask.size]
        return dataclasses.replace(record, action_mask=mask)
    if how == "logprob" and np.size(record.logprobs):
        values = record.logprobs.copy()
        values[t % values.size] = draw(st.sampled_from([float("nan"), float("inf"), 0.5, -0.0, -3.0, 0.0]))
        return dataclasses.replace(record, logprobs=values)
    if how == "segment_shift" and segments:
        s = segments[i]
        delta = draw(st.integers(-2, 2))
        segments[i] = dataclasses.replace(
            s, **{draw(st.sampled_from(["start", "end"])): s.start + delta}
        )
        return dataclasses.replace(record, segments=tuple(segments))
    if how == "segment_drop" and segments:
        del segments[i]
        return dataclasses.replace(record, segments=tuple(segments))
    if how == "kind" and segments:
        segments[i] = dataclasses.replace(
            segments[i], kind=draw(st.sampled_from(["action", "observation", "tool"]))
        )
        return dataclasses.replace(record, segments=tuple(segments))
    if how == "version" and segments:
        segments[i] = dataclasses.replace(
            segments[i], policy_version=draw(st.sampled_from([None, -1, 0, 1, 2, 9]))
        )
        return dataclasses.replace(record, segments=tuple(segments))
    if how == "length":
        field = draw(st.sampled_from(["action_mask", "logprobs", "token_rewards"]))
        size = n + draw(st.sampled_from([-1, 1]))
        values = np.zeros(max(size, 0), dtype=np.float32 if field != "action_mask" else np.bool_)
        return dataclasses.replace(record, **{field: values})
    if how == "token" and n:
        ids = record.completion_ids.copy()
        ids[t] = -1
        return dataclasses.replace(record, completion_ids=ids)
    if how == "reward":
        return dataclasses.replace(
            record, reward=float("nan"), token_rewards=np.full(n, np.nan, np.float32)
        )
    if how == "sampling":
        return dataclasses.replace(record, sampling=RecordedSampling(-1.0, 0.0, -5, 0, None))
    if how == "timings":
        end = record.timings.created_at - dt.timedelta(seconds=1)
        return dataclasses.replace(
            record, timings=dataclasses.replace(record.timings, finished_at=end, tool_s=-1.0)
        )
    if how == "swap_segments" and len(segments) > 1:
        segments[0], segments[-1] = segments[-1], segments[0]
        return dataclasses.replace(record, segments=tuple(segments))
    if how == "scalars":
        return dataclasses.replace(
            record,
            run_id=draw(st.sampled_from(["run 0", "-run", "run-0"])),
            trajectory_id="",
            termination_reason="done",
            logprob_kind="argmax",
            num_turns=-1,
        )
    if how == "routing":
        tokens = record.prompt_ids.size + n + draw(st.integers(-2, 1))
        return dataclasses.replace(record, routed_experts=np.zeros((max(tokens, 0), 2, 2), np.uint8))
    if how == "empty":
        return dataclasses.replace(
            record, completion_ids=[], action_mask=[], logprobs=[], segments=()
        )
    return record


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[TrajectoryRecord], list[int]]:
    size = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 10_000))
    records = make_trajectories(
        size,
        seed=seed,
        num_tokens=draw(st.integers(5, 24)),
        turns=draw(st.integers(1, 3)),
        prompt_tokens=3,
        policy_versions=(0, 1, 2),
    )
    out = []
    for record in records:
        for _ in range(draw(st.integers(0, 2))):
            record = _corrupt(record, draw(_CORRUPTIONS), draw)
        out.append(record)
    newest = [draw(st.sampled_from([NO_VERSION, 0, 1, 2])) for _ in out]
    return out, newest


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_fast_path_equals_reference(batch):
    records, newest = batch
    reference = [
        dataclasses.replace(v, row=row)
        for row, (record, version) in enumerate(zip(records, newest, strict=True))
        for v in validate_record(record, None if version == NO_VERSION else version)
    ]
    assert validate_table(records_to_arrow(records), newest) == reference
