"""The compiled decode-attention kernel against plain attention, one row at a time."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sao.rollout.kernels import decode_attention


def _reference(query, key, value, lengths, scaling):
    """Row by row: its own columns only, KV heads repeated for every query head of their group."""
    heads, kv_heads = query.shape[1], key.shape[1]
    rows = []
    for row, length in enumerate(lengths.tolist()):
        k = key[row, :, :length].repeat_interleave(heads // kv_heads, 0)
        v = value[row, :, :length].repeat_interleave(heads // kv_heads, 0)
        rows.append(F.scaled_dot_product_attention(query[row, :, None], k, v, scale=scaling)[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (4, 4, 8), (6, 1, 16)])
def test_decode_attention_equals_plain_attention_row_by_row(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    rows, capacity = 9, 50
    key = torch.randn(rows + 3, kv_heads, capacity, head_dim, generator=generator)  # spare slots are never read
    value = torch.randn(rows + 3, kv_heads, capacity, head_dim, generator=generator)
    query = torch.randn(rows, heads, head_dim, generator=generator)
    lengths = np.array([1, 50, 3, 17, 49, 8, 22, 2, 31])
    out = decode_attention(query, key, value, lengths, 0.3)
    torch.testing.assert_close(out, _reference(query, key, value, lengths, 0.3), atol=1e-6, rtol=1e-5)


def test_columns_past_a_rows_length_are_never_read():
    generator = torch.Generator().manual_seed(1)
    key = torch.randn(2, 2, 16, 8, generator=generator)
    value = torch.randn(2, 2, 16, 8, generator=generator)
    query = torch.randn(2, 4, 8, generator=generator)
    lengths = np.array([5, 11])
    before = decode_attention(query, key, value, lengths, 0.5)
    key[0, :, 5:], value[0, :, 5:] = float("nan"), float("nan")
    key[1, :, 11:], value[1, :, 11:] = 1e30, -1e30
    torch.testing.assert_close(decode_attention(query, key, value, lengths, 0.5), before, atol=0, rtol=0)


def test_large_scores_do_not_overflow_and_a_nan_input_shows():
    """The running maximum is subtracted before exp (scores of 1e4 would overflow otherwise), and the
    kernel makes no no-NaN assumption: a NaN in a row's keys gives NaN in that row, not a silent number."""
    key = torch.zeros(2, 1, 4, 2)
    key[:, 0, :, 0] = torch.tensor([1e4, 0.0, -1e4, 1e4])
    value = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 1, 4, 2)
    query = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    out = decode_attention(query, key, value, np.array([4, 4]), 1.0)
    # Columns 0 and 3 share all the mass: the mean of their values.
    torch.testing.assert_close(out[0, 0], (value[0, 0, 0] + value[0, 0, 3]) / 2)
    key[1, 0, 2, 1] = float("nan")
    out = decode_attention(query, key, value, np.array([4, 4]), 1.0)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


def test_bad_inputs_are_refused_with_the_reason():
    key = torch.zeros(2, 2, 8, 4)
    query = torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match=r"lengths must be 2 values in 1 \.\. 8"):
        decode_attention(query, key, key, np.array([0, 3]), 1.0)
    with pytest.raises(ValueError, match=r"lengths must be 2 values in 1 \.\. 8"):
        decode_attention(query, key, key, np.array([9, 3]), 1.0)
    with pytest.raises(TypeError, match="float32"):
        decode_attention(query.double(), key, key, np.array([1, 1]), 1.0)
    with pytest.raises(ValueError, match="does not fit a cache"):
        decode_attention(torch.zeros(3, 4, 4), key, key, np.array([1, 1, 1]), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(query, key.transpose(2, 3).contiguous().transpose(2, 3), key, np.array([1, 1]), 1.0)


def test_the_kernels_exp_is_as_accurate_as_expf():
    """The vectorisable exp against float64 exp: about 1e-7 relative where float32 is normal; below
    exp(-87) everything is at most exp(-87) (it only ever weighs a score far below the row's largest)."""
    from sao.rollout.kernels import _exp_shifted

    x = np.concatenate([np.linspace(-87.0, 0.0, 200_001), np.array([-87.5, -100.0, -1e30, float("nan")])])
    scores = (x + 3.0).astype(np.float32)  # the row's largest score is 3
    row = scores.copy()
    _exp_shifted(row, np.float32(3.0), len(row), np.empty(len(row), dtype=np.int32))
    exact = np.exp((scores[:-4] - np.float32(3.0)).astype(np.float64))  # the same float32 difference
    relative = np.abs(row[:-4] - exact) / exact
    assert relative.max() < 3e-7, relative.max()
    assert np.all(row[-4:-1] <= np.exp(-87.0) * 1.0001) and np.all(row[-4:-1] > 0)
    assert np.isnan(row[-1])
