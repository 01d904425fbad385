"""The slot KV cache and its attention (``sao/rollout/kv_cache.py``) against slow references."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from sao.rollout.kv_cache import SlotCache, SlotLayout, chunked_columns, slot_attention

# Decode attention in chunks of rows ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_decode_attention_equals_plain_attention_row_by_row(chunk):
    """The fast path (chunks of rows, each reading up to its own longest row, batched products with the
    query heads of a KV group stacked) against the slow reference: one row at a time, its own columns only,
    KV heads repeated for every query head."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, head_dim, capacity = 7, 4, 2, 8, 40
    key = torch.randn(rows + 2, kv_heads, capacity, head_dim, generator=generator)  # spare slots are never read
    value = torch.randn(rows + 2, kv_heads, capacity, head_dim, generator=generator)
    query = torch.randn(1, heads, rows, head_dim, generator=generator)
    positions = torch.tensor([3, 30, 0, 17, 39, 8, 22])
    none = torch.zeros(0, dtype=torch.long)
    layout = SlotLayout.build(rows, positions, none, none, kv_heads, chunk, torch.float32)
    out, _ = slot_attention(None, query, key, value, None, scaling=0.3, sao_slot_layout=layout)
    assert out.shape == (1, rows, heads, head_dim)
    for row, position in enumerate(positions.tolist()):
        k = key[row, :, : position + 1].repeat_interleave(heads // kv_heads, 0)
        v = value[row, :, : position + 1].repeat_interleave(heads // kv_heads, 0)
        expected = F.scaled_dot_product_attention(query[:, :, row : row + 1], k[None], v[None], scale=0.3)[0, :, 0]
        torch.testing.assert_close(out[0, row], expected, atol=1e-6, rtol=1e-5)


def test_chunked_columns_counts_each_chunk_up_to_its_longest_row():
    assert chunked_columns([5, 9, 2, 2, 7], 2) == 2 * 9 + 2 * 2 + 7
    assert chunked_columns([5, 9, 2, 2, 7], 5) == 5 * 9


def test_slot_cache_writes_bound_columns_and_keeps_them_when_it_grows():
    config = Qwen3Config(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, max_position_embeddings=1024)
    cache = SlotCache(config, slots=3, dtype=torch.float32)
    assert cache.keys[0].shape == (3, 1, 256, 4)
    key = torch.randn(1, 1, 2, 4)  # (1, kv_heads, packed tokens, head_dim)
    cache.bind(torch.tensor([2, 0]), torch.tensor([5, 0]))
    keys, values = cache.update(key, -key, 0)
    assert keys is cache.keys[0] and values is cache.values[0]  # the whole cache, for the attention to read
    assert cache.get_seq_length() == 6
    cache.reserve(300)  # doubles to 512, contents kept
    assert cache.capacity == 512
    torch.testing.assert_close(cache.keys[0][2, :, 5], key[0, :, 0])
    torch.testing.assert_close(cache.values[0][0, :, 0], -key[0, :, 1])
    cache.move(torch.tensor([2]), torch.tensor([1]), width=6)
    torch.testing.assert_close(cache.keys[0][1, :, :6], cache.keys[0][2, :, :6])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        cache.reserve(1025)
