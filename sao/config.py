"""The run config: one typed model (:class:`RunConfig`) of everything a training run takes, shared
by ``sao train``, the Prefect flows (their UI form is generated from it) and the lake (``runs`` table).

Sections: ``model`` (the user's model directory), ``sft`` (the warm start: the built-in policy's, or SFT of one's own model on ``sft.data``), ``data``
(the user's task files), ``reward``
(reward functions), ``env`` (episode rules on those tasks), ``rollout`` (replicas, budgets, sampling),
``algorithm`` (every :class:`~sao.train.config.UpdateConfig` field), ``train`` (steps, batch, staleness,
workers), ``value_pretraining``, ``eval``, ``lake``, ``ray`` and ``retention`` (every
:class:`~sao.train.retention.RetentionConfig` field), plus ``run_id``, ``workdir`` and ``seed``.

**One place for each default.** A setting that a component config also has takes the component's
default (:func:`default_of`), and :data:`BUILDS` names the component fields each setting is built
into; ``tests/test_config.py`` fails when a default is written out a second time or disagrees. The
``algorithm`` and ``retention`` sections are generated from their dataclasses, so a new field there
is a new setting here with no other edit. The defaults are the components' (the paper's where they
transfer); ``configs/demo.yaml`` holds what the laptop demo changes (``sao demo``, ``make demo``).

**Where values come from.** :func:`resolve` layers, lowest first: the defaults, a YAML (or JSON) file,
``--set section.key=value`` overrides, the CLI's shorthand flags; it returns the config and the
source of every key that is not a default. An unknown key, a wrong type or a value out of range is a
:class:`ConfigError` listing every problem with its dotted key, the value given and what is allowed.

**No secrets.** Object-store credentials and options come from the environment only (``AWS_*`` and
the like, read by delta-rs), never from the config, so the stored config can hold none.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from sao.envs.dataset import DatasetEnvConfig
from sao.lake.config import LakeConfig
from sao.models.critic import CriticConfig
from sao.pipeline import PipelineConfig
from sao.rollout.agent import AgentConfig
from sao.rollout.driver import DriverConfig
from sao.rollout.torch_engine import TorchEngineConfig
from sao.rollout.vllm_engine import VLLMEngineConfig
from sao.runtime import RayConfig
from sao.train.config import TrainConfig, UpdateConfig, check_gpus_per_worker
from sao.train.device import DeviceSetting, check_settings
from sao.train.evaluate import EvalConfig
from sao.train.pretrain import PretrainConfig
from sao.train.retention import RetentionConfig
from sao.train.sft import SFTConfig
from schemas.trajectories import RUN_ID_PATTERN

__all__ = ["BUILDS", "DEMO_CONFIG", "RESUME_SAFE", "RUN_OWN", "TASK_KEYS", "ConfigError", "RunConfig", "changed_keys",
           "default_of", "demo_config", "from_data", "setting_keys", "leaves", "show",
           "load_file", "resolve", "under_free_mapping", "unread_keys", "without_unread"]

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
"""The laptop demo's config (``sao demo``, ``make demo``), in the source checkout."""

