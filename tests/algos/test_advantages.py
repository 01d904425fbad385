"""Skip-observation GAE: hand-worked golden values and invariances; GRPO and running-mean baselines."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.algos.advantages import (
    RunningMeanBaseline,
    broadcast_to_actions,
    flat_groups,
    grpo_advantages,
    length_adaptive_lambda,
    skip_observation_gae,
    success_advantages,
)

NAN = float("nan")

# Two action segments (tokens 0-1 and 4-5) separated by an observation segment (2-3), then padding.
# Values at observation / padding positions are garbage on purpose: they must never be read.
ACTION = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
VALUES = torch.tensor([[0.2, 0.4, 100.0, NAN, 0.5, 0.9, -7.0]], dtype=torch.float64)


def gae(rewards, bootstrap, gamma, lam):
    return skip_observation_gae(
        torch.tensor([rewards], dtype=torch.float64), VALUES, ACTION,
        torch.tensor([bootstrap], dtype=torch.float64), gamma, lam,
    )


def close(tensor, expected):
    return torch.allclose(tensor, torch.tensor([expected], dtype=torch.float64), atol=1e-12)


def test_natural_end_hand_worked():
    # Action-only values [0.2, 0.4, 0.5, 0.9], reward 1 on the last action, gamma 1, lam 0.5, V_end 0:
    # delta = [0.2, 0.1, 0.4, 0.1]; A3 = 0.1; A2 = 0.4 + 0.5*0.1 = 0.45;
    # A1 = 0.1 + 0.5*0.45 = 0.325; A0 = 0.2 + 0.5*0.325 = 0.3625. Returns = A + V.
    adv, ret = gae([0, 0, 0, 0, 0, 1.0, 0], 0.0, gamma=1.0, lam=0.5)
    assert close(adv, [0.3625, 0.325, 0, 0, 0.45, 0.1, 0])
    assert close(ret, [0.5625, 0.725, 0, 0, 0.95, 1.0, 0])


def test_truncation_bootstraps_with_the_last_state_value():
    # Budget end, no reward, V(s_end) = 0.6: delta3 = 0.6 - 0.9 = -0.3; A2 = 0.4 + 0.5*(-0.3) = 0.25;
    # A1 = 0.1 + 0.5*0.25 = 0.225; A0 = 0.2 + 0.5*0.225 = 0.3125.
    adv, ret = gae([0] * 7, 0.6, gamma=1.0, lam=0.5)
    assert close(adv, [0.3125, 0.225, 0, 0, 0.25, -0.3, 0])
    assert close(ret, [0.5125, 0.625, 0, 0, 0.75, 0.6, 0])


def test_gamma_discounts_per_action_token_not_per_observation_token():
    # lam = 1 gives A_i = gamma^(n-1-i) * r - V_i: [0.125-0.2, 0.25-0.4, 0.5-0.5, 1-0.9].
    adv, _ = gae([0, 0, 0, 0, 0, 1.0, 0], 0.0, gamma=0.5, lam=1.0)
    assert close(adv, [-0.075, -0.15, 0, 0, 0.0, 0.1, 0])


def test_reward_on_a_non_action_token_is_an_error_not_a_silent_drop():
    with pytest.raises(ValueError, match=r"rewards has a non-zero value 1.0 at non-action position \(row 0, token 3\)"):
        gae([0, 0, 0, 1.0, 0, 0, 0], 0.0, gamma=1.0, lam=1.0)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="bootstrap_values must have shape"):
        skip_observation_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool),
                             torch.zeros(3), 1.0, 1.0)
    with pytest.raises(ValueError, match="lam must be a float or a"):
        skip_observation_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool),
                             torch.zeros(2), 1.0, torch.ones(3))
    with pytest.raises(ValueError, match="values has shape"):
        skip_observation_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool),
                             torch.zeros(2), 1.0, 1.0)


# ----- invariances (property-based) ---------------------------------------------------------------


def reference_gae(rewards, values, bootstrap, gamma, lam):
    """Ordinary GAE on one action-only sequence (slow reference, plain Python)."""
    n = len(rewards)
    advantages = [0.0] * n
    last = 0.0
    for i in reversed(range(n)):
        next_value = values[i + 1] if i + 1 < n else bootstrap
        delta = rewards[i] + gamma * next_value - values[i]
        last = delta + gamma * lam * last
        advantages[i] = last
    return advantages


finite = st.floats(-3, 3, allow_nan=False, width=64)


@st.composite
def trajectories(draw):
    """One sequence: action tokens with values and rewards, observation runs between them, padding."""
    n_actions = draw(st.integers(0, 12))
    values = draw(st.lists(finite, min_size=n_actions, max_size=n_actions))
    rewards = draw(st.lists(finite, min_size=n_actions, max_size=n_actions))
    gaps = draw(st.lists(st.integers(0, 3), min_size=n_actions + 1, max_size=n_actions + 1))
    padding = draw(st.integers(0, 3))
    return values, rewards, gaps, padding, draw(finite)


def layout(values, rewards, gaps, padding):
    """Interleave observation runs (length gaps[i]) before each action; garbage values off actions."""
    mask, vals, rews = [], [], []
    for i, (v, r) in enumerate(zip(values, rewards, strict=True)):
        mask += [False] * gaps[i] + [True]
        vals += [99.0] * gaps[i] + [v]
        rews += [0.0] * gaps[i] + [r]
    tail = gaps[len(values)] + padding
    return mask + [False] * tail, vals + [-99.0] * tail, rews + [0.0] * tail


def run_one(values, rewards, gaps, padding, bootstrap, gamma, lam):
    mask, vals, rews = layout(values, rewards, gaps, padding)
    adv, ret = skip_observation_gae(
        torch.tensor([rews], dtype=torch.float64), torch.tensor([vals], dtype=torch.float64),
        torch.tensor([mask], dtype=torch.bool), torch.tensor([bootstrap], dtype=torch.float64), gamma, lam,
    )
    action = torch.tensor(mask, dtype=torch.bool)
    return adv[0][action].tolist(), ret[0][action].tolist(), adv[0][~action].tolist()


@settings(max_examples=300, deadline=None)
@given(trajectories(), st.floats(0, 1), st.floats(0, 1))
def test_equals_ordinary_gae_on_the_action_only_subsequence(traj, gamma, lam):
    values, rewards, gaps, padding, bootstrap = traj
    adv, ret, off_action = run_one(values, rewards, gaps, padding, bootstrap, gamma, lam)
    expected = reference_gae(rewards, values, bootstrap, gamma, lam)
    assert adv == pytest.approx(expected, abs=1e-9)
    assert ret == pytest.approx([a + v for a, v in zip(expected, values, strict=True)], abs=1e-9)
    assert all(x == 0.0 for x in off_action)


@settings(max_examples=200, deadline=None)
@given(trajectories(), st.lists(st.integers(0, 3), min_size=13, max_size=13), st.integers(0, 5),
       st.floats(0, 1), st.floats(0, 1))
def test_observation_tokens_and_padding_change_no_action_advantage(traj, other_gaps, other_padding, gamma, lam):
    values, rewards, gaps, padding, bootstrap = traj
    adv_a, _, _ = run_one(values, rewards, gaps, padding, bootstrap, gamma, lam)
    adv_b, _, _ = run_one(values, rewards, other_gaps[: len(values) + 1], other_padding, bootstrap, gamma, lam)
    assert adv_a == adv_b


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.floats(0, 1), st.floats(0, 1), st.integers(0, 2**31 - 1))
def test_lam_float_equals_lam_constant_tensor(batch, length, gamma, lam, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < 0.6
    rewards = torch.where(mask, torch.randn(batch, length, generator=gen, dtype=torch.float64), 0.0)
    boot = torch.randn(batch, generator=gen, dtype=torch.float64)
    a_float, r_float = skip_observation_gae(rewards, values, mask, boot, gamma, lam)
    a_tensor, r_tensor = skip_observation_gae(rewards, values, mask, boot, gamma,
                                              torch.full((batch,), lam, dtype=torch.float64))
    assert torch.equal(a_float, a_tensor) and torch.equal(r_float, r_tensor)


def test_per_sequence_lam_is_applied_per_row():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv, _ = skip_observation_gae(rewards, values, mask, torch.zeros(2), 1.0, torch.tensor([0.0, 1.0]))
    # Row 0 (lam 0): A0 = delta0 = 0. Row 1 (lam 1): A0 = 1 - 0.5 = 0.5.
    assert adv.tolist() == [[0.0, 0.5], [0.5, 0.5]]


# ----- lambda, GRPO, running mean -------------------------------------------------------------------


def test_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([10, 100, 1, 0]), alpha=1.5)
    expected = [1 - 1 / 15, 1 - 1 / 150, 1 - 1 / 1.5, 1 - 1 / 1.5]
    assert lam.tolist() == pytest.approx(expected, rel=1e-6)
    assert lam.shape == (4,)
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(torch.tensor([3]), alpha=0.0)
    assert length_adaptive_lambda(torch.tensor([1]), alpha=0.5).tolist() == [0.0]


def test_grpo_advantages_hand_worked():
    # Group 0: rewards [1, 0, 1, 0], mean 0.5, unbiased std sqrt(1/3); group 1 of one member -> 0.
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 0, 1]))
    z = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([z, -z, z, -z, 0.0], rel=1e-6)
    centred = grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([3, 3, 3]), scale_by_std=False)
    assert centred.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    # A group whose rewards are all equal carries no signal.
    assert grpo_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0])).tolist() == [0.0, 0.0]


def test_flat_groups_counts_groups_of_two_or_more_with_one_reward():
    # groups: 0 -> [1, 0] (varied), 1 -> [1, 1, 1] (flat), 2 -> [0] (one member: not a group), 5 -> [0, 0] (flat)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 5, 5])
    assert flat_groups(rewards, ids) == (3, 2)
    assert flat_groups(torch.tensor([1.0, 0.0]), torch.tensor([0, 1])) == (0, 0)


def test_broadcast_to_actions():
    out = broadcast_to_actions(torch.tensor([2.0, -1.0]), torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool))
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, -1.0, 0.0]]


def test_success_advantages():
    out = success_advantages(torch.tensor([1.0, 0.0, 0.99, 2.0]), threshold=1.0)
    assert out.tolist() == [1.0, 0.0, 0.0, 1.0] and out.dtype == torch.float32
    assert success_advantages(torch.tensor([0.5, 0.2]), threshold=0.5).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        success_advantages(torch.zeros(2, 3), threshold=1.0)


def test_running_mean_baseline_window():
    base = RunningMeanBaseline(window=2)
    assert base.advantages(torch.tensor([1.0])).tolist() == [1.0]  # baseline 0 before any reward
    assert base.advantages(torch.tensor([0.0])).tolist() == [-1.0]  # baseline mean[1] = 1
    assert base.advantages(torch.tensor([1.0])).tolist() == [0.5]  # baseline mean[1, 0] = 0.5
    assert base.value == 0.5  # window keeps [0, 1]
    base.update([1.0, 1.0, 1.0])
    assert base.value == 1.0
    with pytest.raises(ValueError, match="window"):
        RunningMeanBaseline(window=0)
