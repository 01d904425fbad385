"""The ``policy_versions`` table: one row per policy version of a run (the checkpoint registry).

Versions of a run are 0, 1, 2, ... without gaps: 0 is the initial (SFT) policy, each actor update adds
one. ``(run_id, version)`` is unique. The trajectory writer reads the newest version of a run to refuse
trajectories that claim a version nobody has produced yet.
"""

from __future__ import annotations

import pyarrow as pa

from schemas._spec import TIMESTAMP, TableSpec, doc_field

__all__ = ["NAME", "SCHEMA", "SCHEMA_VERSION", "SPEC"]

NAME = "policy_versions"
SCHEMA_VERSION = 1

SCHEMA = pa.schema(
    [
        doc_field("run_id", pa.string(), False, "Training run."),
        doc_field("version", pa.int64(), False, "Policy version: 0 initial, +1 per actor update."),
        doc_field(
            "parent_version", pa.int64(), True, "Version this one was trained from; null for 0."
        ),
        doc_field("checkpoint_uri", pa.string(), False, "Where the weights are stored."),
        doc_field("weights_hash", pa.string(), False, "Hash of the weights, e.g. 'sha256:<hex>'."),
        doc_field(
            "step", pa.int64(), True, "train_steps.step whose update produced it; null for 0."
        ),
        doc_field("created_at", TIMESTAMP, False, "When the version was registered."),
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
    description="Policy versions of each run: parent, checkpoint, weights hash, step, time.",
)
