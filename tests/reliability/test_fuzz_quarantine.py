"""Fuzzing the lake writer: over a thousand malformed records, of every kind a buggy or hostile producer
could send, each land in ``quarantine`` with the rule they broke; the valid records delivered in the
same batches are stored exactly as sent; every count reconciles and ``sao lake check`` passes."""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sao.audit import check_run
from sao.lake.columnar import records_to_arrow
from sao.lake.config import LakeConfig, SizeLimits, WriterConfig
from sao.lake.issued import IssuedRollout, IssueLog
from sao.lake.ledger import register_policy_version
from sao.lake.reader import read_trajectories
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectory
from sao.lake.validate import Rule
from schemas.trajectories import RECORD_SCHEMA

RUN = "fuzz-run"
PER_CATEGORY = 130  # x 8 categories = 1,040 malformed records
VALID = 400
BATCH = 100
LIMITS = SizeLimits(
    max_tokens=512, max_segments=64, max_string_bytes=256, max_quarantine_payload_bytes=2048
)
# Columns a row may lack (derived, or optional: read as null when absent).
DERIVED = ("min_policy_version", "max_policy_version", "num_action_tokens", "token_rewards", "routed_experts",
           "router_top_k", "error", "episode_id", "episode_part", "agent_info")

Row = dict[str, Any]


def _action_positions(row: Row) -> list[int]:
    return [t for t, a in enumerate(row["action_mask"]) if a]


def wrong_type(row: Row, rng: np.random.Generator) -> Rule:
    field, value = [
        ("completion_ids", "not a list"),
        ("prompt_ids", [1.5, 2.5]),
        ("reward", "high"),
        ("num_turns", 2.5),
        ("segments", 5),
        ("termination_reason", 7),
        ("timings", "yesterday"),
        ("action_mask", [[True]]),
        ("trajectory_id", None),
        ("logprobs", {"a": 1}),
    ][int(rng.integers(10))]
    row[field] = value
    return Rule.TYPE


def bad_logprob(row: Row, rng: np.random.Generator) -> Rule:
    t = int(rng.choice(_action_positions(row)))
    if rng.random() < 0.5:
        row["logprobs"][t] = [math.nan, math.inf, -math.inf][int(rng.integers(3))]
        return Rule.LOGPROB_NOT_FINITE
    row["logprobs"][t] = float(rng.uniform(1e-3, 10.0))
    return Rule.LOGPROB_POSITIVE


def length_mismatch(row: Row, rng: np.random.Generator) -> Rule:
    name = ["logprobs", "action_mask"][int(rng.integers(2))]
    cut = int(rng.integers(1, 4))
    row[name] = row[name][:-cut] if rng.random() < 0.5 else row[name] + row[name][:cut]
    return Rule.LENGTH_MISMATCH


def overlapping_segments(row: Row, rng: np.random.Generator) -> Rule:
    segments = row["segments"]
    i = int(rng.integers(1, len(segments)))
    back = int(rng.integers(1, segments[i - 1]["end"] - segments[i - 1]["start"] + 1))
    segments[i]["start"] -= back
    return Rule.SEGMENT_OVERLAP


def unknown_termination(row: Row, rng: np.random.Generator) -> Rule:
    row["termination_reason"] = ["exploded", "STOP", "", "done", "stop "][int(rng.integers(5))]
    return Rule.TERMINATION_REASON


def version_ahead(row: Row, rng: np.random.Generator) -> Rule:
    actions = [s for s in row["segments"] if s["kind"] == "action"]
    actions[int(rng.integers(len(actions)))]["policy_version"] = int(rng.integers(2, 10**6))
    return Rule.POLICY_VERSION_AHEAD


def missing_field(row: Row, rng: np.random.Generator) -> Rule:
    required = [name for name in RECORD_SCHEMA.names if name not in DERIVED]
    del row[required[int(rng.integers(len(required)))]]
    return Rule.TYPE


def oversized(row: Row, rng: np.random.Generator) -> Rule:
    choice = int(rng.integers(3))
    if choice == 0:  # a string field far over its byte limit
        row[["task_id", "env_name", "engine_version", "worker_id"][int(rng.integers(4))]] = "x" * 10_000
    elif choice == 1:  # a runaway completion: valid in every other way, too many tokens
        n = int(rng.integers(600, 5000))
        row["completion_ids"] = [7] * n
        row["action_mask"] = [True] * n
        row["logprobs"] = [-0.5] * n
        row["segments"] = [{"kind": "action", "policy_version": 0, "start": 0, "end": n}]
    else:  # too many segments: alternating one-token actions and observations
        n = 2 * int(rng.integers(33, 200))
        row["completion_ids"] = [7] * n
        row["action_mask"] = [t % 2 == 0 for t in range(n)]
        row["logprobs"] = [-0.5 if t % 2 == 0 else 0.0 for t in range(n)]
        row["segments"] = [
            {"kind": "action" if t % 2 == 0 else "observation",
             "policy_version": 0 if t % 2 == 0 else None, "start": t, "end": t + 1}
            for t in range(n)
        ]  # fmt: skip
    return Rule.PAYLOAD_TOO_LARGE


