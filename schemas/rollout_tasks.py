"""The ``rollout_tasks`` table: one row per rollout the driver issued (the run's issue log).

A trajectory that is lost leaves no row in ``trajectories``; only a record of what was *issued* lets
anyone notice. The rollout driver appends one row here per launched rollout (a retry of a failed one is
a new row under a new ``trajectory_id``, naming the attempt it retries), batched like the trajectory
writer. ``sao lake check --run R`` then accounts for every row: each ``trajectory_id`` issued must end
as exactly one ``trajectories`` row of the run (with its termination reason) or in ``quarantine``.

Rows are events, appended blindly (no read before write): a row delivered twice shows up twice, and
the check reports it.
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field

__all__ = ["NAME", "PARTITION_BY", "SCHEMA", "SCHEMA_VERSION", "SPEC"]

NAME = "rollout_tasks"
SCHEMA_VERSION = 1
PARTITION_BY = ("run_id",)

SCHEMA = pa.schema(
    [
        doc_field("run_id", pa.string(), False, "Training run. Partition."),
        doc_field(
            "trajectory_id", pa.string(), False, "Id the rollout was issued under (its record's id)."
        ),
        doc_field("task_id", pa.string(), False, "Task (prompt) id within the environment."),
        doc_field("env_name", pa.string(), False, "Environment of the task."),
        doc_field("attempt", pa.int32(), False, "0 for the first rollout of a task, +1 per retry."),
        doc_field(
            "retry_of",
            pa.string(),
            True,
            "trajectory_id of the failed attempt this one retries; null for a first attempt.",
        ),
        doc_field("issuer_id", pa.string(), False, "Driver that issued it."),
        doc_field("issued_at", TIMESTAMP, False, "When the rollout was launched."),
        doc_field(
            "schema_version", pa.int32(), False, "Version of this schema the row was written with."
        ),
    ]
)

SPEC = TableSpec(
    name=NAME,
    schema=SCHEMA,
    schema_version=SCHEMA_VERSION,
    partition_by=PARTITION_BY,
    description="Rollouts issued by the driver: task, attempt, retry, time (what check accounts for).",
)
