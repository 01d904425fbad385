"""The sampling distribution: hand-worked values and agreement with transformers' logits warpers."""

import math
import subprocess
import sys

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sao.algos.sampling import check_sampling, sampling_logprobs, token_logprobs

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))


def probs(**kw):
    return sampling_logprobs(LOGITS, **kw).exp().tolist()


def test_hand_worked_filters():
    assert probs() == pytest.approx([0.5, 0.3, 0.2])
    assert probs(top_k=2) == pytest.approx([0.625, 0.375, 0.0])
    assert probs(top_p=0.6) == pytest.approx([0.625, 0.375, 0.0])  # mass before token 2 is 0.8
    assert probs(top_p=0.5) == pytest.approx([1.0, 0.0, 0.0])  # mass before token 1 is 0.5, not < 0.5
    assert probs(top_k=1) == pytest.approx([1.0, 0.0, 0.0])
    z = sum(math.sqrt(p) for p in (0.5, 0.3, 0.2))
    assert probs(temperature=2.0) == pytest.approx([math.sqrt(p) / z for p in (0.5, 0.3, 0.2)])


def test_filtered_tokens_are_minus_inf():
    logp = sampling_logprobs(LOGITS, top_k=1)
    assert logp[1] == float("-inf") and logp[2] == float("-inf")


def test_per_row_settings_equal_one_call_per_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    temperature = torch.tensor([0.7, 1.0, 1.3, 2.0])
    top_k = torch.tensor([0, 5, 20, 1])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3])
    batched = sampling_logprobs(logits, temperature, top_k, top_p)
    for i in range(4):
        single = sampling_logprobs(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
        assert torch.equal(batched[i], single)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 0, 0.9), (1.3, 20, 1.0), (1.0, 10, 0.8), (0.5, 3, 0.95)])
def test_agrees_with_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=gen, dtype=torch.float64)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.log_softmax(scores, dim=-1)
    ours = sampling_logprobs(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(ours[finite], expected[finite], atol=1e-12)


def test_token_logprobs_raw_and_sampling():
    tokens = torch.tensor([1])
    logits = LOGITS.unsqueeze(0)
    assert float(token_logprobs(logits, tokens, "raw", temperature=2.0)) == pytest.approx(math.log(0.3))
    assert float(token_logprobs(logits, tokens, "sampling", top_k=2)) == pytest.approx(math.log(0.375))


@pytest.mark.parametrize(("kw", "field"), [({"temperature": 0.0}, "temperature"), ({"top_k": -1}, "top_k"),
                                           ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_check_sampling_names_the_setting(kw, field):
    args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} | kw
    with pytest.raises(ValueError, match=field):
        check_sampling(**args)


def test_the_logprob_kind_is_the_lakes_and_the_core_loads_no_storage():
    """One ``LogprobKind`` (the lake's vocabulary); importing the core pulls in no pyarrow or Delta."""
    import schemas.trajectories
    from sao.algos.sampling import LogprobKind

    assert LogprobKind is schemas.trajectories.LogprobKind
    code = ("import sys, sao.algos.sampling; "
            "print(sorted(m for m in ('pyarrow', 'deltalake', 'ray', 'prefect') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
