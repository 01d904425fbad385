"""Benchmark: what the chat endpoint costs an agent of one's own, against the direct engine path.

    sao bench endpoint [--quick] [--concurrency 16,64] [--window-s 8] [--repeats 3]

With ``--engine-cpu`` (default: the machine's last CPU, as ``sao bench rollout``) the engine decodes on
that CPU and the replica's side of both arms runs on the others.

One engine as a rollout replica runs it (the torch engine in a child process,
:mod:`sao.rollout.engine_process`, tiny policy, fp32, one torch thread), the replica's side in a fresh
process of its own, C concurrent episodes in a closed loop, two arms measured alternately on that same
engine (A B A B ...):

* ``direct``: each episode is two generations the way the built-in agent loop makes them: the prompt's
  ids, the first generation, a user turn's ids appended, the second generation
  (``engine.generate`` on token ids, no HTTP).
* ``endpoint``: the same episodes written as an agent of one's own: the ``openai.AsyncOpenAI`` client
  :class:`~sao.rollout.user_agent.UserAgentRunner` gives it (its requests reach the replica's chat
  endpoint in process), two ``chat.completions.create`` calls with messages, the endpoint's work
  (:mod:`sao.rollout.chat_endpoint`: parsing, rendering, the token record, the reply) and the trajectory
  record.

* ``loop`` and ``env_agent``: the built-in environments' path before and after it moved onto the
  endpoint: :class:`~sao.rollout.agent.AgentLoop` and :func:`~sao.rollout.env_agent.environment_agent`
  on the endpoint, with one environment that answers the first action with a tool's output and ends
  the episode at the second.

The arms use the same prompts (32-96 tokens of text), budgets (64-192 new tokens per call), stop ids
and seeds. Throughput is generated tokens per second over a window after a warm-up; each arm's figure
is the median of ``--repeats`` windows (min and max given). Target: ``endpoint`` at least 90% of
``direct`` (a cost of at most 10%) at 16 and 64 concurrent episodes.

Writes ``docs/results/endpoint.json`` and the ``endpoint`` section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._report import (
    add_output_arguments,
    machine,
    machine_line,
    median_spread,
    publish,
    spread_text,
)
from benchmarks.rollout import _engine_cpus

TARGET_RATIO = 0.9
DEFAULT_JSON, DEFAULT_RESULTS = Path("docs/results/endpoint.json"), Path("docs/RESULTS.md")
WORDS = ("alpha", "beta", "gamma", "delta", "seven", "shop", "boxes", "pens", "loose", "total", "how", "many")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench endpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (concurrency 4, 1 s windows, 1 repeat)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="concurrent episodes, comma-separated (default 16,64)")
    parser.add_argument("--window-s", type=float, default=None, help="measured seconds per window (default 8)")
    parser.add_argument("--repeats", type=int, default=None, help="windows per arm and level (default 3)")
    parser.add_argument("--engine-cpu", default=None,
                        help="the CPU the engine decodes on, the replica's side on the others (default: the last "
                             "CPU, as `sao bench rollout`); 'none' leaves placement to the OS")
    add_output_arguments(parser, DEFAULT_JSON, DEFAULT_RESULTS)
    args = parser.parse_args(argv)
    args.concurrency = args.concurrency or ([4] if args.quick else [16, 64])
    args.window_s = args.window_s or (1.0 if args.quick else 8.0)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.engine_cpus = _engine_cpus(parser, args.engine_cpu)
    return args


class _TwoTurns:
    """An environment whose first action gets a tool's answer and whose second ends the episode."""

    name = "dataset"

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, task):
        self.steps = 0
        return [{"role": "user", "content": task.prompt}]

    def step(self, action_text: str):
        from sao.envs.base import StepResult, Termination

        self.steps += 1
        if self.steps == 1:
            return StepResult("ok", False)
        return StepResult(None, True, 0.0, Termination.STOP)