_ENGINE_SIZES = ("max_num_seqs", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager")
_PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
"""vLLM's engine arguments whose product is the GPUs one engine runs on, one worker each."""

RESUME_SAFE = ("train.steps", "eval.tasks", "eval.seed", "ray.address", "ray.num_cpus", "rollout.num_replicas",
               "rollout.resources", "rollout.max_in_flight", "rollout.cancel_stale", "rollout.gpus",
               "rollout.engine", "rollout.python",
               *(f"rollout.vllm.{key}" for key in (*_ENGINE_SIZES, "startup_timeout_s")),
               *(f"rollout.vllm.engine_args.{key}" for key in (*_ENGINE_SIZES, *_PARALLEL_SIZES, "max_num_batched_tokens",
                                                               "swap_space", "cpu_offload_gb")),
               "train.workers", "train.resources", "train.device", "train.gpus_per_worker")
"""Keys a resumed run may change (how far to train, where it runs, how it is evaluated); any other
change is refused: the run's steps must stay replayable with one configuration. ``lake.root`` and
``workdir`` name where the run is, so they cannot differ on a resume at all. ``rollout.vllm.engine_args``
is compared argument by argument: those that place the engine or size its memory and batches may
change (``rollout.gpus`` with ``tensor_parallel_size``, say), any other may not."""


class ConfigError(ValueError):
    """A config that cannot be used: every problem, one per line, each with its dotted key."""


def default_of(component: type, name: str) -> Any:
    """The default of dataclass field ``name`` of ``component`` (where a setting's default lives)."""
    for field in dataclasses.fields(component):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
            raise TypeError(f"{component.__name__}.{name} has no default")
    raise TypeError(f"{component.__name__} has no field {name!r}")


def attribute_docs(component: type) -> dict[str, str]:
    """Field descriptions from the ``Attributes:`` block of a dataclass's docstring (Google style;
    an entry may name several fields: ``eps_low, eps_high: ...``)."""
    doc = component.__doc__ or ""
    _, found, block = doc.partition("Attributes:")
    if not found:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in block.splitlines():
        entry = re.match(r"^\s{4,8}([a-z_][a-z0-9_, ]*):\s*(.*)$", line)
        if entry and not line.startswith(" " * 12):
            names = [n.strip() for n in entry.group(1).split(",")]
            for name in names:
                docs[name] = entry.group(2).strip()
        elif line.strip() and names:
            for name in names:
                docs[name] += " " + line.strip()
        elif not line.strip() and docs:
            names = []
    module = sys.modules.get(component.__module__)

    def role(match: re.Match) -> str:  # :data:`NAME` shows the value too, :meth:`x` / :mod:`y` the name
        kind, name = match.group(1), match.group(2)
        value = getattr(module, name, None) if kind == "data" else None
        return name if value is None else f"{name} ({value})"

    return {name: re.sub(r":(\w+):`~?([^`]*)`", role, re.sub(r"``([^`]*)``", r"\1", text))
            for name, text in docs.items()}


class Section(BaseModel):
    """A section of the run config: unknown keys are refused, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True,
                              validate_default=True)


class DerivedSection(Section):
    """A section generated from a component dataclass (:func:`derived_section`): the same fields,
    types, defaults and descriptions; the component's own checks validate it."""

    component: ClassVar[type]
    renamed: ClassVar[dict[str, str]] = {}  # section key -> component field

    @model_validator(mode="after")
    def _component_accepts(self) -> DerivedSection:
        self.build()  # a ValueError from the component's checks is a validation error of the section
        return self

    def build(self) -> Any:
        """The component config these values make."""
        return self.component(**{self.renamed.get(key, key): getattr(self, key)
                                 for key in type(self).model_fields})


def derived_section(component: type, name: str, doc: str, renamed: Mapping[str, str] | None = None
                    ) -> type[DerivedSection]:
    renamed = dict(renamed or {})
    to_key = {field: key for key, field in renamed.items()}
    hints = typing.get_type_hints(component)
    docs = attribute_docs(component)
    fields = {to_key.get(f.name, f.name): (hints[f.name], Field(default_of(component, f.name),
                                                                description=docs.get(f.name)))
              for f in dataclasses.fields(component)}
    model = create_model(name, __base__=DerivedSection, __doc__=doc, **fields)
    model.component = component
    model.renamed = renamed
    return model


AlgorithmSection = derived_section(
    UpdateConfig, "AlgorithmSection", "The algorithm (`name`: sao or a baseline) and every setting of its update.",
    renamed={"name": "algorithm"})
RetentionSection = derived_section(
    RetentionConfig, "RetentionSection", "Which old checkpoint parts are pruned as the run goes.")
CriticSection = derived_section(
    CriticConfig, "CriticSection", "The critic built from the policy at the start of a run: which of its parts "
    "train (SAO.md section 3: attention frozen, the MLP / expert projections and the value head train: the "
    "defaults), how its value head starts.")


class ModelSection(Section):
    """The policy to train."""

    path: str | None = None
    """A Hugging Face model directory (config.json, safetensors weights, a fast tokenizer with a chat
    template), dense or mixture-of-experts; it is version 0 as it is, or after SFT on sft.data. None:
    the built-in tiny Qwen3-MoE policy, warm-started by SFT on math_tool demonstrations."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables of the model's chat template, as vLLM's and TRL's chat_template_kwargs: {enable_thinking:
    false} turns Qwen3's thinking off. Set at the top of the template that version 0 carries
    (sao.models.tokenizer.with_template_variables), so every rendering, replay and the recorded template
    hash use them."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, variables: dict[str, Any]) -> dict[str, Any]:
        from sao.models.tokenizer import template_lines

        template_lines(variables)  # names and values a template can be given
        return variables


class SFTSection(Section):
    """The SFT warm start, the run's version 0: of the built-in policy on its math_tool demonstrations,
    or of the model of model.path on sft.data (without sft.data, that model is trained as it is)."""

    seed: int = default_of(SFTConfig, "seed")
    """Seed of the warm start (policy initialisation and batch order)."""
    data: str | None = None
    """Demonstrations for the model of model.path: rows with prompt (a string or chat messages) and
    completion (the assistant's reply, a string), in the formats of data.train (sao/data.py)."""
    max_steps: int = Field(default_of(SFTConfig, "max_steps"), ge=1)
    """Optimiser steps at most (training stops earlier once the held-out success reaches its target)."""
    learning_rate: float = Field(default_of(SFTConfig, "learning_rate"), gt=0)
    """Peak AdamW learning rate (the default suits the built-in policy trained from scratch; a
    pretrained model of one's own wants far less, e.g. 1e-5)."""
    batch_size: int = Field(default_of(SFTConfig, "batch_size"), ge=1)
    """Demonstrations per optimiser step."""


class DataSection(Section):
    """The tasks: the user's files, or (without data.train) the built-in math_tool tasks. Formats and
    columns: sao/data.py (prompt, optional answer, info, task_id)."""

    train: str | None = None
    """Training tasks: a .jsonl or .parquet file, a saved datasets directory or a Delta table; None: math_tool."""
    eval: str | None = None
    """Held-out tasks (same formats); None: a seeded eval_fraction of data.train is held out."""
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Fraction of data.train held out for evaluation when data.eval is not given."""


class RewardSection(Section):
    """How the user's tasks (data.train) are scored; math_tool scores its own."""

    functions: list[str] = Field(default_factory=lambda: list(default_of(DatasetEnvConfig, "rewards")),
                                 min_length=1)
    """Reward functions, module:function each, importable from the working directory or an installed
    package (sao/rewards.py: the arguments they get; built in: sao.rewards:exact_match, sao.rewards:math_verify)."""
    weights: list[float] | None = default_of(DatasetEnvConfig, "weights")
    """One weight per function (None: 1 each); the reward is the weighted sum."""

    @model_validator(mode="after")
    def _one_weight_each(self) -> RewardSection:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"weights has {len(self.weights)} values for {len(self.functions)} functions")
        return self


class VerifiersSection(Section):
    """A verifiers environment (extra sao[verifiers]; sao/envs/verifiers_env.py): its dataset is the task
    source, its rollout loop the agent, its rubric the reward."""

    id: str = Field(min_length=1)
    """The environment's module (on the import path or in the working directory), which defines load_environment."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of load_environment."""


class EnvSection(Section):
    """The rules of an episode on the user's tasks (data.train); math_tool keeps its own."""

    max_tool_calls: int = Field(default_of(DatasetEnvConfig, "max_tool_calls"), ge=0)
    """Sandboxed Python tool calls allowed per episode (0: single-turn, the first action is the answer). A
    model of your own calls the tool in its own format if its chat template renders tool calls in
    the Hermes JSON, the XML, GLM-4.5's, the bare JSON (Llama 3.1-3.3) or one of Mistral's layouts
    (sao.models.chat.template_tool_calls)."""
    tools: list[str] = Field(default_factory=lambda: list(default_of(DatasetEnvConfig, "tools")))
    """Tool functions of your own, module:function each: defined in the sandbox before each tool call's
    code, so the policy's code can call them (self-contained functions; the sandbox's limits apply)."""
    system_prompt: str = default_of(DatasetEnvConfig, "system_prompt")
    """A system message before each prompt ('' = none; a task given as chat messages keeps its own)."""
    agent: str = default_of(DatasetEnvConfig, "agent")
    """An agent of your own, module:function: async agent(client, task) -> reward (or None: the reward
    functions score it), talking to the policy through an openai.AsyncOpenAI client (sao/rollout/user_agent.py);
    '' = the built-in tool loop (max_tool_calls, tools)."""
    verifiers: VerifiersSection | None = None
    """A verifiers environment instead of data.train, reward and agent: {id: module, args: {...}}."""


class VLLMSection(Section):
    """The vLLM engine's settings (rollout.engine: vllm; sao/rollout/vllm_engine.py, docs/VLLM.md)."""

    dtype: str = default_of(VLLMEngineConfig, "dtype")
    """Model dtype in vLLM (float32 matches the trainer's recomputation on a CPU; bfloat16 on a GPU)."""
    max_model_len: int | None = Field(default_of(VLLMEngineConfig, "max_model_len"), ge=1)
    """Longest prompt plus completion (None: the model's max_position_embeddings)."""
    max_num_seqs: int = Field(default_of(VLLMEngineConfig, "max_num_seqs"), ge=1)
    """Most requests one replica decodes together."""
    gpu_memory_utilization: float | None = Field(default_of(VLLMEngineConfig, "gpu_memory_utilization"), gt=0, le=1)
    """Share of the GPU's memory vLLM may take (None: vLLM's 0.9); lower it where the trainer shares the GPU."""
    kv_cache_memory_bytes: int | None = Field(default_of(VLLMEngineConfig, "kv_cache_memory_bytes"), ge=1)
    """KV cache size in bytes, instead of gpu_memory_utilization (on a CPU: in place of VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = default_of(VLLMEngineConfig, "enforce_eager")
    """Run eagerly, without CUDA graphs or torch.compile: faster start, slower decode on a GPU."""
    enable_prefix_caching: bool = default_of(VLLMEngineConfig, "enable_prefix_caching")
    """vLLM's prefix cache (cleared at every weight update)."""
    record_routing: bool = default_of(VLLMEngineConfig, "record_routing")
    """Record the experts each token was routed to (vLLM's V2 model runner: GPU only); off: routing is null."""
    startup_timeout_s: float = Field(default_of(VLLMEngineConfig, "startup_timeout_s"), gt=0)
    """Longest wait for a replica's vLLM to start."""
    engine_args: dict[str, Any] = Field(default_factory=lambda: dict(default_of(VLLMEngineConfig, "engine_args")))
    """Further vllm.AsyncEngineArgs fields, passed as given (e.g. {tensor_parallel_size: 2})."""


class RolloutSection(Section):
    """Rollout replicas (Ray Serve), their engine, the agent loop's budgets and its sampling."""

    engine: Literal["torch", "vllm"] = "torch"
    """The replicas' engine: torch (built in, runs anywhere) or vllm (in the environment `make vllm-env`
    creates, or rollout.python's)."""
    python: str | None = None
    """The Python executable the replicas run in (an environment with vLLM and this project installed).
    None: this Python if it has vLLM, else .venv-vllm/bin/python of the checkout (make vllm-env)."""
    vllm: VLLMSection = VLLMSection()

    num_replicas: int = Field(default_of(PipelineConfig, "num_replicas"), ge=1)
    """Serve rollout replicas."""
    resources: dict[str, float] = Field(default_factory=lambda: default_of(PipelineConfig, "resources_per_replica"))
    """Custom Ray resources each replica needs, e.g. {rollout: 1} (placement: docs/SCALING.md); empty: any node."""
    gpus: float = Field(default_of(PipelineConfig, "gpus_per_replica"), ge=0)
    """Ray GPUs per replica: 0 for the torch engine; 1 (or a share beside the trainer) for vLLM on a GPU. The
    replicas' GPUs are not the trainer's: train.device auto trains on CPU when they hold every GPU."""
    max_in_flight: int = Field(default_of(PipelineConfig, "max_in_flight"), ge=1)
    """Trajectories generated at once across replicas."""
    group_size: int = Field(default_of(PipelineConfig, "group_size"), ge=1)
    """Rollouts per task (GRPO's groups; 1 for SAO): next to each other in the task stream, so launched
    one after another as slots free up (a group may span policy versions)."""
    cancel_stale: bool = Field(default_of(PipelineConfig, "cancel_stale"))
    """Cancel a rollout still in flight once the trainer is more than train.max_staleness versions past
    the version at its launch (the trainer would pass it over); it is stored as `cancelled`."""
    max_tokens: int = Field(default_of(AgentConfig, "max_tokens"), ge=1)
    """Completion budget of a trajectory (action and observation tokens together)."""
    max_turns: int = Field(default_of(AgentConfig, "max_turns"), ge=1)
    """Most action segments of a trajectory (with an agent of one's own: most calls of an episode, all its
    parts)."""
    timeout_s: float = Field(default_of(AgentConfig, "timeout_s"), gt=0)
    """Wall-clock budget of a trajectory (with an agent of one's own: of an episode, all its parts)."""
    temperature: float = Field(default_of(AgentConfig, "temperature"), gt=0)
    """Sampling temperature, > 0 (greedy decoding: top_k 1); recorded with every trajectory."""
    top_k: int = Field(default_of(AgentConfig, "top_k"), ge=0)
    """Top-k sampling (0: off)."""
    top_p: float = Field(default_of(AgentConfig, "top_p"), gt=0, le=1)
    """Nucleus sampling (1: off)."""


class TrainSection(Section):
    """The trainer: how many updates of what size, on how stale data, on how many workers, on what device."""

    steps: int = Field(default_of(TrainConfig, "total_steps"), ge=0)
    """Actor updates of the run (a resumed run continues to this count)."""
    batch_size: int = Field(default_of(TrainConfig, "batch_size"), ge=1)
    """Trajectories per actor update."""
    max_staleness: int = Field(default_of(TrainConfig, "max_staleness"), ge=0)
    """Most policy versions a trajectory may lag when trained on."""
    synchronous: bool = default_of(PipelineConfig, "synchronous")
    """Synchronous RL, the comparison baseline (needs max_staleness 0): one batch per version."""
    workers: int = Field(default_of(TrainConfig, "num_workers"), ge=1)
    """Ray Train workers (data parallel)."""
    threads: int | None = Field(None, ge=1)
    """Intra-op torch threads of each trainer worker. None: one in an asynchronous run (the replicas generate on
    the other CPUs while it updates); in a synchronous run, where nothing generates during an update, this
    machine's CPUs shared among the workers, counted when the run started (a resumed run keeps that count).
    Replay uses the number the run trained with."""
    resources: dict[str, float] = Field(default_factory=lambda: default_of(TrainConfig, "resources_per_worker"))
    """Custom Ray resources each trainer worker needs, e.g. {trainer: 1}; empty: any node."""
    device: DeviceSetting = default_of(TrainConfig, "device")
    """Where the trainer and value pretraining run: cpu, cuda (one GPU per trainer worker; an error when the Ray
    cluster has none) or auto (GPUs when the Ray cluster has them). Replay always runs on CPU."""
    gpus_per_worker: float = Field(default_of(TrainConfig, "gpus_per_worker"), gt=0)
    """GPUs each trainer worker gets when it trains on GPUs: a fraction in (0, 1] shares one (with a vLLM replica,
    say), more must be a whole number."""
    bf16: bool = default_of(TrainConfig, "bf16")
    """bf16 autocast of the trainer's forward passes on CUDA (weights and optimiser state stay float32); refused
    with train.device cpu."""

    @model_validator(mode="after")
    def _device_settings(self) -> TrainSection:
        check_settings(self.device, self.bf16)
        check_gpus_per_worker(self.gpus_per_worker)
        return self


class ValuePretrainingSection(Section):
    """Value pretraining: the critic fitted on version-0 rollouts before the first step."""

    samples: int = Field(default_of(PretrainConfig, "num_samples"), ge=0)
    """Version-0 rollouts collected for value pretraining: most fit the critic, a share is held out to measure
    the fit (0 skips value pretraining, 1 is too few; unused by an algorithm without a critic; the paper used
    about 6k)."""


class EvalSection(Section):
    """Held-out accuracy before and after training."""

    tasks: int = Field(default_of(EvalConfig, "num_tasks"), ge=1)
    """Held-out tasks evaluated (sampled at temperature 1; with an agent of one's own or a verifiers
    environment, as its rollouts sample)."""
    seed: int | None = None
    """Seed of the evaluation's sampling; None: the run's seed. Fixed, runs of different seeds are
    evaluated on the same draws, so their accuracies compare pairwise."""


class LakeSection(Section):
    """The lake. Object-store options and credentials come from the environment only (AWS_* and the
    like), never from here."""

    root: str = Field(default_of(LakeConfig, "root"), min_length=1)
    """A folder or an s3://bucket/prefix URI."""


class RaySection(Section):
    """Where Ray runs."""

    address: str | None = default_of(RayConfig, "address")
    """None starts a local Ray; "auto" or "ray://host:10001" joins a cluster."""
    num_cpus: int | None = Field(default_of(RayConfig, "num_cpus"), ge=1)
    """CPUs of a local Ray (None: all of the machine's)."""


class RunConfig(Section):
    """A training run: re-running with the same run id resumes it."""

    run_id: str = "demo"
    """Names the run in every table and its folder under workdir; an existing run resumes (letters,
    digits, '.', '_', '-'; at most 128; starts with a letter or digit)."""
    workdir: str = Field("runs", min_length=1)
    """Run files go to workdir/run_id (warm start, checkpoints, plots)."""
    seed: int = default_of(TrainConfig, "seed")
    """Seed of the run (task order, sampling, torch, evaluation)."""
    model: ModelSection = ModelSection()
    sft: SFTSection = SFTSection()
    data: DataSection = DataSection()
    reward: RewardSection = RewardSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = AlgorithmSection()  # type: ignore[valid-type]
    train: TrainSection = TrainSection()
    value_pretraining: ValuePretrainingSection = ValuePretrainingSection()
    eval: EvalSection = EvalSection()
    lake: LakeSection = LakeSection()
    ray: RaySection = RaySection()
    retention: RetentionSection = RetentionSection()  # type: ignore[valid-type]
    critic: CriticSection = CriticSection()  # type: ignore[valid-type]

    @field_validator("run_id")
    @classmethod
    def _valid_run_id(cls, run_id: str) -> str:
        if re.fullmatch(RUN_ID_PATTERN, run_id) is None:  # it names a folder and a partition
            raise ValueError(f"{run_id!r} is not a valid run id: it must match {RUN_ID_PATTERN}")
        return run_id

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.train.batch_size % self.rollout.group_size:
            raise ValueError(f"train.batch_size {self.train.batch_size} is not a multiple of rollout.group_size "
                             f"{self.rollout.group_size}: a batch would split a group")
        if self.train.synchronous and self.train.max_staleness != 0:
            raise ValueError(f"train.synchronous needs train.max_staleness 0, got {self.train.max_staleness}")
        if self.env.agent and self.data.train is None:
            raise ValueError("env.agent runs on the tasks of data.train; the built-in math_tool tasks have their "
                             "own loop")
        if self.env.verifiers is not None and (self.data.train is not None or self.env.agent):
            raise ValueError("env.verifiers brings its own tasks and rollout loop: leave data.train and env.agent unset")
        vllm = self.rollout.vllm
        window, where = ((vllm.engine_args["max_model_len"], "rollout.vllm.engine_args.max_model_len")
                         if "max_model_len" in vllm.engine_args else (vllm.max_model_len, "rollout.vllm.max_model_len"))
        if self.rollout.engine == "vllm" and window is not None and not _whole(window):
            raise ValueError(f"{where} must be a whole number >= 1 (or null: the model's own), got {window!r}")
        if self.rollout.engine == "vllm" and window is not None and self.rollout.max_tokens >= window:
            raise ValueError(f"rollout.max_tokens {self.rollout.max_tokens} leaves no room for a prompt in "
                             f"{where} {window} (prompt and completion together): every rollout would end with an "
                             "error")
        if self.rollout.engine == "vllm":
            self._check_parallel_sizes()
        if (self.rollout.engine == "vllm" and 0 < self.rollout.gpus < 1 and vllm.gpu_memory_utilization is None
                and vllm.kv_cache_memory_bytes is None and "gpu_memory_utilization" not in vllm.engine_args):
            raise ValueError(f"rollout.gpus {self.rollout.gpus:g} shares a GPU, but vLLM would take 0.9 of its "
                             "memory (its default): set rollout.vllm.gpu_memory_utilization to the replica's share "
                             "of the memory, or rollout.vllm.kv_cache_memory_bytes")
        ignored = self._ignored_settings()
        if ignored:
            raise ValueError(f"{', '.join(ignored)} would be ignored: "
                             + ("env.verifiers brings its own tasks" if self.env.verifiers is not None else
                                "they set up the tasks of data.train, and without it the run trains on the built-in "
                                "math_tool task, with its own reward and tool"))
        if self.model.chat_template_kwargs and self.model.path is None:
            raise ValueError("model.chat_template_kwargs sets variables of the chat template of a model of one's own "
                             "(model.path); the built-in policy's template reads none")
        if self.sft.data is not None and self.model.path is None:
            raise ValueError("sft.data is for a model of one's own (model.path); the built-in policy is warm-started "
                             "on its own demonstrations")
        if self.value_pretraining.samples == 1:
            raise ValueError("value_pretraining.samples must be 0 (no value pretraining) or >= 2, got 1")
        return self

    def _check_parallel_sizes(self) -> None:
        """A vLLM replica on GPUs runs the product of its :data:`_PARALLEL_SIZES` in workers, one a GPU, on
        the GPUs Ray gives the replica (``rollout.gpus``): with fewer, vLLM would ask Ray for more while
        the replicas hold theirs."""
        sizes = {}
        for name in _PARALLEL_SIZES:
            size = self.rollout.vllm.engine_args.get(name, 1)
            if not _whole(size):
                raise ValueError(f"rollout.vllm.engine_args.{name} must be a whole number >= 1, got {size!r}")
            sizes[name] = size
        workers = math.prod(sizes.values())
        # One worker may share a GPU (rollout.gpus below 1); on a CPU (rollout.gpus 0) vLLM places them itself.
        if self.rollout.gpus > 0 and workers > 1 and workers > self.rollout.gpus:
            product = " x ".join(f"{name} {size}" for name, size in sizes.items())
            raise ValueError(f"rollout.vllm.engine_args {product} needs {workers} GPUs a replica, but rollout.gpus "
                             f"gives each {self.rollout.gpus:g}: set rollout.gpus to {workers}")

    def _ignored_settings(self) -> list[str]:
        """The task, reward and tool settings set away from their defaults where nothing reads them:
        :func:`unread_keys`."""
        public, defaults = self.public(), _task_defaults()
        return [key for key in unread_keys(public) if _dotted(public, key) != _dotted(defaults, key)]

    # Where the run's files go.
    @property
    def own_tasks(self) -> bool:
        """Whether the run's tasks are the user's (data.train or a verifiers environment), not math_tool's."""
        return self.data.train is not None or self.env.verifiers is not None

    @property
    def run_dir(self) -> Path:
        return Path(self.workdir) / self.run_id

    @property
    def sft_dir(self) -> Path:
        """The built-in policy's SFT warm start."""
        return self.run_dir / "sft"

    @property
    def initial_policy_dir(self) -> Path:
        """The run's version-0 policy: the SFT warm start, or the model of ``model.path`` copied."""
        return self.sft_dir if self.model.path is None else self.run_dir / "model"

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def plots_dir(self) -> Path:
        return self.run_dir / "plots"

    # The component configs it builds (BUILDS lists which setting goes where).
    def public(self) -> dict[str, Any]:
        """The config as plain JSON data (what the ``runs`` table, results and logs hold)."""
        return self.model_dump(mode="json")

    def lake_config(self) -> LakeConfig:
        return LakeConfig(root=self.lake.root)

    def ray_config(self) -> RayConfig:
        return RayConfig(address=self.ray.address, num_cpus=self.ray.num_cpus)

    def update(self) -> UpdateConfig:
        return self.algorithm.build()

    @property
    def eval_seed(self) -> int:
        """The evaluation's sampling seed: ``eval.seed``, or the run's seed."""
        return self.seed if self.eval.seed is None else self.eval.seed

    def agent(self) -> AgentConfig:
        r = self.rollout
        return AgentConfig(max_tokens=r.max_tokens, max_turns=r.max_turns, timeout_s=r.timeout_s,
                           temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)

    def engine(self) -> TorchEngineConfig | VLLMEngineConfig:
        """The replicas' engine settings (``rollout.engine``; ``rollout.vllm`` for vLLM, which records the
        agent's kind of log-probabilities and is seeded by the run)."""
        if self.rollout.engine == "torch":
            return TorchEngineConfig()
        return VLLMEngineConfig(logprob_kind=self.agent().logprob_kind, seed=self.seed, **self.rollout.vllm.model_dump())

    def retention_config(self) -> RetentionConfig:
        return self.retention.build()

    def critic_config(self) -> CriticConfig:
        return self.critic.build()

    def with_values(self, values: Mapping[str, Any]) -> RunConfig:
        """A copy with dotted keys set (``{"train.steps": 10}``), validated like a file."""
        data = self.public()
        for key, value in values.items():
            _set_dotted(data, key, value)
        return from_data(data, {key: "given" for key in values})


BUILDS: dict[str, tuple[tuple[type, str], ...]] = {
    "seed": ((TrainConfig, "seed"), (PipelineConfig, "seed"), (EvalConfig, "seed"), (VLLMEngineConfig, "seed")),
    "sft.seed": ((SFTConfig, "seed"),),
    "sft.max_steps": ((SFTConfig, "max_steps"),),
    "sft.learning_rate": ((SFTConfig, "learning_rate"),),
    "sft.batch_size": ((SFTConfig, "batch_size"),),
    "reward.functions": ((DatasetEnvConfig, "rewards"),),
    "reward.weights": ((DatasetEnvConfig, "weights"),),
    "env.max_tool_calls": ((DatasetEnvConfig, "max_tool_calls"),),
    "env.tools": ((DatasetEnvConfig, "tools"),),
    "env.system_prompt": ((DatasetEnvConfig, "system_prompt"),),
    "env.agent": ((DatasetEnvConfig, "agent"),),
    "rollout.num_replicas": ((PipelineConfig, "num_replicas"),),
    "rollout.resources": ((PipelineConfig, "resources_per_replica"),),
    "rollout.gpus": ((PipelineConfig, "gpus_per_replica"),),
    "rollout.max_in_flight": ((PipelineConfig, "max_in_flight"), (DriverConfig, "max_in_flight")),
    "rollout.group_size": ((PipelineConfig, "group_size"),),
    "rollout.cancel_stale": ((PipelineConfig, "cancel_stale"), (DriverConfig, "cancel_stale")),
    "rollout.max_tokens": ((AgentConfig, "max_tokens"), (EvalConfig, "max_tokens")),
    "rollout.max_turns": ((AgentConfig, "max_turns"), (EvalConfig, "max_turns")),
    "rollout.timeout_s": ((AgentConfig, "timeout_s"),),
    "rollout.temperature": ((AgentConfig, "temperature"),),
    "rollout.top_k": ((AgentConfig, "top_k"),),
    "rollout.top_p": ((AgentConfig, "top_p"),),
    **{f"rollout.vllm.{key}": ((VLLMEngineConfig, key),) for key in VLLMSection.model_fields},
    **{f"algorithm.{key}": ((UpdateConfig, AlgorithmSection.renamed.get(key, key)),)
       for key in AlgorithmSection.model_fields},
    "train.steps": ((TrainConfig, "total_steps"),),
    "train.batch_size": ((TrainConfig, "batch_size"), (DriverConfig, "batch_size")),
    "train.max_staleness": ((TrainConfig, "max_staleness"), (DriverConfig, "max_staleness")),
    "train.synchronous": ((PipelineConfig, "synchronous"), (DriverConfig, "synchronous")),
    "train.workers": ((TrainConfig, "num_workers"),),
    "train.resources": ((TrainConfig, "resources_per_worker"),),
    "train.device": ((TrainConfig, "device"),),
    "train.bf16": ((TrainConfig, "bf16"),),
    "train.gpus_per_worker": ((TrainConfig, "gpus_per_worker"),),
    "value_pretraining.samples": ((PretrainConfig, "num_samples"),),
    "eval.tasks": ((EvalConfig, "num_tasks"),),
    "lake.root": ((LakeConfig, "root"),),
    "ray.address": ((RayConfig, "address"),),
    "ray.num_cpus": ((RayConfig, "num_cpus"),),
    **{f"retention.{f.name}": ((RetentionConfig, f.name),) for f in dataclasses.fields(RetentionConfig)},
    **{f"critic.{f.name}": ((CriticConfig, f.name),) for f in dataclasses.fields(CriticConfig)},
}
"""Each setting -> the component fields it is built into (the others: :data:`RUN_OWN`)."""

RUN_OWN = ("run_id", "workdir", "model.path", "model.chat_template_kwargs", "sft.data", "data.train", "data.eval",
           "data.eval_fraction", "eval.seed", "env.verifiers", "rollout.engine", "rollout.python", "train.threads")
"""Settings of the run itself, which no component config has, or whose default the run works out
(``train.threads``: :func:`sao.runs.trainer_threads`)."""


def leaves(model: BaseModel, prefix: str = "", *, json_values: bool = False) -> dict[str, Any]:
    """Every setting of ``model`` by dotted key (``json_values``: as JSON data, enums as strings)."""
    found: dict[str, Any] = {}
    data = model.model_dump(mode="json") if json_values else None
    for key in type(model).model_fields:
        value = getattr(model, key)
        if isinstance(value, Section):
            found.update(leaves(value, f"{prefix}{key}.", json_values=json_values))
        else:
            found[prefix + key] = data[key] if data is not None else value
    return found


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parents[:i + 1])}: is a setting, not a section (in {key!r})")
        node = child
    node[last] = value


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value and prefix + key not in _DICT_SETTINGS:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def _whole(value: Any) -> bool:
    """Whether ``value`` is a whole number >= 1 (a boolean is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_DICT_SETTINGS = frozenset({"rollout.resources", "train.resources", "env.verifiers.args", "model.chat_template_kwargs"})
"""Settings that are mappings compared whole; the one other mapping, ``rollout.vllm.engine_args``, is
compared argument by argument (:func:`under_free_mapping`)."""


def under_free_mapping(key: str) -> bool:
    """Whether dotted ``key`` is an argument of ``rollout.vllm.engine_args``, a mapping compared argument
    by argument: such an argument has no default, so one that a config lacks is never at it."""
    return key.startswith("rollout.vllm.engine_args.")


def setting_keys(data: Mapping[str, Any]) -> set[str]:
    """The dotted keys of a config's JSON data (:meth:`RunConfig.public`; an older one may lack some)."""
    return set(_flatten(data))


