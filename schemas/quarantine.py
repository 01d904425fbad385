"""The ``quarantine`` table: one row per rejected delivery of a record, with every rule it broke.

A record that fails validation on write lands here instead of its table; it never stops the batch it
came in and is never dropped silently. Each delivery is an event: a bad record delivered twice is
quarantined twice.

``payload_json`` holds the record as JSON exactly as it was delivered (``TrajectoryRecord.to_row()``
form); non-finite floats, which JSON cannot hold, are written as the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"``, and timestamps as ISO 8601 strings. An oversized payload's JSON is cut at
``sao.lake.config.SizeLimits.max_quarantine_payload_bytes`` and ends with ``...[truncated: N bytes]``.
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field, list_of

__all__ = ["NAME", "SCHEMA", "SCHEMA_VERSION", "SPEC", "VIOLATION_TYPE"]

NAME = "quarantine"
SCHEMA_VERSION = 1

VIOLATION_TYPE = pa.struct(
    [
        doc_field(
            "reason",
            pa.string(),
            False,
            "Rule code, e.g. 'logprob_positive' (sao.lake.validate.Rule).",
        ),
        doc_field("field", pa.string(), False, "Offending field path, e.g. 'segments[2].start'."),
        doc_field(
            "position",
            pa.int64(),
            True,
            "Token (or segment) index inside the field, when it applies.",
        ),
        doc_field("message", pa.string(), False, "What was wrong and what was expected."),
    ]
)

SCHEMA = pa.schema(
    [
        doc_field("quarantine_id", pa.string(), False, "Unique id of this rejection (a UUID)."),
        doc_field("table_name", pa.string(), False, "Table the record was meant for."),
        doc_field("run_id", pa.string(), True, "Run of the record, when it could be read."),
        doc_field(
            "record_id",
            pa.string(),
            True,
            "Id of the record (trajectory_id), when it could be read.",
        ),
        doc_field("reason", pa.string(), False, "Rule code of the first violation."),
        doc_field("field", pa.string(), False, "Field of the first violation."),
        doc_field("row", pa.int64(), True, "Position of the record in the flushed batch."),
        doc_field("position", pa.int64(), True, "Token (or segment) index of the first violation."),
        doc_field("message", pa.string(), False, "Message of the first violation."),
        doc_field(
            "violations", list_of(VIOLATION_TYPE), False, "Every violation found, in rule order."
        ),
        doc_field("payload_json", pa.string(), False, "The rejected record as delivered, as JSON."),
        doc_field("writer_id", pa.string(), False, "Lake writer that rejected it."),
        doc_field("quarantined_at", TIMESTAMP, False, "When it was rejected."),
        doc_field(
            "schema_version", pa.int32(), False, "Version of this schema the row was written with."
        ),
    ]
)

SPEC = TableSpec(
    name=NAME,
    schema=SCHEMA,
    schema_version=SCHEMA_VERSION,
    partition_by=(),
    description="Rejected deliveries: the payload, the rules it broke, when.",
)