def _episode(rng: random.Random) -> tuple[str, int, int]:
    """(the user's text, first budget, second budget) of one episode."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 48)))
    return words, rng.randint(64, 192), rng.randint(64, 192)


async def _closed_loop(run_episode, concurrency: int, window_s: float, warmup_s: float = 1.0) -> float:
    """Tokens/s generated by ``concurrency`` clients each running episodes back to back."""
    counted = 0.0
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + window_s

    async def client(index: int) -> None:
        nonlocal counted
        rng = random.Random(index)
        while time.perf_counter() < stop_at:
            began = time.perf_counter()
            tokens = await run_episode(rng, index)
            ended = time.perf_counter()
            inside = max(0.0, min(ended, stop_at) - max(began, measure_from))
            counted += tokens * inside / max(ended - began, 1e-9)

    await asyncio.gather(*[client(i) for i in range(concurrency)])
    return counted / window_s


def measure(policy_dir: str, levels: list[int], window_s: float, repeats: int,
            cpus: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Every arm, in turn, on one engine (run in a fresh process); ``cpus``: the engine decodes there and
    this process (the replica's side of every arm) runs on the others."""
    import functools

    import torch

    from sao.envs.base import Split, Task
    from sao.envs.dataset import DatasetEnv, DatasetEnvConfig
    from sao.models.chat import ChatTokens, prompt_ids
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.rollout.agent import AgentConfig, AgentLoop
    from sao.rollout.chat_endpoint import ChatEndpoint
    from sao.rollout.cpus import keep_process_off
    from sao.rollout.engine import SamplingParams
    from sao.rollout.engine_process import TorchEngineProcess
    from sao.rollout.env_agent import environment_agent
    from sao.rollout.torch_engine import TorchEngineConfig
    from sao.rollout.user_agent import UserAgentRunner

    torch.set_num_threads(1)
    if cpus is not None:
        keep_process_off(cpus)
    tokenizer = load_tokenizer(policy_dir)
    stops = ChatTokens.from_tokenizer(tokenizer).stop_token_ids
    engine = TorchEngineProcess(functools.partial(load_policy, policy_dir), config=TorchEngineConfig(threads=1, cpus=cpus))
    follow_up = "Go on."
    agent_config = AgentConfig(max_tokens=512, max_turns=4, timeout_s=600.0)

    async def direct(rng: random.Random, index: int) -> int:
        text, first, second = _episode(rng)
        ids = prompt_ids(tokenizer, [{"role": "user", "content": text}])
        seed = rng.randrange(2**31)
        one = await engine.generate(ids, SamplingParams(max_tokens=first, seed=seed, stop_token_ids=stops))
        turn = tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{follow_up}<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False)
        two = await engine.generate(ids + list(one.token_ids) + turn,
                                    SamplingParams(max_tokens=second, seed=seed + 1, stop_token_ids=stops))
        return len(one.token_ids) + len(two.token_ids)

    async def run_arms() -> dict[str, dict[int, list[float]]]:
        endpoint = ChatEndpoint(engine, tokenizer)
        runner = UserAgentRunner(endpoint, agent_config, "bench")
        env = DatasetEnv(DatasetEnvConfig())

        async def agent(client, task) -> float:
            text, first, second = task["info"]["episode"]
            messages = [{"role": "user", "content": text}]
            one = await client.chat.completions.create(model="policy", messages=messages, max_tokens=first)
            messages += [{"role": "assistant", "content": one.choices[0].message.content or ""},
                         {"role": "user", "content": follow_up}]
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=second)
            return 0.0

        async def via_endpoint(rng: random.Random, index: int) -> int:
            import json

            episode = _episode(rng)
            rng.randrange(2**31)  # the direct arm's seed draw: both arms see the same episodes
            task_id = f"{index}-{rng.random()}"
            task = Task(task_id=task_id, env="dataset", prompt=episode[0], answer="", split=Split.TRAIN,
                        info=json.dumps({"episode": episode}))
            records = await runner.run(agent, env, task, "bench", task_id, seed=None)
            return sum(int(r.action_mask.sum()) for r in records)

        tools = concurrent.futures.ThreadPoolExecutor(8)
        loop_runner = AgentLoop(engine, tokenizer, lambda task: _TwoTurns(), agent_config)

        async def agent_loop(rng: random.Random, index: int) -> int:
            text, _, _ = _episode(rng)
            task = Task(task_id=f"{index}", env="dataset", prompt=text, answer="", split=Split.TRAIN)
            record = await loop_runner.run(task, "bench", None, rng.randrange(2**31))
            return int(record.action_mask.sum())

        async def env_agent(rng: random.Random, index: int) -> int:
            text, _, _ = _episode(rng)
            task = Task(task_id=f"{index}", env="dataset", prompt=text, answer="", split=Split.TRAIN)
            two_turns = _TwoTurns()
            records = await runner.run(environment_agent(two_turns, task, tools), two_turns, task, "bench",
                                       f"{index}-{rng.random()}", rng.randrange(2**31), built_in=True)
            return sum(int(r.action_mask.sum()) for r in records)

        arms = {"direct": direct, "endpoint": via_endpoint, "loop": agent_loop, "env_agent": env_agent}
        results: dict[str, dict[int, list[float]]] = {name: {c: [] for c in levels} for name in arms}
        try:
            for arm in arms.values():  # compile and warm up every path
                await _closed_loop(arm, 4, 0.5, warmup_s=0.5)
            for c in levels:
                for repeat in range(repeats):
                    order = list(arms.items())
                    for name, arm in order if repeat % 2 == 0 else order[::-1]:
                        print(f"  concurrency {c}, {name}, window {repeat + 1}/{repeats} ...", file=sys.stderr)
                        results[name][c].append(await _closed_loop(arm, c, window_s))
        finally:
            await runner.close()
            await endpoint.close()
            loop_runner.close()
            tools.shutdown()
        return results

    try:
        return asyncio.run(run_arms())
    finally:
        engine.close()


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "## The chat endpoint's cost (`sao bench endpoint`)",
        "",
        f"Command: `{result['command']}`. {machine_line(result['machine'])} Raw data: `{DEFAULT_JSON}`.",
        "",
        "Generated tokens/s of one torch engine as a replica runs it (a child process; tiny policy, fp32, one "
        "thread) under C "
        "concurrent two-call episodes, the two arms measured alternately on the same engine: `direct` (token "
        "ids to `engine.generate`, as the built-in agent loop) and `endpoint` (an agent of one's own: "
        "the `openai.AsyncOpenAI` client it is given, whose requests reach the replica's chat endpoint in process; "
        f"rendering, the token record and the trajectory record). Median of {result['repeats']} windows of {result['window_s']:g} s (min-max). "
        f"Target: `endpoint` >= {TARGET_RATIO:.0%} of `direct` at 16 and 64. "
        + (f"The engine decodes on CPU {', '.join(map(str, result['engine_cpus']))}, the replica's side of both arms "
           "(clients, endpoint, records) on the others (`--engine-cpu`)." if result.get("engine_cpus") else
           "No CPU pinning (`--engine-cpu none`)."),
        "",
        "The second pair is the built-in environments' path before and after it moved onto the endpoint: "
        "`loop` (the agent loop, `sao/rollout/agent.py`) and `env_agent` (`sao/rollout/env_agent.py` on the "
        "endpoint), one environment that answers the first action with a tool's output and ends at the second.",
        "",
        "| concurrency | direct | endpoint | endpoint / direct | loop | env_agent | env_agent / loop |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(spread: dict[str, float], digits: str = ",.0f") -> str:
        return spread_text(spread, digits)

    for c in result["concurrency"]:
        point = result["levels"][str(c)]
        lines.append(f"| {c} | {cell(point['direct'])} | {cell(point['endpoint'])} | {cell(point['ratio'], '.2f')} | "
                     f"{cell(point['loop'])} | {cell(point['env_agent'])} | {cell(point['env_agent_ratio'], '.2f')} |")
    lines += ["", *result["notes"]]
    return "\n".join(lines)


