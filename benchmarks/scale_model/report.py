"""The markdown the scaling model's data renders to: the ``scale`` section of ``docs/RESULTS.md``
(:func:`results_markdown`) and the predictions section of ``docs/SCALING.md`` (:func:`scaling_markdown`).

Both take the dict written to ``docs/results/scale.json`` (built in :mod:`.cli`), so either document
can be rebuilt from the JSON alone.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks._report import machine_line

__all__ = ["REMEDIES", "results_markdown", "scaling_markdown"]


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
    """The predictions section of docs/SCALING.md (between its markers), from the same data."""
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
        f"(7B: 1 GPU, 30B: 2); a decode step reads the weights and each running request's KV cache "
        f"({hw['kv_bytes_per_token_per_param'] * 1e6:.1f} bytes per context token per million parameters; "
        "half the trajectory on average), or is compute-bound, whichever is slower; requests per replica are "
        "capped by KV memory (30B, 100k tokens: 6).",
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
    lines += ["", "Reading the table (the figures are the model's; the sentences were written from this run of it):",
              "",
              "- **The trainer** is the first limit of a modest deployment: a 7B policy with a critic of the same "
              "size trains 8k-token trajectories on 64 GPUs at about 19 per second.",
              "- **The staleness gate, fed by late weights** comes next: with 8x the trainer GPUs a step is only "
              "twice the time a one-source broadcast needs to reach 64 replicas (18 s), so rollouts started in "
              "that time sample the older weights, more go stale, and the gate (which counts them as started) "
              "holds the rest back. "
              "Sharded broadcast (0.3 s) gains half again; the rest is the gate's bound on work in flight, "
              "`batch x (max_staleness + 1)`: grow the batch with the replicas.",
              "- **The lake writer** at the pipeline's default of 16 rows per commit (kept small so a laptop's "
              "trainer is fed quickly) caps a 512-replica deployment; about a hundred rows per commit or more "
              "(`WriterConfig.flush_rows` 1024 with the age flush) doubles it and hands the limit back to the "
              "trainer.",
              "- **More replicas do not help a trainer-bound run**: 4096 replicas with a 4x batch train no "
              "faster than 512.",
              "- **30B and 100k-token trajectories** are trainer-bound on 512 GPUs (a step of 28 minutes); with "
              "2048 GPUs the gate binds again because each rollout runs for many minutes and few (6 per "
              "replica, by KV memory) fit in flight."]
    return "\n".join(lines)