def _format_errors(error: ValidationError, origin: Mapping[str, str]) -> str:
    lines = []
    for item in error.errors(include_url=False):
        key = ".".join(str(part) for part in item["loc"]) or "(config)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            parent = key.rpartition(".")[0]
            section = _section_at(parent)
            known = ", ".join(sorted(section.model_fields)) if section is not None else ""
            where_known = parent or "the top level"
            message = f"unknown key; {where_known} has: {known}" if known else "unknown key"
        elif item["loc"] and key in _SECTION_KEYS:
            # A check of a whole section (a component's __post_init__): name the key it is about.
            named = next((name for name in _section_at(key).model_fields if message.startswith(name)), None)
            key = f"{key}.{named}" if named else key
        where = origin.get(key)
        value = item.get("input")
        shown = "" if item["type"] == "extra_forbidden" or isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{key}: {message}{shown}{f' [from {where}]' if where else ''}")
    return "\n".join(lines)


_SECTION_KEYS = frozenset(key for key, field in RunConfig.model_fields.items()
                          if isinstance(field.annotation, type) and issubclass(field.annotation, Section))


def _section_at(key: str) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in filter(None, key.split(".")):
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def from_data(data: Mapping[str, Any], origin: Mapping[str, str] | None = None) -> RunConfig:
    """A config from plain data (a parsed file); ``origin``: where each dotted key came from, for the
    messages of a :class:`ConfigError`."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, origin or {})) from None


def load_file(path: str | Path) -> dict[str, Any]:
    """A config file's data (YAML, which JSON is a subset of)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def parse_set(item: str) -> tuple[str, Any]:
    """``"algorithm.eps_high=4.0"`` -> ``("algorithm.eps_high", 4.0)``: the value is read as YAML
    (numbers, true/false, null, [lists], {maps}); anything else is a string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", key):
        raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. train.steps=10")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def resolve(path: str | Path | None = None, sets: Sequence[str] = (),
            flags: Mapping[str, tuple[str, Any]] | None = None) -> tuple[RunConfig, dict[str, str]]:
    """The config from the defaults, then ``path``, then ``--set`` items, then shorthand ``flags``
    (dotted key -> (flag, value); a None value is a flag not given), and where each key that is not
    at its default came from.

    Raises:
        ConfigError: every problem found, each with its dotted key, value and what is allowed.
    """
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path is not None:
        data = load_file(path)
        origin.update(dict.fromkeys(_flatten(data), str(path)))
    for item in sets:
        key, value = parse_set(item)
        _set_dotted(data, key, value)
        origin[key] = f"--set {item}"
    for key, (flag, value) in (flags or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
            origin[key] = flag
    return from_data(data, origin), origin


def show(config: RunConfig, origin: Mapping[str, str]) -> str:
    """``config`` as YAML, each key that is not at its default commented with where it came from."""
    lines: list[str] = []
    section = None
    for key, value in leaves(config, json_values=True).items():
        head, _, name = key.rpartition(".")
        if head != section:
            if head:
                lines.append(f"{head}:")
            section = head
        text = json.dumps(value)
        note = f"  # {origin[key]}" if key in origin else ""
        lines.append(f"{'  ' if head else ''}{name}: {text}{note}")
    return "\n".join(lines)


def demo_config() -> RunConfig:
    """The laptop demo's config (:data:`DEMO_CONFIG`)."""
    if not DEMO_CONFIG.exists():
        raise ConfigError(f"the demo config {DEMO_CONFIG} is missing: it ships with the source checkout "
                          "(configs/demo.yaml); run `sao train --config FILE` with a config of your own")
    return resolve(DEMO_CONFIG)[0]


