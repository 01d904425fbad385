"""The ``runs`` table: one row per start or resume of a training run, and per what-if replay, with the resolved
run config it ran with (:class:`sao.config.RunConfig`), so SQL can answer "which settings produced this
trajectory" (join on ``run_id``).

Rows are appended blindly, one per event; a run's settings are those of its latest row. Schema version 2
added ``code`` (nullable: older rows read null). Secrets are
never here: the config holds no object-store options or credentials (they come from the environment).
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field

__all__ = ["EVENTS", "NAME", "PARTITION_BY", "RESUME", "SCHEMA", "SCHEMA_VERSION", "SPEC", "START", "WHAT_IF"]

NAME = "runs"
SCHEMA_VERSION = 2

START = "start"
RESUME = "resume"
WHAT_IF = "what_if"
EVENTS = (START, RESUME, WHAT_IF)
PARTITION_BY = ()

SCHEMA = pa.schema(
    [
        doc_field("run_id", pa.string(), False, "Training run."),
        doc_field(
            "event",
            pa.string(),
            False,
            "start (the run's first row), resume (a later start) or what_if (a what-if replay of another "
            "run's steps with changed settings: `sao replay --set`).",
        ),
        doc_field("started_at", TIMESTAMP, False, "When the run (re)started."),
        doc_field(
            "config",
            pa.string(),
            False,
            "The resolved run config as JSON (every key; `sao config schema` describes them).",
        ),
        doc_field(
            "settings",
            pa.map_(pa.string(), pa.string()),
            False,
            "The same config by dotted key, each value as JSON text, for SQL: "
            "settings['algorithm.eps_high'].",
        ),
        doc_field(
            "sources",
            pa.string(),
            False,
            "JSON object: each key not at its default -> where its value came from (a file, --set, a flag).",
        ),
        doc_field(
            "changed",
            pa.string(),
            True,
            "On a resume, JSON object of the keys changed since the previous row -> [before, after]; "
            "null on a start.",
        ),
        doc_field("notes", pa.string(), True, "What the run said once about itself (null: nothing)."),
        doc_field("parent_run_id", pa.string(), True, "what_if: the run whose steps were re-run; else null."),
        doc_field(
            "parent_steps", pa.string(), True, "what_if: the steps re-run, FIRST:LAST (both included); else null."
        ),
        doc_field("sao_version", pa.string(), False, "Version of sao that wrote the row."),
        doc_field(
            "schema_version", pa.int32(), False, "Version of this schema the row was written with."
        ),
        doc_field(
            "code",
            pa.string(),
            True,
            "JSON object: each module of one's own the run imports (reward, tool and agent functions, the "
            "verifiers environment, and the modules they import from their folders) -> {file, sha256, key}: "
            "what a resume ran with (sao/user_code.py). Null for a run of the built-in task, a what_if, "
            "and rows of schema version 1.",
        ),
    ]
)

SPEC = TableSpec(
    name=NAME,
    schema=SCHEMA,
    schema_version=SCHEMA_VERSION,
    partition_by=PARTITION_BY,
    description="Training runs: one row per start or resume, with the resolved config it ran with.",
)
