"""The ``rollout_tasks`` table: one row per rollout the driver issued (the run's issue log).

A trajectory that is lost leaves no row in ``trajectories``; only a record of what was *issued* lets
anyone notice. The rollout driver appends one row here per launched rollout (a retry of a failed one is
a new row under a new ``trajectory_id``, naming the attempt it retries), batched like the trajectory
writer. ``sao lake check --run R`` then accounts for every row: each ``trajectory_id`` issued must end
as exactly one ``trajectories`` row of the run (with its termination reason) or in ``quarantine``.

Rows are events, appended blindly (no read before write): a row delivered twice shows up twice, and
the check reports it. Two kinds (``event``):

* ``issued``: a launch (rows written before schema version 2 have a null ``event`` and are launches);
* ``abandoned``: a launch found unresolved (neither stored nor quarantined) when the run resumed after
  its driver process died: it was in flight at the crash. The resuming driver closes it out with this
  row (``reason`` says why, ``issued_at`` is the time of the close-out) and, by default, launches the
  task again as a new attempt whose ``retry_of`` names it. ``sao lake check`` reports such ids as
  information, not as lost.
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field

__all__ = ["ABANDONED", "EVENTS", "ISSUED", "NAME", "PARTITION_BY", "SCHEMA", "SCHEMA_VERSION", "SPEC"]

NAME = "rollout_tasks"
SCHEMA_VERSION = 2

ISSUED = "issued"
ABANDONED = "abandoned"
EVENTS = (ISSUED, ABANDONED)
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
        doc_field(
            "issued_at",
            TIMESTAMP,
            False,
            "When the rollout was launched (event abandoned: when it was closed out).",
        ),
        doc_field(
            "schema_version", pa.int32(), False, "Version of this schema the row was written with."
        ),
        doc_field(
            "event",
            pa.string(),
            True,
            "issued (a launch) or abandoned (in flight when its driver died, closed out on resume); "
            "null in rows of schema version 1, which are launches. Added in version 2.",
        ),
        doc_field(
            "reason",
            pa.string(),
            True,
            "Why an abandoned rollout was closed out; null for a launch. Added in version 2.",
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
