"""Lake benchmark: validated, idempotent ingest throughput and the trainer's next-micro-batch latency.

Run with ``sao bench lake`` (``--quick`` for a smoke run). Measures, on a local lake:

1. ingest: synthetic 500-token trajectories through :class:`sao.lake.TrajectoryWriter` (Arrow
   conversion, every validation rule, de-duplication against the table, exactly-once commit) at 1, 64
   and 1,024 records per commit, beside a raw ``write_deltalake`` append of the same rows (no
   validation, no de-duplication) as the floor;
2. two writer processes appending 1,024-record batches to the same run at once (commit races are
   re-planned, every row stored once);
3. the trainer's query (:class:`sao.lake.TrajectoryReader`) as the table grows, after compaction: a
   cold call (a new reader: reads the consumed ids from ``train_steps``, scans the run's index columns,
   fetches the rows) and warm calls (the steady state: a scan of the rows committed since the last call,
   plus the fetch). Half of the table is marked consumed in ``train_steps``; each call asks for 256 rows.

Writes ``docs/results/lake.json`` and the lake section of ``docs/RESULTS.md`` (between markers, so other
sections are left alone).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import multiprocessing
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import deltalake
import numpy as np
import pyarrow as pa

from benchmarks._report import machine
from sao.lake import (
    Lake,
    LakeConfig,
    PolicyVersionRecord,
    TrainStepRecord,
    TrajectoryReader,
    TrajectoryWriter,
    WriterConfig,
    compact,
    record_train_step,
    register_policy_version,
    utc_now,
)
from sao.lake.columnar import records_to_arrow
from sao.lake.synthetic import make_trajectories
from sao.lake.validate import validate_table

RUN = "bench"
MARK_BEGIN = "<!-- lake_ingest:begin -->"
MARK_END = "<!-- lake_ingest:end -->"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench lake", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Small sizes, for tests (seconds).")
    parser.add_argument("--tokens", type=int, default=500, help="Completion tokens per trajectory.")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument(
        "--sizes", type=str, default=None, help="Table sizes for the query, e.g. 1000,10000,100000."
    )
    parser.add_argument(
        "--root", type=str, default=None, help="Folder for the lakes (a temporary one by default)."
    )
    parser.add_argument("--out", type=Path, default=Path("docs/results/lake.json"))
    parser.add_argument("--results-md", type=Path, default=Path("docs/RESULTS.md"))
    return parser.parse_args(argv)


def _fresh_lake(root: Path, name: str) -> Lake:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    lake = Lake.open(LakeConfig(root=str(path)))
    register_policy_version(lake, PolicyVersionRecord(RUN, 0, "ckpt/0", "sha256:0"))
    return lake


def _records(count: int, seed: int, tokens: int, prompt_tokens: int) -> list:
    return make_trajectories(
        count, seed=seed, run_id=RUN, num_tokens=tokens, prompt_tokens=prompt_tokens
    )


def bench_ingest(
    root: Path, batch: int, commits: int, tokens: int, prompt_tokens: int
) -> dict[str, Any]:
    """One writer, ``commits`` flushes of ``batch`` records each."""
    lake = _fresh_lake(root, f"ingest-{batch}")
    records = _records(batch * commits, seed=batch, tokens=tokens, prompt_tokens=prompt_tokens)
    writer = TrajectoryWriter(lake, WriterConfig(flush_rows=batch, background_flush=False))
    started = time.perf_counter()
    for record in records:
        writer.add(record)
    writer.close()
    seconds = time.perf_counter() - started
    assert writer.stats.written == len(records) and writer.stats.quarantined == 0
    return {
        "batch": batch,
        "commits": writer.stats.commits,
        "rows": len(records),
        "seconds": seconds,
        "rows_per_s": len(records) / seconds,
        "ms_per_commit": 1000 * seconds / writer.stats.commits,
    }


def bench_breakdown(root: Path, tokens: int, prompt_tokens: int, repeats: int) -> dict[str, float]:
    """Where a 1,024-record flush spends its time: conversion, validation, the raw append."""
    records = _records(1024, seed=7, tokens=tokens, prompt_tokens=prompt_tokens)
    convert, validate, raw = [], [], []
    lake = _fresh_lake(root, "raw")
    for _ in range(repeats):
        t0 = time.perf_counter()
        table = records_to_arrow(records)
        t1 = time.perf_counter()
        validate_table(table, np.zeros(table.num_rows, dtype=np.int64))
        t2 = time.perf_counter()
        convert.append(t1 - t0)
        validate.append(t2 - t1)
    full = _full_rows(records_to_arrow(records))
    for _ in range(repeats):
        t0 = time.perf_counter()
        deltalake.write_deltalake(
            lake.table("trajectories"), full, mode="append", partition_by=["run_id"]
        )
        raw.append(time.perf_counter() - t0)
    return {
        "convert_ms": 1000 * statistics.median(convert),
        "validate_ms": 1000 * statistics.median(validate),
        "raw_append_ms": 1000 * statistics.median(raw),
        "raw_append_rows_per_s": 1024 / statistics.median(raw),
    }


def _full_rows(table: pa.Table) -> pa.Table:
    from schemas import trajectories

    now = pa.array([utc_now()] * table.num_rows, trajectories.SCHEMA.field("arrived_at").type)
    extra = {
        "arrived_at": now,
        "ingested_at": now,
        "writer_id": pa.array(["raw"] * table.num_rows),
        "ingest_seq": pa.array(np.arange(1, table.num_rows + 1, dtype=np.int64)),
        "schema_version": pa.array(np.ones(table.num_rows, dtype=np.int32)),
    }
    for name, column in extra.items():
        table = table.append_column(trajectories.SCHEMA.field(name), column)
    return table.select(trajectories.SCHEMA.names).cast(trajectories.SCHEMA)


def _writer_process(
    root: str, seed: int, batches: int, tokens: int, prompt_tokens: int, go: Any
) -> dict[str, Any]:
    """One of the two concurrent writers (runs in its own process)."""
    records = _records(1024 * batches, seed=seed, tokens=tokens, prompt_tokens=prompt_tokens)
    lake = Lake.open(LakeConfig(root=root))
    writer = TrajectoryWriter(lake, WriterConfig(flush_rows=1024, background_flush=False))
    go.wait(120)
    started = time.time()
    for record in records:
        writer.add(record)
    writer.close()
    return {
        "start": started,
        "end": time.time(),
        "written": writer.stats.written,
        "conflicts": writer.stats.conflicts,
    }


def bench_two_writers(root: Path, batches: int, tokens: int, prompt_tokens: int) -> dict[str, Any]:
    lake = _fresh_lake(root, "two-writers")
    context = multiprocessing.get_context("spawn")
    go = context.Manager().Event()
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        futures = [
            pool.submit(_writer_process, lake.root, seed, batches, tokens, prompt_tokens, go)
            for seed in (101, 202)
        ]
        time.sleep(2.0 + 0.002 * batches * 1024)  # let both generate their records before the start
        go.set()
        results = [f.result(timeout=1800) for f in futures]
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    rows = sum(r["written"] for r in results)
    stored = lake.read("trajectories", columns=["trajectory_id", "ingest_seq"])
    assert stored.num_rows == rows == 2 * 1024 * batches
    assert sorted(stored["ingest_seq"].to_pylist()) == list(range(1, rows + 1))
    return {
        "rows": rows,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "conflicts": [r["conflicts"] for r in results],
    }


def _grow(
    lake: Lake, writer: TrajectoryWriter, target: int, tokens: int, prompt_tokens: int
) -> None:
    seed = 10_000
    while True:
        have = writer.stats.written
        if have >= target:
            return
        count = min(1024, target - have)
        writer.add_many(
            _records(count, seed=seed + have, tokens=tokens, prompt_tokens=prompt_tokens)
        )
        writer.flush()


def _percentiles(values: list[float]) -> dict[str, float]:
    data = np.array(values) * 1000
    return {
        "p50_ms": float(np.percentile(data, 50)),
        "p95_ms": float(np.percentile(data, 95)),
        "n": len(values),
    }


def bench_query(
    root: Path, sizes: list[int], repeats: int, tokens: int, prompt_tokens: int
) -> list[dict[str, Any]]:
    lake = _fresh_lake(root, "query")
    writer = TrajectoryWriter(lake, WriterConfig(flush_rows=1024, background_flush=False))
    results = []
    step = 0
    consumed = 0
    for size in sizes:
        _grow(lake, writer, size, tokens, prompt_tokens)
        # Mark the first half of the table consumed, as a trainer halfway through would have.
        half = lake.read("trajectories", columns=["trajectory_id", "ingest_seq"]).sort_by(
            "ingest_seq"
        )
        ids = half["trajectory_id"].to_pylist()[consumed : size // 2]
        if ids:
            now = utc_now()
            version = lake.version("trajectories")
            record_train_step(lake, TrainStepRecord(RUN, step, 0, 0, version, tuple(ids), now, now))
            step += 1
            consumed = size // 2
        t0 = time.perf_counter()
        compact(lake, ["trajectories"])
        compact_s = time.perf_counter() - t0
        files = len(lake.table("trajectories").file_uris())
        rows = lake.table("trajectories").count()
        cold, warm, warm_new = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            TrajectoryReader(lake, RUN).next_micro_batch(
                trainer_version=0, max_staleness=4, max_rows=256
            )
            cold.append(time.perf_counter() - t0)
        reader = TrajectoryReader(lake, RUN)
        reader.release(reader.next_micro_batch(0, 4, 256).trajectory_ids)
        for _ in range(repeats):
            t0 = time.perf_counter()
            batch = reader.next_micro_batch(0, 4, 256)
            warm.append(time.perf_counter() - t0)
            assert len(batch) == 256
            reader.release(batch.trajectory_ids)  # offered again: the next call does the same work
        for _ in range(max(3, repeats // 4)):  # new rows arrived since the last call
            writer.add_many(
                _records(
                    256, seed=900_000 + len(warm_new), tokens=tokens, prompt_tokens=prompt_tokens
                )
            )
            writer.flush()
            t0 = time.perf_counter()
            batch = reader.next_micro_batch(0, 4, 256)
            warm_new.append(time.perf_counter() - t0)
            reader.release(batch.trajectory_ids)
        results.append(
            {
                "rows": rows,
                "files_after_compaction": files,
                "compact_s": compact_s,
                "cold": _percentiles(cold),
                "warm": _percentiles(warm),
                "warm_after_append": _percentiles(warm_new),
            }
        )
        print(
            f"  query at {results[-1]['rows']:>7} rows: cold p95 {results[-1]['cold']['p95_ms']:.1f} ms, "
            f"warm p95 {results[-1]['warm']['p95_ms']:.1f} ms",
            flush=True,
        )
    writer.close()
    return results


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        MARK_BEGIN,
        "## Lake ingest and the trainer's query (`sao bench lake`)",
        "",
        f"Command: `{result['command']}`. Machine: {m['cpus']} CPU cores, {m['memory_gib']} GiB memory, "
        f"{m['platform']}; Python {m['python']}, deltalake {m['deltalake']}, pyarrow {m['pyarrow']}. "
        f"Date: {result['date']}. Trajectories: {result['tokens']} completion + {result['prompt_tokens']} "
        "prompt tokens, local lake. Raw data: `docs/results/lake.json`.",
        "",
        "Ingest through `TrajectoryWriter` (every validation rule, de-duplication against the table, "
        "exactly-once commit; target >= 5,000 trajectories/s at 1,024 per commit):",
        "",
        "| records per commit | commits | trajectories/s | ms per commit |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["ingest"]:
        lines.append(
            f"| {row['batch']} | {row['commits']} | {row['rows_per_s']:,.0f} | {row['ms_per_commit']:.1f} |"
        )
    b = result["breakdown_1024"]
    two = result["two_writers"]
    lines += [
        "",
        f"Two writer processes, 1,024 per commit, same run, at once: **{two['rows_per_s']:,.0f} trajectories/s** "
        f"together ({two['rows']} rows in {two['seconds']:.1f} s; commit races lost and re-planned: "
        f"{two['conflicts']}; every row stored once, `ingest_seq` gap-free).",
        "",
        f"Where a 1,024-record flush goes (medians): Arrow conversion {b['convert_ms']:.1f} ms, validation "
        f"{b['validate_ms']:.1f} ms; a raw `write_deltalake` append of the same rows (no validation, no "
        f"de-duplication) {b['raw_append_ms']:.1f} ms = {b['raw_append_rows_per_s']:,.0f} rows/s. The rest "
        "is the exactly-once protocol: refreshing the log, the catch-up scan of ids and `ingest_seq` "
        "committed since the writer last looked (pruned to the newest files), and the id bookkeeping. "
        "At 1 record per commit the fixed cost of a Delta commit plus that refresh and scan (about 35 ms) "
        "is the whole story: batch.",
        "",
        "Trainer's next micro-batch (256 rows, half the table consumed, after compaction; target p95 < "
        "250 ms at 100k rows). Cold: a new reader (consumed ids, index scan of the run, fetch). Warm: the "
        "steady state (scan of rows committed since the last call, fetch); after append: 256 new rows "
        "committed before the call.",
        "",
        "| rows | files | compaction s | cold p50 / p95 ms | warm p50 / p95 ms | after append p50 / p95 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for q in result["query"]:
        lines.append(
            f"| {q['rows']:,} | {q['files_after_compaction']} | {q['compact_s']:.1f} | "
            f"{q['cold']['p50_ms']:.1f} / {q['cold']['p95_ms']:.1f} | {q['warm']['p50_ms']:.1f} / "
            f"{q['warm']['p95_ms']:.1f} | {q['warm_after_append']['p50_ms']:.1f} / "
            f"{q['warm_after_append']['p95_ms']:.1f} |"
        )
    first, last = result["query"][0], result["query"][-1]
    if last["rows"] > first["rows"]:
        grow = last["rows"] / first["rows"]
        cold = last["cold"]["p95_ms"] / first["cold"]["p95_ms"]
        warm = last["warm"]["p95_ms"] / first["warm"]["p95_ms"]
        lines += [
            "",
            f"From {first['rows']:,} to {last['rows']:,} rows ({grow:.0f}x) the p95 grows {cold:.1f}x cold "
            f"and {warm:.1f}x warm. A warm call scans only `ingest_seq` above its cursor (file statistics "
            "prune the rest of the table); it still opens the snapshot's larger compacted files and "
            "filters its in-memory candidates (half the table here). A cold call also scans the run's "
            "three index columns once.",
        ]
    lines += ["", MARK_END]
    return "\n".join(lines)


def update_results_md(path: Path, section: str) -> None:
    """Replace the lake section of ``path`` (or append it; create the file with a header)."""
    text = (
        path.read_text()
        if path.exists()
        else "# Results\n\nMeasured figures, each with the command that produced it.\n"
    )
    if MARK_BEGIN in text and MARK_END in text:
        before = text.split(MARK_BEGIN)[0]
        after = text.split(MARK_END, 1)[1]
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    quick = args.quick
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([1000, 3000] if quick else [1000, 10_000, 100_000])
    )
    plan = [(1, 8), (64, 3), (1024, 2)] if quick else [(1, 100), (64, 30), (1024, 20)]
    owned = args.root is None
    root = Path(args.root or tempfile.mkdtemp(prefix="sao-bench-lake-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        print(f"lake benchmark in {root} ({'quick' if quick else 'full'})", flush=True)
        ingest = []
        for batch, commits in plan:
            ingest.append(bench_ingest(root, batch, commits, args.tokens, args.prompt_tokens))
            print(
                f"  ingest {batch:>5}/commit: {ingest[-1]['rows_per_s']:,.0f} trajectories/s",
                flush=True,
            )
        breakdown = bench_breakdown(root, args.tokens, args.prompt_tokens, 2 if quick else 5)
        two = bench_two_writers(root, 2 if quick else 20, args.tokens, args.prompt_tokens)
        print(f"  two writers: {two['rows_per_s']:,.0f} trajectories/s together", flush=True)
        query = bench_query(root, sizes, 5 if quick else 30, args.tokens, args.prompt_tokens)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "command": "sao bench lake" + (" " + " ".join(argv) if argv else ""),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "ingest": ingest,
        "breakdown_1024": breakdown,
        "two_writers": two,
        "query": query,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    section = _markdown(result)
    update_results_md(args.results_md, section)
    print(section)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(__import__("sys").argv[1:]))
