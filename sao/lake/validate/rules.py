"""What makes a trajectory row valid: the rule codes, the violation each reports, the messages.

Two implementations check them and must agree to the character: :mod:`sao.lake.validate.reference`
(row by row) and :mod:`sao.lake.validate.vectorised` (the whole batch at once). Both build their
messages with the functions below.

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
from dataclasses import dataclass

__all__ = [
    "NO_VERSION",
    "OBSERVATION_LOGPROB",
    "Rule",
    "Violation",
    "ahead_message",
    "bounds_message",
    "entry_message",
    "enum_message",
    "gap_message",
    "length_message",
    "mask_message",
    "overlap_message",
    "routing_length_message",
    "segment_version_message",
    "size_message",
    "top_k_message",
]

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


# Messages shared by both implementations, so that they agree to the character.

OBSERVATION_LOGPROB = "is not 0.0 at an observation position"


def enum_message(name: str, value: object, kind: type[enum.StrEnum]) -> str:
    return f"{name} = {value!r} is not one of {', '.join(kind)}"


def length_message(name: str, got: int, n: int) -> str:
    return f"{name} has {got} entries but completion_ids has {n}"


def segment_version_message(i: int, kind: str, version: object) -> str:
    if kind == "action":
        return f"segments[{i}] is an action segment without a policy_version"
    return f"segments[{i}] has kind {kind!r} but carries policy_version {version}; only actions have one"


def ahead_message(i: int, version: int, newest: int, run_id: str) -> str:
    if newest == NO_VERSION:
        return f"segments[{i}].policy_version = {version} but run {run_id!r} has no registered policy version"
    return f"segments[{i}].policy_version = {version} is ahead of the newest registered version {newest}"


def bounds_message(i: int, start: int, end: int, n: int) -> str:
    return f"segments[{i}] = [{start}, {end}) is empty or outside [0, {n})"


def gap_message(start: int, end: int) -> str:
    return f"tokens [{start}, {end}) are covered by no segment"


def overlap_message(i: int, start: int, previous_end: int) -> str:
    return (
        f"segments[{i}] starts at {start}, inside the previous segment which ends at {previous_end}"
    )


def mask_message(t: int, value: bool) -> str:
    kind = "an observation" if value else "an action"
    return f"action_mask[{t}] = {value} but the segments make token {t} {kind}"


def size_message(name: str, size: int, unit: str, limit: int, attribute: str) -> str:
    return f"{name} has {size} {unit}, over the limit of {limit} (SizeLimits.{attribute})"


def top_k_message(top_k: int | None, no_entries: bool) -> str:
    if no_entries:
        return f"router_top_k = {top_k} without routed_experts (both or neither)"
    return f"router_top_k = {top_k} must be an int >= 1 beside routed_experts"


def routing_length_message(entries: int, tokens: int) -> str:
    return f"routed_experts has {entries} entries, more than the {tokens} tokens of prompt_ids and completion_ids"


def entry_message(i: int, size: int, first: int, top_k: int) -> str:
    return (f"routed_experts[{i}] has {size} bytes; every entry must have the same size ({first} bytes in "
            f"entry 0), a positive multiple of router_top_k = {top_k}")

