"""Benchmark: the SAO update against its arithmetic floor.

    sao bench update [--batch 128] [--max-tokens 64] [--repeats 5] [--threads 1]
                     [--budgets 2048,4096,8192] [--sweep-threads 1,2] [--quick]

The update is :meth:`sao.train.step.Learner.update` at the run config's defaults (the demo's algorithm
section: SAO, K critic updates, the token budget that forms micro-batches), on one batch of the peer
single-turn shape: ``--batch`` math_tool prompts rendered by the chat template (groups of 8 per task)
with completions of 8 to ``--max-tokens`` tokens (uniform, fixed seed; random ids of the vocabulary
outside the special tokens), recorded log-probabilities equal to the policy's own (so DIS keeps every
token, as on fresh rollouts). The model is the tiny Qwen3-MoE policy and its critic (:class:`Critic`,
default freezing), fp32 on ``--threads`` torch threads (the trainer's default is one).

The floor is the same models' forward and backward passes on the same tokens, timed alone, with
nothing of the update around them:

* actor: the decoder over each micro-batch, the output layer at the positions that score completion
  tokens, the backward of the sum of the sampled tokens' log-probabilities;
* one critic forward without gradients (the values GAE needs);
* K times the critic's forward and the backward of a squared error at the action positions.

It is measured twice, on the micro-batches the update forms (``split_by_token_budget``: rows padded to
the longest of their bucket) and on the same sequences packed several to a row (first-fit decreasing
into rows twice as wide as the longest, each sequence its own block of a block-diagonal causal mask
through its position ids); the floor of a repeat is the faster of the two. On the padded micro-batches
the passes run the decoders' last layer at the positions read only, as the update does
(:func:`sao.models.trimmed.decoder_at`); packed rows have no such positions apart, so they run it
everywhere. Optimiser steps, clipping, advantages, DIS and the losses' bookkeeping are not in the
floor: they are the update's own cost.

The update and the floor run alternately (update, floor, update, floor, ...), after one warm-up of
each; the ratio of each pair is the update's time over the floor's, and the figure is the median of
``--repeats`` pairs with min and max. Target: at most 1.3.

The update runs its passes one after the other for that comparison (``critic_beside_actor`` off, as on
one core); where the machine has a core more than the torch threads, the update with its later critic
steps beside the actor step (``critic_beside_actor``, off by default) is timed in the same repeats on a copy of the models,
and reported beside it. So is the same update with its decoders' last layers run at every position
(:func:`sao.models.trimmed.whole_forward`: the whole forward, as the trainer ran before it ran them at the
positions read only), on a copy of the models.

Then the update alone at each of ``--budgets`` (and the default token budgets) on each of
``--sweep-threads`` torch threads, round-robin after a warm-up round (:func:`sweep_budgets`): what the
default token budgets (``UpdateConfig.micro_batch_tokens``: one for one thread, one for more) are
chosen from.

Writes ``docs/results/update.json`` and the ``update`` section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, median_spread, publish

TARGET_RATIO = 1.3
DEFAULT_JSON, DEFAULT_RESULTS = Path("docs/results/update.json"), Path("docs/RESULTS.md")
GROUP = 8  # completions per prompt, as the peer benchmark's GRPO groups


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench update", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="trajectories in the batch")
    parser.add_argument("--max-tokens", type=int, default=64, help="longest completion")
    parser.add_argument("--repeats", type=int, default=5, help="update/floor pairs measured")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the trainer's default, TrainConfig.torch_threads)")
    parser.add_argument("--budgets", default="2048,4096,8192",
                        help="token budgets the update is also timed at (the default's is added), comma-separated")
    parser.add_argument("--sweep-threads", default="1,2", help="torch thread counts of that sweep, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run for the tests (16 rows, 2 repeats)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--results-md", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.max_tokens, args.repeats = 16, 16, 2
    if args.batch < 1 or args.max_tokens < 8 or args.repeats < 1:
        parser.error("--batch and --repeats must be >= 1 and --max-tokens >= 8")
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
        args.sweep_threads = sorted({int(t) for t in args.sweep_threads.split(",") if t.strip()})
    except ValueError:
        parser.error("--budgets and --sweep-threads take comma-separated integers")
    if any(b < 1 for b in args.budgets) or any(t < 1 for t in args.sweep_threads):
        parser.error("--budgets and --sweep-threads must be >= 1")
    return args


def make_rows(batch: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """``batch`` trajectory rows as the lake stores them: math_tool prompts, random completions."""
    from sao.envs.math_tool import MathToolConfig, MathToolEnv, generate_tasks
    from sao.models.chat import prompt_ids
    from sao.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    rng = random.Random(seed)
    config = MathToolConfig(seed=seed, num_train=max(1, -(-batch // GROUP)), num_heldout=1, max_tool_calls=0)
    tasks = [t for t in generate_tasks(config) if t.split == "train"]
    env = MathToolEnv(config)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    rows = []
    for i in range(batch):
        task = tasks[i // GROUP]
        length = rng.randint(8, max_tokens)
        rows.append({
            "trajectory_id": f"t{i}", "task_id": task.task_id, "prompt_ids": prompt_ids(tokenizer, env.reset(task)),
            "completion_ids": [rng.choice(ordinary) for _ in range(length)], "action_mask": [True] * length,
            "logprobs": [0.0] * length, "logprob_kind": "sampling", "reward": float(rng.random() < 0.5),
            "termination_reason": "length" if length == max_tokens else "stop", "min_policy_version": 0,
            "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}})
    return rows


def _packed(mb, width: int):
    """``(input_ids (R, W), position_ids (R, W), starts (B,))``: the micro-batch's sequences first-fit
    decreasing into rows of ``width`` tokens; ``starts`` is each sequence's first token in the flattened
    rows. Each row's unused tail continues its own positions (a block of its own)."""
    import torch

    lengths = (mb.prompt_lens + mb.completion_lens).tolist()
    free: list[int] = []  # tokens used per packed row
    starts = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, used in enumerate(free) if used + lengths[i] <= width), None)
        if row is None:
            free.append(0)
            row = len(free) - 1
        starts[i] = row * width + free[row]
        free[row] += lengths[i]
    ids = torch.zeros(len(free) * width, dtype=torch.long)
    positions = torch.arange(len(free) * width) % width
    for i, n in enumerate(lengths):
        ids[starts[i]: starts[i] + n] = mb.input_ids[i, :n]
        positions[starts[i]: starts[i] + n] = torch.arange(n)
    return ids.view(len(free), width), positions.view(len(free), width), torch.tensor(starts)


