"""Areas under accuracy curves and paired bootstrap intervals (``benchmarks.stats``), golden
values worked by hand."""

import numpy as np
import pytest

from benchmarks.stats import (
    area_weights,
    decode_rewards,
    encode_rewards,
    paired_bootstrap,
    point_weights,
    two_sample_bootstrap,
)


def test_point_weights_interpolate_between_knots_and_hold_after_the_last():
    assert point_weights([0, 10, 20], 5).tolist() == [0.5, 0.5, 0.0]
    assert point_weights([0, 10, 20], 10).tolist() == [0.0, 1.0, 0.0]
    assert point_weights([0, 10, 20], 25).tolist() == [0.0, 0.0, 1.0]
    assert point_weights([0, 10, 10, 20], 10).tolist() == [0.0, 0.0, 1.0, 0.0]  # a repeated x: the later knot


def test_area_weights_are_the_mean_of_the_lines_over_the_horizon():
    # a0 -> a1 over [0, 10], then a1 held over [10, 20]: 5 a0 + 15 a1, over 20
    assert area_weights([0, 10], 20) == pytest.approx([0.25, 0.75])
    # [0, 10]: 5 a0 + 5 a1; [10, 15]: 5 x (a1 + (a1 + a2) / 2) / 2 = 3.75 a1 + 1.25 a2; over 15
    assert area_weights([0, 10, 20], 15) == pytest.approx([5 / 15, 8.75 / 15, 1.25 / 15])
    # a flat curve's mean is its value, whatever the knots
    assert area_weights([0, 3, 3, 7.5, 40], 33).sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="start at 0"):
        area_weights([1, 2], 3)
    with pytest.raises(ValueError, match="horizon"):
        area_weights([0, 2], 0)


def test_the_paired_bootstrap_interval_holds_the_mean_and_collapses_on_constant_differences():
    constant = paired_bootstrap([np.full(50, 0.2), np.full(70, 0.2)], samples=300)
    assert constant["mean"] == pytest.approx(0.2) and constant["low"] == pytest.approx(0.2)
    assert constant["high"] == pytest.approx(0.2) and constant["seeds"] == 2
    rng = np.random.default_rng(1)
    noisy = [rng.choice([-1.0, 0.0, 1.0], size=400) + 0.1 for _ in range(3)]
    result = paired_bootstrap(noisy, samples=1000)
    assert result["low"] < result["mean"] < result["high"]
    assert result["mean"] == pytest.approx(np.mean([d.mean() for d in noisy]))
    # the interval is about two standard errors wide each side (tasks and seeds resampled)
    assert 0.03 < result["high"] - result["mean"] < 0.15
    with pytest.raises(ValueError, match="no seeds"):
        paired_bootstrap([])


def test_rewards_round_trip_compactly():
    assert encode_rewards([1.0, 0.0, 0.0, 1.0]) == "1001"
    assert decode_rewards("1001").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert encode_rewards([0.5, 1.0]) == [0.5, 1.0]
    assert decode_rewards([0.5, 1.0]).tolist() == [0.5, 1.0]


def test_the_two_sample_bootstrap_compares_unpaired_samples_seed_by_seed():
    pairs = [(np.array([1.0, 1.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.0])), (np.full(5, 0.5), np.full(9, 0.25))]
    result = two_sample_bootstrap(pairs, samples=500)
    assert result["per_seed"] == [0.5, 0.25] and result["mean"] == pytest.approx(0.375)
    assert result["low"] < 0.375 < result["high"] and result["high"] <= 1.0
    constant = two_sample_bootstrap([(np.full(4, 0.7), np.full(6, 0.2))], samples=100)
    assert constant["low"] == pytest.approx(0.5) and constant["high"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no values"):
        two_sample_bootstrap([(np.array([]), np.array([1.0]))])
