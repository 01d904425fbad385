"""Validation of trajectories on write: every rule, a vectorised fast path and a slow reference.

The writer runs :func:`validate_table` on each flushed batch (Arrow columns, numpy over the flat token
arrays: no Python loop per token). :func:`validate_record` is the reference, written row by row over
``TrajectoryRecord.to_row()``; a property test holds the two equal on random corruptions.

Each rule reports at most one violation per record: the first offending position (or segment), so a
quarantined record says exactly where it first went wrong. Violations come sorted by record, then in
the order of :class:`Rule`.

Notation: n = len(completion_ids); "action positions" are where ``action_mask`` is true.

Rules (``Rule`` value: what must hold):
    run_id_invalid: run_id matches ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` (it names a partition folder).
    id_empty: trajectory_id is not empty.
    termination_reason: one of stop, length, turns, timeout, cancelled, error.
    logprob_kind: sampling or raw.
    length_mismatch: action_mask, logprobs and token_rewards (when present) have n entries.
    token_id_negative: prompt and completion token ids are >= 0.
    segment_kind: every segment kind is action or observation.
    segment_version: action segments carry a policy version, observation segments none.
    policy_version_negative: versions are >= 0.
    policy_version_ahead: versions are <= the newest version registered for the run.
    segment_bounds / segment_gap / segment_overlap: segments, in order, tile [0, n): each non-empty and
        inside [0, n), each starting where the previous one ended (the first at 0, the last ending at n).
    action_mask_mismatch: the action segments are exactly the action positions (checked when the
        lengths agree and the segments tile).
    logprob_not_finite / logprob_positive: log-probabilities at action positions are finite and <= 0.
    logprob_at_observation: log-probabilities at observation positions are exactly 0.0.
    reward_not_finite: reward and token_rewards are finite.
    num_turns_negative: num_turns >= 0.
    sampling_invalid: temperature >= 0, 0 < top_p <= 1, top_k null or >= 1, max_tokens >= 1.
    timings_invalid: generation_s and tool_s finite and >= 0; created_at <= started_at <= finished_at.
    routing_invalid: with ``routed_experts``, ``router_top_k`` >= 1; at most P + n entries (P prompt
        tokens: the routing covers a prefix of prompt + completion); every entry of the same size, a
        positive multiple of ``router_top_k``. (Expert ids below the model's expert count are checked
        where the model is known: the trainer's replay, :func:`sao.models.routing.replay_routing`.)
    payload_too_large: within :class:`sao.lake.config.SizeLimits` (tokens per list, segments, bytes
        per string field); reported once, for the first field over its limit.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from sao.lake.config import SizeLimits
from sao.lake.records import STRING_FIELDS, TrajectoryRecord
from schemas.trajectories import RUN_ID_PATTERN, LogprobKind, SegmentKind, TerminationReason

__all__ = ["NO_VERSION", "Rule", "Violation", "validate_record", "validate_table"]

NO_VERSION = -1
"""``newest_versions`` entry for a run with no registered policy version (every version is ahead)."""


class Rule(enum.StrEnum):
    """Rule codes, in reporting order (stored in ``quarantine.reason``)."""

    RUN_ID_INVALID = "run_id_invalid"
    ID_EMPTY = "id_empty"
    TERMINATION_REASON = "termination_reason"
    LOGPROB_KIND = "logprob_kind"
    LENGTH_MISMATCH = "length_mismatch"
    TOKEN_ID_NEGATIVE = "token_id_negative"
    SEGMENT_KIND = "segment_kind"
    SEGMENT_VERSION = "segment_version"
    POLICY_VERSION_NEGATIVE = "policy_version_negative"
    POLICY_VERSION_AHEAD = "policy_version_ahead"
    SEGMENT_BOUNDS = "segment_bounds"
    SEGMENT_GAP = "segment_gap"
    SEGMENT_OVERLAP = "segment_overlap"
    ACTION_MASK_MISMATCH = "action_mask_mismatch"
    LOGPROB_NOT_FINITE = "logprob_not_finite"
    LOGPROB_POSITIVE = "logprob_positive"
    LOGPROB_AT_OBSERVATION = "logprob_at_observation"
    REWARD_NOT_FINITE = "reward_not_finite"
    NUM_TURNS_NEGATIVE = "num_turns_negative"
    SAMPLING_INVALID = "sampling_invalid"
    TIMINGS_INVALID = "timings_invalid"
    ROUTING_INVALID = "routing_invalid"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    TYPE = "type"  # the record could not be read as a TrajectoryRecord (wrong type, missing field)


_ORDER = {rule: index for index, rule in enumerate(Rule)}
# The three tiling problems are one check: only the first problem of a record is reported.
_TILING = (Rule.SEGMENT_BOUNDS, Rule.SEGMENT_GAP, Rule.SEGMENT_OVERLAP)


@dataclass(frozen=True)
class Violation:
    """One broken rule.

    Attributes:
        row: index of the record in the validated batch.
        rule: which rule.
        field: the offending field path, e.g. ``logprobs`` or ``segments[2].start``.
        position: token index (for token fields) or segment index (for segment fields); None for
            scalar fields.
        message: what was wrong and what was expected.
    """

    row: int
    rule: Rule
    field: str
    position: int | None
    message: str

    def sort_key(self) -> tuple[int, int]:
        return self.row, _ORDER[self.rule]


# ------------------------------------------------------------------------------------------------
# Reference: one record at a time, plain Python.
# ------------------------------------------------------------------------------------------------


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
            return name, _size_message(name, size, "bytes", limits.max_string_bytes, "max_string_bytes")
    for name in ("prompt_ids", "completion_ids"):
        if len(r[name]) > limits.max_tokens:
            return name, _size_message(name, len(r[name]), "tokens", limits.max_tokens, "max_tokens")
    if len(r["segments"]) > limits.max_segments:
        count = len(r["segments"])
        return "segments", _size_message("segments", count, "entries", limits.max_segments, "max_segments")
    return None


def _size_message(name: str, size: int, unit: str, limit: int, attribute: str) -> str:
    return f"{name} has {size} {unit}, over the limit of {limit} (SizeLimits.{attribute})"


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
            _enum_message("termination_reason", r["termination_reason"], TerminationReason),
        )
    if r["logprob_kind"] not in set(LogprobKind):
        yield (
            Rule.LOGPROB_KIND,
            "logprob_kind",
            None,
            _enum_message("logprob_kind", r["logprob_kind"], LogprobKind),
        )
    lengths_ok = {}
    for name in ("action_mask", "logprobs", "token_rewards"):
        values = r[name]
        lengths_ok[name] = values is None or len(values) == n
    for name in ("action_mask", "logprobs", "token_rewards"):
        if not lengths_ok[name]:
            yield Rule.LENGTH_MISMATCH, name, None, _length_message(name, len(r[name]), n)
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
                _enum_message(f"segments[{i}].kind", s["kind"], SegmentKind),
            )
            break
    for i, s in enumerate(segments):
        if (s["kind"] == "action") == (s["policy_version"] is None):
            yield (
                Rule.SEGMENT_VERSION,
                f"segments[{i}].policy_version",
                i,
                _segment_version_message(i, s["kind"], s["policy_version"]),
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
                _ahead_message(i, s["policy_version"], newest, r["run_id"]),
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
                yield Rule.ACTION_MASK_MISMATCH, "action_mask", t, _mask_message(t, mask[t])
                break
    if lengths_ok["action_mask"] and lengths_ok["logprobs"]:
        checks = (
            (Rule.LOGPROB_NOT_FINITE, lambda a, x: a and not math.isfinite(x), "is not finite"),
            (Rule.LOGPROB_POSITIVE, lambda a, x: a and math.isfinite(x) and x > 0, "is positive"),
            (Rule.LOGPROB_AT_OBSERVATION, lambda a, x: not a and x != 0.0, _OBSERVATION_LOGPROB),
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
        return "router_top_k", None, _top_k_message(top_k, entries is None)
    if len(entries) > tokens:
        return "routed_experts", None, _routing_length_message(len(entries), tokens)
    for i, entry in enumerate(entries):
        if len(entry) != len(entries[0]) or len(entry) == 0 or len(entry) % top_k:
            return "routed_experts", i, _entry_message(i, len(entry), len(entries[0]), top_k)
    return None


def _top_k_message(top_k: int | None, no_entries: bool) -> str:
    if no_entries:
        return f"router_top_k = {top_k} without routed_experts (both or neither)"
    return f"router_top_k = {top_k} must be an int >= 1 beside routed_experts"


def _routing_length_message(entries: int, tokens: int) -> str:
    return f"routed_experts has {entries} entries, more than the {tokens} tokens of prompt_ids and completion_ids"


def _entry_message(i: int, size: int, first: int, top_k: int) -> str:
    return (f"routed_experts[{i}] has {size} bytes; every entry must have the same size ({first} bytes in "
            f"entry 0), a positive multiple of router_top_k = {top_k}")


def _reference_tiling(
    segments: list[dict[str, Any]], n: int
) -> tuple[Rule, str, int | None, str] | None:
    expected = 0
    for i, s in enumerate(segments):
        start, end = s["start"], s["end"]
        if end <= start or start < 0 or end > n:
            return Rule.SEGMENT_BOUNDS, f"segments[{i}]", start, _bounds_message(i, start, end, n)
        if start > expected:
            return Rule.SEGMENT_GAP, f"segments[{i}].start", expected, _gap_message(expected, start)
        if start < expected:
            return (
                Rule.SEGMENT_OVERLAP,
                f"segments[{i}].start",
                start,
                _overlap_message(i, start, expected),
            )
        expected = end
    if expected < n:
        return Rule.SEGMENT_GAP, "segments", expected, _gap_message(expected, n)
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


# Messages shared by both implementations, so that they agree to the character.

_OBSERVATION_LOGPROB = "is not 0.0 at an observation position"


def _enum_message(name: str, value: object, kind: type[enum.StrEnum]) -> str:
    return f"{name} = {value!r} is not one of {', '.join(kind)}"


def _length_message(name: str, got: int, n: int) -> str:
    return f"{name} has {got} entries but completion_ids has {n}"


def _segment_version_message(i: int, kind: str, version: object) -> str:
    if kind == "action":
        return f"segments[{i}] is an action segment without a policy_version"
    return f"segments[{i}] has kind {kind!r} but carries policy_version {version}; only actions have one"


def _ahead_message(i: int, version: int, newest: int, run_id: str) -> str:
    if newest == NO_VERSION:
        return f"segments[{i}].policy_version = {version} but run {run_id!r} has no registered policy version"
    return f"segments[{i}].policy_version = {version} is ahead of the newest registered version {newest}"


def _bounds_message(i: int, start: int, end: int, n: int) -> str:
    return f"segments[{i}] = [{start}, {end}) is empty or outside [0, {n})"


def _gap_message(start: int, end: int) -> str:
    return f"tokens [{start}, {end}) are covered by no segment"


def _overlap_message(i: int, start: int, previous_end: int) -> str:
    return (
        f"segments[{i}] starts at {start}, inside the previous segment which ends at {previous_end}"
    )


def _mask_message(t: int, value: bool) -> str:
    kind = "an observation" if value else "an action"
    return f"action_mask[{t}] = {value} but the segments make token {t} {kind}"


# ------------------------------------------------------------------------------------------------
# Fast path: the whole batch at once.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Lists:
    """A list column as numpy: per-row lengths and offsets, flat values, and the row of each value."""

    lengths: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    values: np.ndarray
    rows: npt.NDArray[np.int64]

    @classmethod
    def of(cls, column: pa.ChunkedArray | pa.Array) -> _Lists:
        array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        lengths = pc.list_value_length(array).fill_null(0).to_numpy().astype(np.int64)
        flat = array.flatten()
        values = flat if isinstance(flat, pa.StructArray) else flat.to_numpy(zero_copy_only=False)
        return cls(lengths, _starts(lengths), values, np.repeat(np.arange(len(lengths)), lengths))

    def subset(self, row_mask: npt.NDArray[np.bool_]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, rows, starts) of the rows where ``row_mask`` is true; ``starts`` indexes the
        returned values."""
        if row_mask.all():
            return self.values, self.rows, self.starts
        keep = row_mask[self.rows]
        return self.values[keep], self.rows[keep], _starts(np.where(row_mask, self.lengths, 0))


