"""decoder_at: the last layer at the read positions only gives the whole forward's outputs there."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2Model,
    LlamaConfig,
    LlamaModel,
    Qwen2Config,
    Qwen2Model,
    Qwen3Config,
    Qwen3Model,
)

from sao.models.critic import Critic
from sao.models.policy import build_policy
from sao.models.routing import record_routing, replay_routing
from sao.models.trimmed import decoder_at, supports_decoder_at, whole_forward
from tests.models.test_routing import selection_noise

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def decoders():
    torch.manual_seed(0)
    yield "qwen3_moe", build_policy(seed=3).get_decoder()
    yield "llama", LlamaModel(LlamaConfig(**SMALL))
    yield "qwen2", Qwen2Model(Qwen2Config(**SMALL))
    yield "qwen3", Qwen3Model(Qwen3Config(**SMALL))


def inputs(vocab):
    # Right-padded rows read from different offsets; the last row's positions run past the end and are
    # clamped onto its final position (as the trainer's padding columns are).
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (4, 20), generator=generator)
    starts = torch.tensor([[2], [7], [0], [12]])
    positions = (starts + torch.arange(10)).clamp(max=19)
    return input_ids, positions


def whole(decoder, input_ids, positions):
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


@pytest.mark.parametrize(("name", "decoder"), list(decoders()), ids=lambda x: x if isinstance(x, str) else "")
def test_outputs_and_gradients_are_the_whole_forwards(name, decoder):
    assert supports_decoder_at(decoder), name
    input_ids, positions = inputs(decoder.config.vocab_size)
    trimmed_model, whole_model = decoder, copy.deepcopy(decoder)
    got = decoder_at(trimmed_model, input_ids, positions)
    want = whole(whole_model, input_ids, positions)
    assert got.shape == want.shape == (4, 10, decoder.config.hidden_size)
    assert torch.allclose(got, want, rtol=0, atol=2e-6)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (key, a), b in zip(trimmed_model.named_parameters(), whole_model.parameters(), strict=True):
        if b.grad is None:
            assert a.grad is None, key
            continue
        scale = float(b.grad.abs().max())
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-4 * max(scale, 1e-6)), key


def test_the_last_layer_runs_at_the_read_positions_only():
    decoder = build_policy(seed=0).get_decoder()
    input_ids, positions = inputs(512)
    seen = {}
    handles = [layer.mlp.register_forward_hook(lambda module, args, out, i=i: seen.__setitem__(i, args[0].shape))
               for i, layer in enumerate(decoder.layers)]
    decoder_at(decoder, input_ids, positions)
    for handle in handles:
        handle.remove()
    assert seen == {0: (4, 20, 128), 1: (4, 10, 128)}
    # the layer is restored: a later whole forward runs it everywhere
    assert decoder(input_ids=input_ids).last_hidden_state.shape == (4, 20, 128)
    assert "forward" not in decoder.layers[-1].__dict__


def test_what_it_cannot_run_takes_the_whole_forward():
    policy = build_policy(seed=0)
    decoder = policy.get_decoder()
    assert supports_decoder_at(decoder)
    with whole_forward():  # the comparison's switch, on this thread only
        assert not supports_decoder_at(decoder)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(supports_decoder_at(decoder)))
        thread.start()
        thread.join()
        assert seen == [True]
    assert supports_decoder_at(decoder)
    with record_routing(policy):  # a routing record needs every position
        assert not supports_decoder_at(decoder)
    with selection_noise(policy, scale=0.01):  # another replaced router forward: not told the positions
        assert not supports_decoder_at(decoder)
    assert supports_decoder_at(decoder)
    input_ids, _ = inputs(512)
    assert not supports_decoder_at(GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    sliding = Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not supports_decoder_at(Qwen3Model(sliding))
    assert not supports_decoder_at(LlamaModel(LlamaConfig(**SMALL, attention_dropout=0.1)))
    with pytest.raises(ValueError, match=r"positions \(10,\) must be \(B, T\)"):
        decoder_at(decoder, input_ids, torch.arange(10))


def test_a_replayed_routing_is_replayed_at_the_positions_the_last_layer_runs():
    policy = build_policy(seed=0)
    decoder = policy.get_decoder()
    input_ids, positions = inputs(512)
    with selection_noise(policy, scale=0.05), record_routing(policy) as recorder:
        noisy = whole(decoder, input_ids, positions)  # the "rollout": other routing decisions
    experts = recorder.pop().view(*input_ids.shape, 2, 2)
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[0, 15:] = False  # unrecorded positions route live
    with replay_routing(policy, experts, mask) as stats:
        assert supports_decoder_at(decoder)
        got = decoder_at(decoder, input_ids, positions)
    with replay_routing(policy, experts, mask) as whole_stats:
        want = whole(decoder, input_ids, positions)
    assert torch.allclose(got, want, rtol=0, atol=2e-6)
    assert (got - noisy)[1:].abs().max() < 2e-6  # rows recorded throughout are the rollout's
    assert (decoder_at(decoder, input_ids, positions) - noisy).abs().max() > 1e-3  # live routing differs
    # the first layer ran everywhere; the last at each row's distinct read positions (row 3's are clamped
    # onto position 19 from its eighth on; row 0 reads 2-11, all recorded)
    assert stats.recorded[:, 0].tolist() == whole_stats.recorded[:, 0].tolist() == [15.0, 20.0, 20.0, 20.0]
    assert stats.recorded[:, 1].tolist() == [10.0, 10.0, 10.0, 8.0]
    assert torch.equal(stats.disagree[:, 0], whole_stats.disagree[:, 0])
    run = torch.zeros_like(mask).scatter(1, positions, True) & mask
    assert stats.disagree[:, 1].sum() <= whole_stats.disagree[:, 1].sum()
    assert float(stats.disagree[:, 1].sum()) == float((whole_disagreement(policy, input_ids, experts) & run).sum())


def whole_disagreement(policy, input_ids, experts):
    """(B, L) bool: positions whose live top-k set in the last layer differs from the recorded one."""
    with record_routing(policy) as recorder:
        policy.get_decoder()(input_ids=input_ids)
    live = recorder.pop().view(*input_ids.shape, 2, 2)[:, :, 1].long().sort(-1).values
    return (live != experts[:, :, 1].long().sort(-1).values).any(-1)


def test_the_critics_values_at_positions_are_its_whole_forwards():
    critic = Critic.from_policy(build_policy(seed=0))
    input_ids, positions = inputs(512)
    with torch.no_grad():
        assert torch.allclose(critic.values_at(input_ids, positions), critic(input_ids).gather(1, positions),
                              rtol=0, atol=1e-6)