class Floor:
    """The floor's passes (see the module docstring) on fixed micro-batches, padded or packed."""

    def __init__(self, policy, critic, micro_batches, critic_updates: int, packed: bool) -> None:
        from sao.train.batch import completion_positions
        from sao.train.step import forward_mask

        self.policy, self.critic, self.k = policy, critic, critic_updates
        self.inputs = []
        for mb in micro_batches:
            positions = completion_positions(mb)
            targets = mb.input_ids.gather(1, (positions + 1).clamp(max=mb.input_ids.shape[1] - 1))
            if packed:
                width = 2 * int((mb.prompt_lens + mb.completion_lens).max())
                ids, position_ids, starts = _packed(mb, width)
                # the scoring positions in the flattened rows (padding places, masked, clamped into range)
                flat = (starts.unsqueeze(-1) + positions).clamp(max=ids.numel() - 1)
                self.inputs.append(({"input_ids": ids, "position_ids": position_ids}, flat, targets, mb.action_mask))
            else:
                # the mask the update's forwards pass (None for these right-padded rows), so both run one kernel
                # path; the positions read, where the last layers run
                self.inputs.append(({"input_ids": mb.input_ids, "attention_mask": forward_mask(mb)}, positions,
                                    targets, mb.action_mask))
        self.packed = packed
        self.tokens = sum(int(kwargs["input_ids"].numel()) for kwargs, *_ in self.inputs)

    def actor(self) -> None:
        import torch

        from sao.models.trimmed import decoder_at, supports_decoder_at

        decoder, head = self.policy.get_decoder(), self.policy.get_output_embeddings()
        trimmed = not self.packed and supports_decoder_at(decoder)
        for kwargs, at, targets, mask in self.inputs:
            if trimmed and kwargs["attention_mask"] is None:
                scoring = decoder_at(decoder, kwargs["input_ids"], at)  # (B, T, H)
            else:
                hidden = decoder(**kwargs, use_cache=False).last_hidden_state
                scoring = self._read(hidden, at)
            logp = torch.log_softmax(head(scoring).float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            (logp * mask).sum().backward()

    def critic_forward(self, grad: bool) -> None:
        import torch

        for kwargs, at, _, mask in self.inputs:
            with torch.set_grad_enabled(grad):
                if not self.packed and kwargs["attention_mask"] is None:
                    values = self.critic.values_at(kwargs["input_ids"], at)  # the last layer where read only
                else:
                    values = self._read(self.critic(**kwargs).unsqueeze(-1), at).squeeze(-1)
            if grad:
                (((values - 0.5) ** 2) * mask).sum().backward()

    def _read(self, out, at):
        """``out`` (rows, width, C) at the positions read ``at``: (B, T) per row of a padded micro-batch,
        flat indices into the packed rows' places."""
        if self.packed:
            return out.reshape(-1, out.shape[-1])[at]
        return out.gather(1, at.unsqueeze(-1).expand(-1, -1, out.shape[-1]))

    def run(self) -> dict[str, float]:
        """One pass of everything, timed by part (seconds)."""
        parts = {}
        started = time.perf_counter()
        self.actor()
        parts["actor_s"] = time.perf_counter() - started
        started = time.perf_counter()
        self.critic_forward(grad=False)
        parts["critic_forward_s"] = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(self.k):
            self.critic_forward(grad=True)
        parts["critic_updates_s"] = time.perf_counter() - started
        for module in (self.policy, self.critic):
            module.zero_grad(set_to_none=True)
        parts["total_s"] = sum(parts.values())
        return parts


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks._settings import bench_config
    from sao.models.critic import Critic
    from sao.models.policy import build_policy
    from sao.models.trimmed import whole_forward
    from sao.train.batch import collate, split_by_token_budget
    from sao.train.config import TrainConfig
    from sao.train.step import Learner, policy_logprobs

    threads = args.threads or TrainConfig.__dataclass_fields__["torch_threads"].default
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    run_config = bench_config()
    config = run_config.update()
    rows = make_rows(args.batch, args.max_tokens, args.seed)
    policy = build_policy(seed=args.seed)
    with torch.no_grad():  # the rollout's log-probabilities: the policy's own
        logp = policy_logprobs(policy, collate(rows, trainer_version=0))
    for b, row in enumerate(rows):
        row["logprobs"] = logp[b, : len(row["completion_ids"])].tolist()
    batch = collate(rows, trainer_version=0, bootstrap_reasons=config.bootstrap_reasons)
    critic = Critic.from_policy(policy)
    # against the floor, the update runs its passes one after the other on the floor's threads; with the
    # later critic steps beside the actor step (an option, off by default) it is timed apart
    beside = None
    if torch.get_num_threads() < len(os.sched_getaffinity(0)):
        beside = Learner(dataclasses.replace(config, critic_beside_actor=True), copy.deepcopy(policy),
                         copy.deepcopy(critic))
    config = dataclasses.replace(config, critic_beside_actor=False)
    whole = Learner(config, copy.deepcopy(policy), copy.deepcopy(critic))  # run under whole_forward()
    learner = Learner(config, policy, critic)
    budget = config.micro_batch_tokens(threads)
    micro = [batch.select(r) for r in split_by_token_budget(batch, budget)]
    floor_models = (copy.deepcopy(policy), copy.deepcopy(critic))
    floors = {name: Floor(*floor_models, micro, config.critic_updates, packed=name == "packed")
              for name in ("padded", "packed")}
    for warm in (learner, beside):
        if warm is not None:
            warm.update(batch)
    with whole_forward():
        whole.update(batch)
    for floor in floors.values():
        floor.run()
    pairs = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        metrics = learner.update(batch)
        update_s = time.perf_counter() - started
        beside_s = None
        if beside is not None:
            started = time.perf_counter()
            beside.update(batch)
            beside_s = time.perf_counter() - started
        with whole_forward():
            started = time.perf_counter()
            whole.update(batch)
            whole_s = time.perf_counter() - started
        timed = {name: floor.run() for name, floor in floors.items()}
        best = min(timed, key=lambda name: timed[name]["total_s"])
        strict = timed[best]["total_s"] - timed[best]["critic_forward_s"]
        pairs.append({"update_s": update_s, "update_beside_s": beside_s, "update_whole_s": whole_s, "update_actor_s": metrics["time/actor_s"],
                      "update_critic_s": metrics["time/critic_s"], "floor": timed, "floor_used": best,
                      "ratio": update_s / timed[best]["total_s"], "strict_ratio": update_s / strict})
        print(f"repeat {repeat + 1}/{args.repeats}: update {update_s:.3f} s, floor {timed[best]['total_s']:.3f} s "
              f"({best}), ratio {pairs[-1]['ratio']:.3f}", file=sys.stderr)
    real = int(batch.attention_mask.sum())
    defaults = {config.micro_batch_tokens(t) for t in args.sweep_threads}
    sweep = sweep_budgets(learner, batch, sorted(set(args.budgets) | defaults), args.sweep_threads, args.repeats)
    torch.set_num_threads(threads)
    return {
        "pairs": pairs, "budget_sweep": sweep, "threads": threads, "batch": args.batch, "max_tokens": args.max_tokens,
        "critic_updates": config.critic_updates, "token_budget": budget, "algorithm": config.algorithm.value,
        "tokens": {"real": real, "action": int(batch.action_mask.sum()),
                   "update_micro_batches": sum(int(mb.input_ids.numel()) for mb in micro),
                   **{f"floor_{name}": floor.tokens for name, floor in floors.items()}},
        "micro_batches": [list(mb.input_ids.shape) for mb in micro],
    }


def sweep_budgets(learner, batch, budgets: list[int], thread_counts: list[int], repeats: int) -> list[dict[str, Any]]:
    """The update's seconds at each token budget and torch thread count: ``repeats`` rounds, each timing every
    (threads, budget) once after one warm-up round; the default budget's time at the same thread count
    (``UpdateConfig.micro_batch_tokens``) in the same round is the reference of each ratio. The learner's
    config is restored afterwards."""
    import torch

    from sao.train.batch import split_by_token_budget

    default = learner.config
    cells = [(t, b) for t in thread_counts for b in budgets]
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    try:
        for round_ in range(repeats + 1):
            for t, b in cells:
                torch.set_num_threads(t)
                learner.config = dataclasses.replace(default, token_budget=b)
                started = time.perf_counter()
                learner.update(batch)
                if round_:  # the first round warms each cell up
                    times[(t, b)].append(time.perf_counter() - started)
            if round_:
                print(f"budget sweep round {round_}/{repeats}: "
                      + ", ".join(f"{t}t/{b}: {times[(t, b)][-1]:.3f} s" for t, b in cells), file=sys.stderr)
    finally:
        learner.config = default
    lengths = batch.prompt_lens + batch.completion_lens
    rows = []
    for t, b in cells:
        groups = split_by_token_budget(batch, b)
        chosen = default.micro_batch_tokens(t)
        reference = times[(t, chosen)]
        rows.append({"threads": t, "token_budget": b, "default": b == chosen,
                     "micro_batches": len(groups), "token_places": sum(len(g) * int(lengths[g].max()) for g in groups),
                     "update_s": times[(t, b)],
                     "vs_default": [x / r for x, r in zip(times[(t, b)], reference, strict=True)]})
    return rows


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    pairs = result["pairs"]
    spread = lambda values: median_spread(values) | {"runs": values}  # noqa: E731
    floor_parts = ("actor_s", "critic_forward_s", "critic_updates_s", "total_s")
    return {
        "ratio": spread([p["ratio"] for p in pairs]),
        "strict_ratio": spread([p["strict_ratio"] for p in pairs]),
        "update_s": spread([p["update_s"] for p in pairs]),
        "update_actor_s": spread([p["update_actor_s"] for p in pairs]),
        "update_critic_s": spread([p["update_critic_s"] for p in pairs]),
        "floor_s": {part: spread([p["floor"][p["floor_used"]][part] for p in pairs]) for part in floor_parts},
        "floor_padded_s": spread([p["floor"]["padded"]["total_s"] for p in pairs]),
        "floor_packed_s": spread([p["floor"]["packed"]["total_s"] for p in pairs]),
        "update_whole_s": spread([p["update_whole_s"] for p in pairs]),
        "update_vs_whole": spread([p["update_s"] / p["update_whole_s"] for p in pairs]),
        "update_beside_s": spread([p["update_beside_s"] for p in pairs]) if pairs[0]["update_beside_s"] else None,
        "beside_vs_update": (spread([p["update_beside_s"] / p["update_s"] for p in pairs])
                             if pairs[0]["update_beside_s"] else None),
        "budget_sweep": [{key: row[key] for key in ("threads", "token_budget", "default")}
                         | {"update_s": median_spread(row["update_s"]), "vs_default": median_spread(row["vs_default"])}
                         for row in result["budget_sweep"]],
    }


def _markdown(result: dict[str, Any]) -> str:
    s, tokens = result["summary"], result["tokens"]

    def cell(spread: dict[str, float], digits: str = ".3f") -> str:
        return f"{spread['median']:{digits}} ({spread['min']:{digits}}-{spread['max']:{digits}})"

    met = s["ratio"]["median"] <= TARGET_RATIO
    floor = s["floor_s"]
    rest = s["update_s"]["median"] - floor["actor_s"]["median"] - floor["critic_updates_s"]["median"]
    return "\n".join([
        "## The SAO update against its arithmetic floor (`sao bench update`)",
        "",
        f"Command: `{result['command']}`. {machine_line(result['machine'])} Raw data: `{DEFAULT_JSON}`.",
        "",
        f"One batch of the peer single-turn shape: {result['batch']} trajectories, math_tool prompts in groups of "
        f"{GROUP}, with completions of 8-{result['max_tokens']} tokens, {tokens['real']:,} tokens of which {tokens['action']:,} "
        f"actions; the tiny Qwen3-MoE policy and its critic, fp32, {result['threads']} torch thread(s); the run "
        f"config's algorithm section ({result['algorithm']}, K={result['critic_updates']}, token budget "
        f"{result['token_budget']:,}: micro-batches {', '.join('x'.join(map(str, m)) for m in result['micro_batches'])}). "
        "The floor is the same models' forward and backward passes alone (actor; one critic forward; K critic "
        "forward and backward passes), on the update's own micro-batches and on the sequences packed into rows "
        "twice the longest; the faster counts (`benchmarks/update_floor.py` says exactly what each pass does). "
        f"Update and floor alternate; median of {len(result['pairs'])} pairs (min-max).",
        "",
        "| | seconds |",
        "|---|---:|",
        f"| `Learner.update` | {cell(s['update_s'])} |",
        f"| of which the actor step | {cell(s['update_actor_s'])} |",
        f"| of which the critic's steps (the first one's forward also gives GAE its values) | {cell(s['update_critic_s'])} |",
        f"| floor | {cell(floor['total_s'])} |",
        f"| floor: actor forward and backward | {cell(floor['actor_s'])} |",
        f"| floor: one critic forward | {cell(floor['critic_forward_s'])} |",
        f"| floor: K critic forward and backward passes | {cell(floor['critic_updates_s'])} |",
        f"| floor on the update's micro-batches ({tokens['floor_padded']:,} token places) | {cell(s['floor_padded_s'])} |",
        f"| floor packed ({tokens['floor_packed']:,} token places) | {cell(s['floor_packed_s'])} |",
        "",
        "| target | measured | met |",
        "|---|---:|---|",
        f"| update / floor <= {TARGET_RATIO} | {cell(s['ratio'], '.2f')} | {'yes' if met else '**NO**'} |",
        "",
        "The update takes GAE's values from its first critic step's forward, so it runs one critic forward "
        "fewer than the floor counts. Against the strict floor, the passes the update itself runs (actor, K "
        f"critic forward and backward passes), it takes {cell(s['strict_ratio'], '.2f')}x; its own cost beyond "
        "them (optimiser steps, gradient clipping, advantages, DIS, the losses, the metrics) is "
        f"{rest:.3f} s at the medians.",
        "",
        "With its decoders' last layers run at every position (the whole forward, "
        "`sao.models.trimmed.whole_forward`; the trainer runs them at the positions read only), the same update "
        f"took {cell(s['update_whole_s'])} s, timed in the same repeats on its own copy of the models: the update "
        f"above takes {cell(s['update_vs_whole'], '.2f')} of that time.",
        "",
        *([f"With its later critic steps on a second thread beside the actor step (`critic_beside_actor`, "
           f"off by default; here on a core the update above leaves idle), the same update took {cell(s['update_beside_s'])} s, "
           f"{cell(s['beside_vs_update'], '.2f')} of its time one step after the other, timed in the same "
           "repeats on its own copy of the models. That uses a second core, which the floor does not, so "
           "it is not the figure held against the floor; in a run the replicas share that core.", ""]
          if s["update_beside_s"] else []),
        "The same update at other token budgets (the most rows x padded length in one micro-batch, "
        "`UpdateConfig.token_budget`) and torch thread counts (1: the trainer's default in an asynchronous run; "
        "every core: its default in a synchronous one), timed round-robin in the same process, median of "
        f"{len(result['pairs'])} rounds (min-max); the ratio is to the default budget's time at the same thread count in the same round:",
        "",
        "| torch threads | token budget | micro-batches | token places | update s | vs default |",
        "|---:|---:|---:|---:|---:|---:|",
        *(f"| {row['threads']} | {row['token_budget']:,}{' (default)' if row['default'] else ''} | "
          f"{row['micro_batches']} | {row['token_places']:,} | {cell(summary['update_s'])} | "
          f"{cell(summary['vs_default'], '.2f')} |"
          for row, summary in zip(result["budget_sweep"], s["budget_sweep"], strict=True)),
    ])


def main(argv: list[str]) -> int:
    args = _parse(argv)
    info = machine()  # the load at the start
    result = measure(args)
    result |= {"command": "sao bench update" + (" " + " ".join(argv) if argv else ""), "machine": info,
               "target_ratio": TARGET_RATIO}
    result["summary"] = summarise(result)
    publish("update", result, _markdown(result), out=args.out, results_md=args.results_md, quick=args.quick,
            default_json=DEFAULT_JSON, default_results=DEFAULT_RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
