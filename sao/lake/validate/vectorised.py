"""Fast path: every rule on a whole batch at once (Arrow columns, numpy over the flat token arrays:
no Python loop per token).

The writer runs :func:`validate_table` on each flushed batch. It must agree, violation for
violation, with the slow reference :func:`sao.lake.validate.reference.validate_record`; a property
test (``tests/lake/validate/test_vectorised.py``) holds the two equal on random corruptions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from sao.lake.config import SizeLimits
from sao.lake.records import OPTIONAL_STRING_FIELDS, STRING_FIELDS
from sao.lake.validate.rules import (
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

__all__ = ["validate_table"]


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
            yield Violation(row, rule, name, None, enum_message(name, values[row], kind))


def _check_lengths(b: _Batch) -> Iterator[Violation]:
    reported = np.zeros(b.rows, dtype=np.bool_)
    for name, lists in (
        ("action_mask", b.mask),
        ("logprobs", b.logprobs),
        ("token_rewards", b.token_rewards),
    ):
        bad = ~b.lengths_ok[name] & ~reported
        for row in np.flatnonzero(bad).tolist():
            message = length_message(name, int(lists.lengths[row]), int(b.n[row]))
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
            row, Rule.SEGMENT_KIND, name, i, enum_message(name, b.seg_kind[j], SegmentKind)
        )
    mislabelled = b.seg_action == b.seg_version_null
    for row, i, j in _first(rows, starts, mislabelled):
        version = None if b.seg_version_null[j] else int(b.seg_version[j])
        message = segment_version_message(i, b.seg_kind[j], version)
        yield Violation(row, Rule.SEGMENT_VERSION, f"segments[{i}].policy_version", i, message)
    versioned_action = b.seg_action & ~b.seg_version_null
    for row, i, j in _first(rows, starts, versioned_action & (b.seg_version < 0)):
        message = f"segments[{i}].policy_version = {int(b.seg_version[j])} is negative"
        yield Violation(
            row, Rule.POLICY_VERSION_NEGATIVE, f"segments[{i}].policy_version", i, message
        )
    ahead = versioned_action & (b.seg_version > b.newest[rows])
    for row, i, j in _first(rows, starts, ahead):
        message = ahead_message(i, int(b.seg_version[j]), int(b.newest[row]), str(b.run_id[row]))
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
                    bounds_message(i, s, e, int(b.n[row])),
                )
            )
        elif s > p:
            found.append(
                Violation(row, Rule.SEGMENT_GAP, f"segments[{i}].start", p, gap_message(p, s))
            )
        else:
            found.append(
                Violation(
                    row, Rule.SEGMENT_OVERLAP, f"segments[{i}].start", s, overlap_message(i, s, p)
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
                gap_message(int(last_end[row]), int(b.n[row])),
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
            row, Rule.ACTION_MASK_MISMATCH, "action_mask", t, mask_message(t, bool(actual[index]))
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
            (Rule.LOGPROB_AT_OBSERVATION, ~action & (logprobs != 0.0), OBSERVATION_LOGPROB),
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
        yield Violation(row, Rule.ROUTING_INVALID, "router_top_k", None, top_k_message(value, not has_entries[row]))
    for row in np.flatnonzero(too_long).tolist():
        message = routing_length_message(int(entries.lengths[row]), int(tokens[row]))
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
        message = entry_message(i, int(sizes[index]), int(first[row]), int(top_k[row]))
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
    for name, attribute in OPTIONAL_STRING_FIELDS.items():
        size = _numpy(pc.binary_length(b.table[name].cast(pa.binary())).fill_null(0))
        checks.append((size > getattr(limits, attribute), _size_problem(name, size, "bytes",
                        getattr(limits, attribute), attribute)))  # fmt: skip
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
    return lambda r: (name, size_message(name, int(sizes[r]), unit, limit, attribute))


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
