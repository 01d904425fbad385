"""Code run in child processes by the concurrency tests (importable under the spawn start method)."""

from __future__ import annotations

import random
from typing import Any

from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter


def write_slice(
    root: str, options: dict[str, str], start: int, stop: int, flush_rows: int, go: Any, seed: int
) -> dict[str, int]:
    """Write records ``start:stop`` of a fixed synthetic set, shuffled, once ``go`` is set."""
    records = make_trajectories(stop, seed=1234, num_tokens=16, prompt_tokens=2)[start:stop]
    random.Random(seed).shuffle(records)
    lake = Lake.open(LakeConfig(root=root, storage_options=options))
    go.wait(60)
    config = WriterConfig(flush_rows=flush_rows, background_flush=False)
    with TrajectoryWriter(lake, config) as writer:
        for record in records:
            writer.add(record)
    stats = writer.stats
    return {"written": stats.written, "duplicates": stats.duplicates, "conflicts": stats.conflicts}
