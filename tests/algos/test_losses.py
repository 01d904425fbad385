"""DIS policy loss, PPO clip loss and value loss: golden values, gradients, invariances."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.algos.losses import dis_policy_loss, ppo_clip_loss, value_loss

MATH = (0.3, 5.0)
TEACHING = (0.3, 0.5)


def logps(*probs):
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def test_dis_loss_hand_worked():
    # Three action tokens: rho 1.1 (kept), 1.8 (masked under (0.7, 1.5)), 1.0 (kept); one observation.
    current = logps(0.22, 0.36, 0.5, 0.9).requires_grad_()
    rollout = logps(0.2, 0.2, 0.5, 0.1)
    adv = torch.tensor([[2.0, 5.0, -1.0, 7.0]], dtype=torch.float64)
    action = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, m = dis_policy_loss(current, rollout, adv, action, *TEACHING)
    # loss = -(1.1*2*log .22 + 0 + 1.0*(-1)*log .5) / 3 action tokens (masked one in the denominator)
    expected = -(1.1 * 2 * math.log(0.22) - math.log(0.5)) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert m["actor/kept_frac"] == pytest.approx(2 / 3)
    assert m["actor/masked_high_frac"] == pytest.approx(1 / 3)
    assert m["actor/masked_low_frac"] == 0.0
    assert m["actor/rho_mean"] == pytest.approx((1.1 + 1.8 + 1.0) / 3)
    assert m["actor/rho_max"] == pytest.approx(1.8)
    assert m["actor/all_masked"] == 0.0


def model_logps(theta, tokens):
    """A tiny differentiable policy: per-position logits over 4 actions, (T, 4) from theta (T, 4, 2)."""
    logits = theta.square().sum(-1) - theta[..., 0]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens.T).T  # (1, T)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_detached_weight_gradient_is_minus_w_a_grad_log_pi_per_kept_token(seed):
    gen = torch.Generator().manual_seed(seed)
    T = 6
    theta = torch.randn(T, 4, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 4, (1, T), generator=gen)
    current = model_logps(theta, tokens)
    rollout = (current.detach() + 0.6 * torch.randn(1, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(1, T, generator=gen, dtype=torch.float64)
    action = torch.rand(1, T, generator=gen) < 0.8
    loss, _ = dis_policy_loss(current, rollout, adv, action, *TEACHING)
    (grad,) = torch.autograd.grad(loss, theta)

    from sao.algos.dis import dis_weights

    weights, keep = dis_weights(current.detach(), rollout, action, *TEACHING)
    expected = torch.zeros_like(theta)
    n_action = max(int(action.sum()), 1)
    for t in range(T):
        if keep[0, t]:
            (g,) = torch.autograd.grad(model_logps(theta, tokens)[0, t], theta)
            expected += -weights[0, t] * adv[0, t] * g / n_action
    assert torch.allclose(grad, expected, atol=1e-12)


def test_masked_tokens_contribute_exactly_zero_gradient():
    current = logps(0.22, 0.36, 0.05, 0.5).requires_grad_()
    rollout = logps(0.2, 0.2, 0.2, 0.5)  # rho 1.1 kept, 1.8 masked high, 0.25 masked low, obs
    adv = torch.tensor([[1.0, 3.0, -2.0, 4.0]], dtype=torch.float64)
    action = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, _ = dis_policy_loss(current, rollout, adv, action, *TEACHING)
    loss.backward()
    assert current.grad[0, 1:].tolist() == [0.0, 0.0, 0.0]
    assert float(current.grad[0, 0]) == pytest.approx(-1.1 * 1.0 / 3)


def test_ratio_form_has_the_same_gradient_as_the_detached_form():
    gen = torch.Generator().manual_seed(3)
    base = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 2
    rollout = (base + 0.3 * torch.randn(4, 7, generator=gen, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    action = torch.rand(4, 7, generator=gen) < 0.7
    grads = []
    for detach in (True, False):
        current = base.clone().requires_grad_()
        loss, _ = dis_policy_loss(current, rollout, adv, action, *TEACHING, detach_weight=detach)
        loss.backward()
        grads.append(current.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-12)


@pytest.mark.parametrize("case", ["all_stale", "no_actions"])
def test_all_masked_micro_batch_gives_zero_loss_zero_grad_no_nan(case):
    current = logps(0.9, 0.9).requires_grad_()
    rollout = logps(0.01, 0.01)  # rho 90: masked under any interval here
    action = torch.tensor([[1, 1]], dtype=torch.bool) if case == "all_stale" else torch.zeros(1, 2, dtype=torch.bool)
    loss, m = dis_policy_loss(current, rollout, torch.ones(1, 2, dtype=torch.float64), action, *TEACHING)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert current.grad.tolist() == [[0.0, 0.0]]
    assert m["actor/all_masked"] == 1.0 and m["actor/kept_frac"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("detach", [True, False])
def test_a_masked_ratio_too_large_for_float32_gives_a_zero_gradient_in_either_form(detach):
    # log rho = 99.99 overflows exp() in float32; the token is masked, and the ratio form differentiated
    # that exp on the branch where() did not take: 0 * inf = NaN in the gradient.
    current = torch.tensor([[-0.01, -0.5]], dtype=torch.float32, requires_grad=True)
    rollout = torch.tensor([[-100.0, -0.5]], dtype=torch.float32)
    action = torch.tensor([[True, False]])
    loss, m = dis_policy_loss(current, rollout, torch.ones(1, 2), action, *MATH, detach_weight=detach)
    loss.backward()
    assert float(loss.detach()) == 0.0 and current.grad.tolist() == [[0.0, 0.0]]
    assert m["actor/all_masked"] == 1.0


def test_nan_in_padding_never_reaches_loss_or_gradient():
    current = torch.tensor([[-0.5, float("nan")]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-0.5, float("nan")]], dtype=torch.float64)
    adv = torch.tensor([[1.0, float("nan")]], dtype=torch.float64)
    loss, _ = dis_policy_loss(current, rollout, adv, torch.tensor([[True, False]]), *MATH)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and torch.isfinite(current.grad).all()


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_token_mode_batch_loss_equals_count_weighted_sum_of_single_sequence_losses(seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = 8, 9
    current = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    rollout = (current + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    action = torch.rand(B, T, generator=gen) < 0.6
    batch_loss, _ = dis_policy_loss(current, rollout, adv, action, *TEACHING)
    counts = action.sum(-1).double()
    singles = torch.stack([
        dis_policy_loss(current[i:i + 1], rollout[i:i + 1], adv[i:i + 1], action[i:i + 1], *TEACHING)[0]
        for i in range(B)
    ])
    assert float(batch_loss) == pytest.approx(float((singles * counts).sum() / counts.sum().clamp(min=1)), abs=1e-12)


def test_dis_loss_validation_names_the_field():
    with pytest.raises(ValueError, match="advantages has shape"):
        dis_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2, dtype=torch.bool), *MATH)
    with pytest.raises(ValueError, match="eps_low"):
        dis_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 1.2, 1.0)
    with pytest.raises(ValueError, match=r"logp_rollout has a positive log-probability"):
        dis_policy_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), *MATH)


# ----- PPO clip (baselines) ---------------------------------------------------------------------


def test_ppo_clip_hand_worked_keeps_the_corrective_gradient():
    # A = 1 everywhere, clip 0.2. Token 0: rho 1.5 -> pg1 -1.5, pg2 -1.2 -> clipped, no gradient.
    # Token 1: rho 0.5 -> pg1 -0.5, pg2 -0.8 -> max is pg1: unclipped, gradient -rho*A/2 = -0.25.
    current = logps(0.3, 0.1).requires_grad_()
    rollout = logps(0.2, 0.2)
    loss, m = ppo_clip_loss(current, rollout, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool))
    assert float(loss.detach()) == pytest.approx((-1.2 - 0.5) / 2)
    loss.backward()
    assert current.grad.tolist()[0] == pytest.approx([0.0, -0.25])
    assert m["actor/clip_frac"] == 0.5


def test_ppo_clip_validation():
    with pytest.raises(ValueError, match="clip range"):
        ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), clip_low=1.0)
    with pytest.raises(ValueError, match="logp_current has a non-finite"):
        ppo_clip_loss(torch.full((1, 1), float("nan")), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))


# ----- value loss ---------------------------------------------------------------------------------


def test_value_loss_over_action_tokens_only():
    values = torch.tensor([[0.5, 9.0, 1.5]], requires_grad=True)
    returns = torch.tensor([[1.0, -9.0, 0.5]])
    action = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    loss, m = value_loss(values, returns, action, reward_range=(0.0, 1.0))
    # 0.5 * (0.25 + 1.0) / 2
    assert float(loss.detach()) == pytest.approx(0.3125)
    loss.backward()
    assert values.grad.tolist() == [[pytest.approx(-0.25), 0.0, pytest.approx(0.5)]]
    assert m["critic/value_mean"] == 1.0
    assert m["critic/frac_outside_reward_range"] == 0.5


def test_value_clipping_hand_worked():
    values = torch.tensor([[2.0]], requires_grad=True)
    loss, m = value_loss(values, torch.tensor([[2.0]]), torch.ones(1, 1, dtype=torch.bool),
                         old_values=torch.tensor([[0.0]]), clip=0.5)
    # unclipped error 0; clipped value 0.5 -> 0.5 * 1.5^2 = 1.125 is the larger: taken.
    assert float(loss.detach()) == pytest.approx(1.125)
    assert m["critic/value_clip_frac"] == 1.0
    with pytest.raises(ValueError, match="both old_values and clip"):
        value_loss(values, values.detach(), torch.ones(1, 1, dtype=torch.bool), clip=0.5)
