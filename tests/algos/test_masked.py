"""Masked reductions and the two denominator modes."""

import pytest
import torch

from sao.algos.masked import LossAggregation, aggregate, masked_mean, masked_sum, masked_whiten

NAN = float("nan")


def test_masked_sum_and_mean_ignore_masked_entries_even_nan():
    values = torch.tensor([[1.0, NAN, 3.0], [4.0, 5.0, NAN]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    assert float(masked_sum(values, mask)) == 9.0
    assert float(masked_mean(values, mask)) == 3.0
    assert masked_mean(values, mask, dim=-1).tolist() == [2.0, 5.0]


def test_masked_mean_of_nothing_is_zero_not_nan():
    assert float(masked_mean(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))) == 0.0


def test_masked_whiten():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = masked_whiten(values, mask)
    # mean 2, population variance 2/3 -> (x - 2) / sqrt(2/3); masked entry -> 0.
    scale = (2 / 3) ** 0.5
    assert out.tolist()[0] == pytest.approx([-1 / scale, 0.0, 1 / scale, 0.0], rel=1e-6)
    kept_mean = masked_whiten(values, mask, shift_mean=False)
    assert float(masked_mean(kept_mean, mask)) == pytest.approx(2.0)
    # One entry: nothing to scale by, only centred.
    assert masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]], dtype=torch.bool)).tolist() == [[0.0, 0.0]]


def test_token_and_sequence_modes_hand_worked():
    per_token = torch.tensor([[1.0, 3.0, 0.0], [6.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # token: (1 + 3 + 6) / 3 tokens; sequence: mean(2, 6) = 4.
    assert float(aggregate(per_token, mask, LossAggregation.TOKEN)) == pytest.approx(10 / 3)
    assert float(aggregate(per_token, mask, "sequence")) == 4.0


def test_explicit_denominator_makes_micro_batches_add_up():
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) < 0.7
    for mode, count in (("token", float(mask.sum())), ("sequence", 6.0)):
        whole = aggregate(per_token, mask, mode)
        parts = sum(aggregate(per_token[i:i + 2], mask[i:i + 2], mode, denominator=count) for i in (0, 2, 4))
        assert float(parts) == pytest.approx(float(whole), abs=1e-12)


def test_empty_batch_gives_zero_with_a_gradient_path():
    x = torch.ones(2, 3, requires_grad=True)
    loss = aggregate(x * 2, torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert float(loss) == 0.0 and x.grad.abs().sum() == 0


def test_errors():
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="denominator must be positive"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), denominator=0)
    with pytest.raises(ValueError, match="'mean' is not a valid LossAggregation"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "mean")
