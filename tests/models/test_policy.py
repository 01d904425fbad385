"""The tiny Qwen3-MoE policy: built from a typed config, seeded, saved and loaded as a HF directory."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen3_moe import Qwen3MoeForCausalLM

from sao.models.chat import ChatTokens
from sao.models.policy import (
    METADATA_FILE,
    PolicyConfig,
    build_policy,
    count_parameters,
    load_policy,
    read_policy_metadata,
    save_policy,
)
from sao.models.tokenizer import (
    SPECIAL_TOKENS,
    build_tokenizer,
    chat_template_version,
    tokenizer_version,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_default_policy_is_a_tiny_qwen3_moe():
    model = build_policy(seed=0)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert count_parameters(model) < 1_000_000
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (128, 2, 4, 2)
    assert (config.head_dim, config.num_experts, config.num_experts_per_tok) == (32, 8, 2)
    assert config._attn_implementation == "sdpa"
    assert config._experts_implementation == "grouped_mm"
    assert next(model.parameters()).dtype == torch.float32


def test_special_ids_of_the_config_match_the_tokenizer(tokenizer):
    config = PolicyConfig()
    assert len(tokenizer) <= config.vocab_size
    assert SPECIAL_TOKENS[config.pad_token_id] == tokenizer.pad_token
    assert SPECIAL_TOKENS[config.eos_token_id] == tokenizer.eos_token


def test_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_policy(seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    second = build_policy(seed=7)
    other = build_policy(seed=8)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.state_dict().values(), other.state_dict().values(), strict=True))


def test_save_load_round_trip_gives_identical_logits(tmp_path, tokenizer):
    model = build_policy(seed=3)
    # Move away from the initialisation so the test does not pass by re-initialising.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    model.eval()
    save_policy(model, tmp_path, tokenizer, policy_version=5, extra={"note": "test"})
    assert (tmp_path / "model.safetensors").exists()
    loaded = load_policy(tmp_path)
    assert isinstance(loaded, Qwen3MoeForCausalLM)
    assert loaded.config._experts_implementation == "grouped_mm"
    input_ids = torch.randint(0, len(tokenizer), (3, 40), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        actual = loaded(input_ids=input_ids, attention_mask=attention_mask).logits
    assert torch.equal(expected, actual)


def test_saved_directory_records_versions_and_samples_from_the_model_distribution(tmp_path, tokenizer):
    save_policy(build_policy(seed=0), tmp_path, tokenizer, policy_version=0)
    metadata = read_policy_metadata(tmp_path)
    assert metadata.policy_version == 0
    assert metadata.tokenizer_version == tokenizer_version(tokenizer)
    assert metadata.chat_template_version == chat_template_version(tokenizer)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["top_k"] == 0 and generation["top_p"] == 1.0 and generation["temperature"] == 1.0
    assert sorted(generation["eos_token_id"]) == sorted(ChatTokens.from_tokenizer(tokenizer).stop_token_ids)
    assert (tmp_path / METADATA_FILE).exists()


def test_a_directory_without_metadata_loads_as_a_plain_checkpoint(tmp_path):
    build_policy(seed=0).save_pretrained(tmp_path)
    assert read_policy_metadata(tmp_path) is None
    assert isinstance(load_policy(tmp_path), Qwen3MoeForCausalLM)


def test_training_is_deterministic():
    def train() -> dict[str, torch.Tensor]:
        model = build_policy(seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return model.state_dict()

    first, second = train(), train()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("experts_implementation", "batched_mm", "25-30x slower"),
        ("attn_implementation", "flash_attention_2", "attn_implementation"),
        ("dtype", "float64", "dtype"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ],
)
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**{field: value})


def test_load_policy_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(tmp_path)
    with pytest.raises(ValueError, match="batched_mm"):
        load_policy(tmp_path, experts_implementation="batched_mm")
    with pytest.raises(ValueError, match="policy_version"):
        save_policy(build_policy(), tmp_path, policy_version=-1)
