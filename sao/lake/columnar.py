"""Records to Arrow columns without a Python loop per token.

:func:`records_to_arrow` is the fast path the writer uses: each list column is one concatenation of
the records' numpy arrays plus an offsets array. :func:`records_to_arrow_reference` builds the same
table row by row through ``TrajectoryRecord.to_row()``; a test holds them equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from sao.lake.records import STRING_FIELDS, TrajectoryRecord
from schemas.trajectories import RECORD_SCHEMA

__all__ = ["records_to_arrow", "records_to_arrow_reference"]

_NUMPY = {pa.int32(): np.int32, pa.bool_(): np.bool_, pa.float32(): np.float32}


def records_to_arrow_reference(records: Sequence[TrajectoryRecord]) -> pa.Table:
    """Slow reference: ``pa.Table.from_pylist`` over ``to_row()``."""
    return pa.Table.from_pylist([r.to_row() for r in records], schema=RECORD_SCHEMA)


def records_to_arrow(records: Sequence[TrajectoryRecord]) -> pa.Table:
    """``records`` as a table of ``schemas.trajectories.RECORD_SCHEMA`` (one chunk)."""
    columns: dict[str, pa.Array] = {}
    for name in STRING_FIELDS:
        columns[name] = pa.array([getattr(r, name) for r in records], pa.string())
    columns["logprob_kind"] = pa.array([str(r.logprob_kind) for r in records], pa.string())
    columns["termination_reason"] = pa.array(
        [str(r.termination_reason) for r in records], pa.string()
    )
    for name in ("prompt_ids", "completion_ids", "action_mask", "logprobs"):
        columns[name] = _list_column(name, [getattr(r, name) for r in records])
    columns["token_rewards"] = _list_column("token_rewards", [r.token_rewards for r in records])
    columns["segments"] = _segments_column(records)
    columns["min_policy_version"] = pa.array([r.min_policy_version for r in records], pa.int64())
    columns["max_policy_version"] = pa.array([r.max_policy_version for r in records], pa.int64())
    columns["num_action_tokens"] = pa.array(
        np.fromiter((np.count_nonzero(r.action_mask) for r in records), np.int32, len(records))
    )
    columns["reward"] = pa.array([float(r.reward) for r in records], pa.float64())
    columns["num_turns"] = pa.array([int(r.num_turns) for r in records], pa.int32())
    columns["sampling"] = _struct_column("sampling", [r.sampling.to_row() for r in records])
    columns["timings"] = _struct_column("timings", [r.timings.to_row() for r in records])
    columns["routed_experts"] = _routing_column(records)
    columns["router_top_k"] = pa.array(
        [None if r.routed_experts is None else int(r.routed_experts.shape[2]) for r in records], pa.int32()
    )
    columns["error"] = pa.array([r.error for r in records], pa.string())
    columns["episode_id"] = pa.array([r.episode_id for r in records], pa.string())
    columns["episode_part"] = pa.array([r.episode_part for r in records], pa.int32())
    columns["agent_info"] = pa.array([r.agent_info for r in records], pa.string())
    return pa.table([columns[name] for name in RECORD_SCHEMA.names], schema=RECORD_SCHEMA)


def _list_column(name: str, arrays: list[np.ndarray | None]) -> pa.Array:
    list_type = RECORD_SCHEMA.field(name).type
    value_type = list_type.value_type
    present = [a for a in arrays if a is not None]
    lengths = np.fromiter((0 if a is None else a.size for a in arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{name}: more than 2**31 values in one batch; flush smaller batches")
    values = np.concatenate(present) if present else np.zeros(0, dtype=_NUMPY[value_type])
    mask = None
    if len(present) < len(arrays):
        mask = pa.array([a is None for a in arrays], pa.bool_())
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values, value_type), type=list_type, mask=mask
    )


def _routing_column(records: Sequence[TrajectoryRecord]) -> pa.Array:
    """``routed_experts``: per record a list of R entries of M * K bytes, one binary buffer for the batch."""
    arrays = [r.routed_experts for r in records]
    present = [a for a in arrays if a is not None]
    entries = np.fromiter((0 if a is None else a.shape[0] for a in arrays), np.int64, len(arrays))
    list_offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(entries, out=list_offsets[1:])
    entry_sizes = np.concatenate([np.full(a.shape[0], a.shape[1] * a.shape[2], np.int64) for a in present]
                                 or [np.zeros(0, np.int64)])
    byte_offsets = np.zeros(len(entry_sizes) + 1, dtype=np.int64)
    np.cumsum(entry_sizes, out=byte_offsets[1:])
    if byte_offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError("routed_experts: more than 2**31 bytes in one batch; flush smaller batches")
    data = np.concatenate([a.reshape(-1) for a in present]) if present else np.zeros(0, np.uint8)
    values = pa.Array.from_buffers(pa.binary(), len(entry_sizes),
                                   [None, pa.py_buffer(byte_offsets.astype(np.int32)), pa.py_buffer(data)])
    mask = pa.array([a is None for a in arrays], pa.bool_()) if len(present) < len(arrays) else None
    return pa.ListArray.from_arrays(pa.array(list_offsets), values,
                                    type=RECORD_SCHEMA.field("routed_experts").type, mask=mask)


def _segments_column(records: Sequence[TrajectoryRecord]) -> pa.Array:
    list_type = RECORD_SCHEMA.field("segments").type
    counts = np.fromiter((len(r.segments) for r in records), np.int64, len(records))
    offsets = np.zeros(len(records) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flat = [s for r in records for s in r.segments]
    struct_type = list_type.value_type
    values = pa.StructArray.from_arrays(
        [
            pa.array([str(s.kind) for s in flat], pa.string()),
            pa.array([s.policy_version for s in flat], pa.int64()),
            pa.array([s.start for s in flat], pa.int32()),
            pa.array([s.end for s in flat], pa.int32()),
        ],
        fields=list(struct_type),
    )
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=list_type)


def _struct_column(name: str, rows: list[dict[str, object]]) -> pa.Array:
    struct_type = RECORD_SCHEMA.field(name).type
    return pa.StructArray.from_arrays(
        [pa.array([row[f.name] for row in rows], f.type) for f in struct_type],
        fields=list(struct_type),
    )
