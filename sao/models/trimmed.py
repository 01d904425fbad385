"""A decoder's final hidden states at chosen positions only: the last layer runs where it is read.

The trainer reads the models' outputs at the completion's positions only (the policy's log-probabilities
of the completion tokens, the critic's values of the states they were sampled in); nothing reads the
last layer's outputs at the prompt's positions. Every layer but the last must still run at every
position (the last layer's keys and values are taken from their outputs), but the last one needs, at
the other positions, only its key and value projections. :func:`decoder_at` runs the decoder's own
forward up to its last layer, then that layer's attention with queries at the chosen positions only
(keys and values at every position, causal), its MLP or mixture of experts and the final norm at those
positions only. On the peer single-turn batch (two layers, prompts about half the tokens) the SAO
update took 0.88 of its time with the whole forward (docs/RESULTS.md, section ``update``).

Notation:
    B rows, L input positions (right-padded: a row's real tokens come first), T chosen positions per row,
    H hidden size, D head size.
    positions: (B, T) input positions; several may repeat one position (clamped padding), and a position's
        output is the one the whole forward gives there, to float rounding (the attention and the
        projections run on other shapes).

Supported: decoders laid out as Llama, Qwen2, Qwen3 and Qwen3-MoE are (``embed_tokens``, ``layers``
whose items have ``input_layernorm``, ``self_attn`` with q/k/v/o projections and optional q/k norms,
``post_attention_layernorm`` and ``mlp``, then ``norm`` and ``rotary_emb``), full causal attention
(no sliding window), no attention dropout, and no MoE routing being recorded (a record covers every
position; :func:`supports_decoder_at`). Anything else takes the whole forward. A replayed routing
(:func:`~sao.models.routing.replay_routing`) is replayed at the positions the last layer runs at
(:func:`~sao.models.routing.replay_at`), each position counted once in its statistics.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from sao.models.routing import moe_routers, replay_at, replaying

__all__ = ["TRIMMED_MODEL_TYPES", "decoder_at", "supports_decoder_at", "whole_forward"]

TRIMMED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe"})
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_whole = threading.local()


@contextlib.contextmanager
def whole_forward() -> Iterator[None]:
    """Within the block (on this thread), :func:`supports_decoder_at` says False: every forward runs its
    last layer everywhere, as before this module. For side-by-side comparisons (``sao bench update``)."""
    before = getattr(_whole, "on", False)
    _whole.on = True
    try:
        yield
    finally:
        _whole.on = before


def supports_decoder_at(decoder: nn.Module) -> bool:
    """Whether :func:`decoder_at` can run ``decoder`` (see the module docstring); False means: take the
    whole forward and gather."""
    config = getattr(decoder, "config", None)
    if getattr(_whole, "on", False) or getattr(config, "model_type", None) not in TRIMMED_MODEL_TYPES:
        return False
    if any(not hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if not len(decoder.layers) or getattr(config, "attention_dropout", 0.0):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    if getattr(config, "layer_types", None) is None and getattr(config, "use_sliding_window", False):
        return False
    last = decoder.layers[-1]
    if any(not hasattr(last, name) for name in _LAYER_PARTS):
        return False
    if any(not hasattr(last.self_attn, name) for name in _ATTENTION_PARTS):
        return False
    # a routing record (forward hooks) covers every position; a router's forward replaced by anything but
    # a replay (which replay_at points at the positions run) cannot be told which positions it sees
    return not any(router._forward_hooks or ("forward" in router.__dict__ and not replaying(router))
                   for router in moe_routers(last))


def decoder_at(decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, T, H) ``decoder``'s final hidden states (after its final norm) at ``positions`` (B, T) of
    right-padded ``input_ids`` (B, L), its last layer run at those positions only. The caller checks
    :func:`supports_decoder_at` first."""
    if positions.dim() != 2 or positions.shape[0] != input_ids.shape[0]:
        raise ValueError(f"positions {tuple(positions.shape)} must be (B, T) over input_ids {tuple(input_ids.shape)}")
    last = decoder.layers[-1]
    with _last_layer_at(last, positions):
        return decoder(input_ids=input_ids, use_cache=False).last_hidden_state


@contextlib.contextmanager
def _last_layer_at(layer: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Within the block, ``layer``'s forward (the decoder's own loop calls it) returns its output at
    ``positions`` only, (B, T, H)."""

    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                **_: object) -> torch.Tensor:
        return _layer_at(layer, hidden_states, position_embeddings, positions)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` (B, heads, N, D) with ``cos``/``sin`` (B, N, D), as the models apply it."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def _layer_at(layer: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
              positions: torch.Tensor) -> torch.Tensor:
    """One pre-norm decoder layer on ``hidden`` (B, L, H), its output at ``positions`` (B, T) only."""
    rows, length, width = hidden.shape
    attention = layer.self_attn
    head_dim = attention.head_dim
    at = positions.unsqueeze(-1)
    residual = hidden.gather(1, at.expand(-1, -1, width))
    normed = layer.input_layernorm(hidden)
    query = attention.q_proj(normed.gather(1, at.expand(-1, -1, width))).view(rows, positions.shape[1], -1, head_dim)
    key = attention.k_proj(normed).view(rows, length, -1, head_dim)
    value = attention.v_proj(normed).view(rows, length, -1, head_dim).transpose(1, 2)
    if hasattr(attention, "q_norm"):
        query, key = attention.q_norm(query), attention.k_norm(key)
    cos, sin = (part.expand(rows, -1, -1) for part in position_embeddings)
    query = _rotary(query.transpose(1, 2), cos.gather(1, at.expand(-1, -1, head_dim)),
                    sin.gather(1, at.expand(-1, -1, head_dim)))
    key = _rotary(key.transpose(1, 2), cos, sin)
    causal = torch.arange(length, device=hidden.device).view(1, 1, 1, length) <= positions.view(rows, 1, -1, 1)
    attended = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal, scale=attention.scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    out = residual + attention.o_proj(attended.transpose(1, 2).reshape(rows, positions.shape[1], -1))
    tokens = positions + length * torch.arange(rows, device=hidden.device).unsqueeze(-1)  # flat, as recorded
    first = torch.ones_like(positions, dtype=torch.bool)
    first[:, 1:] = positions[:, 1:] != positions[:, :-1]  # a clamped repeat is counted once
    with replay_at(layer.mlp, tokens, first):
        return out + layer.mlp(layer.post_attention_layernorm(out))
