"""The torch engine's slot KV cache and the attention that reads it.

:class:`SlotCache` keeps one slot per running request, each with its own length, in preallocated
tensors ``(slots, kv_heads, capacity, head_dim)`` per layer. The engine packs a step's tokens (one new
token per running request, then the whole contexts of the joining requests) into one sequence, builds
its :class:`SlotLayout` and binds each token's slot and column to the cache. In the forward pass each
attention layer writes its keys and values there (:meth:`SlotCache.update`) and calls
:func:`slot_attention` (registered with Transformers' attention interface as :data:`SLOT_ATTENTION`),
which lets every token attend to its own slot only:

* decode rows (one query token each) read their slot up to their own position, through the compiled
  kernel (:func:`sao.rollout.kernels.decode_attention`: each row read once, up to its own length) or,
  for a bfloat16 / float16 model, batched products in chunks of rows, each chunk reading up to its own
  longest row (:func:`chunked_columns` counts the columns a grouping of rows reads);
* a joiner's tokens attend causally within their own slot (one ``scaled_dot_product_attention`` call,
  grouped KV heads kept grouped).

Both decode paths are fast paths of plain attention computed row by row, and tests compare them with it
(``tests/rollout/test_kv_cache.py``, ``tests/rollout/test_kernels.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from sao.rollout.kernels import decode_attention

__all__ = ["SLOT_ATTENTION", "SlotCache", "SlotLayout", "chunked_columns", "slot_attention"]


SLOT_ATTENTION = "sao_slot_attention"


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """How a packed forward's tokens map to slots, for :func:`slot_attention`.

    The packed sequence holds ``decode`` single tokens (rows ``0 .. decode-1``, one each) followed by the
    whole contexts of the joiners (rows ``decode ..``), one after another.
    """

    decode: int
    lengths: np.ndarray | None  # (decode,) int64 columns each decode row reads (the compiled kernel's input)
    chunks: tuple[tuple[int, int, int], ...]  # chunked path: decode rows [start, end) read cache columns 0 .. width-1
    decode_bias: torch.Tensor | None  # chunked path: (decode * kv_heads, 1, width), -inf after each row's position
    joiners: int
    gather: torch.Tensor | None  # (joiners, longest): packed index of each joiner's token (padding: 0)
    prefill_mask: torch.Tensor | None  # (joiners, 1, longest, longest): causal within the joiner's context
    valid: torch.Tensor | None  # (joiners * longest,) which padded positions are real tokens
    width: int  # cache columns the step touches

    @classmethod
    def build(cls, decode: int, positions: torch.Tensor, sizes: torch.Tensor, starts: torch.Tensor,
              kv_heads: int, chunk: int | None, dtype: torch.dtype) -> SlotLayout:
        """``chunk`` None: the decode rows go to the compiled kernel (:func:`sao.rollout.kernels.decode_attention`),
        which reads each row up to its own length; otherwise batched products in chunks of ``chunk`` rows."""
        width = int(positions.max()) + 1 if decode else 0
        lengths = None
        chunks: tuple[tuple[int, int, int], ...] = ()
        decode_bias = None
        if decode and chunk is None:
            lengths = positions[:decode].numpy() + 1
        elif decode:
            listed = positions.tolist()
            chunks = tuple((s, min(s + chunk, decode), max(listed[s : s + chunk]) + 1) for s in range(0, decode, chunk))
            hidden = torch.arange(width)[None, None, None, :] > positions[:, None, None, None]
            decode_bias = torch.zeros(decode, kv_heads, 1, width, dtype=dtype).masked_fill_(hidden, float("-inf"))
            decode_bias = decode_bias.view(decode * kv_heads, 1, width)
        gather = prefill_mask = valid = None
        if len(sizes):
            longest = int(sizes.max())
            columns = torch.arange(longest)
            real = columns[None, :] < sizes[:, None]
            gather = torch.where(real, decode + starts[:, None] + columns[None, :], 0)
            prefill_mask = ((columns[:, None] >= columns[None, :])[None] & real[:, None, :])[:, None]
            valid = real.reshape(-1)
            width = max(width, longest)
        return cls(decode, lengths, chunks, decode_bias, len(sizes), gather, prefill_mask, valid, width)


def chunked_columns(lengths: Sequence[int], chunk: int) -> int:
    """Cache columns the decode attention reads for rows of these lengths in this order (see
    :attr:`sao.rollout.torch_engine.TorchEngineConfig.attention_chunk`): each chunk of rows reads up to its longest row."""
    return sum(max(lengths[s : s + chunk]) * len(lengths[s : s + chunk]) for s in range(0, len(lengths), chunk))


def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SlotLayout,
                      scaling: float) -> torch.Tensor:
    """Attention of the decode rows, one query token each: ``query`` ``(decode, heads, head_dim)``, ``key`` /
    ``value`` the slot cache; returns ``(decode, heads, head_dim)``.

    Per chunk of rows, two batched matrix products over ``(row, kv head)`` pairs with the query heads of a
    group stacked (grouped KV heads are read once, never copied per query head); ``decode_bias`` hides the
    columns after each row's position (its chunk may be wider). Decoding one token per row reads the
    cache once and does little arithmetic on it: this is a memory-bound step, and the chunks keep short
    rows from reading the padding up to the batch's longest row. A layout built for the compiled kernel
    (``layout.lengths``) goes to :func:`sao.rollout.kernels.decode_attention` instead."""
    if layout.lengths is not None:
        return decode_attention(query, key, value, layout.lengths, scaling)
    _, kv_heads, _, head_dim = key.shape
    group = query.shape[1] // kv_heads
    parts = []
    for start, end, width in layout.chunks:
        rows = (end - start) * kv_heads
        q = query[start:end].reshape(rows, group, head_dim)
        k = key[start:end, :, :width].reshape(rows, width, head_dim)
        v = value[start:end, :, :width].reshape(rows, width, head_dim)
        bias = layout.decode_bias[start * kv_heads : end * kv_heads, :, :width]
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scaling)  # (rows, group, width)
        parts.append(torch.bmm(torch.softmax(scores, dim=-1), v).view(end - start, group * kv_heads, head_dim))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    sao_slot_layout: SlotLayout | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """Attention of a packed engine step over the slot cache (registered with Transformers).

    ``query`` is ``(1, heads, tokens, head_dim)`` in packed order; ``key`` / ``value`` are the whole slot
    cache ``(slots, kv_heads, capacity, head_dim)`` (see :class:`SlotCache`). Decode tokens attend to
    their own slot up to their position (:func:`_decode_attention`); each joiner's tokens attend causally
    within their own slot (one ``scaled_dot_product_attention`` call, grouped KV heads kept grouped).
    Without a layout (the model used outside the engine) it is plain ``sdpa`` attention."""
    if sao_slot_layout is None:
        gqa = key.shape[1] != query.shape[1]
        is_causal = attention_mask is None and query.shape[2] > 1
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=is_causal, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    layout = sao_slot_layout
    packed = query[0].transpose(0, 1)  # (tokens, heads, head_dim)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    parts = []
    n = layout.decode
    if n:
        parts.append(_decode_attention(packed[:n], key, value, layout, scaling))
    if layout.joiners:
        longest = layout.gather.shape[1]
        q = packed[layout.gather].transpose(1, 2)  # (joiners, heads, longest, head_dim)
        rows = slice(n, n + layout.joiners)
        out = F.scaled_dot_product_attention(q, key[rows, :, :longest], value[rows, :, :longest],
                                             attn_mask=layout.prefill_mask, scale=scaling, enable_gqa=True)
        parts.append(out.transpose(1, 2).flatten(0, 1)[layout.valid])  # (joiner tokens, heads, head_dim)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0), None


AttentionInterface.register(SLOT_ATTENTION, slot_attention)


class SlotCache(Cache):
    """A KV cache with one slot per running request and each slot's own length.

    Layer ``l`` keeps keys and values of shape ``(slots, kv_heads, capacity, head_dim)``; a request's
    tokens sit at columns ``0 .. length-1`` of its slot, so a join writes only its own slot (no copy of the
    batch's cache) and a finished request frees its slot. Before each forward the engine binds, for every
    packed token, the slot and column it is written to; ``update`` writes them there and returns the whole
    cache, which :func:`slot_attention` reads slot by slot. Capacity grows by doubling up to
    ``max_position_embeddings``.
    """

    def __init__(self, config: object, slots: int, dtype: torch.dtype) -> None:
        super().__init__(layers=[])
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads  # none: GPT-2, GPT-NeoX
        self._shape = (slots, kv_heads, head_dim)
        self.kv_heads = kv_heads
        self._layers = text.num_hidden_layers
        self._limit = getattr(text, "max_position_embeddings", None) or 1 << 20
        self.dtype = dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self._slots: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None
        self.reserve(min(256, self._limit))

    def reserve(self, width: int) -> None:
        """Make room for ``width`` columns (grows by doubling; existing contents kept)."""
        if width <= self.capacity:
            return
        if width > self._limit:
            raise ValueError(f"a sequence of {width} tokens exceeds max_position_embeddings ({self._limit})")
        capacity = min(max(width, 2 * self.capacity), self._limit)
        slots, heads, head_dim = self._shape

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(slots, heads, capacity, head_dim, dtype=self.dtype)
            if old is not None:
                new[:, :, : old.shape[2]] = old
            return new

        self.keys = [grown(self.keys[i] if self.keys else None) for i in range(self._layers)]
        self.values = [grown(self.values[i] if self.values else None) for i in range(self._layers)]
        self.capacity = capacity

    def bind(self, slots: torch.Tensor, columns: torch.Tensor) -> None:
        """The next forward's packed tokens go to ``(slots[i], columns[i])``."""
        self._slots, self._columns = slots, columns

    def move(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """Copy the first ``width`` columns of slots ``src`` into slots ``dst``."""
        for tensor in (*self.keys, *self.values):
            tensor[dst, :, :width] = tensor[src, :, :width]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self._slots, :, self._columns] = key_states[0].transpose(0, 1)
        values[self._slots, :, self._columns] = value_states[0].transpose(0, 1)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._columns is None else int(self._columns.max()) + 1

    @property
    def is_compileable(self) -> bool:
        return False
