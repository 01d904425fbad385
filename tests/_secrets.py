"""Helpers of the secret-leak tests: a moto S3 server with a bucket, and searches for a marker in
every place a secret could end up (lake objects and rows, files and logs, a Prefect server)."""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path

from tests.lake.conftest import moto_bucket  # noqa: F401  (re-exported for the secret-leak tests)


def secret_marker(what: str) -> str:
    """A value that cannot occur by chance: a leak of it is a leak of the secret."""
    return f"sao-secret-{what}-{uuid.uuid4().hex}"


def objects_containing(endpoint: str, bucket: str, prefix: str, marker: str) -> tuple[int, list[str]]:
    """(objects read, keys whose bytes contain ``marker``) under ``prefix``: Delta logs and data files."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="reader", aws_secret_access_key="reader",
                          region_name="us-east-1")
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]
    hits = [k for k in keys if marker.encode() in client.get_object(Bucket=bucket, Key=k)["Body"].read()]
    return len(keys), hits


def rows_containing(lake, marker: str) -> tuple[int, list[str]]:
    """(rows read, tables with a row whose values contain ``marker``), every table of the lake."""
    from schemas import TABLES

    read, hits = 0, []
    for name in TABLES:
        rows = lake.read(name).to_pylist()
        read += len(rows)
        if marker in json.dumps(rows, default=str):
            hits.append(name)
    return read, hits


def files_containing(root: Path, marker: str) -> tuple[int, list[Path]]:
    """(files read, files whose bytes contain ``marker``) under ``root`` (logs, checkpoints, configs,
    databases)."""
    read, hits = 0, []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                data = path.read_bytes()
                read += 1
                if marker.encode() in data:
                    hits.append(path)
    return read, hits
