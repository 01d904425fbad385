"""MoE routing: record the experts a forward pass chose, and replay recorded choices (R3).

Rollout Routing Replay (R3, arXiv 2510.11370): in RL on a mixture-of-experts policy the rollout
engine and the trainer choose experts independently, and small numerical differences or stale weights
flip near-tied top-k decisions. A flipped expert changes the token's hidden state, so the trainer's
log pi_theta is evaluated under a different network than the one that sampled, and the DIS ratio rho
measures routing noise rather than policy change. R3 records the expert ids of every token at rollout
time and forces them in the training forward, while the routing *weights* still come from the live
router, so the router keeps learning.

Notation:
    N tokens of one forward (``B * L`` flattened, as the MoE block flattens them), E experts per layer,
    K experts per token (the router's top-k), M MoE layers (in model order).
    router_logits: (N, E), ``h @ W_router^T`` of the live router.
    experts: (N, M, K) expert ids; within a layer in the router's top-k order (most probable first).

Replayed routing weights (Qwen3-MoE's router, :class:`Qwen3MoeTopKRouter`, with the selection
replaced)::

    p = softmax(router_logits)                  # (N, E), float32
    w = p.gather(-1, experts)                   # (N, K)
    w = w / w.sum(-1)        if norm_topk_prob  # renormalise the top-k weights

Where ``experts`` equals the live top-k (same ids, same order), ``w`` is bit-identical to the live
router's output (``gather`` reads the very values ``topk`` returned; the sums run in the same order),
so replaying unchanged routing changes nothing. Gradients reach the router weight through ``p``; the
selection itself is discrete and carries none, exactly as in the live router.

Tokens without a recorded routing (``mask`` False: padding, the final token of a trajectory, which the
engine never ran, observation tokens appended after the last generation, rows written before routing
was recorded) are routed live.

A forward may run a layer at some positions only (:func:`sao.models.trimmed.decoder_at` runs the last
layer where its outputs are read): :func:`replay_at` tells that layer's routers which of the recorded
positions their tokens are, and they replay and count those.

Only :class:`Qwen3MoeTopKRouter` routers are recognised (the architecture of the policy and critic);
:func:`moe_routers` of a dense model is empty and both context managers then do nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

__all__ = [
    "ReplayStats",
    "RoutingRecorder",
    "moe_routers",
    "record_routing",
    "replay_at",
    "replay_routing",
    "replaying",
    "replayed_weights",
]


def moe_routers(model: nn.Module) -> list[Qwen3MoeTopKRouter]:
    """The MoE routers of ``model`` in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