def _ratios(arm: list[float], reference: list[float]) -> list[float]:
    """Window by window (each pair measured one after the other)."""
    return [a / r for a, r in zip(arm, reference, strict=True)]


def _spread(values: list[float]) -> dict[str, float]:
    return median_spread(values) | {"runs": values}


def main(argv: list[str]) -> int:
    args = _parse(argv)
    machine_info = machine()  # the commit and the load before the run, not after it
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    workdir = Path(tempfile.mkdtemp(prefix="sao-bench-endpoint-"))
    policy_dir = save_policy(build_policy(seed=0), workdir / "policy", build_tokenizer())
    print("both arms on one engine, in a fresh process ...", file=sys.stderr)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = pool.submit(measure, str(policy_dir), args.concurrency, args.window_s, args.repeats,
                           args.engine_cpus).result()
    levels = {}
    for c in args.concurrency:
        levels[str(c)] = {name: _spread(runs[name][c]) for name in runs} | {
            "ratio": _spread(_ratios(runs["endpoint"][c], runs["direct"][c])),
            "env_agent_ratio": _spread(_ratios(runs["env_agent"][c], runs["loop"][c]))}
    misses = [c for c in (16, 64) if str(c) in levels and levels[str(c)]["ratio"]["median"] < TARGET_RATIO]
    measured = [c for c in (16, 64) if str(c) in levels]
    notes = ([f"**Target missed** at concurrency {', '.join(map(str, misses))}: endpoint/direct = "
              + ", ".join(f"{levels[str(c)]['ratio']['median']:.2f}" for c in misses) + "."] if misses else
             [f"Target met at {', '.join(map(str, measured))}."] if measured else
             ["Concurrency 16 and 64 not measured (the target is judged there)."])
    command = "sao bench endpoint" + (" " + " ".join(argv) if argv else "")
    result = {"machine": machine_info, "command": command, "concurrency": args.concurrency, "window_s": args.window_s,
              "repeats": args.repeats, "levels": levels,
              "engine_cpus": list(args.engine_cpus) if args.engine_cpus is not None else None, "target_ratio": TARGET_RATIO, "notes": notes}
    publish("endpoint", result, _markdown(result), out=args.out_json, results_md=args.results_md, quick=args.quick,
            default_json=DEFAULT_JSON, default_results=DEFAULT_RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
