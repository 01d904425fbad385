"""DIS weights: golden values from the seed, the strict interval, validation errors."""

import math

import pytest
import torch

from sao.algos.dis import dis_weights

MATH = (0.3, 5.0)  # paper: math with Python tools, interval (0.7, 6.0)
TEACHING = (0.3, 0.5)  # the seed's illustrative interval (0.7, 1.5)


def one_token(p_now: float, p_then: float, dtype=torch.float64):
    current = torch.tensor([[math.log(p_now)]], dtype=dtype)
    rollout = torch.tensor([[math.log(p_then)]], dtype=dtype)
    return current, rollout, torch.tensor([[True]])


def test_seed_token_kept_with_weight_1_1():
    weights, keep = dis_weights(*one_token(0.22, 0.2), *TEACHING)
    assert bool(keep[0, 0])
    assert math.isclose(float(weights[0, 0]), 1.1, rel_tol=1e-12)


def test_seed_token_at_rho_1_8_masked_in_teaching_interval_kept_in_paper_math_interval():
    weights, keep = dis_weights(*one_token(0.36, 0.2), *TEACHING)
    assert not bool(keep[0, 0]) and float(weights[0, 0]) == 0.0
    weights, keep = dis_weights(*one_token(0.36, 0.2), *MATH)
    assert bool(keep[0, 0])
    assert math.isclose(float(weights[0, 0]), 1.8, rel_tol=1e-12)


def test_rho_exactly_on_either_bound_is_masked():
    # log rho = log(0.7) - 0 is exactly the lower bound's log; 0 - (-log 1.5) exactly the upper's.
    current = torch.tensor([[math.log(0.7), 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[0.0, -math.log(1.5)]], dtype=torch.float64)
    weights, keep = dis_weights(current, rollout, torch.ones(1, 2, dtype=torch.bool), *TEACHING)
    assert keep.tolist() == [[False, False]]
    assert weights.tolist() == [[0.0, 0.0]]
    # Just inside both bounds, both kept.
    inside_current = torch.tensor([[math.log(0.7) + 1e-9, 0.0]], dtype=torch.float64)
    inside_rollout = torch.tensor([[0.0, -math.log(1.5) + 1e-9]], dtype=torch.float64)
    _, keep = dis_weights(inside_current, inside_rollout, torch.ones(1, 2, dtype=torch.bool), *TEACHING)
    assert keep.tolist() == [[True, True]]


def test_non_action_tokens_get_zero_weight_even_with_garbage_logprobs():
    current = torch.tensor([[-1.0, float("nan"), 5.0, -0.5]])
    rollout = torch.tensor([[-1.1, float("inf"), -2.0, -0.5]])
    action = torch.tensor([[True, False, False, True]])
    weights, keep = dis_weights(current, rollout, action, *MATH)
    assert keep.tolist() == [[True, False, False, True]]
    assert weights[0, 1] == 0 and weights[0, 2] == 0
    assert torch.isfinite(weights).all()
    assert math.isclose(float(weights[0, 0]), math.exp(0.1), rel_tol=1e-6)
    assert float(weights[0, 3]) == 1.0


def test_weights_carry_the_graph_of_logp_current():
    current = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights, _ = dis_weights(current, torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool), *MATH)
    weights.sum().backward()
    # d rho / d logp_current = rho = 1 for both tokens.
    assert current.grad.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize(
    ("eps_low", "eps_high", "field"),
    [(0.0, 0.5, "eps_low"), (1.0, 0.5, "eps_low"), (-0.2, 0.5, "eps_low"), (1.5, 0.5, "eps_low"),
     (0.3, 0.0, "eps_high"), (0.3, -1.0, "eps_high"), (float("nan"), 0.5, "eps_low"),
     (0.3, float("inf"), "eps_high")],
)
def test_bounds_that_do_not_straddle_one_are_refused(eps_low, eps_high, field):
    with pytest.raises(ValueError, match=field):
        dis_weights(*one_token(0.2, 0.2), eps_low, eps_high)


@pytest.mark.parametrize("field", ["logp_current", "logp_rollout"])
@pytest.mark.parametrize(("bad", "problem"), [(float("nan"), "non-finite"), (float("-inf"), "non-finite"),
                                              (0.25, "positive")])
def test_bad_logprob_at_an_action_position_names_field_problem_and_position(field, bad, problem):
    current = torch.full((2, 3), -1.0)
    rollout = torch.full((2, 3), -1.0)
    {"logp_current": current, "logp_rollout": rollout}[field][1, 2] = bad
    with pytest.raises(ValueError, match=rf"{field} has a {problem} log-probability .*row 1, token 2"):
        dis_weights(current, rollout, torch.ones(2, 3, dtype=torch.bool), *MATH)


def test_shape_mismatch_names_the_tensors():
    with pytest.raises(ValueError, match=r"shape mismatch: logp_current has shape \(2, 3\) but logp_rollout"):
        dis_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), *MATH)
    with pytest.raises(ValueError, match="action_mask has shape"):
        dis_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 3, dtype=torch.bool), *MATH)


def test_zero_logprob_is_valid():
    weights, keep = dis_weights(*one_token(1.0, 1.0), *MATH)
    assert bool(keep[0, 0]) and float(weights[0, 0]) == 1.0
