"""Torch-engine behaviour beyond the shared contract (``test_engine_contract.py`` runs that on every engine)."""

import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from sao.models.routing import record_routing
from sao.rollout.engine import SamplingParams
from sao.rollout.torch_engine import TorchEngine, TorchEngineConfig
from tests.rollout.conftest import tiny_policy
from tests.rollout.test_engine_contract import PROMPTS, recompute, wait_for_progress


def test_weights_queued_without_a_pause_apply_at_the_next_decode_step(engine):
    sampling = SamplingParams(max_tokens=40)
    futures = [engine.submit(p, sampling.replace(seed=i)) for i, p in enumerate(PROMPTS)]
    engine.load_weights(7, tiny_policy(seed=2).state_dict())
    results = [f.result(timeout=60) for f in futures]
    assert all(len(r.token_ids) == 40 for r in results)
    assert all(r.spans[-1].version == 7 for r in results)
    assert all(r.spans[0].start == 0 and r.spans[-1].end == 40 for r in results)


# Rows grouped by length (the attention itself: test_kv_cache.py) ---------------------------------


def test_rows_regrouped_by_length_keep_tokens_logprobs_and_routing(engine):
    """Requests of many lengths leave at different times, so rows are compacted and regrouped (their cache
    rows move) again and again; every request still gets the tokens it gets alone, log-probabilities equal
    to a teacher-forced recomputation and the routing of a plain forward."""
    rng = random.Random(0)
    requests = [([rng.randrange(9, 512) for _ in range(rng.randint(1, 40))], SamplingParams(max_tokens=rng.randint(4, 40), seed=i))
                for i in range(12)]
    grouped = TorchEngine(tiny_policy(), config=TorchEngineConfig(decode_kernel=False, attention_chunk=2, reorder_slack=0.0))
    try:
        together = [f.result(timeout=120) for f in [grouped.submit(p, s) for p, s in requests]]
        assert grouped.stats().reorders > 0
    finally:
        grouped.close()
    for index, ((prompt, sampling), result) in enumerate(zip(requests, together, strict=True)):
        alone = engine.generate_sync(prompt, sampling, timeout=120)
        assert result.token_ids == alone.token_ids, f"request {index}: tokens differ from the request alone"
        gap = (torch.tensor(result.logprobs) - recompute(engine.reference, prompt, result, sampling)).abs().max().item()
        assert gap <= 1e-5, f"request {index}: recorded log-probabilities differ from recomputation by {gap:.3g}"
        expected = teacher_forced_routing(engine.reference, (prompt + list(result.token_ids))[:-1])
        assert bool(same_sets(result.routed_experts, expected).all()), f"request {index}: routing differs"


# Routing record (R3) ------------------------------------------------------------------------------


def teacher_forced_routing(model, ids):
    """(len(ids), layers, top_k) expert ids of one plain forward of ``ids`` (no engine)."""
    with record_routing(model) as recorder, torch.no_grad():
        model(torch.tensor([ids]))
    return recorder.pop()


def same_sets(a, b):
    """Per token and layer, whether two routings chose the same experts (as sets)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_routing_record_covers_every_token_run_and_matches_a_plain_forward(engine):
    sampling = SamplingParams(max_tokens=12)
    futures = [engine.submit(p, sampling.replace(seed=i)) for i, p in enumerate(PROMPTS)]  # joins, decodes, compaction
    results = [f.result(timeout=60) for f in futures]
    assert engine.records_routing
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = prompt + list(result.token_ids)
        routed = result.routed_experts
        assert routed.dtype == torch.uint8 and routed.shape == (len(ids) - 1, 2, 2)  # all but the last token
        expected = teacher_forced_routing(engine.reference, ids[:-1])
        assert bool(same_sets(routed, expected).all()), f"prompt {prompt}: routing differs from a plain forward"


def test_a_weight_update_reroutes_every_token_with_the_new_weights(engine):
    sampling = SamplingParams(max_tokens=200, seed=3)
    future = engine.submit(PROMPTS[1], sampling, request_id="r")
    new = tiny_policy(seed=2)
    wait_for_progress(engine, "r", 5)
    engine.load_weights(1, new.state_dict())
    result = future.result(timeout=60)
    assert result.spans[-1].version == 1 and len(result.spans) == 2  # the update landed mid-request
    ids = PROMPTS[1] + list(result.token_ids)
    new_routing = teacher_forced_routing(new.eval(), ids[:-1])
    old_routing = teacher_forced_routing(engine.reference, ids[:-1])
    assert bool(same_sets(result.routed_experts, new_routing).all())  # the latest forward's routing
    assert not bool(same_sets(result.routed_experts, old_routing).all())


def test_routing_record_is_optional_and_needs_an_moe_model():
    quiet = TorchEngine(tiny_policy(), config=TorchEngineConfig(record_routing=False))
    try:
        assert quiet.generate_sync([5, 6], SamplingParams(max_tokens=3, seed=0), timeout=60).routed_experts is None
    finally:
        quiet.close()
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="record_routing=True, but the model has no MoE router"):
        TorchEngine(dense, config=TorchEngineConfig(record_routing=True))


def test_routing_travels_from_the_engine_process(process_engine):
    result = process_engine.generate_sync([5, 17, 300], SamplingParams(max_tokens=5, seed=1), timeout=60)
    assert result.routed_experts.shape == (3 + len(result.token_ids) - 1, 2, 2)
