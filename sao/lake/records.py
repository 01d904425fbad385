"""Python-side records of the lake's tables: what producers build and hand to the writers.

:class:`TrajectoryRecord` is what a rollout worker builds per finished trajectory. Token sequences are
numpy arrays (``int32`` ids, ``bool`` mask, ``float32`` log-probabilities) so that a batch becomes Arrow
columns without a Python loop per token. Construction coerces lists and checks *types* (a float where a
token id belongs raises :class:`RecordTypeError` naming the field); the *content* rules (lengths,
segment tiling, log-probability range, versions) are checked by the writer, which quarantines a bad
record instead of raising.

Notation: n is the number of completion tokens (everything after the prompt).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.trajectories import LogprobKind, SegmentKind, TerminationReason

__all__ = [
    "PolicyVersionRecord",
    "RecordTypeError",
    "RecordedSampling",
    "Segment",
    "Timings",
    "TrainStepRecord",
    "TrajectoryRecord",
    "decode_routing",
    "routing_entries",
    "utc_now",
]

_INT32 = np.iinfo(np.int32)


class RecordTypeError(TypeError):
    """A record field has the wrong type or shape; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def utc_now() -> dt.datetime:
    """The current time, timezone-aware UTC, microsecond precision (what Delta stores)."""
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Segment:
    """A run of completion tokens ``[start, end)`` produced by one source.

    Attributes:
        kind: ``action`` (sampled by the policy) or ``observation`` (tool / environment output).
        start: first token position; end: one past the last.
        policy_version: the version that sampled an action segment; None for observations.
    """

    kind: SegmentKind
    start: int
    end: int
    policy_version: int | None = None

    def to_row(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "policy_version": self.policy_version,
            "start": self.start,
            "end": self.end,
        }


