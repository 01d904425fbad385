"""The policy: a tiny ``Qwen3MoeForCausalLM`` built from code, saved and loaded as a Hugging Face directory.

Qwen3-MoE is the architecture of the paper's Qwen3-30B-A3B. The defaults (:class:`PolicyConfig`) are
the configuration measured to work in both transformers and vLLM on CPU (see STACK-NOTES): about 625k
parameters, fp32, ``sdpa`` attention and ``grouped_mm`` experts (``batched_mm`` is 25-30x slower on CPU
and is refused).

A policy directory is what ``save_pretrained`` writes (``config.json``, ``model.safetensors``,
``generation_config.json``) plus the tokenizer files and ``sao_policy.json`` (:class:`PolicyMetadata`:
policy version, tokenizer and chat-template versions, free-form provenance). :func:`load_policy`
reads it with ``AutoModelForCausalLM.from_pretrained``, so a real checkpoint directory loads through the
same function.

The saved generation config samples from the model's own distribution (``top_k=0``, ``top_p=1``,
temperature 1; ``generate()`` would otherwise apply top_k=50) and stops at the chat format's stop ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao.models.chat import ChatTokens, tool_calls_problem
from sao.models.tokenizer import chat_template_version, save_tokenizer, tokenizer_version

__all__ = [
    "METADATA_FILE",
    "PolicyConfig",
    "PolicyMetadata",
    "build_policy",
    "ModelDirectoryError",
    "check_model_directory",
    "count_parameters",
    "import_policy",
    "is_mixture_of_experts",
    "routing_note",
    "load_policy",
    "read_policy_metadata",
    "sets_experts_implementation",
    "save_policy",
]

METADATA_FILE = "sao_policy.json"
_ATTENTION = ("sdpa", "eager")
_EXPERTS = ("grouped_mm", "eager")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_implementations(attn_implementation: str, experts_implementation: str, dtype: str) -> None:
    if attn_implementation not in _ATTENTION:
        raise ValueError(f"attn_implementation must be one of {_ATTENTION}, got {attn_implementation!r}")
    if experts_implementation not in _EXPERTS:
        hint = " (batched_mm is 25-30x slower on CPU, see STACK-NOTES)" if experts_implementation == "batched_mm" else ""
        raise ValueError(f"experts_implementation must be one of {_EXPERTS}, got {experts_implementation!r}{hint}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Architecture of the tiny Qwen3-MoE policy (Hugging Face ``Qwen3MoeConfig`` field names).

    Attributes:
        vocab_size: embedding rows; at least the tokenizer's vocabulary.
        hidden_size: residual width.
        intermediate_size: width of a dense MLP (unused while every layer is MoE; kept for vLLM).
        moe_intermediate_size: width of one expert (avoid 2 * it == hidden_size: a vLLM CPU quirk).
        num_hidden_layers: decoder layers, all MoE.
        num_attention_heads / num_key_value_heads: query heads and grouped KV heads.
        head_dim: per-head width (vLLM CPU needs >= 32).
        num_experts / num_experts_per_tok: experts per layer and the router's top-k.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1 (as Qwen3-30B-A3B does).
        max_position_embeddings: longest sequence (prompt + all segments).
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        initializer_range: std of the normal initialisation.
        tie_word_embeddings: share the input embedding with the output head.
        pad_token_id / eos_token_id: ``<|endoftext|>`` and ``<|im_end|>`` of :mod:`sao.models.tokenizer`.
        attn_implementation: ``sdpa`` or ``eager``.
        experts_implementation: ``grouped_mm`` or ``eager`` (never ``batched_mm``).
        dtype: parameter dtype name; fp32 on CPU.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int = 0
    eos_token_id: int = 2
    attn_implementation: str = "sdpa"
    experts_implementation: str = "grouped_mm"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_implementations(self.attn_implementation, self.experts_implementation, self.dtype)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must lie in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")

    def to_hf(self) -> Qwen3MoeConfig:
        """The equivalent ``Qwen3MoeConfig``."""
        config = Qwen3MoeConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            bos_token_id=None,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_cache=True,
        )
        config._attn_implementation = self.attn_implementation
        config._experts_implementation = self.experts_implementation
        return config


@dataclasses.dataclass(frozen=True)
class PolicyMetadata:
    """What ``sao_policy.json`` records beside the weights.

    Attributes:
        policy_version: 0 for the initial (SFT) policy, +1 per actor update.
        tokenizer_version / chat_template_version: content hashes of the saved tokenizer ('' if none).
        extra: provenance (e.g. the SFT config and its metrics), JSON-serialisable.
    """

    policy_version: int
    tokenizer_version: str = ""
    chat_template_version: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def build_policy(config: PolicyConfig | None = None, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A freshly initialised policy; the same ``(config, seed)`` always gives the same weights.

    The global torch RNG is left as it was (the initialisation uses a forked RNG state).
    """
    config = config or PolicyConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config.to_hf())
    model.to(_DTYPES[config.dtype])
    model.generation_config = _generation_config(config.pad_token_id, [config.eos_token_id])
    return model


