"""The markdown the scaling model's data renders to: the ``scale`` section of ``docs/RESULTS.md``
(:func:`results_markdown`) and the predictions section of ``docs/SCALING.md`` (:func:`scaling_markdown`).

Both take the dict written to ``docs/results/scale.json`` (built in :mod:`.cli`), so either document
can be rebuilt from the JSON alone.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from benchmarks._report import machine_line
from benchmarks.scale_model.hardware import Hardware, decode_curve, replica_gpus

__all__ = ["GRID_ROWS", "REMEDIES", "results_markdown", "scaling_markdown"]


def results_markdown(data: dict[str, Any]) -> str:
    """The ``scale`` section of docs/RESULTS.md: the validation runs here, then the data-centre predictions."""
    lines = ["## Scaling model: predicted against measured throughput (`sao bench scale`)", "",
             f"Command: `{data['command']}`. {machine_line(data['machine'])} Raw data: `docs/results/scale.json`; "
             "the model and its data-centre predictions: `docs/SCALING.md`.", ""]
    validation = data.get("validation")
    if validation:
        fitted = validation["calibration"]
        first = validation["rows"][0]
        lines += [f"Real pipeline runs here (`{validation['measured_by']}`: Serve replicas, lake writer, Ray Train "
                  f"trainer; tiny policy, math_tool, max staleness 2, {first['measured']['max_in_flight']} in "
                  "flight, a local lake), after an unmeasured warm-up run. Throughput: trajectories trained per "
                  "second after the first 3 steps (from `train_steps.finished_at`). The model is calibrated on "
                  f"`{first['run_id']}`'s stage timings only: generation time per turn (-> "
                  f"{fitted['turn_overhead_s'] * 1000:.0f} ms of replica time per turn at full speed), update "
                  f"(-> {fitted['update_full_s']:.2f} s per {first['batch']}-trajectory update at full speed), "
                  "the trainer's read-and-wait, commit and the gap between steps, tool latency; plus the rollout "
                  "and lake benchmarks (`rollout.json`, `lake.json`) and the Serve overhead of 0.4 core. The "
                  "other runs are predictions for another replica count and another batch size on the same 2 "
                  "shared cores.", "",
                  "| run | replicas | batch | load avg after | measured traj/s | predicted traj/s | error | "
                  "predicted limit |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for row in validation["rows"]:
            tag = " (calibration: by construction)" if row["calibration_run"] else ""
            lines.append(f"| `{row['run_id']}`{tag} | {row['replicas']} | {row['batch']} | "
                         f"{row['measured'].get('load_average', 0.0):.1f} | "
                         f"{row['measured_trajectories_per_s']:.2f} | {row['predicted_trajectories_per_s']:.2f} | "
                         f"{row['error'] * 100:+.0f}% | {row['predicted_bottleneck']} |")
        worst = max(abs(r["error"]) for r in validation["rows"] if not r["calibration_run"])
        lines += ["", f"Largest error on the predicted runs: {worst * 100:.0f}% (target: within 20%): "
                  + ("**met**." if worst <= 0.2 else "**missed**.") + " The load average is the machine's (other "
                  "jobs shared the 2 cores); the model knows only the pipeline's own processes.", ""]
    else:
        lines += ["No validation runs (run `sao bench scale --validate`).", ""]
    lines += ["Data-centre predictions (assumptions in `docs/SCALING.md`):", "",
              "| scenario | trajectories/s | tokens/s | step s | first bottleneck | stale skipped |",
              "|---|---:|---:|---:|---|---:|"]
    for row in data["datacentre"]:
        lines.append(f"| {row['scenario']} | {row['trajectories_per_s']:,.1f} | {row['tokens_per_s']:,.0f} | "
                     f"{row['step_s']:,.0f} | {row['bottleneck']} | {row['skipped_stale_frac'] * 100:.0f}% |")
    return "\n".join(lines)


REMEDIES = {
    "trainer": "more trainer GPUs (data parallel; the step is compute-bound), a cheaper critic (frozen "
               "attention, a smaller critic), fewer critic epochs",
    "lake": "more rows per commit (`WriterConfig.flush_rows`; a commit costs ~0.25 s on an object store "
            "whatever its size), one writer per driver shard (appends never conflict), table partitioning "
            "by run and hour so a commit and the trainer's scan touch one partition",
    "publish": "sharded weight broadcast: each trainer node sends its shard, replicas relay along a tree "
               "(one source serving every replica grows linearly with replicas); or a larger max_staleness",
    "gate": "let the staleness gate admit what the replicas can run: `batch * (max_staleness + 1)` at "
            "least the replicas' in-flight capacity; if rollouts go stale (weights arrive late), shard "
            "the weight broadcast",
    "rollout": "more replicas, or more requests per replica (KV memory: fp8 KV cache, more GPUs per "
               "replica); shorter tool latency tails",
}


def scaling_markdown(data: dict[str, Any]) -> str:
    """The predictions section of docs/SCALING.md (between its markers), from the same data.

    Its reading of the table is written for the grid of :data:`GRID_ROWS` and takes every figure from
    the rows; ValueError if the rows are another grid or no longer bear the reading out (``scale.json``
    is already written then: fix the reading and rebuild the section from it)."""
    hw = data["hardware_assumed"]
    lines = [
        "## Which part saturates first: the scaling model", "",
        "`benchmarks/scale_model/` (`sao bench scale`) is a discrete-event simulation of the pipeline (one "
        "heap of timed events, numpy only): rollout replicas that decode their running requests together at "
        "a measured tokens/s-per-concurrency curve plus a fixed cost per turn, with log-normal (heavy-tailed) "
        "tool latency between turns; the driver's staleness gate; one lake writer that commits every "
        "`flush_rows` records or `flush_seconds`, at a measured fixed cost plus a cost per stored token; the "
        "trainer's read, update and weight publication; weights reaching replicas `broadcast_s` later, so "
        "trajectories sampled by weights more than `max_staleness` versions old are skipped. On this machine "
        "the replicas, the trainer and the Serve machinery share two cores. The docstring of "
        "`benchmarks/scale_model/simulator.py` has the details.",
        "",
        "**Validation here.** Calibrated on one real run's stage timings and the component benchmarks, it "
        "predicts the end-to-end throughput of real runs at other replica counts and batch sizes; the table, "
        "the errors and the command are in `docs/RESULTS.md` (section \"Scaling model\").",
        "",
        "**Assumptions at data-centre sizes** (none of these is measured here; `Hardware` in "
        "`benchmarks/scale_model/hardware.py`):",
        "",
        f"- GPU: {hw['gpu_flops'] / 1e12:.0f} TFLOP/s bf16, {hw['gpu_hbm_bytes_s'] / 1e12:.2f} TB/s HBM, "
        f"{hw['gpu_memory_bytes'] / 1e9:.0f} GB (H100-class); training at {hw['train_mfu']:.0%} MFU; a training "
        "token costs 14 x parameters FLOPs (actor forward + backward, a critic of the same size, the "
        "recomputed log-probabilities).",
        f"- Rollout replica: tensor-parallel over enough GPUs that bf16 weights fill at most half their memory "
        f"({_replica_gpus(data)}); a decode step reads the weights and each running request's KV cache "
        f"({hw['kv_bytes_per_token_per_param'] * 1e6:.1f} bytes per context token per million parameters; "
        "half the trajectory on average), or is compute-bound, whichever is slower; requests per replica are "
        f"capped by KV memory ({_kv_capacity(data)}).",
        "- Trajectories: turns of 2,000 tokens, half generated, half tool observations (prefilled); tool "
        f"latency log-normal, median {hw['tool_median_s']:.0f} s, sigma {hw['tool_sigma']} (p99 about 16x the "
        "median).",
        f"- Network: {hw['nic_bytes_s'] / 1e9:.0f} GB/s per node. Weight publication `naive`: one source "
        "serves every replica (`replicas x 2 bytes x parameters / bandwidth`); `sharded`: each trainer node "
        "sends its shard and replicas relay along a tree (`weights / (bandwidth x trainer nodes)` + 50 ms per "
        "tree level).",
        f"- Lake on an object store: {hw['commit_s']:.2f} s per commit (conditional put and log read), plus "
        f"68 ns per stored token (measured here: Arrow conversion and validation) and {hw['bytes_per_token']:.0f} "
        f"bytes per token at {hw['writer_bytes_s'] / 1e9:.0f} GB/s per writer; the trainer reads a batch at the "
        "same rate per trainer node.",
        "- The driver keeps `batch x (max_staleness + 1)` rollouts in flight (the staleness gate's bound; "
        "max_staleness 2), at most what the replicas' KV memory holds.",
        "",
        "Each row changes one thing from the row above (\"...\"), usually the remedy for the row above's "
        "bottleneck. \"stale skipped\": trajectories sampled by weights too old when the trainer reached them "
        "(the heavy tool-latency tail makes some rollouts outlive `max_staleness` steps).",
        "",
        "| scenario | trajectories/s | tokens/s | step s | first bottleneck | stale skipped | what to do next |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for row in data["datacentre"]:
        step = "stalls" if not math.isfinite(row["step_s"]) else f"{row['step_s']:,.0f}"
        lines.append(f"| {row['scenario']} | {row['trajectories_per_s']:,.1f} | {row['tokens_per_s']:,.0f} | {step} | "
                     f"{row['bottleneck']} | {row['skipped_stale_frac'] * 100:.0f}% | {REMEDIES[row['bottleneck']]} |")
    lines += ["", *_reading(data["datacentre"])]
    return "\n".join(lines)



# The rows of the data-centre grid (``datacentre_grid`` in :mod:`.datacentre`) that the reading of the
# table in docs/SCALING.md talks about, by key, in the grid's order. The reading takes every figure from
# these rows (and the trainer GPUs from their labels); if the grid changes (a row renamed, added, removed
# or moved), :func:`scaling_markdown` refuses to write it rather than describe rows that are not there.
GRID_ROWS: dict[str, str] = {
    "base": "7B, 64 replicas, 8k-token trajectories, 64 trainer GPUs, batch 1024",
    "trainer_gpus": "... 512 trainer GPUs",
    "sharded": "... sharded weight broadcast",
    "replicas": "... 512 replicas, batch 8192",
    "commit_rows": "... 1024 rows per commit",
    "more_replicas": "... 4096 replicas, batch 32768",
    "long": "30B, 4096 replicas, 100k-token trajectories, 512 trainer GPUs, batch 8192",
    "long_trainer_gpus": "... 2048 trainer GPUs",
}


def _hardware(data: dict[str, Any]) -> Hardware:
    """The hardware the rows were predicted for (``data["hardware_assumed"]``)."""
    assumed = data["hardware_assumed"]
    return Hardware(**{f.name: assumed[f.name] for f in dataclasses.fields(Hardware) if f.name in assumed})


def _billions(params: float) -> str:
    return f"{params / 1e9:.0f}B"


def _kilo_tokens(tokens: float) -> str:
    return f"{tokens / 1000:.0f}k"


def _replica_gpus(data: dict[str, Any]) -> str:
    """GPUs per rollout replica of each model size in the grid, e.g. "7B: 1 GPU, 30B: 2"."""
    hw = _hardware(data)
    sizes = sorted({row["params"] for row in data["datacentre"]})
    parts = [f"{_billions(params)}: {replica_gpus(params, hw)}" for params in sizes]
    parts[0] += " GPU" if replica_gpus(sizes[0], hw) == 1 else " GPUs"
    return ", ".join(parts)


def _kv_capacity(data: dict[str, Any]) -> str:
    """Requests per replica that KV memory holds for the grid's largest model and longest trajectories,
    e.g. "30B, 100k tokens: 6"."""
    row = max(data["datacentre"], key=lambda r: (r["params"], r["context_tokens"]))
    capacity = decode_curve(row["params"], row["context_tokens"], _hardware(data))[-1][0]
    return f"{_billions(row['params'])}, {_kilo_tokens(row['context_tokens'])} tokens: {capacity:.0f}"


def _trainer_gpus(label: str) -> int:
    match = re.search(r"(\d+) trainer GPUs", label)
    if match is None:
        raise ValueError(f"no trainer GPU count in the scenario label {label!r}")
    return int(match.group(1))


def _about(n: float) -> str:
    """``n`` to one significant figure, in words where that reads better: 103 -> "a hundred"."""
    rounded = round(n, -math.floor(math.log10(n))) if n > 0 else 0.0
    return {100: "a hundred", 1000: "a thousand"}.get(int(rounded), f"{rounded:,.0f}")


def _times(ratio: float) -> str:
    """What multiplying by ``ratio`` does to a throughput: "doubles it", "multiplies it by 2.6"."""
    return "doubles it" if 1.8 <= ratio < 2.25 else f"multiplies it by {ratio:.1f}"


def _grid_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """:data:`GRID_ROWS`' rows by key; None for a ``--quick`` run (the grid's first rows only). Raises
    ValueError if the rows are not the grid the reading was written for."""
    labels = [row["scenario"] for row in rows]
    expected = list(GRID_ROWS.values())
    if labels == expected:
        return dict(zip(GRID_ROWS, rows, strict=True))
    if 0 < len(labels) < len(expected) and labels == expected[:len(labels)]:
        return None
    raise ValueError("the data-centre grid is not the one docs/SCALING.md's reading of the table was written "
                     f"for (benchmarks/scale_model/report.py, GRID_ROWS): expected rows {expected}, got {labels}; "
                     "update GRID_ROWS and the reading")


def _reading(rows: list[dict[str, Any]]) -> list[str]:
    """The "Reading the table" bullets of docs/SCALING.md: sentences written for the grid's rows, with
    every figure taken from them. Raises ValueError if a claim the sentences make no longer holds."""
    head = "Reading the table (the figures are the model's; the sentences were written from this run of it):"
    row = _grid_rows(rows)
    if row is None:
        return [head, "", f"(Written for the full grid; this run has its first {len(rows)} rows only.)"]
    base, faster, sharded, wide = row["base"], row["trainer_gpus"], row["sharded"], row["replicas"]
    batched, widest, long, long_faster = row["commit_rows"], row["more_replicas"], row["long"], row["long_trainer_gpus"]
    doubling = batched["trajectories_per_s"] / wide["trajectories_per_s"]
    widening = widest["trajectories_per_s"] / batched["trajectories_per_s"]
    long_speedup = long_faster["trajectories_per_s"] / long["trajectories_per_s"]
    claims = {
        "the base row is trainer-bound": base["bottleneck"] == "trainer",
        "with more trainer GPUs the lake writer binds": faster["bottleneck"] == "lake",
        "that step is longer than, but under twice, the naive broadcast":
            faster["broadcast_s"] < faster["step_s"] < 2 * faster["broadcast_s"],
        "the sharded broadcast cuts the stale share": sharded["skipped_stale_frac"] < faster["skipped_stale_frac"],
        "then the gate binds": sharded["bottleneck"] == "gate",
        "the 512-replica row is lake-bound": wide["bottleneck"] == "lake",
        "bigger commits hand the limit back to the trainer": batched["bottleneck"] == "trainer",
        "more replicas are hardly faster": widening < 1.1,
        "the 30B rows are trainer-bound": long["bottleneck"] == long_faster["bottleneck"] == "trainer",
        "the steps quoted are finite": all(math.isfinite(r["step_s"]) for r in (faster, long, long_faster)),
    }
    if broken := [claim for claim, holds in claims.items() if not holds]:
        raise ValueError("docs/SCALING.md's reading of the table no longer holds for these predictions ("
                         + "; ".join(broken) + "): rewrite it in benchmarks/scale_model/report.py")

    def pct(r: dict[str, Any]) -> str:
        return f"{r['skipped_stale_frac'] * 100:.0f}%"

    gpus = {key: _trainer_gpus(r["scenario"]) for key, r in row.items() if "trainer GPUs" in r["scenario"]}
    return [
        head, "",
        f"- **The trainer** is the first limit of a modest deployment: a {_billions(base['params'])} policy with "
        f"a critic of the same size trains {_kilo_tokens(base['context_tokens'])}-token trajectories on "
        f"{gpus['base']} GPUs at about {base['trajectories_per_s']:.0f} per second.",
        f"- **Late weights, then the lake writer** come next: with {gpus['trainer_gpus'] / gpus['base']:.0f}x the "
        f"trainer GPUs a step ({faster['step_s']:.0f} s) is not much longer than a one-source broadcast to "
        f"{faster['replicas']} replicas ({faster['broadcast_s']:.0f} s), so rollouts started meanwhile sample older "
        f"weights and {pct(faster)} go stale (they are passed over, and their places go back to the staleness "
        f"gate); the rest arrive faster than {faster['flush_rows']}-row commits store them. Sharded broadcast "
        f"({sharded['broadcast_s']:.1f} s) cuts the stale share to {pct(sharded)}; what binds then is the gate's "
        "bound on work in flight, `batch x (max_staleness + 1)`: grow the batch with the replicas.",
        f"- **The lake writer** at {wide['flush_rows']} rows per commit (the pipeline's default for an asynchronous "
        "run's batch of up to 32, kept small so a laptop's trainer is fed quickly; larger batches commit every half "
        f"batch, a synchronous run each batch whole: `PipelineConfig.writer_config`) caps a {wide['replicas']}-replica deployment; about "
        f"{_about(batched['rows_per_commit'])} rows per commit or more (`WriterConfig.flush_rows` "
        f"{batched['flush_rows']} with the age flush) {_times(doubling)} and hands the limit back to the trainer.",
        f"- **More replicas do not help a trainer-bound run**: {widest['replicas']} replicas with a "
        f"{widest['batch'] / batched['batch']:.0f}x batch train {'hardly' if widening >= 1 else 'no'} faster than "
        f"{batched['replicas']} ({widest['trajectories_per_s']:.0f} against {batched['trajectories_per_s']:.0f} "
        "per second).",
        f"- **{_billions(long['params'])} and {_kilo_tokens(long['context_tokens'])}-token trajectories** are "
        f"trainer-bound on {gpus['long']} GPUs (a step of {long['step_s'] / 60:.0f} minutes) and still on "
        f"{gpus['long_trainer_gpus']} ({long_faster['step_s'] / 60:.0f} minutes, {long_speedup:.1f}x faster); about "
        f"{pct(long_faster)} of rollouts go stale at these lengths, because each runs for many minutes.",
    ]
