"""The ``trajectories`` table: one row per trajectory, everything SAO.md section 6 asks a trajectory to
record. It is the data path of training: rollout workers append, the trainer reads micro-batches.

Notation:
    n: number of completion tokens (every token after the prompt: action and observation tokens).
    A token position ``t`` is in ``[0, n)``; a segment covers the half-open range ``[start, end)``.

Invariants (checked on write by ``sao.lake.validate``; a row that breaks one goes to ``quarantine``):
    - ``action_mask``, ``logprobs`` (and ``token_rewards`` when present) have n entries each;
    - ``segments`` are in token order and tile ``[0, n)`` without gap or overlap; the action segments
      are exactly the positions where ``action_mask`` is true;
    - ``logprobs`` are finite and <= 0 at action positions and exactly 0.0 at observation positions;
    - policy versions are >= 0 and not ahead of the newest version registered for the run in
      ``policy_versions``; observation segments carry no version.

Columns set by the lake writer, not by the producer: see :data:`WRITER_FIELDS`.

Schema evolution: bump :data:`SCHEMA_VERSION` and append new fields at the end as nullable; opening a
lake adds such fields to an older table (old rows read null) and refuses any other difference. Fields a
producer provides keep their place after the writer's fields of older versions (the table's column order
is the order of the versions that added them); :data:`RECORD_SCHEMA` lists every producer field.

Version 2 (routing record and replay, R3; :mod:`sao.models.routing`) adds, for mixture-of-experts
policies whose engine records routing:

    ``routed_experts``: ``list<binary>``, one entry per token the engine ran through the model, in
        order: position ``i < P`` is prompt token ``i`` (P = len(prompt_ids)), position ``P + t`` is
        completion token ``t``. The list covers a prefix of those ``P + n`` tokens: normally all but the
        last completion token (sampling it ended the trajectory; it was never an input), and none of the
        observation tokens appended after the last generation. An entry holds ``layers * top_k`` uint8
        expert ids, layer-major, each layer's ids in the router's top-k order (most probable first).
        Which forward's routing a token holds: the latest one that ran it. In a multi-turn trajectory the
        next turn's prompt (the whole context) is run again, so action tokens of earlier turns and every
        observation token hold the routing of the next turn's prefill; tokens run again after a weight
        update (the torch engine's recompute) hold the new version's routing.
    ``router_top_k``: int32, K (experts per token per layer); ``layers = len(entry) / K``.

Both are null for dense policies, engines that do not record routing (vLLM) and rows written before
version 2. The trainer replays recorded positions and routes the rest live (:mod:`sao.train.step`).

Version 3 adds ``error`` (what failed in an ``error`` end). Version 4 (agents of one's own on the chat
endpoint, :mod:`sao.rollout.chat_endpoint`) adds ``episode_id``, ``episode_part`` and ``agent_info``: an episode is one
trajectory unless its agent rewrote or truncated its history, when it is split there into parts, each a
trajectory whose tokens extend exactly; the parts share ``episode_id`` (the id the rollout was issued
under, which part 0 keeps as its ``trajectory_id``; part k is ``<episode_id>.k``).
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field, list_of
from schemas.vocabulary import LogprobKind, SegmentKind, TerminationReason

__all__ = [
    "NAME",
    "PARTITION_BY",
    "RECORD_SCHEMA",
    "RUN_ID_PATTERN",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SPEC",
    "WRITER_FIELDS",
    "LogprobKind",
    "SegmentKind",
    "TerminationReason",
]

NAME = "trajectories"
SCHEMA_VERSION = 4

RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
"""What a run id must match in full: it names a partition folder and appears in SQL predicates."""
PARTITION_BY = ("run_id",)


SEGMENT_TYPE = pa.struct(
    [
        doc_field("kind", pa.string(), False, "'action' (sampled by the policy) or 'observation'."),
        doc_field(
            "policy_version",
            pa.int64(),
            True,
            "Policy version that sampled every token of an action segment; null for observations.",
        ),
        doc_field("start", pa.int32(), False, "First completion-token position of the segment."),
        doc_field("end", pa.int32(), False, "One past the last position (half-open [start, end))."),
    ]
)

SAMPLING_TYPE = pa.struct(
    [
        doc_field("temperature", pa.float64(), False, "Sampling temperature, > 0 (greedy decoding is top_k 1)."),
        doc_field("top_p", pa.float64(), False, "Nucleus mass in (0, 1]; 1 disables it."),
        doc_field("top_k", pa.int32(), True, "Top-k cut-off; null when disabled."),
        doc_field("max_tokens", pa.int32(), False, "The trajectory's token budget (rollout.max_tokens, action and observation "
                  "tokens together); each turn is given what is left of it."),
        doc_field("seed", pa.int64(), True, "The rollout's sampling seed: each engine call's seed derives from it (unless "
                  "an agent's call gave its own); null when the engine drew its own."),
    ]
)

TIMINGS_TYPE = pa.struct(
    [
        doc_field("created_at", TIMESTAMP, False, "When the replica started the rollout."),
        doc_field("started_at", TIMESTAMP, False, "When the replica started the rollout (as created_at today)."),
        doc_field("finished_at", TIMESTAMP, False, "When the trajectory ended (any reason)."),
        doc_field("generation_s", pa.float64(), False, "Seconds spent generating in the engine."),
        doc_field("tool_s", pa.float64(), False, "Seconds spent in tools and the environment."),
    ]
)

_PRODUCER_FIELDS = [
    doc_field(
        "trajectory_id", pa.string(), False, "Unique id (a UUID); the idempotency key within a run."
    ),
    doc_field(
        "run_id",
        pa.string(),
        False,
        "Training run; [A-Za-z0-9._-], at most 128 characters. Partition.",
    ),
    doc_field("task_id", pa.string(), False, "Task (prompt) id within the environment."),
    doc_field("env_name", pa.string(), False, "Environment that scored the trajectory."),
    doc_field(
        "prompt_ids", list_of(pa.int32()), False, "Prompt token ids (chat template applied)."
    ),
    doc_field(
        "completion_ids",
        list_of(pa.int32()),
        False,
        "The n token ids after the prompt: actions and observations.",
    ),
    doc_field(
        "action_mask",
        list_of(pa.bool_()),
        False,
        "n flags: true where the policy sampled the token.",
    ),
    doc_field(
        "logprobs",
        list_of(pa.float32()),
        False,
        "n engine log-probabilities of the sampled tokens at generation time (log pi_behave); "
        "exactly 0.0 at observation positions.",
    ),
    doc_field(
        "logprob_kind", pa.string(), False, "'sampling' or 'raw': the distribution of logprobs."
    ),
    doc_field(
        "segments",
        list_of(SEGMENT_TYPE),
        False,
        "Action / observation runs tiling [0, n) in order.",
    ),
    doc_field(
        "min_policy_version",
        pa.int64(),
        True,
        "Oldest policy version among the action segments (staleness at trainer version v is "
        "v - min_policy_version); null when there is no action token.",
    ),
    doc_field(
        "max_policy_version", pa.int64(), True, "Newest policy version among the action segments."
    ),
    doc_field(
        "num_action_tokens",
        pa.int32(),
        False,
        "Number of action tokens (true entries of action_mask).",
    ),
    doc_field(
        "reward",
        pa.float64(),
        False,
        "Trajectory reward, placed on the last action token by the trainer.",
    ),
    doc_field(
        "token_rewards",
        list_of(pa.float32()),
        True,
        "Optional n per-token rewards from environments with step rewards; null when only `reward`.",
    ),
    doc_field(
        "termination_reason",
        pa.string(),
        False,
        "stop, length, turns, timeout, cancelled or error.",
    ),
    doc_field(
        "num_turns", pa.int32(), False, "Number of action segments the agent loop ran (turns)."
    ),
    doc_field("sampling", SAMPLING_TYPE, False, "Sampling settings of the engine."),
    doc_field(
        "tokenizer_version", pa.string(), False, "Tokenizer identity (name and revision or hash)."
    ),
    doc_field("chat_template_version", pa.string(), False, "Chat template identity (hash)."),
    doc_field("engine_name", pa.string(), False, "Rollout engine: 'torch' or 'vllm'; 'unknown' in a row the driver wrote for a "
                  "rollout that failed or was cancelled before its replica reported."),
    doc_field("engine_version", pa.string(), False, "Version of the engine package."),
    doc_field("worker_id", pa.string(), False, "Rollout replica that generated the trajectory; 'driver' in a row the driver "
                  "wrote for a rollout that failed or was cancelled before its replica reported."),
    doc_field("timings", TIMINGS_TYPE, False, "Rollout timings."),
]

_WRITER_FIELDS = [
    doc_field("arrived_at", TIMESTAMP, False, "When the lake writer received the record."),
    doc_field(
        "ingested_at", TIMESTAMP, False, "When the commit that stored the row was attempted."
    ),
    doc_field("writer_id", pa.string(), False, "The lake writer instance that stored the row."),
    doc_field(
        "ingest_seq",
        pa.int64(),
        False,
        "Arrival order within the run: 1, 2, 3, ... without gaps, increasing with the Delta commit "
        "that stored the row (rows of one commit keep the order they were received in).",
    ),
    doc_field(
        "schema_version", pa.int32(), False, "Version of this schema the row was written with."
    ),
]

_PRODUCER_FIELDS_V2 = [
    doc_field(
        "routed_experts",
        list_of(pa.binary()),
        True,
        "MoE routing per token the engine ran (prompt then completion, a prefix of them): layers * top_k "
        "uint8 expert ids each, layer-major, top-k order. Null for dense policies / no record.",
    ),
    doc_field(
        "router_top_k", pa.int32(), True, "Experts per token per layer (K) of routed_experts; null with it."
    ),
]

_PRODUCER_FIELDS_V3 = [
    doc_field(
        "error",
        pa.string(),
        True,
        "Why a trajectory ended with termination_reason 'error': the exception's type and message (a "
        "failing engine, tool, environment or reward function). Null otherwise. Added in version 3.",
    ),
]

_PRODUCER_FIELDS_V4 = [
    doc_field(
        "episode_id",
        pa.string(),
        True,
        "The agent episode the trajectory is part of (the trajectory_id its rollout was issued under). An "
        "episode whose agent rewrote its history is split there into parts that share it. Every episode "
        "has one, the built-in environments' too (they run on the same endpoint); null in rows written "
        "before version 4 and in rows the driver wrote for a failed or cancelled rollout. Added in version 4.",
    ),
    doc_field(
        "episode_part",
        pa.int32(),
        True,
        "Position of the trajectory in its episode: 0, 1, ... (a part after 0 starts where the agent "
        "rewrote its history); null with episode_id.",
    ),
    doc_field(
        "agent_info",
        pa.string(),
        True,
        "What an agent of one's own returned beside its reward (`(reward, info)`), as JSON text; null "
        "otherwise.",
    ),
]

RECORD_SCHEMA = pa.schema(_PRODUCER_FIELDS + _PRODUCER_FIELDS_V2 + _PRODUCER_FIELDS_V3 + _PRODUCER_FIELDS_V4)
"""The columns a producer (rollout worker) provides: ``TrajectoryRecord.to_row()`` has these keys."""

SCHEMA = pa.schema(_PRODUCER_FIELDS + _WRITER_FIELDS + _PRODUCER_FIELDS_V2 + _PRODUCER_FIELDS_V3
                   + _PRODUCER_FIELDS_V4)
"""The full table schema (the fields of versions 2 to 4 appended after version 1's writer fields)."""

WRITER_FIELDS = tuple(f.name for f in _WRITER_FIELDS)
"""Columns the lake writer sets when it stores a row."""

SPEC = TableSpec(
    name=NAME,
    schema=SCHEMA,
    schema_version=SCHEMA_VERSION,
    partition_by=PARTITION_BY,
    description="Every trajectory: tokens, action mask, engine log-probabilities, segment versions, "
    "reward, termination reason, sampling settings, timings.",
    # The nested columns before it use up Delta's default of 32 leaf columns with statistics, and
    # without statistics on ``ingest_seq`` the reader's and the writer's "rows after N" reads opened
    # every file of the run (0.7 ms each: 0.2 s a read at 300 files).
    stats_columns=("trajectory_id", "task_id", "env_name", "min_policy_version", "max_policy_version",
                   "num_action_tokens", "reward", "termination_reason", "num_turns", "arrived_at",
                   "ingested_at", "ingest_seq", "episode_id"),
)