CATEGORIES: dict[str, Callable[[Row, np.random.Generator], Rule]] = {
    "wrong_type": wrong_type,
    "bad_logprob": bad_logprob,
    "length_mismatch": length_mismatch,
    "overlapping_segments": overlapping_segments,
    "unknown_termination": unknown_termination,
    "version_ahead": version_ahead,
    "missing_field": missing_field,
    "oversized": oversized,
}


def deliveries(seed: int = 0):
    """(payload, expected rule or None) in a shuffled order; valid ones are TrajectoryRecords."""
    rng = np.random.default_rng(seed)

    def fresh():
        return make_trajectory(rng, run_id=RUN, num_tokens=int(rng.integers(8, 64)),
                               prompt_tokens=4, turns=int(rng.integers(2, 4)), policy_versions=(0, 1))  # fmt: skip

    items: list[tuple[Any, Rule | None]] = [(fresh(), None) for _ in range(VALID)]
    for mutate in CATEGORIES.values():
        for _ in range(PER_CATEGORY):
            row = copy.deepcopy(fresh().to_row())
            items.append((row, mutate(row, rng)))
    order = rng.permutation(len(items))
    return [items[i] for i in order]


def payload_id(payload: Any) -> str | None:
    value = payload.get("trajectory_id") if isinstance(payload, dict) else payload.trajectory_id
    return value if isinstance(value, str) else None


@pytest.fixture
def lake(tmp_path) -> Lake:
    opened = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register_policy_version(opened, PolicyVersionRecord(RUN, 0, "mem://v0", "h0"))
    register_policy_version(opened, PolicyVersionRecord(RUN, 1, "mem://v1", "h1", 0, 0))
    return opened


def test_a_thousand_malformed_records_are_quarantined_and_the_valid_ones_stored(lake):
    from sao.lake.writer import TrajectoryWriter

    items = deliveries()
    malformed = [(p, rule) for p, rule in items if rule is not None]
    valid = [p for p, rule in items if rule is None]
    assert len(malformed) >= 1000
    issue_log = IssueLog(lake, WriterConfig(flush_rows=10_000, background_flush=False))
    issue_log.add_many(IssuedRollout(RUN, payload_id(p), "task", "env") for p, _ in items if payload_id(p))
    issue_log.flush()
    config = WriterConfig(flush_rows=BATCH, background_flush=False, limits=LIMITS)
    with TrajectoryWriter(lake, config) as writer:
        for start in range(0, len(items), BATCH):
            writer.add_many(p for p, _ in items[start : start + BATCH])
    stats = writer.stats
    assert (stats.received, stats.written, stats.quarantined, stats.duplicates) == (
        len(items), len(valid), len(malformed), 0,
    )  # fmt: skip

    # Each malformed delivery: one quarantine row, with the rule it broke, a field and a message.
    rows = lake.read("quarantine").to_pylist()
    assert len(rows) == len(malformed)
    by_id = {r["record_id"]: r for r in rows if r["record_id"] is not None}
    for payload, rule in malformed:
        trajectory_id = payload_id(payload)
        if trajectory_id is None:  # the id itself was the broken field
            continue
        row = by_id[trajectory_id]
        assert row["reason"] == str(rule), (row["reason"], rule, row["message"])
        assert row["field"] and row["message"]
        assert row["run_id"] == (RUN if isinstance(payload.get("run_id"), str) else None)
        assert len(row["payload_json"]) <= LIMITS.max_quarantine_payload_bytes + 40
    unnamed = [r for r in rows if r["record_id"] is None]
    assert len(unnamed) == sum(payload_id(p) is None for p, _ in malformed)
    assert all(r["reason"] == "type" and r["field"] == "trajectory_id" for r in unnamed)
    expected = Counter(str(rule) for _, rule in malformed)
    assert Counter(r["reason"] for r in rows) == expected

    # The valid records of the same batches: stored once each, exactly as delivered.
    ids = [r.trajectory_id for r in valid]
    stored = read_trajectories(lake, run_id=RUN, trajectory_ids=ids, columns=RECORD_SCHEMA.names)
    assert stored.equals(records_to_arrow(valid))
    assert lake.read("trajectories").num_rows == len(valid)

    # And the run reconciles: every issued id is stored or quarantined, nothing lost or doubled.
    report = check_run(lake, RUN, max_staleness=4, verify_checkpoints=False)
    assert report.ok, report.lines()
    assert (report.stored, report.quarantined) == (len(valid), len(malformed))
    assert report.quarantined_by_rule == dict(expected)
