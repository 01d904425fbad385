"""Slow reference: every rule on one record at a time, plain Python over ``to_row()``.

:func:`sao.lake.validate.vectorised.validate_table` is the fast path the writer runs; a property
test (``tests/lake/validate/test_vectorised.py``) holds the two equal on random corruptions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from sao.lake.config import SizeLimits
from sao.lake.records import OPTIONAL_STRING_FIELDS, STRING_FIELDS, TrajectoryRecord
from sao.lake.validate.rules import (
    NO_VERSION,
    OBSERVATION_LOGPROB,
    Rule,
    Violation,
    ahead_message,
    bounds_message,
    entry_message,
    enum_message,
    gap_message,
    length_message,
    mask_message,
    overlap_message,
    routing_length_message,
    segment_version_message,
    size_message,
    top_k_message,
)
from schemas.trajectories import RUN_ID_PATTERN, LogprobKind, SegmentKind, TerminationReason

__all__ = ["validate_record"]


def validate_record(
    record: TrajectoryRecord,
    newest_version: int | None,
    row: int = 0,
    limits: SizeLimits | None = None,
) -> list[Violation]:
    """Every rule on one record (slow reference). ``newest_version``: newest registered version of the
    record's run, None when none is registered; ``limits``: the size limits (defaults when None)."""
    r = record.to_row()
    newest = NO_VERSION if newest_version is None else newest_version
    found = [Violation(row, rule, f, p, m) for rule, f, p, m in _reference_checks(r, newest)]
    problem = _reference_size(r, limits or SizeLimits())
    if problem is not None:
        found.append(Violation(row, Rule.PAYLOAD_TOO_LARGE, problem[0], None, problem[1]))
    return sorted(found, key=Violation.sort_key)


def _reference_size(r: dict[str, Any], limits: SizeLimits) -> tuple[str, str] | None:
    for name in STRING_FIELDS:
        size = len(r[name].encode("utf-8", errors="surrogatepass"))
        if size > limits.max_string_bytes:
            return name, size_message(name, size, "bytes", limits.max_string_bytes, "max_string_bytes")
    for name, attribute in OPTIONAL_STRING_FIELDS.items():
        size = 0 if r.get(name) is None else len(r[name].encode("utf-8", errors="surrogatepass"))
        if size > getattr(limits, attribute):
            return name, size_message(name, size, "bytes", getattr(limits, attribute), attribute)
    for name in ("prompt_ids", "completion_ids"):
        if len(r[name]) > limits.max_tokens:
            return name, size_message(name, len(r[name]), "tokens", limits.max_tokens, "max_tokens")
    if len(r["segments"]) > limits.max_segments:
        count = len(r["segments"])
        return "segments", size_message("segments", count, "entries", limits.max_segments, "max_segments")
    return None


