"""Torch-engine behaviour beyond the shared contract (``test_engine_contract.py`` runs that on every engine)."""

from sao.rollout.engine import SamplingParams
from tests.rollout.conftest import tiny_policy
from tests.rollout.test_engine_contract import PROMPTS


def test_weights_queued_without_a_pause_apply_at_the_next_decode_step(engine):
    sampling = SamplingParams(max_tokens=40)
    futures = [engine.submit(p, sampling.replace(seed=i)) for i, p in enumerate(PROMPTS)]
    engine.load_weights(7, tiny_policy(seed=2).state_dict())
    results = [f.result(timeout=60) for f in futures]
    assert all(len(r.token_ids) == 40 for r in results)
    assert all(r.spans[-1].version == 7 for r in results)
    assert all(r.spans[0].start == 0 and r.spans[-1].end == 40 for r in results)
