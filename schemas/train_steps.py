"""The ``train_steps`` table: one row per trainer step, tying it to the exact data it used.

A step records the Delta version of ``trajectories`` it read and the ids it consumed; a trajectory is
consumed by at most one step of its run (the ledger refuses a second), so the set of consumed ids of a
run is the union of ``trajectory_ids`` over its rows. Replaying step N reads ``trajectories`` at
``trajectories_version`` and selects ``trajectory_ids``; vacuum keeps every such version readable.
``(run_id, step)`` is unique and steps of a run increase. A what-if replay is a run of its own whose
steps name the parent's snapshots and ids, with ``data_run_id`` the parent.
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field, list_of

__all__ = ["NAME", "SCHEMA", "SCHEMA_VERSION", "SPEC"]

NAME = "train_steps"
SCHEMA_VERSION = 2

SCHEMA = pa.schema(
    [
        doc_field("run_id", pa.string(), False, "Training run."),
        doc_field("step", pa.int64(), False, "Trainer step, increasing within the run."),
        doc_field(
            "policy_version_before", pa.int64(), False, "Policy version the step started from."
        ),
        doc_field(
            "policy_version_after", pa.int64(), False, "Policy version after the step's update."
        ),
        doc_field(
            "trajectories_version",
            pa.int64(),
            False,
            "Delta version of `trajectories` the step read.",
        ),
        doc_field(
            "trajectory_ids",
            list_of(pa.string()),
            False,
            "Trajectories the step consumed, in read order.",
        ),
        doc_field("num_trajectories", pa.int32(), False, "Length of trajectory_ids."),
        doc_field(
            "metrics",
            pa.map_(pa.string(), pa.float64()),
            False,
            "Step metrics, e.g. 'actor/kept_frac'.",
        ),
        doc_field(
            "seeds", pa.map_(pa.string(), pa.int64()), False, "Seeds that make the step replayable."
        ),
        doc_field(
            "timings",
            pa.map_(pa.string(), pa.float64()),
            False,
            "Seconds per phase, e.g. 'read_s'.",
        ),
        doc_field("started_at", TIMESTAMP, False, "When the step started."),
        doc_field("finished_at", TIMESTAMP, False, "When the step finished."),
        doc_field("recorded_at", TIMESTAMP, False, "When the row's commit was planned (a commit that lost a "
                  "race is re-planned, with a new time)."),
        doc_field(
            "schema_version", pa.int32(), False, "Version of this schema the row was written with."
        ),
        doc_field(
            "data_run_id",
            pa.string(),
            True,
            "The run whose trajectories the step read: null for its own; a what-if replay's steps "
            "(`sao replay --set`) read those their parent's step read (added in schema version 2).",
        ),
    ]
)

SPEC = TableSpec(
    name=NAME,
    schema=SCHEMA,
    schema_version=SCHEMA_VERSION,
    partition_by=(),
    description="Trainer steps: versions before/after, the trajectories snapshot and ids consumed.",
)