def _reference_checks(
    r: dict[str, Any], newest: int
) -> Iterator[tuple[Rule, str, int | None, str]]:
    n = len(r["completion_ids"])
    if not re.fullmatch(RUN_ID_PATTERN, r["run_id"]):
        yield (
            Rule.RUN_ID_INVALID,
            "run_id",
            None,
            f"run_id {r['run_id']!r} must match {RUN_ID_PATTERN}",
        )
    if r["trajectory_id"] == "":
        yield Rule.ID_EMPTY, "trajectory_id", None, "trajectory_id is empty"
    if r["termination_reason"] not in set(TerminationReason):
        yield (
            Rule.TERMINATION_REASON,
            "termination_reason",
            None,
            enum_message("termination_reason", r["termination_reason"], TerminationReason),
        )
    if r["logprob_kind"] not in set(LogprobKind):
        yield (
            Rule.LOGPROB_KIND,
            "logprob_kind",
            None,
            enum_message("logprob_kind", r["logprob_kind"], LogprobKind),
        )
    lengths_ok = {}
    for name in ("action_mask", "logprobs", "token_rewards"):
        values = r[name]
        lengths_ok[name] = values is None or len(values) == n
    for name in ("action_mask", "logprobs", "token_rewards"):
        if not lengths_ok[name]:
            yield Rule.LENGTH_MISMATCH, name, None, length_message(name, len(r[name]), n)
            break
    for name in ("prompt_ids", "completion_ids"):
        negative = [t for t, token in enumerate(r[name]) if token < 0]
        if negative:
            t = negative[0]
            yield Rule.TOKEN_ID_NEGATIVE, name, t, f"{name}[{t}] = {r[name][t]} is negative"
            break
    segments = r["segments"]
    kinds_ok = True
    for i, s in enumerate(segments):
        if s["kind"] not in set(SegmentKind):
            kinds_ok = False
            yield (
                Rule.SEGMENT_KIND,
                f"segments[{i}].kind",
                i,
                enum_message(f"segments[{i}].kind", s["kind"], SegmentKind),
            )
            break
    for i, s in enumerate(segments):
        if (s["kind"] == "action") == (s["policy_version"] is None):
            yield (
                Rule.SEGMENT_VERSION,
                f"segments[{i}].policy_version",
                i,
                segment_version_message(i, s["kind"], s["policy_version"]),
            )
            break
    actions = [
        (i, s)
        for i, s in enumerate(segments)
        if s["kind"] == "action" and s["policy_version"] is not None
    ]
    for i, s in actions:
        if s["policy_version"] < 0:
            yield (
                Rule.POLICY_VERSION_NEGATIVE,
                f"segments[{i}].policy_version",
                i,
                (f"segments[{i}].policy_version = {s['policy_version']} is negative"),
            )
            break
    for i, s in actions:
        if s["policy_version"] > newest:
            yield (
                Rule.POLICY_VERSION_AHEAD,
                f"segments[{i}].policy_version",
                i,
                ahead_message(i, s["policy_version"], newest, r["run_id"]),
            )
            break
    tiling = _reference_tiling(segments, n)
    if tiling is not None:
        yield tiling
    mask, logprobs = r["action_mask"], r["logprobs"]
    if lengths_ok["action_mask"] and tiling is None and kinds_ok:
        expected = [False] * n
        for s in segments:
            for t in range(s["start"], s["end"]):
                expected[t] = s["kind"] == "action"
        for t in range(n):
            if mask[t] != expected[t]:
                yield Rule.ACTION_MASK_MISMATCH, "action_mask", t, mask_message(t, mask[t])
                break
    if lengths_ok["action_mask"] and lengths_ok["logprobs"]:
        checks = (
            (Rule.LOGPROB_NOT_FINITE, lambda a, x: a and not math.isfinite(x), "is not finite"),
            (Rule.LOGPROB_POSITIVE, lambda a, x: a and math.isfinite(x) and x > 0, "is positive"),
            (Rule.LOGPROB_AT_OBSERVATION, lambda a, x: not a and x != 0.0, OBSERVATION_LOGPROB),
        )
        for rule, bad, what in checks:
            for t in range(n):
                if bad(mask[t], logprobs[t]):
                    yield rule, "logprobs", t, f"logprobs[{t}] = {logprobs[t]} {what}"
                    break
    if not math.isfinite(r["reward"]):
        yield Rule.REWARD_NOT_FINITE, "reward", None, f"reward = {r['reward']} is not finite"
    elif r["token_rewards"] is not None:
        for t, x in enumerate(r["token_rewards"]):
            if not math.isfinite(x):
                yield (
                    Rule.REWARD_NOT_FINITE,
                    "token_rewards",
                    t,
                    f"token_rewards[{t}] = {x} is not finite",
                )
                break
    if r["num_turns"] < 0:
        yield (
            Rule.NUM_TURNS_NEGATIVE,
            "num_turns",
            None,
            f"num_turns = {r['num_turns']} is negative",
        )
    problem = _reference_sampling(r["sampling"])
    if problem is not None:
        yield Rule.SAMPLING_INVALID, problem[0], None, problem[1]
    problem = _reference_timings(r["timings"])
    if problem is not None:
        yield Rule.TIMINGS_INVALID, problem[0], None, problem[1]
    problem = _reference_routing(r["routed_experts"], r["router_top_k"], len(r["prompt_ids"]) + n)
    if problem is not None:
        yield (Rule.ROUTING_INVALID, *problem)


def _reference_routing(entries: list[bytes] | None, top_k: int | None, tokens: int,
                       ) -> tuple[str, int | None, str] | None:
    if entries is None and top_k is None:
        return None
    if entries is None or top_k is None or top_k < 1:
        return "router_top_k", None, top_k_message(top_k, entries is None)
    if len(entries) > tokens:
        return "routed_experts", None, routing_length_message(len(entries), tokens)
    for i, entry in enumerate(entries):
        if len(entry) != len(entries[0]) or len(entry) == 0 or len(entry) % top_k:
            return "routed_experts", i, entry_message(i, len(entry), len(entries[0]), top_k)
    return None


def _reference_tiling(
    segments: list[dict[str, Any]], n: int
) -> tuple[Rule, str, int | None, str] | None:
    expected = 0
    for i, s in enumerate(segments):
        start, end = s["start"], s["end"]
        if end <= start or start < 0 or end > n:
            return Rule.SEGMENT_BOUNDS, f"segments[{i}]", start, bounds_message(i, start, end, n)
        if start > expected:
            return Rule.SEGMENT_GAP, f"segments[{i}].start", expected, gap_message(expected, start)
        if start < expected:
            return (
                Rule.SEGMENT_OVERLAP,
                f"segments[{i}].start",
                start,
                overlap_message(i, start, expected),
            )
        expected = end
    if expected < n:
        return Rule.SEGMENT_GAP, "segments", expected, gap_message(expected, n)
    return None


def _reference_sampling(s: dict[str, Any]) -> tuple[str, str] | None:
    if not (math.isfinite(s["temperature"]) and s["temperature"] >= 0):
        return "sampling.temperature", f"temperature = {s['temperature']} must be finite and >= 0"
    if not (0 < s["top_p"] <= 1):
        return "sampling.top_p", f"top_p = {s['top_p']} must lie in (0, 1]"
    if s["top_k"] is not None and s["top_k"] < 1:
        return "sampling.top_k", f"top_k = {s['top_k']} must be >= 1 (null disables it)"
    if s["max_tokens"] < 1:
        return "sampling.max_tokens", f"max_tokens = {s['max_tokens']} must be >= 1"
    return None


def _reference_timings(t: dict[str, Any]) -> tuple[str, str] | None:
    for name in ("generation_s", "tool_s"):
        if not (math.isfinite(t[name]) and t[name] >= 0):
            return f"timings.{name}", f"{name} = {t[name]} must be finite and >= 0"
    if t["started_at"] < t["created_at"]:
        return "timings.started_at", "started_at is before created_at"
    if t["finished_at"] < t["started_at"]:
        return "timings.finished_at", "finished_at is before started_at"
    return None