def _generation_config(pad_token_id: int, eos_token_ids: list[int]) -> GenerationConfig:
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids,
    )


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (only those with ``requires_grad`` if ``trainable_only``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def save_policy(
    model: PreTrainedModel,
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    policy_version: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a policy directory (weights as safetensors, tokenizer, ``sao_policy.json``); returns it.

    With a tokenizer, the generation config stops at the chat format's stop ids.
    """
    if policy_version < 0:
        raise ValueError(f"policy_version must be >= 0, got {policy_version}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    metadata = PolicyMetadata(policy_version=policy_version, extra=dict(extra or {}))
    if tokenizer is not None:
        tokens = ChatTokens.from_tokenizer(tokenizer)
        model.generation_config = _generation_config(tokens.pad_id, list(tokens.stop_token_ids))
        save_tokenizer(tokenizer, path)
        metadata = dataclasses.replace(
            metadata,
            tokenizer_version=tokenizer_version(tokenizer),
            chat_template_version=chat_template_version(tokenizer),
        )
    model.save_pretrained(path, safe_serialization=True)
    (path / METADATA_FILE).write_text(json.dumps(dataclasses.asdict(metadata), indent=2, sort_keys=True) + "\n")
    return path


def read_policy_metadata(path: str | Path) -> PolicyMetadata | None:
    """``sao_policy.json`` of a policy directory, or ``None`` for a directory without one."""
    file = Path(path) / METADATA_FILE
    if not file.exists():
        return None
    data = json.loads(file.read_text())
    return PolicyMetadata(
        policy_version=int(data["policy_version"]),
        tokenizer_version=str(data.get("tokenizer_version", "")),
        chat_template_version=str(data.get("chat_template_version", "")),
        extra=dict(data.get("extra", {})),
    )


def load_policy(
    path: str | Path,
    *,
    attn_implementation: str = "sdpa",
    experts_implementation: str = "grouped_mm",
    dtype: str = "float32",
) -> PreTrainedModel:
    """Load a policy directory (ours or a real Hugging Face checkpoint) as a causal LM, in eval mode."""
    _check_implementations(attn_implementation, experts_implementation, dtype)
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"load_policy: {path} has no config.json (not a Hugging Face model directory)")
    config = AutoConfig.from_pretrained(str(path))
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if attn_implementation == "sdpa" and model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        attn_implementation = "eager"  # an architecture without an sdpa path (the engine sets its own anyway)
    options: dict[str, Any] = {"dtype": _DTYPES[dtype], "attn_implementation": attn_implementation}
    if sets_experts_implementation(model_class, config):
        options["experts_implementation"] = experts_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **options)
    model.eval()
    return model


def sets_experts_implementation(model_class: type | None, config: Any) -> bool:
    """Whether a model of ``model_class`` built from ``config`` takes an ``experts_implementation``: a
    mixture-of-experts model whose experts Transformers can dispatch (a dense model refuses the option,
    and so does an MoE model whose experts are written out, such as Llama 4's)."""
    can_set = getattr(model_class, "_can_set_experts_implementation", None)  # Transformers 5's own test
    return is_mixture_of_experts(config) and can_set is not None and bool(can_set())


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
ROUTING_RECORDED = ("qwen3_moe",)
"""Model types whose routers :mod:`sao.models.routing` records and replays (R3)."""


class ModelDirectoryError(ValueError):
    """A model directory that cannot be a policy: what is missing or wrong, and where."""


def check_model_directory(path: str | Path, *, need_tools: bool = False, own_format: bool = False,
                          template_variables: Mapping[str, Any] | None = None) -> PreTrainedTokenizerBase:
    """Check a Hugging Face model directory of the user's before anything starts: ``config.json``,
    weights, a fast tokenizer with a chat template and a token that ends a turn; with ``need_tools``
    (the built-in tool loop runs), this project's tool-call tokens or, with ``own_format`` (tasks of
    one's own: the built-in math_tool task asks for this project's format), a chat template that
    renders tool calls in a layout the loop reads (:func:`sao.models.chat.renders_tool_calls`: the loop
    then runs in the model's own format, :mod:`sao.rollout.env_agent`). ``template_variables``
    (``model.chat_template_kwargs``) are set in its chat template first
    (:func:`sao.models.tokenizer.with_template_variables`), so the checks see the template the run
    renders with. Returns the tokenizer. Loads no weights.

    Raises:
        ModelDirectoryError: naming the directory and what it lacks.
    """
    from sao.models.tokenizer import load_tokenizer, with_template_variables

    path = Path(path)
    if not path.is_dir():
        raise ModelDirectoryError(f"model.path {path}: no such folder")
    if not (path / "config.json").exists():
        raise ModelDirectoryError(f"model.path {path}: no config.json: not a Hugging Face model directory "
                                  "(save one with model.save_pretrained(path))")
    if not (list(path.glob("*.safetensors")) or list(path.glob("pytorch_model*.bin"))):
        raise ModelDirectoryError(f"model.path {path}: no weights (*.safetensors or pytorch_model*.bin)")
    try:
        tokenizer = load_tokenizer(path)
    except Exception as error:  # transformers raises OSError, ValueError, TypeError, ... here
        raise ModelDirectoryError(f"model.path {path}: no usable tokenizer ({type(error).__name__}: {error}); "
                                  "save one beside the model with tokenizer.save_pretrained(path)") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ModelDirectoryError(f"model.path {path}: the tokenizer has no chat template; rollouts render chat "
                                  "messages with it (set tokenizer.chat_template and save the tokenizer again)")
    try:
        with_template_variables(tokenizer, template_variables)
    except ValueError as error:
        raise ModelDirectoryError(f"model.chat_template_kwargs: {error}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ModelDirectoryError(f"model.path {path}: the tokenizer is not a fast tokenizer (tokenizer.json); "
                                  "trajectories record its content hash")
    try:
        tokens = ChatTokens.from_tokenizer(tokenizer)
    except ValueError as error:
        raise ModelDirectoryError(f"model.path {path}: {error}") from None
    _check_architecture(path)
    if need_tools and not tokens.supports_tools and not own_format:
        raise ModelDirectoryError(
            f"model.path {path}: the tokenizer lacks the tool-call tokens of this project's chat format "
            "(<tool_call>, <answer>, ...) that the built-in math_tool task is written in: give your tasks in "
            "data.train (a model whose chat template renders tool calls in the Hermes JSON, XML, GLM-4.5, bare JSON or a Mistral layout "
            "calls the tool in its own format there), or set env.max_tool_calls: 0 with them for single-turn")
    problem = tool_calls_problem(tokenizer) if need_tools and not tokens.supports_tools else None
    if problem is not None:
        raise ModelDirectoryError(
            f"model.path {path}: the tokenizer lacks the tool-call tokens of this project's chat format "
            f"(<tool_call>, <answer>, ...), and its chat template cannot call tools in its own format: {problem}; "
            "so actions cannot call the Python tool: set env.max_tool_calls: 0 (single-turn), or call tools from "
            "an agent of your own (env.agent)")
    return tokenizer


def _check_architecture(path: Path) -> None:
    """A causal LM that Transformers knows and the torch engine can run (built on the meta device:
    no weights are read, nothing is computed)."""
    from sao.rollout.torch_engine import engine_support  # the engine's module imports this one

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as error:
        raise ModelDirectoryError(f"model.path {path}: config.json does not load ({error})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelDirectoryError(f"model.path {path}: {config.model_type} is not a causal language model that "
                                  f"transformers can load with AutoModelForCausalLM")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    unsupported = engine_support(model)
    if unsupported:
        raise ModelDirectoryError(f"model.path {path}: the torch rollout engine cannot run it: {unsupported}")


def import_policy(source: str | Path, path: str | Path, template_variables: Mapping[str, Any] | None = None) -> Path:
    """The user's model directory ``source`` as this project's version-0 policy directory ``path``
    (float32 weights, its tokenizer with ``template_variables`` set in its chat template,
    ``sao_policy.json`` naming the source); checked first (:func:`check_model_directory`)."""
    tokenizer = check_model_directory(source, template_variables=template_variables)
    model = load_policy(source)
    return save_policy(model, path, tokenizer, extra={"source": str(Path(source).resolve()),
                                                      "chat_template_kwargs": dict(template_variables or {})})


def routing_note(path: str | Path) -> str | None:
    """What a run with the model at ``path`` should say once about MoE routing: None for a dense model
    or one whose routing is recorded (:data:`ROUTING_RECORDED`)."""
    config = AutoConfig.from_pretrained(str(path))
    if not is_mixture_of_experts(config) or config.model_type in ROUTING_RECORDED:
        return None
    return (f"routing is not recorded: {config.model_type} is a mixture-of-experts model whose routers are not "
            f"among those recorded and replayed ({', '.join(ROUTING_RECORDED)}); routed_experts stays null and the "
            "actor's forward routes live")


def is_mixture_of_experts(config: Any) -> bool:
    """Whether a Hugging Face model config describes a mixture-of-experts model (Qwen-MoE's
    ``num_experts``, Mixtral's ``num_local_experts``, DeepSeek's ``n_routed_experts``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any((getattr(text, name, None) or 0) > 1 for name in _EXPERT_COUNTS)