@dataclass(frozen=True)
class RecordedSampling:
    """The sampling settings a trajectory row stores: its ``sampling`` struct
    (:mod:`schemas.trajectories`).

    Not the engine's request settings (:class:`sao.rollout.engine.SamplingParams`): this is what the
    row keeps of them, in the table's terms. A disabled top-k is stored as null (``top_k=None``), where
    the engine spells it ``top_k=0``; a stored ``top_k`` is otherwise >= 1. The agent loop records
    (:meth:`sao.rollout.agent.AgentLoop.run`, mapping 0 -> None) and the trainer reads back
    (:func:`sao.train.batch.collate`, mapping None -> 0).

    Attributes:
        temperature: the logits' divisor (> 0).
        top_p: nucleus mass kept, in (0, 1]; 1.0 = no nucleus cut.
        top_k: the k most likely tokens kept, >= 1; None = no top-k (the engine's 0).
        max_tokens, seed: the token budget and the sampler seed (None: the engine drew its own).
    """

    temperature: float
    top_p: float
    top_k: int | None
    max_tokens: int
    seed: int | None

    def to_row(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Timings:
    """Rollout timings; timestamps must be timezone-aware."""

    created_at: dt.datetime
    started_at: dt.datetime
    finished_at: dt.datetime
    generation_s: float
    tool_s: float

    def __post_init__(self) -> None:
        for name in ("created_at", "started_at", "finished_at"):
            value = getattr(self, name)
            if not isinstance(value, dt.datetime) or value.tzinfo is None:
                raise RecordTypeError(
                    f"timings.{name}", f"needs a timezone-aware datetime, got {value!r}"
                )

    def to_row(self) -> dict[str, Any]:
        return {
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "generation_s": self.generation_s,
            "tool_s": self.tool_s,
        }


# Plain string columns of a trajectory record (identity and provenance), in schema order.
STRING_FIELDS = (
    "trajectory_id",
    "run_id",
    "task_id",
    "env_name",
    "tokenizer_version",
    "chat_template_version",
    "engine_name",
    "engine_version",
    "worker_id",
)
# Nullable string columns and the SizeLimits attribute that bounds each.
OPTIONAL_STRING_FIELDS = {"episode_id": "max_string_bytes", "error": "max_text_bytes", "agent_info": "max_text_bytes"}


@dataclass(frozen=True, eq=False)
class TrajectoryRecord:
    """One finished trajectory, as a rollout worker hands it to the lake.

    Attributes (n = number of completion tokens):
        trajectory_id: unique id (use ``uuid.uuid4().hex``); a second delivery is stored once.
        run_id, task_id, env_name: which run, task and environment.
        prompt_ids: (P,) int32 prompt token ids.
        completion_ids: (n,) int32 ids after the prompt, action and observation tokens alike.
        action_mask: (n,) bool, True where the policy sampled the token.
        logprobs: (n,) float32 engine log-probability of each sampled token at generation time
            (log pi_behave), 0.0 at observation positions.
        logprob_kind: ``sampling`` or ``raw``.
        segments: action / observation runs tiling ``[0, n)`` in token order.
        reward: the trajectory's reward.
        termination_reason: why it ended.
        num_turns: number of action segments the agent loop ran.
        sampling, timings: engine settings and rollout timings.
        tokenizer_version, chat_template_version, engine_name, engine_version, worker_id: provenance.
        token_rewards: optional (n,) float32 step rewards.
        routed_experts: optional (R, M, K) uint8 MoE routing, R <= P + n: the expert ids of the first R
            tokens of prompt + completion, per MoE layer (M) in the router's top-k order (K); see
            ``routed_experts`` in :mod:`schemas.trajectories` for which tokens and which forward.
        error: with ``termination_reason`` error, what failed (exception type and message); else None.
        episode_id, episode_part: the agent episode this trajectory is part k of (chat endpoint
            rollouts, :mod:`sao.rollout.chat_endpoint`); None for the built-in loop.
        agent_info: JSON text of the info an agent of one's own returned with its reward, or None.
    """

    trajectory_id: str
    run_id: str
    task_id: str
    env_name: str
    prompt_ids: npt.NDArray[np.int32]
    completion_ids: npt.NDArray[np.int32]
    action_mask: npt.NDArray[np.bool_]
    logprobs: npt.NDArray[np.float32]
    logprob_kind: LogprobKind
    segments: tuple[Segment, ...]
    reward: float
    termination_reason: TerminationReason
    num_turns: int
    sampling: RecordedSampling
    tokenizer_version: str
    chat_template_version: str
    engine_name: str
    engine_version: str
    worker_id: str
    timings: Timings
    token_rewards: npt.NDArray[np.float32] | None = None
    routed_experts: npt.NDArray[np.uint8] | None = None
    error: str | None = None
    episode_id: str | None = None
    episode_part: int | None = None
    agent_info: str | None = None

    def __post_init__(self) -> None:
        for name in (*STRING_FIELDS, "logprob_kind", "termination_reason"):
            if not isinstance(getattr(self, name), str):
                raise RecordTypeError(
                    name, f"needs a str, got {type(getattr(self, name)).__name__}"
                )
        set_ = object.__setattr__
        set_(self, "prompt_ids", _int32_array("prompt_ids", self.prompt_ids))
        set_(self, "completion_ids", _int32_array("completion_ids", self.completion_ids))
        set_(self, "action_mask", _bool_array("action_mask", self.action_mask))
        set_(self, "logprobs", _float32_array("logprobs", self.logprobs))
        if self.token_rewards is not None:
            set_(self, "token_rewards", _float32_array("token_rewards", self.token_rewards))
        if self.routed_experts is not None:
            set_(self, "routed_experts", _routing_array(self.routed_experts))
        set_(self, "segments", tuple(_segment(i, s) for i, s in enumerate(self.segments)))
        if not isinstance(self.sampling, RecordedSampling):
            raise RecordTypeError(
                "sampling", f"needs RecordedSampling, got {type(self.sampling).__name__}"
            )
        if not isinstance(self.timings, Timings):
            raise RecordTypeError("timings", f"needs Timings, got {type(self.timings).__name__}")
        _check_number("reward", self.reward)
        _check_int("num_turns", self.num_turns)
        if (self.episode_id is None) != (self.episode_part is None):
            raise RecordTypeError("episode_part", "is set exactly when episode_id is")
        if self.episode_id is not None:
            if not isinstance(self.episode_id, str):
                raise RecordTypeError("episode_id", f"needs a str, got {type(self.episode_id).__name__}")
            _check_int("episode_part", self.episode_part)

    # Derived, denormalised columns --------------------------------------------------------------

    @property
    def action_versions(self) -> list[int | None]:
        return [s.policy_version for s in self.segments if s.kind == SegmentKind.ACTION]

    @property
    def min_policy_version(self) -> int | None:
        """Oldest version among action segments (None without actions or with a missing version)."""
        versions = self.action_versions
        return None if not versions or None in versions else min(versions)  # type: ignore[type-var]

    @property
    def max_policy_version(self) -> int | None:
        versions = self.action_versions
        return None if not versions or None in versions else max(versions)  # type: ignore[type-var]

    @property
    def num_action_tokens(self) -> int:
        return int(np.count_nonzero(self.action_mask))

    # Conversion ---------------------------------------------------------------------------------

    def to_row(self) -> dict[str, Any]:
        """The record as one row of ``schemas.trajectories.RECORD_SCHEMA`` (plain Python values)."""
        return {
            "trajectory_id": self.trajectory_id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "env_name": self.env_name,
            "prompt_ids": self.prompt_ids.tolist(),
            "completion_ids": self.completion_ids.tolist(),
            "action_mask": self.action_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "logprob_kind": str(self.logprob_kind),
            "segments": [s.to_row() for s in self.segments],
            "min_policy_version": self.min_policy_version,
            "max_policy_version": self.max_policy_version,
            "num_action_tokens": self.num_action_tokens,
            "reward": float(self.reward),
            "token_rewards": None if self.token_rewards is None else self.token_rewards.tolist(),
            "termination_reason": str(self.termination_reason),
            "num_turns": int(self.num_turns),
            "sampling": self.sampling.to_row(),
            "tokenizer_version": self.tokenizer_version,
            "chat_template_version": self.chat_template_version,
            "engine_name": self.engine_name,
            "engine_version": self.engine_version,
            "worker_id": self.worker_id,
            "timings": self.timings.to_row(),
            "routed_experts": None if self.routed_experts is None else routing_entries(self.routed_experts),
            "router_top_k": None if self.routed_experts is None else int(self.routed_experts.shape[2]),
            "error": self.error,
            "episode_id": self.episode_id,
            "episode_part": self.episode_part,
            "agent_info": self.agent_info,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TrajectoryRecord:
        """Inverse of :meth:`to_row` (derived columns in ``row`` are ignored: they are recomputed).

        Raises :class:`RecordTypeError` naming the first missing or mistyped field.
        """
        try:
            segments = tuple(_segment_from_row(i, s) for i, s in enumerate(_get(row, "segments")))
            sampling = RecordedSampling(**_subrow(row, "sampling", RecordedSampling))
            timings = Timings(**_subrow(row, "timings", Timings))
        except RecordTypeError:
            raise
        except (TypeError, ValueError) as error:
            raise RecordTypeError("segments", str(error)) from error
        return cls(
            trajectory_id=_get(row, "trajectory_id"),
            run_id=_get(row, "run_id"),
            task_id=_get(row, "task_id"),
            env_name=_get(row, "env_name"),
            prompt_ids=_get(row, "prompt_ids"),
            completion_ids=_get(row, "completion_ids"),
            action_mask=_get(row, "action_mask"),
            logprobs=_get(row, "logprobs"),
            logprob_kind=_get(row, "logprob_kind"),
            segments=segments,
            reward=_get(row, "reward"),
            termination_reason=_get(row, "termination_reason"),
            num_turns=_get(row, "num_turns"),
            sampling=sampling,
            tokenizer_version=_get(row, "tokenizer_version"),
            chat_template_version=_get(row, "chat_template_version"),
            engine_name=_get(row, "engine_name"),
            engine_version=_get(row, "engine_version"),
            worker_id=_get(row, "worker_id"),
            timings=timings,
            token_rewards=row.get("token_rewards"),
            routed_experts=decode_routing(row.get("routed_experts"), row.get("router_top_k")),
            error=row.get("error"),
            episode_id=row.get("episode_id"),
            episode_part=row.get("episode_part"),
            agent_info=row.get("agent_info"),
        )


@dataclass(frozen=True)
class PolicyVersionRecord:
    """One row of ``policy_versions`` (see :mod:`schemas.policy_versions`)."""

    run_id: str
    version: int
    checkpoint_uri: str
    weights_hash: str
    parent_version: int | None = None
    step: int | None = None
    created_at: dt.datetime = field(default_factory=utc_now)

    def to_row(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "parent_version": self.parent_version,
            "checkpoint_uri": self.checkpoint_uri,
            "weights_hash": self.weights_hash,
            "step": self.step,
            "created_at": self.created_at,
        }


@dataclass(frozen=True)
class TrainStepRecord:
    """One row of ``train_steps`` (see :mod:`schemas.train_steps`).

    Attributes:
        trajectories_version: Delta version of ``trajectories`` the step read (``MicroBatch.
            snapshot_version``); trajectory_ids: what it consumed, in read order.
        metrics, seeds, timings: flat name -> value maps (``actor/kept_frac``, ``torch``, ``read_s``).
        data_run_id: the run whose trajectories the step read, when not its own (a what-if replay).
    """

    run_id: str
    step: int
    policy_version_before: int
    policy_version_after: int
    trajectories_version: int
    trajectory_ids: tuple[str, ...]
    started_at: dt.datetime
    finished_at: dt.datetime
    metrics: Mapping[str, float] = field(default_factory=dict)
    seeds: Mapping[str, int] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    data_run_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectory_ids", tuple(self.trajectory_ids))

    @property
    def data_run(self) -> str:
        """The run whose trajectories the step read."""
        return self.data_run_id or self.run_id

    def to_row(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "step": self.step,
            "policy_version_before": self.policy_version_before,
            "policy_version_after": self.policy_version_after,
            "trajectories_version": self.trajectories_version,
            "trajectory_ids": list(self.trajectory_ids),
            "num_trajectories": len(self.trajectory_ids),
            "metrics": [(k, float(v)) for k, v in sorted(self.metrics.items())],
            "seeds": [(k, int(v)) for k, v in sorted(self.seeds.items())],
            "timings": [(k, float(v)) for k, v in sorted(self.timings.items())],
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "data_run_id": self.data_run_id,
        }


# Coercion helpers --------------------------------------------------------------------------------


def _as_1d(name: str, value: Any) -> np.ndarray:
    if isinstance(value, (str, bytes)) or value is None:
        raise RecordTypeError(name, f"needs a 1-D sequence, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise RecordTypeError(name, f"is not a regular 1-D sequence ({error})") from None
    if array.ndim != 1:
        raise RecordTypeError(name, f"needs a 1-D sequence, got shape {array.shape}")
    return array


def _int32_array(name: str, value: Any) -> npt.NDArray[np.int32]:
    array = _as_1d(name, value)
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)
    if array.dtype.kind not in "iu":
        raise RecordTypeError(name, f"needs integer token ids, got dtype {array.dtype}")
    if array.size and (array.min() < _INT32.min or array.max() > _INT32.max):
        raise RecordTypeError(name, "has ids outside the int32 range")
    return np.ascontiguousarray(array, dtype=np.int32)


def _bool_array(name: str, value: Any) -> npt.NDArray[np.bool_]:
    array = _as_1d(name, value)
    if array.size == 0:
        return np.zeros(0, dtype=np.bool_)
    if array.dtype.kind == "b":
        return np.ascontiguousarray(array)
    if array.dtype.kind in "iu" and np.isin(array, (0, 1)).all():
        return array.astype(np.bool_)
    raise RecordTypeError(name, f"needs booleans (or 0/1), got dtype {array.dtype}")


def _float32_array(name: str, value: Any) -> npt.NDArray[np.float32]:
    array = _as_1d(name, value)
    if array.size == 0:
        return np.zeros(0, dtype=np.float32)
    if array.dtype.kind not in "fiu":
        raise RecordTypeError(name, f"needs numbers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.float32)


def _routing_array(value: Any) -> npt.NDArray[np.uint8]:
    if isinstance(value, np.ndarray):
        array = value
    else:
        try:
            array = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
        except (TypeError, ValueError) as error:
            raise RecordTypeError("routed_experts", f"is not a regular array ({error})") from None
    if array.ndim != 3 or array.shape[1] < 1 or array.shape[2] < 1:
        raise RecordTypeError("routed_experts", f"needs shape (tokens, layers >= 1, top_k >= 1), got {array.shape}")
    if array.dtype.kind not in "iu":
        raise RecordTypeError("routed_experts", f"needs integer expert ids, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise RecordTypeError("routed_experts", "has expert ids outside [0, 255] (stored as uint8)")
    return np.ascontiguousarray(array, dtype=np.uint8)


def routing_entries(routed_experts: npt.NDArray[np.uint8]) -> list[bytes]:
    """(R, M, K) uint8 routing as the ``routed_experts`` column's R entries of M * K bytes."""
    tokens, layers, top_k = routed_experts.shape
    return [row.tobytes() for row in routed_experts.reshape(tokens, layers * top_k)]


def decode_routing(entries: Sequence[bytes] | None, top_k: int | None) -> npt.NDArray[np.uint8] | None:
    """Inverse of :func:`routing_entries`: the ``routed_experts`` column of one row as (R, M, K) uint8
    (None when the row has no routing). Raises :class:`RecordTypeError` on entries of unequal size or a
    size that is not a multiple of ``top_k``. Entries may be hex strings (a row written as JSON)."""
    if entries is None:
        return None
    if isinstance(entries, str | bytes) or not isinstance(entries, Sequence):
        raise RecordTypeError("routed_experts", f"needs a list of byte strings, got {type(entries).__name__}")
    if not all(isinstance(e, str | bytes | bytearray | memoryview) for e in entries):
        # bytes(3) would be three zero bytes, bytes([1.5]) a TypeError: only bytes, or hex from JSON
        raise RecordTypeError("routed_experts", "needs a list of byte strings (or hex strings from JSON), got "
                              f"{sorted({type(e).__name__ for e in entries})}")
    try:
        entries = [bytes.fromhex(e) if isinstance(e, str) else bytes(e) for e in entries]  # JSON (json_safe): hex
    except ValueError as error:
        raise RecordTypeError("routed_experts", f"an entry is not hex: {error}") from None
    if top_k is None or top_k < 1:
        raise RecordTypeError("router_top_k", f"needs an int >= 1 beside routed_experts, got {top_k!r}")
    sizes = {len(e) for e in entries}
    if len(sizes) > 1 or any(size == 0 or size % top_k for size in sizes):
        raise RecordTypeError("routed_experts", f"entries of {sorted(sizes)} bytes: all must have the same "
                              f"size, a positive multiple of router_top_k = {top_k}")
    size = sizes.pop() if sizes else top_k
    flat = np.frombuffer(b"".join(entries), dtype=np.uint8)
    return flat.reshape(len(entries), size // top_k, top_k)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RecordTypeError(name, f"needs an int, got {type(value).__name__}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RecordTypeError(name, f"needs a number, got {type(value).__name__}")


def _segment(index: int, value: Any) -> Segment:
    if not isinstance(value, Segment):
        raise RecordTypeError(f"segments[{index}]", f"needs a Segment, got {type(value).__name__}")
    for attr in ("start", "end"):
        _check_int(f"segments[{index}].{attr}", getattr(value, attr))
    if value.policy_version is not None:
        _check_int(f"segments[{index}].policy_version", value.policy_version)
    if not isinstance(value.kind, str):
        raise RecordTypeError(
            f"segments[{index}].kind", f"needs a str, got {type(value.kind).__name__}"
        )
    return value


def _segment_from_row(index: int, value: Any) -> Segment:
    if not isinstance(value, Mapping):
        raise RecordTypeError(f"segments[{index}]", f"needs a mapping, got {type(value).__name__}")
    return Segment(
        kind=value.get("kind"),  # type: ignore[arg-type]
        start=value.get("start"),  # type: ignore[arg-type]
        end=value.get("end"),  # type: ignore[arg-type]
        policy_version=value.get("policy_version"),
    )


def _get(row: Mapping[str, Any], name: str) -> Any:
    if name not in row:
        raise RecordTypeError(name, "is missing")
    return row[name]


def _subrow(row: Mapping[str, Any], name: str, kind: type) -> dict[str, Any]:
    value = _get(row, name)
    if not isinstance(value, Mapping):
        raise RecordTypeError(name, f"needs a mapping, got {type(value).__name__}")
    wanted = set(kind.__dataclass_fields__)  # type: ignore[attr-defined]
    missing = sorted(wanted - set(value))
    if missing:
        raise RecordTypeError(f"{name}.{missing[0]}", "is missing")
    return {k: value[k] for k in wanted}


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings and datetimes as ISO strings (for JSON)."""
    if isinstance(value, float | np.floating):
        number = float(value)
        if math.isnan(number):
            return "NaN"
        if math.isinf(number):
            return "Infinity" if number > 0 else "-Infinity"
        return number
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, np.ndarray):
        return [json_safe(v) for v in value.tolist()]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return repr(value)
