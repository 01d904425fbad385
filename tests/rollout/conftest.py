import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao.rollout.torch_engine import TorchEngine


def tiny_policy(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
    )
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture
def policy():
    return tiny_policy()


@pytest.fixture
def engine(policy):
    reference = tiny_policy()
    reference.load_state_dict(policy.state_dict())
    engine = TorchEngine(policy)
    engine.reference = reference  # a second copy of version 0 for teacher-forced recomputation
    yield engine
    engine.close()