TASK_KEYS = ("reward.functions", "reward.weights", "env.tools", "env.max_tool_calls", "env.system_prompt",
             "data.eval", "data.eval_fraction")
"""The settings of a run's own tasks: what :func:`unread_keys` may leave unread."""


def _dotted(data: Mapping[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _task_defaults() -> dict[str, Any]:
    return {"data": DataSection().model_dump(mode="json"), "reward": RewardSection().model_dump(mode="json"),
            "env": EnvSection().model_dump(mode="json")}


def unread_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of :data:`TASK_KEYS` that nothing reads in a config (JSON data, :meth:`RunConfig.public`):
    every one without ``data.train`` and ``env.verifiers`` (the run trains on the built-in math_tool
    task, with its own reward and tool); ``data.eval`` beside ``env.verifiers`` (its environment's data
    is split by ``data.eval_fraction``; its held-out evaluation is scored by ``reward.functions``)."""
    if _dotted(config, "data.train") is not None:
        return ()
    return ("data.eval",) if _dotted(config, "env.verifiers") is not None else TASK_KEYS


def without_unread(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (JSON data) with its :func:`unread_keys` at their defaults: what a run recorded
    before they were refused is compared, and rebuilt, as it ran."""
    data = json.loads(json.dumps(config))
    defaults = _task_defaults()
    for key in unread_keys(data):
        section, name = key.split(".")
        if isinstance(data.get(section), dict):
            data[section][name] = defaults[section][name]
    return data


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two configs' JSON data (:meth:`RunConfig.public`), or that
    one of them lacks (a key one side lacks and the other holds as null is a change too: the caller
    tells a key that a later version of sao added)."""
    def flat(data: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for key in _flatten(data):
            node: Any = data
            for part in key.split("."):
                node = node[part]
            if not (isinstance(node, Mapping) and not node and key not in _DICT_SETTINGS):
                values[key] = node  # an empty mapping compared by its keys (engine_args) has none to compare
        return values

    before, after = flat(old), flat(new)
    # A key one side lacks is a change even where the other holds null (an engine argument added as
    # null); the caller tells a key that a later version of sao added (RunConfig's defaults have it).
    return {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if (key in before) != (key in after)
            or json.dumps(before[key], sort_keys=True) != json.dumps(after[key], sort_keys=True)}