def _starts(lengths: np.ndarray) -> npt.NDArray[np.int64]:
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def _first(rows: np.ndarray, starts: np.ndarray, bad: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(row, position in row, flat index) of the first bad value of each row (flat order is
    row-major, and ``starts[row]`` is the flat index of the row's first value)."""
    flat = np.flatnonzero(bad)
    unique_rows, first = np.unique(rows[flat], return_index=True)
    for row, index in zip(unique_rows.tolist(), flat[first].tolist(), strict=True):
        yield row, index - int(starts[row]), index


def _numpy(column: pa.ChunkedArray | pa.Array, fill: Any = None) -> np.ndarray:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if fill is not None:
        array = array.fill_null(fill)
    return array.to_numpy(zero_copy_only=False)


def validate_table(
    table: pa.Table, newest_versions: npt.ArrayLike, limits: SizeLimits | None = None
) -> list[Violation]:
    """Every rule on a batch of ``schemas.trajectories.RECORD_SCHEMA`` rows (fast path).

    Args:
        table: the batch (``sao.lake.columnar.records_to_arrow``).
        newest_versions: (rows,) int64, the newest registered policy version of each row's run, or
            :data:`NO_VERSION`.
        limits: the size limits (defaults when None).

    Returns:
        Violations sorted by row, then rule order; rows without one are valid.
    """
    newest = np.asarray(newest_versions, dtype=np.int64)
    if newest.shape != (table.num_rows,):
        raise ValueError(f"newest_versions has shape {newest.shape}, expected ({table.num_rows},)")
    ctx = _Batch(table, newest, limits or SizeLimits())
    found = [v for check in _CHECKS for v in check(ctx)]
    return sorted(found, key=Violation.sort_key)


class _Batch:
    """Columns of one batch as numpy, shared by the checks."""

    def __init__(self, table: pa.Table, newest: np.ndarray, limits: SizeLimits) -> None:
        self.table = table
        self.limits = limits
        self.rows = table.num_rows
        self.newest = newest
        self.completion = _Lists.of(table["completion_ids"])
        self.n = self.completion.lengths
        self.mask = _Lists.of(table["action_mask"])
        self.logprobs = _Lists.of(table["logprobs"])
        token_rewards = table["token_rewards"].combine_chunks()
        self.token_rewards = _Lists.of(token_rewards)
        self.has_token_rewards = ~_numpy(token_rewards.is_null())
        self.lengths_ok = {
            "action_mask": self.mask.lengths == self.n,
            "logprobs": self.logprobs.lengths == self.n,
            "token_rewards": ~self.has_token_rewards | (self.token_rewards.lengths == self.n),
        }
        segments = _Lists.of(table["segments"])
        kind, version, start, end = segments.values.flatten()
        self.seg = segments
        self.seg_kind = _numpy(kind)
        self.seg_version_null = _numpy(version.is_null())
        self.seg_version = _numpy(version, fill=0).astype(np.int64)
        self.seg_start = _numpy(start).astype(np.int64)
        self.seg_end = _numpy(end).astype(np.int64)
        self.seg_action = self.seg_kind == SegmentKind.ACTION.value
        self.seg_kind_ok = self.seg_action | (self.seg_kind == SegmentKind.OBSERVATION.value)
        self.run_id = _numpy(table["run_id"])


def _check_scalars(b: _Batch) -> Iterator[Violation]:
    run_ok = _numpy(pc.match_substring_regex(b.table["run_id"], f"^{RUN_ID_PATTERN}$"))
    for row in np.flatnonzero(~run_ok).tolist():
        value = b.run_id[row]
        yield Violation(
            row,
            Rule.RUN_ID_INVALID,
            "run_id",
            None,
            f"run_id {value!r} must match {RUN_ID_PATTERN}",
        )
    empty = _numpy(pc.equal(b.table["trajectory_id"], ""))
    for row in np.flatnonzero(empty).tolist():
        yield Violation(row, Rule.ID_EMPTY, "trajectory_id", None, "trajectory_id is empty")
    for name, rule, kind in (
        ("termination_reason", Rule.TERMINATION_REASON, TerminationReason),
        ("logprob_kind", Rule.LOGPROB_KIND, LogprobKind),
    ):
        ok = _numpy(pc.is_in(b.table[name], value_set=pa.array([str(k) for k in kind])))
        values = _numpy(b.table[name])
        for row in np.flatnonzero(~ok).tolist():
            yield Violation(row, rule, name, None, _enum_message(name, values[row], kind))


def _check_lengths(b: _Batch) -> Iterator[Violation]:
    reported = np.zeros(b.rows, dtype=np.bool_)
    for name, lists in (
        ("action_mask", b.mask),
        ("logprobs", b.logprobs),
        ("token_rewards", b.token_rewards),
    ):
        bad = ~b.lengths_ok[name] & ~reported
        for row in np.flatnonzero(bad).tolist():
            message = _length_message(name, int(lists.lengths[row]), int(b.n[row]))
            yield Violation(row, Rule.LENGTH_MISMATCH, name, None, message)
        reported |= bad


def _check_token_ids(b: _Batch) -> Iterator[Violation]:
    reported = np.zeros(b.rows, dtype=np.bool_)
    prompt = _Lists.of(b.table["prompt_ids"])
    for name, lists in (("prompt_ids", prompt), ("completion_ids", b.completion)):
        for row, t, index in _first(lists.rows, lists.starts, lists.values < 0):
            if not reported[row]:
                reported[row] = True
                value = int(lists.values[index])
                yield Violation(
                    row, Rule.TOKEN_ID_NEGATIVE, name, t, f"{name}[{t}] = {value} is negative"
                )


def _check_segment_labels(b: _Batch) -> Iterator[Violation]:
    rows, starts = b.seg.rows, b.seg.starts
    for row, i, j in _first(rows, starts, ~b.seg_kind_ok):
        name = f"segments[{i}].kind"
        yield Violation(
            row, Rule.SEGMENT_KIND, name, i, _enum_message(name, b.seg_kind[j], SegmentKind)
        )
    mislabelled = b.seg_action == b.seg_version_null
    for row, i, j in _first(rows, starts, mislabelled):
        version = None if b.seg_version_null[j] else int(b.seg_version[j])
        message = _segment_version_message(i, b.seg_kind[j], version)
        yield Violation(row, Rule.SEGMENT_VERSION, f"segments[{i}].policy_version", i, message)
    versioned_action = b.seg_action & ~b.seg_version_null
    for row, i, j in _first(rows, starts, versioned_action & (b.seg_version < 0)):
        message = f"segments[{i}].policy_version = {int(b.seg_version[j])} is negative"
        yield Violation(
            row, Rule.POLICY_VERSION_NEGATIVE, f"segments[{i}].policy_version", i, message
        )
    ahead = versioned_action & (b.seg_version > b.newest[rows])
    for row, i, j in _first(rows, starts, ahead):
        message = _ahead_message(i, int(b.seg_version[j]), int(b.newest[row]), str(b.run_id[row]))
        yield Violation(row, Rule.POLICY_VERSION_AHEAD, f"segments[{i}].policy_version", i, message)


def _tiling_ok(b: _Batch) -> tuple[npt.NDArray[np.bool_], list[Violation]]:
    """Rows whose segments tile [0, n), and the first tiling violation of every other row."""
    rows, starts = b.seg.rows, b.seg.starts
    start, end = b.seg_start, b.seg_end
    previous_end = np.zeros_like(end)
    previous_end[1:] = end[:-1]
    previous_end[starts[b.seg.lengths > 0]] = 0  # the first segment of a row starts after 0
    n = b.n[rows]
    bounds = (end <= start) | (start < 0) | (end > n)
    problem = bounds | (start != previous_end)
    found: list[Violation] = []
    ok = np.ones(b.rows, dtype=np.bool_)
    for row, i, j in _first(rows, starts, problem):
        ok[row] = False
        s, e, p = int(start[j]), int(end[j]), int(previous_end[j])
        if bounds[j]:
            found.append(
                Violation(
                    row,
                    Rule.SEGMENT_BOUNDS,
                    f"segments[{i}]",
                    s,
                    _bounds_message(i, s, e, int(b.n[row])),
                )
            )
        elif s > p:
            found.append(
                Violation(row, Rule.SEGMENT_GAP, f"segments[{i}].start", p, _gap_message(p, s))
            )
        else:
            found.append(
                Violation(
                    row, Rule.SEGMENT_OVERLAP, f"segments[{i}].start", s, _overlap_message(i, s, p)
                )
            )
    counts = b.seg.lengths
    last_end = np.zeros(b.rows, dtype=np.int64)
    has = counts > 0
    last_end[has] = end[b.seg.starts[has] + counts[has] - 1]
    for row in np.flatnonzero(ok & (last_end < b.n)).tolist():
        ok[row] = False
        found.append(
            Violation(
                row,
                Rule.SEGMENT_GAP,
                "segments",
                int(last_end[row]),
                _gap_message(int(last_end[row]), int(b.n[row])),
            )
        )
    return ok, found


def _check_tiling_and_mask(b: _Batch) -> Iterator[Violation]:
    tiles, found = _tiling_ok(b)
    yield from found
    kinds_ok = np.ones(b.rows, dtype=np.bool_)
    kinds_ok[b.seg.rows[~b.seg_kind_ok]] = False
    rows_ok = tiles & kinds_ok & b.lengths_ok["action_mask"]
    segment_ok = rows_ok[b.seg.rows]
    expected = np.repeat(b.seg_action[segment_ok], (b.seg_end - b.seg_start)[segment_ok])
    actual, token_rows, token_starts = b.mask.subset(rows_ok)
    for row, t, index in _first(token_rows, token_starts, actual != expected):
        yield Violation(
            row, Rule.ACTION_MASK_MISMATCH, "action_mask", t, _mask_message(t, bool(actual[index]))
        )


def _check_logprobs(b: _Batch) -> Iterator[Violation]:
    rows_ok = b.lengths_ok["action_mask"] & b.lengths_ok["logprobs"]
    action = b.mask.subset(rows_ok)[0]
    logprobs, token_rows, token_starts = b.logprobs.subset(rows_ok)
    finite = np.isfinite(logprobs)
    with np.errstate(invalid="ignore"):
        checks = (
            (Rule.LOGPROB_NOT_FINITE, action & ~finite, "is not finite"),
            (Rule.LOGPROB_POSITIVE, action & finite & (logprobs > 0), "is positive"),
            (Rule.LOGPROB_AT_OBSERVATION, ~action & (logprobs != 0.0), _OBSERVATION_LOGPROB),
        )
    for rule, bad, what in checks:
        for row, t, index in _first(token_rows, token_starts, bad):
            value = float(logprobs[index])
            yield Violation(row, rule, "logprobs", t, f"logprobs[{t}] = {value} {what}")


def _check_rewards(b: _Batch) -> Iterator[Violation]:
    reward = _numpy(b.table["reward"])
    bad_reward = ~np.isfinite(reward)
    for row in np.flatnonzero(bad_reward).tolist():
        yield Violation(
            row,
            Rule.REWARD_NOT_FINITE,
            "reward",
            None,
            f"reward = {float(reward[row])} is not finite",
        )
    lists = b.token_rewards
    bad = ~np.isfinite(lists.values) & ~bad_reward[lists.rows]
    for row, t, index in _first(lists.rows, lists.starts, bad):
        value = float(lists.values[index])
        yield Violation(
            row,
            Rule.REWARD_NOT_FINITE,
            "token_rewards",
            t,
            f"token_rewards[{t}] = {value} is not finite",
        )
    turns = _numpy(b.table["num_turns"])
    for row in np.flatnonzero(turns < 0).tolist():
        yield Violation(
            row,
            Rule.NUM_TURNS_NEGATIVE,
            "num_turns",
            None,
            f"num_turns = {int(turns[row])} is negative",
        )


def _check_sampling(b: _Batch) -> Iterator[Violation]:
    sampling = b.table["sampling"].combine_chunks()
    temperature = _numpy(sampling.field("temperature"))
    top_p = _numpy(sampling.field("top_p"))
    top_k_null = _numpy(sampling.field("top_k").is_null())
    top_k = _numpy(sampling.field("top_k"), fill=1)
    max_tokens = _numpy(sampling.field("max_tokens"))
    with np.errstate(invalid="ignore"):
        checks: list[tuple[np.ndarray, Callable[[int], tuple[str, str]]]] = [
            (
                ~(np.isfinite(temperature) & (temperature >= 0)),
                lambda r: (
                    "sampling.temperature",
                    f"temperature = {float(temperature[r])} must be finite and >= 0",
                ),
            ),
            (
                ~((top_p > 0) & (top_p <= 1)),
                lambda r: ("sampling.top_p", f"top_p = {float(top_p[r])} must lie in (0, 1]"),
            ),
            (
                ~top_k_null & (top_k < 1),
                lambda r: (
                    "sampling.top_k",
                    f"top_k = {int(top_k[r])} must be >= 1 (null disables it)",
                ),
            ),
            (
                max_tokens < 1,
                lambda r: (
                    "sampling.max_tokens",
                    f"max_tokens = {int(max_tokens[r])} must be >= 1",
                ),
            ),
        ]
    yield from _first_scalar_problem(b.rows, Rule.SAMPLING_INVALID, checks)


def _check_timings(b: _Batch) -> Iterator[Violation]:
    timings = b.table["timings"].combine_chunks()
    generation = _numpy(timings.field("generation_s"))
    tool = _numpy(timings.field("tool_s"))
    created, started, finished = (
        _numpy(timings.field(name).cast(pa.int64()))
        for name in ("created_at", "started_at", "finished_at")
    )
    with np.errstate(invalid="ignore"):
        checks: list[tuple[np.ndarray, Callable[[int], tuple[str, str]]]] = [
            (
                ~(np.isfinite(generation) & (generation >= 0)),
                lambda r: (
                    "timings.generation_s",
                    f"generation_s = {float(generation[r])} must be finite and >= 0",
                ),
            ),
            (
                ~(np.isfinite(tool) & (tool >= 0)),
                lambda r: ("timings.tool_s", f"tool_s = {float(tool[r])} must be finite and >= 0"),
            ),
            (
                started < created,
                lambda r: ("timings.started_at", "started_at is before created_at"),
            ),
            (
                finished < started,
                lambda r: ("timings.finished_at", "finished_at is before started_at"),
            ),
        ]
    yield from _first_scalar_problem(b.rows, Rule.TIMINGS_INVALID, checks)


def _check_routing(b: _Batch) -> Iterator[Violation]:
    column = b.table["routed_experts"].combine_chunks()
    has_entries = ~_numpy(column.is_null())
    top_k_column = b.table["router_top_k"]
    has_top_k = ~_numpy(top_k_column.is_null())
    top_k = _numpy(top_k_column, fill=0).astype(np.int64)
    entries = _Lists.of(column)
    tokens = _numpy(pc.list_value_length(b.table["prompt_ids"]).fill_null(0)).astype(np.int64) + b.n
    bad_top_k = (has_entries | has_top_k) & ~(has_entries & has_top_k & (top_k >= 1))
    too_long = has_entries & ~bad_top_k & (entries.lengths > tokens)
    for row in np.flatnonzero(bad_top_k).tolist():
        value = int(top_k[row]) if has_top_k[row] else None
        yield Violation(row, Rule.ROUTING_INVALID, "router_top_k", None, _top_k_message(value, not has_entries[row]))
    for row in np.flatnonzero(too_long).tolist():
        message = _routing_length_message(int(entries.lengths[row]), int(tokens[row]))
        yield Violation(row, Rule.ROUTING_INVALID, "routed_experts", None, message)
    checked = has_entries & ~bad_top_k & ~too_long
    if not checked.any():
        return
    sizes = _numpy(pc.binary_length(column.flatten())).astype(np.int64)
    first = np.where(entries.lengths > 0, sizes[np.minimum(entries.starts, max(len(sizes) - 1, 0))]
                     if len(sizes) else 0, 0)
    row_top_k = top_k[entries.rows]
    bad = (sizes != first[entries.rows]) | (sizes == 0) | (sizes % np.maximum(row_top_k, 1) != 0)
    bad &= checked[entries.rows]
    for row, i, index in _first(entries.rows, entries.starts, bad):
        message = _entry_message(i, int(sizes[index]), int(first[row]), int(top_k[row]))
        yield Violation(row, Rule.ROUTING_INVALID, "routed_experts", i, message)


def _first_scalar_problem(
    rows: int, rule: Rule, checks: list[tuple[np.ndarray, Callable[[int], tuple[str, str]]]]
) -> Iterator[Violation]:
    reported = np.zeros(rows, dtype=np.bool_)
    for bad, describe in checks:
        for row in np.flatnonzero(bad & ~reported).tolist():
            field_name, message = describe(row)
            yield Violation(row, rule, field_name, None, message)
        reported |= bad


def _check_size(b: _Batch) -> Iterator[Violation]:
    limits = b.limits
    checks: list[tuple[np.ndarray, Callable[[int], tuple[str, str]]]] = []
    for name in STRING_FIELDS:
        size = _numpy(pc.binary_length(b.table[name].cast(pa.binary())))
        checks.append((size > limits.max_string_bytes, _size_problem(name, size, "bytes",
                        limits.max_string_bytes, "max_string_bytes")))  # fmt: skip
    prompt = _numpy(pc.list_value_length(b.table["prompt_ids"]).fill_null(0))
    for name, lengths in (("prompt_ids", prompt), ("completion_ids", b.n)):
        checks.append((lengths > limits.max_tokens, _size_problem(name, lengths, "tokens",
                       limits.max_tokens, "max_tokens")))  # fmt: skip
    counts = b.seg.lengths
    checks.append((counts > limits.max_segments, _size_problem("segments", counts, "entries",
                   limits.max_segments, "max_segments")))  # fmt: skip
    yield from _first_scalar_problem(b.rows, Rule.PAYLOAD_TOO_LARGE, checks)


def _size_problem(
    name: str, sizes: np.ndarray, unit: str, limit: int, attribute: str
) -> Callable[[int], tuple[str, str]]:
    return lambda r: (name, _size_message(name, int(sizes[r]), unit, limit, attribute))


_CHECKS: tuple[Callable[[_Batch], Iterator[Violation]], ...] = (
    _check_scalars,
    _check_lengths,
    _check_token_ids,
    _check_segment_labels,
    _check_tiling_and_mask,
    _check_logprobs,
    _check_rewards,
    _check_sampling,
    _check_timings,
    _check_routing,
    _check_size,
)