def replayed_weights(router_logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """Routing weights (N, K) of ``experts`` (N, K) under the live ``router_logits`` (N, E).

    The same arithmetic as the live router (softmax in float32, renormalised top-k if
    ``norm_topk_prob``, cast back to the logits' dtype), with the selection given.
    """
    probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


class RoutingRecorder:
    """Records the expert ids every MoE router of a model selects, one entry per forward pass.

    Forward hooks on the routers (:meth:`attach` / :meth:`detach`, or the :func:`record_routing` context)
    keep each router's top-k ids as uint8 (so at most 256 experts per layer). The hooks read the
    router's output only: recording changes no value of the forward.

    Attributes:
        layers: M, the number of MoE routers.
        calls: per forward pass not yet popped, one (N, K) uint8 tensor per MoE layer, in layer order.
    """

    def __init__(self, model: nn.Module) -> None:
        self._routers = moe_routers(model)
        for router in self._routers:
            if router.num_experts > 256:
                raise ValueError(f"RoutingRecorder stores expert ids as uint8; a router has {router.num_experts} experts")
        self.layers = len(self._routers)
        self.calls: list[list[torch.Tensor]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> RoutingRecorder:
        """Start recording (registers the hooks); returns self."""
        if not self._handles:
            self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]
        return self

    def detach(self) -> None:
        """Stop recording (removes the hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> object:
        def hook(module: nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            if layer == 0:
                self.calls.append([])
            self.calls[-1].append(output[2].to(torch.uint8))

        return hook

    def pop(self) -> torch.Tensor:
        """(N, M, K) uint8 expert ids of the oldest recorded forward pass, removed from :attr:`calls`."""
        if not self.calls:
            raise RuntimeError("RoutingRecorder.pop: no forward pass was recorded")
        layers = self.calls.pop(0)
        if len(layers) != self.layers:
            raise RuntimeError(f"a forward pass ran {len(layers)} of the model's {self.layers} MoE routers")
        return torch.stack(layers, dim=1)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecorder]:
    """A :class:`RoutingRecorder` of ``model``, recording within the block."""
    recorder = RoutingRecorder(model).attach()
    try:
        yield recorder
    finally:
        recorder.detach()


@dataclasses.dataclass
class ReplayStats:
    """Disagreement between the live top-k and the replayed (recorded) experts, per row and layer.

    Attributes:
        disagree: (B, M) float, recorded tokens whose live top-k *set* differs from the recorded set.
        recorded: (B, M) float, tokens with a recorded routing that each layer routed, per row (the
            denominator of each layer; a layer run at some positions only routes fewer).
    """

    disagree: torch.Tensor
    recorded: torch.Tensor


@contextlib.contextmanager
def replay_routing(model: nn.Module, experts: torch.Tensor, mask: torch.Tensor) -> Iterator[ReplayStats]:
    """Within the block, every forward of ``model`` on a ``(B, L)`` input routes recorded tokens to their
    recorded experts (see the module docstring); the routers' weights keep their gradients.

    Args:
        experts: (B, L, M, K) integer expert ids per input position and MoE layer.
        mask: (B, L) bool, True where ``experts`` holds a recorded routing; other positions route live.

    Yields :class:`ReplayStats`, filled by the forward passes run inside the block (summed over them).
    """
    routers = moe_routers(model)
    if experts.dim() != 4 or experts.shape[:2] != mask.shape or experts.shape[2] != len(routers):
        raise ValueError(
            f"replay_routing: experts {tuple(experts.shape)} must be (B, L, M={len(routers)}, K) over mask "
            f"{tuple(mask.shape)}"
        )
    batch = mask.shape[0]
    stats = ReplayStats(disagree=torch.zeros(batch, len(routers), device=mask.device),
                        recorded=torch.zeros(batch, len(routers), device=mask.device))
    flat_mask = mask.reshape(-1)
    for router in routers:
        if experts.shape[3] != router.top_k:
            raise ValueError(f"replay_routing: recorded top-k {experts.shape[3]} != router top_k {router.top_k}")
        if mask.any() and int(experts[mask].max()) >= router.num_experts:
            raise ValueError(f"replay_routing: a recorded expert id {int(experts[mask].max())} is not below the "
                             f"model's {router.num_experts} experts (a record of another architecture?)")
    originals = [router.__dict__.get("forward") for router in routers]  # None: the class's forward
    for layer, router in enumerate(routers):
        recorded = experts[:, :, layer].reshape(-1, router.top_k).long()
        router.forward = _replaying_forward(router, recorded, flat_mask, stats, layer, batch)
    try:
        yield stats
    finally:
        for router, original in zip(routers, originals, strict=True):
            if original is None:
                del router.forward
            else:
                router.forward = original


def replaying(router: nn.Module) -> bool:
    """Whether ``router`` replays a recorded routing (inside :func:`replay_routing`)."""
    return getattr(router.__dict__.get("forward"), "replays", False)


@contextlib.contextmanager
def replay_at(module: nn.Module, tokens: torch.Tensor, counted: torch.Tensor) -> Iterator[None]:
    """Within the block, the replaying routers inside ``module`` route token i of their input as recorded
    for flat position ``tokens[i]`` (of the ``B * L`` the record covers); ``counted`` (same shape, bool)
    marks the tokens their statistics count (False: a repeat of a position already counted). Routers
    that do not replay are left alone."""
    routers = [router for router in moe_routers(module) if replaying(router)]
    for router in routers:
        router.replay_tokens = (tokens.reshape(-1), counted.reshape(-1))
    try:
        yield
    finally:
        for router in routers:
            del router.replay_tokens


def _replaying_forward(router: Qwen3MoeTopKRouter, recorded: torch.Tensor, mask: torch.Tensor,
                       stats: ReplayStats, layer: int, batch: int):
    """The router's forward with the selection replaced by ``recorded`` where ``mask`` (both flat, N)."""

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        chosen, where, counted = recorded, mask, mask
        subset = router.__dict__.get("replay_tokens")
        if subset is not None:  # a layer run at some positions only (replay_at)
            tokens, counts = subset
            chosen, where = recorded[tokens], mask[tokens]
            counted = where & counts
        if hidden_states.shape[0] != where.shape[0]:
            raise ValueError(f"replay_routing: the forward has {hidden_states.shape[0]} tokens, the recorded "
                             f"routing covers {where.shape[0]} (B * L of the batch it was built for)")
        router_logits = nn.functional.linear(hidden_states, router.weight)  # (N, E)
        with torch.no_grad():
            live = torch.topk(torch.softmax(router_logits, dtype=torch.float, dim=-1), router.top_k, dim=-1).indices
            differs = (live.sort(-1).values != chosen.sort(-1).values).any(-1) & counted
            stats.disagree[:, layer] += differs.reshape(batch, -1).sum(-1).float()
            stats.recorded[:, layer] += counted.reshape(batch, -1).sum(-1).float()
        selected = torch.where(where.unsqueeze(-1), chosen, live)
        return router_logits, replayed_weights(router_logits, selected, router.norm_topk_prob), selected

    forward.replays = True
    return forward
