"""R3 end to end: what the torch engine records is what the trainer replays.

The engine's copy of the policy selects experts with "selection noise" (``tests/models/test_routing.py``:
what flips routing between an engine and a trainer holding the same weights), so its recorded routing
and log-probabilities differ from what the trainer's clean copy would compute live. With replay the
trainer reproduces the engine's log-probabilities to fp32 kernel precision; without it, it does not.
This checks the engine's alignment of the routing record (prompt, then every sampled token but the last,
across continuous batching and joins) against the trainer's layout of the same tokens.
"""

import torch

from sao.lake.records import routing_entries
from sao.models.policy import PolicyConfig, build_policy
from sao.models.routing import replay_routing
from sao.rollout.engine import SamplingParams
from sao.rollout.torch_engine import TorchEngine
from sao.train.batch import collate
from sao.train.step import policy_logprobs
from tests.models.test_routing import selection_noise

PROMPTS = [[5, 17, 300, 2], list(range(40, 61)), [7, 8], list(range(100, 133))]


def test_the_trainer_replays_the_engines_routing_record_to_its_logprobs():
    engine_policy = build_policy(PolicyConfig(), seed=0)
    trainer_policy = build_policy(PolicyConfig(), seed=0).eval()
    with selection_noise(engine_policy, 0.05):
        engine = TorchEngine(engine_policy)
        try:  # submitted together: they share decode steps, and the short ones leave while others run
            futures = [engine.submit(p, SamplingParams(max_tokens=12 + 9 * i, seed=i)) for i, p in enumerate(PROMPTS)]
            generations = [f.result(timeout=120) for f in futures]
        finally:
            engine.close()
    rows = []
    for i, (prompt, gen) in enumerate(zip(PROMPTS, generations, strict=True)):
        n = len(gen.token_ids)
        assert gen.routed_experts.shape == (len(prompt) + n - 1, 2, 2)  # every input token, 2 MoE layers, top-2
        rows.append({"trajectory_id": f"t{i}", "task_id": f"t{i}", "prompt_ids": prompt,
                     "completion_ids": list(gen.token_ids), "action_mask": [1] * n, "logprobs": list(gen.logprobs),
                     "reward": 0.0, "termination_reason": "length", "min_policy_version": 0,
                     "logprob_kind": "sampling", "sampling": {"temperature": 1.0, "top_k": None, "top_p": 1.0},
                     "routed_experts": routing_entries(gen.routed_experts.numpy()), "router_top_k": 2})
    batch = collate(rows, trainer_version=0)
    with torch.no_grad():
        with replay_routing(trainer_policy, batch.routed_experts, batch.routing_mask) as stats:
            replayed = policy_logprobs(trainer_policy, batch)
        live = policy_logprobs(trainer_policy, batch)
    actions = batch.action_mask
    assert stats.disagree.sum() > 0, "the selection noise must flip some recorded routing"
    replay_gap = (replayed - batch.logp_rollout)[actions].abs().max().item()
    live_gap = (live - batch.logp_rollout)[actions].abs().max().item()
    assert replay_gap <= 1e-5, f"replayed log-probabilities differ from the engine's by {replay_gap:.3g}"
    assert live_gap > 1e-4, f"live routing should differ from the engine's record, got {live_gap:.3g}"
