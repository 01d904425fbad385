"""The critic (SAO section 3): the policy's decoder with a scalar value head, attention frozen.

Notation:
    B sequences, L tokens per sequence (prompt and everything after it), H hidden size.
    state_values: (B, L) float32, the value head over the final hidden state at each position: the value
        of the state after reading tokens 0..i.
    action_mask: (B, L) bool, True at tokens the policy sampled.
    V(s_t): the value of the state in which action token t was chosen, i.e. ``state_values[:, t - 1]``
        (the same shift as log pi(a_t | s_t) reading the logits at t - 1).

Initialisation: a deep copy of the policy's decoder (embeddings, layers, final norm; no LM head) plus a
new ``Linear(H, 1)`` value head, normal(0, ``value_head_init_std``) weights and zero bias.

Freezing: ``requires_grad=False`` on every self-attention parameter (q/k/v/o projections and the q/k
norms), and by default on the embeddings and RMSNorms too, so that, as in the paper, only the MLP / MoE
parts (expert projections and router) and the value head train. Freezing cuts optimiser state, not
the forward: there is no ``torch.no_grad`` anywhere, so the gradient still flows through frozen
attention into earlier layers' experts (tested).

Routing: the critic shares the policy's MoE architecture but never replays the rollout's recorded
routing (R3, :mod:`sao.models.routing`). Its routers are its own copies, trained on the value loss, so
the experts the *policy's* router chose at rollout time say nothing about which of the critic's experts
should serve a token; and the critic's forward enters no importance ratio, which is what replay
protects. Its routing is always computed live.

Values are unconstrained (no squashing): a value outside the reward range flips advantage signs, so
callers should monitor it (SAO.md section 3).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from sao.models.trimmed import decoder_at, supports_decoder_at

__all__ = [
    "Critic",
    "CriticConfig",
    "attention_modules",
    "decoder_parts",
    "load_critic",
    "save_critic",
    "values_at_actions",
]

_HEAD_FILE = "value_head.safetensors"
_CONFIG_FILE = "sao_critic.json"


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """Which parts of the critic train, and how the value head starts.

    Attributes:
        freeze_attention: q/k/v/o projections and q/k norms get ``requires_grad=False`` (the paper).
        train_embeddings: also train the token embeddings (off: the paper trains MLP/experts only).
        train_norms: also train the layers' RMSNorms and the final norm (off, as above).
        value_head_init_std: std of the value head's initial weights (bias starts at 0). Not 0: a zero
            head would block the gradient into the decoder on the first step.
        seed: seeds the value head's initialisation.
    """

    freeze_attention: bool = True
    train_embeddings: bool = False
    train_norms: bool = False
    value_head_init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.value_head_init_std <= 0:
            raise ValueError(f"CriticConfig.value_head_init_std must be > 0, got {self.value_head_init_std}")

    def trainable(self, name: str, attention: frozenset[str] = frozenset(), embeddings: frozenset[str] = frozenset(),
                  norms: frozenset[str] = frozenset()) -> bool:
        """Whether the decoder parameter ``name`` (as in ``named_parameters()``) trains. The module
        names of the decoder's attention blocks, embeddings and norms (:func:`decoder_parts`) place it;
        without them, Llama/Qwen naming does."""
        def inside(modules: frozenset[str]) -> bool:
            return any(name.startswith(module + ".") for module in modules)

        if inside(attention) or ".self_attn." in f".{name}":
            return not self.freeze_attention
        if inside(embeddings) or "embed_tokens" in name:
            return self.train_embeddings
        if inside(norms) or name.endswith("norm.weight") or name == "norm.weight":
            return self.train_norms
        return True


def _outermost(names: list[str]) -> frozenset[str]:
    return frozenset(name for name in names if not any(name.startswith(other + ".") for other in names))


def decoder_parts(decoder: nn.Module) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """Module names of ``decoder``'s attention blocks (:func:`attention_modules`), embeddings (token
    and position: ``nn.Embedding`` modules) and norms (class names containing ``Norm``)."""
    modules = [(name, module) for name, module in decoder.named_modules() if name]
    embeddings = _outermost([name for name, module in modules if isinstance(module, nn.Embedding)])
    norms = _outermost([name for name, module in modules if "Norm" in type(module).__name__])
    return attention_modules(decoder), embeddings, norms


def attention_modules(decoder: nn.Module) -> frozenset[str]:
    """The names of the attention blocks of ``decoder``'s layers, found per decoder layer whatever the
    architecture calls them (``self_attn`` in Llama, Qwen and Mistral, ``attn`` in GPT-2, ...): the
    outermost submodules whose class name ends with ``Attention`` (their q/k/v/o projections and q/k
    norms are inside)."""
    return _outermost([name for name, module in decoder.named_modules()
                       if name and type(module).__name__.endswith("Attention")])


class Critic(nn.Module):
    """Value model ``V(s)``: decoder ``backbone`` + ``value_head``. Build with :meth:`from_policy`."""

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear, config: CriticConfig) -> None:
        super().__init__()
        hidden = backbone.config.hidden_size
        if tuple(value_head.weight.shape) != (1, hidden):
            raise ValueError(f"value_head must be Linear({hidden}, 1), got weight shape {tuple(value_head.weight.shape)}")
        self.backbone = backbone
        self.value_head = value_head
        self.config = config
        self.apply_freezing()

    @classmethod
    def from_policy(cls, policy: PreTrainedModel, config: CriticConfig | None = None) -> Critic:
        """Copy ``policy``'s decoder (the policy is untouched) and add a fresh value head."""
        config = config or CriticConfig()
        backbone = copy.deepcopy(policy.get_decoder())
        hidden = backbone.config.hidden_size
        dtype = next(backbone.parameters()).dtype
        head = nn.Linear(hidden, 1, dtype=dtype)
        generator = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():  # initialisation only; the forward never uses no_grad
            head.weight.copy_(torch.randn(1, hidden, generator=generator) * config.value_head_init_std)
            head.bias.zero_()
        return cls(backbone, head, config)

    def apply_freezing(self) -> None:
        """Set ``requires_grad`` on every backbone parameter from :attr:`config`; the head trains."""
        parts = decoder_parts(self.backbone)
        for name, parameter in self.backbone.named_parameters():
            parameter.requires_grad_(self.config.trainable(name, *parts))
        for parameter in self.value_head.parameters():
            parameter.requires_grad_(True)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``state_values`` (B, L) float32 for ``input_ids`` (B, L); ``attention_mask`` (B, L) 1 = real token."""
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    def values_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) float32 ``state_values`` at ``positions`` (B, T) of right-padded ``input_ids`` (B, L): the
        backbone's last layer runs at those positions only where :func:`~sao.models.trimmed.decoder_at`
        supports it, else the whole forward is gathered. Both give the same values to float rounding."""
        if supports_decoder_at(self.backbone):
            return self.value_head(decoder_at(self.backbone, input_ids, positions)).squeeze(-1).float()
        return self(input_ids).gather(1, positions)

    def action_values(
        self,
        input_ids: torch.Tensor,
        action_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V(s_t) at each action token t, 0 elsewhere: (B, L). See :func:`values_at_actions`."""
        return values_at_actions(self(input_ids, attention_mask), action_mask)


def values_at_actions(state_values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Values aligned with action tokens: ``out[:, t] = state_values[:, t - 1]`` where ``action_mask[:, t]``.

    Args:
        state_values: (B, L) value of the state after each position.
        action_mask: (B, L) bool; position 0 cannot be an action (no state precedes it).

    Returns:
        (B, L) V(s_t) at action tokens, exactly 0 at prompt, observation and padding tokens, so values
        are never read (or trained) off actions.
    """
    if state_values.shape != action_mask.shape:
        raise ValueError(f"state_values {tuple(state_values.shape)} and action_mask {tuple(action_mask.shape)} differ in shape")
    action_mask = action_mask.bool()
    if action_mask.shape[-1] and bool(action_mask[:, 0].any()):
        raise ValueError("action_mask[:, 0] is True: the first token of a sequence cannot be an action (put the prompt first)")
    previous = torch.nn.functional.pad(state_values[:, :-1], (1, 0))
    return torch.where(action_mask, previous, torch.zeros((), dtype=state_values.dtype, device=state_values.device))


def save_critic(critic: Critic, path: str | Path) -> Path:
    """Write the backbone (``save_pretrained``, safetensors), the value head and the config; returns ``path``.
    The critic may be on any device: the files hold CPU tensors, and :func:`load_critic` loads on CPU."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    critic.backbone.save_pretrained(path, safe_serialization=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in critic.value_head.state_dict().items()},
              str(path / _HEAD_FILE))
    (path / _CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(critic.config), indent=2, sort_keys=True) + "\n")
    return path


def load_critic(path: str | Path) -> Critic:
    """Load a directory written by :func:`save_critic` (freezing re-applied from its config)."""
    path = Path(path)
    for name in ("config.json", _HEAD_FILE, _CONFIG_FILE):
        if not (path / name).exists():
            raise FileNotFoundError(f"load_critic: {path} has no {name} (not written by save_critic)")
    config = CriticConfig(**json.loads((path / _CONFIG_FILE).read_text()))
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from sao.models.policy import sets_experts_implementation

    options = {"attn_implementation": "sdpa"}
    backbone_config = AutoConfig.from_pretrained(str(path))
    if sets_experts_implementation(MODEL_MAPPING.get(type(backbone_config), None), backbone_config):
        options["experts_implementation"] = "grouped_mm"
    backbone = AutoModel.from_pretrained(str(path), **options)
    state = load_file(str(path / _HEAD_FILE))
    head = nn.Linear(backbone.config.hidden_size, 1, dtype=state["weight"].dtype)
    head.load_state_dict(state)
    critic = Critic(backbone, head, config)
    critic.train(False)
    return critic
