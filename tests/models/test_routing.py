"""Routing record and replay (R3): replay reproduces the recording forward bit for bit, even where the
live router would choose other experts, and the router keeps its gradient.

"Selection noise" stands in for what flips routing between a rollout engine and a trainer holding the
same weights (other kernels, reduction orders, precision): a router forward written out here, by hand,
that picks its top-k from slightly perturbed probabilities but weights the chosen experts exactly as
Qwen3-MoE does (softmax of the unperturbed logits, renormalised over the chosen ones when the config's
``norm_topk_prob`` says so).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from sao.models.policy import PolicyConfig, build_policy
from sao.models.routing import moe_routers, record_routing, replay_routing, replayed_weights

B, L = 3, 20


@contextlib.contextmanager
def selection_noise(model, scale, seed=0):
    """Every router of ``model`` selects its top-k from probabilities + N(0, scale^2) noise. Yields a list
    that gets, per router call, which tokens' noisy choice differs (as a set) from the clean top-k."""
    generator = torch.Generator().manual_seed(seed)
    routers = moe_routers(model)
    flips = []

    def noisy(router):
        def forward(hidden_states):
            hidden = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            noise = torch.randn(probs.shape, generator=generator) * scale
            chosen = torch.topk(probs + noise, router.top_k, dim=-1).indices
            clean = torch.topk(probs, router.top_k, dim=-1).indices
            flips.append((chosen.sort(-1).values != clean.sort(-1).values).any(-1))
            weights = probs.gather(-1, chosen)
            if router.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return forward

    for router in routers:
        router.forward = noisy(router)
    try:
        yield flips
    finally:
        for router in routers:
            del router.forward


@pytest.fixture
def policy():
    return build_policy(PolicyConfig(), seed=0).train()


@pytest.fixture
def ids():
    return torch.randint(3, 500, (B, L), generator=torch.Generator().manual_seed(1))


def recorded(recorder, model):
    routing = recorder.pop()
    return routing.view(B, L, len(moe_routers(model)), -1)


def test_replaying_the_live_routing_changes_nothing_bit_for_bit(policy, ids):
    with record_routing(policy) as recorder:
        live = policy(input_ids=ids).logits
    live.logsumexp(-1).sum().backward()
    live_grads = [r.weight.grad.clone() for r in moe_routers(policy)]
    policy.zero_grad()
    with replay_routing(policy, recorded(recorder, policy), torch.ones(B, L, dtype=torch.bool)) as stats:
        replayed = policy(input_ids=ids).logits
    replayed.logsumexp(-1).sum().backward()
    assert torch.equal(replayed, live)
    assert all(torch.equal(r.weight.grad, g) for r, g in zip(moe_routers(policy), live_grads, strict=True))
    assert stats.disagree.sum() == 0 and stats.recorded.tolist() == [[L] * len(moe_routers(policy))] * B


def test_replay_reproduces_a_forward_whose_routing_the_live_router_would_not_choose(policy, ids):
    with selection_noise(policy, scale=0.02) as flips, record_routing(policy) as recorder:
        rollout = policy(input_ids=ids).logits  # the "rollout": same weights, other routing decisions
    experts = recorded(recorder, policy)
    live = policy(input_ids=ids).logits
    with replay_routing(policy, experts, torch.ones(B, L, dtype=torch.bool)) as stats:
        replayed = policy(input_ids=ids).logits
    flipped = torch.stack(flips, -1).view(B, L, -1)  # (B, L, M): the live router would choose otherwise
    assert flipped.any(), "the perturbation must flip some routing for this test to mean anything"
    assert torch.equal(replayed, rollout)
    assert (live - rollout).abs().max() > 1e-3
    assert stats.disagree.tolist() == flipped.sum(1).float().tolist()


def test_gradients_reach_the_router_through_the_replayed_weights(policy, ids):
    target = ids.roll(-1, dims=1)
    with selection_noise(policy, scale=0.02), record_routing(policy) as recorder:
        loss = F.cross_entropy(policy(input_ids=ids).logits.flatten(0, 1), target.flatten())
    loss.backward()  # the gradient of the forward that chose these experts itself
    expected = [r.weight.grad.clone() for r in moe_routers(policy)]
    policy.zero_grad()
    with replay_routing(policy, recorded(recorder, policy), torch.ones(B, L, dtype=torch.bool)):
        loss = F.cross_entropy(policy(input_ids=ids).logits.flatten(0, 1), target.flatten())
    loss.backward()
    for router, grad in zip(moe_routers(policy), expected, strict=True):
        assert router.weight.grad.abs().sum() > 0
        assert torch.equal(router.weight.grad, grad)


def test_unrecorded_positions_route_live(policy, ids):
    with selection_noise(policy, scale=0.02), record_routing(policy) as recorder:
        policy(input_ids=ids)
    live = policy(input_ids=ids).logits
    with replay_routing(policy, recorded(recorder, policy), torch.zeros(B, L, dtype=torch.bool)) as stats:
        replayed = policy(input_ids=ids).logits
    assert torch.equal(replayed, live) and stats.recorded.sum() == 0 and stats.disagree.sum() == 0


def test_replayed_weights_by_hand():
    # logits (0, ln 2, ln 3, 0): softmax (1, 2, 3, 1) / 7; experts (2, 0) -> (3/7, 1/7), renormalised (3/4, 1/4).
    logits = torch.tensor([[0.0, 2.0, 3.0, 1.0]]).log()
    logits[0, 0] = logits[0, 3] = 0.0
    weights = replayed_weights(logits, torch.tensor([[2, 0]]), norm_topk_prob=True)
    assert torch.allclose(weights, torch.tensor([[0.75, 0.25]]))
    assert torch.allclose(replayed_weights(logits, torch.tensor([[2, 0]]), False), torch.tensor([[3 / 7, 1 / 7]]))


def test_a_record_that_does_not_fit_the_model_is_refused(policy, ids):
    mask = torch.ones(B, L, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"experts \(3, 20, 1, 2\) must be \(B, L, M=2, K\)"):
        with replay_routing(policy, torch.zeros(B, L, 1, 2, dtype=torch.uint8), mask):
            pass
    with pytest.raises(ValueError, match="recorded expert id 8 is not below the model's 8 experts"):
        with replay_routing(policy, torch.full((B, L, 2, 2), 8, dtype=torch.uint8), mask):
            pass
    with pytest.raises(ValueError, match="the forward has 40 tokens, the recorded routing covers 60"):
        with replay_routing(policy, torch.zeros(B, L, 2, 2, dtype=torch.uint8), mask):
            policy(input_ids=ids[:2])
    assert all("forward" not in r.__dict__ for r in moe_routers(policy))  # the routers are restored
