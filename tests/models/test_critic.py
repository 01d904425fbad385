"""The critic: policy weights + value head, attention frozen without cutting the gradient path."""

from __future__ import annotations

import pytest
import torch

from sao.models.critic import Critic, CriticConfig, load_critic, save_critic, values_at_actions
from sao.models.policy import build_policy

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


@pytest.fixture(scope="module")
def policy():
    return build_policy(seed=0)


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 512, (3, 24), generator=generator)
    action_mask = torch.zeros(3, 24, dtype=torch.bool)
    action_mask[:, 10:16] = True
    action_mask[:, 20:] = True
    return input_ids, action_mask


def test_critic_starts_from_the_policy_weights_without_touching_the_policy(policy, batch):
    critic = Critic.from_policy(policy)
    input_ids, _ = batch
    with torch.no_grad():
        expected = policy.get_decoder()(input_ids=input_ids).last_hidden_state
        actual = critic.backbone(input_ids=input_ids).last_hidden_state
    assert torch.equal(expected, actual)
    assert critic.backbone is not policy.get_decoder()
    with torch.no_grad():
        next(critic.backbone.parameters()).add_(1.0)
    assert not torch.equal(next(critic.backbone.parameters()), next(policy.get_decoder().parameters()))
    assert all(p.requires_grad for p in policy.parameters())  # freezing the critic froze nothing here


def test_values_have_one_scalar_per_position(policy, batch):
    critic = Critic.from_policy(policy)
    values = critic(batch[0])
    assert values.shape == (3, 24)
    assert values.dtype == torch.float32


def test_frozen_attention_gets_no_gradient_but_first_layer_experts_do(policy, batch):
    critic = Critic.from_policy(policy)
    input_ids, action_mask = batch
    values = critic.action_values(input_ids, action_mask)
    (values.square().sum()).backward()
    for name, parameter in critic.backbone.named_parameters():
        if ".self_attn." in name:
            assert not parameter.requires_grad, name
            assert parameter.grad is None, name
    layer0 = critic.backbone.layers[0].mlp
    for parameter in (layer0.experts.gate_up_proj, layer0.experts.down_proj, layer0.gate.weight):
        assert parameter.requires_grad
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0  # flowed through layer 1's frozen attention
    assert critic.value_head.weight.grad.abs().sum() > 0
    frozen = {n for n, p in critic.backbone.named_parameters() if not p.requires_grad}
    assert {n.split(".")[-2] for n in frozen if ".self_attn." in n} == set(ATTENTION_PARTS)


def test_grad_mode_is_on_inside_every_attention_and_expert_block(policy, batch):
    # "No torch.no_grad involved": record the grad mode each attention / MoE module runs under.
    critic = Critic.from_policy(policy)
    modes: list[bool] = []
    handles = []
    for layer in critic.backbone.layers:
        for module in (layer.self_attn, layer.mlp):
            handles.append(module.register_forward_pre_hook(lambda *_: modes.append(torch.is_grad_enabled())))
    try:
        critic(batch[0]).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert modes == [True] * (2 * len(critic.backbone.layers))


def test_trainable_set_follows_the_config(policy):
    def trainable(config: CriticConfig) -> set[str]:
        critic = Critic.from_policy(policy, config)
        return {n for n, p in critic.named_parameters() if p.requires_grad}

    default = trainable(CriticConfig())
    assert default == {n for n in default if ".mlp." in n or n.startswith("value_head")}
    assert any("embed_tokens" in n for n in trainable(CriticConfig(train_embeddings=True)))
    assert any("layernorm" in n for n in trainable(CriticConfig(train_norms=True)))
    assert any(".self_attn." in n for n in trainable(CriticConfig(freeze_attention=False)))


def test_values_at_actions_golden():
    state_values = torch.tensor([[0.5, 1.0, 2.0, 3.0, 4.0, 5.0]])
    action_mask = torch.tensor([[False, False, True, True, False, True]])
    # V(s_t) for action t is the value after token t - 1.
    expected = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.0, 4.0]])
    assert torch.equal(values_at_actions(state_values, action_mask), expected)


def test_values_at_actions_rejects_bad_input():
    with pytest.raises(ValueError, match="first token"):
        values_at_actions(torch.zeros(1, 3), torch.tensor([[True, False, False]]))
    with pytest.raises(ValueError, match="shape"):
        values_at_actions(torch.zeros(1, 3), torch.zeros(1, 4, dtype=torch.bool))


def test_value_head_seed_is_deterministic(policy):
    a = Critic.from_policy(policy, CriticConfig(seed=1))
    b = Critic.from_policy(policy, CriticConfig(seed=1))
    c = Critic.from_policy(policy, CriticConfig(seed=2))
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    assert not torch.equal(a.value_head.weight, c.value_head.weight)


def test_save_load_round_trip(policy, batch, tmp_path):
    critic = Critic.from_policy(policy, CriticConfig(train_norms=True, seed=4))
    with torch.no_grad():
        critic.value_head.bias.fill_(0.25)
    save_critic(critic, tmp_path)
    loaded = load_critic(tmp_path)
    assert loaded.config == critic.config
    with torch.no_grad():
        assert torch.equal(loaded(batch[0]), critic(batch[0]))
    assert {n: p.requires_grad for n, p in loaded.named_parameters()} == {
        n: p.requires_grad for n, p in critic.named_parameters()
    }


def test_load_critic_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_critic(tmp_path)
