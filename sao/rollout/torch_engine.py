"""The torch engine: KV-cached, continuously batched decoding of a Hugging Face causal LM.

One background thread owns the model. Each loop iteration:

1. applies queued weights, if any (the policy version changes between decode steps; in-flight
   requests continue and their next tokens start a new version span);
2. samples one token for every running request from its next-token logits, records the token's
   log-probability under the request's distribution (``sampling`` or ``raw``), and retires requests
   that stopped, reached their budget or were cancelled;
3. gives free slots of the preallocated KV cache to waiting requests;
4. runs one forward pass over the running requests' new tokens and the joining requests' whole contexts,
   packed into one sequence: every per-token layer runs once for all of them, and attention reads each
   request's own slot (a join costs the compute of its prompt, not a forward pass of its own, and no
   copy of anyone's cache). The running requests' one-token attention is a compiled kernel
   (:mod:`sao.rollout.kernels`) that reads each request's cache once, up to its own length; for a
   bfloat16 / float16 model it is batched products in chunks of rows, each chunk reading up to its own
   longest row, with the rows kept grouped by length so that a short request reads little padding.
   The cache and this attention live in :mod:`sao.rollout.kv_cache`.

Departure from engines that keep the KV cache across a weight update (vLLM in-place reloads): after
new weights are loaded, the cache of every in-flight request is recomputed with them (one prefill), so
a token sampled after the update is drawn from exactly pi_new(. | prefix). The recorded log-probability
of every token therefore equals a teacher-forced recomputation under the version its span names. Set
``recompute_kv_on_update=False`` to keep the stale cache (cheaper, approximate).

Routing record (R3, :mod:`sao.models.routing`): with ``record_routing`` (on by default for an MoE model)
forward hooks on the routers keep the expert ids of every packed token, and one indexed write per step
files them under the request's slot and position (like the KV cache: no per-token Python loop). A
finished request's :attr:`Generation.routed_experts` is its slot's routing for every token the engine
ran through the model: the prompt, then every sampled token but the last (sampling it ended the request,
so it was never an input). A token run again (a recompute after a weight update) keeps its latest
routing, the one the cache that sampled the following tokens was built with.

Sampling uses one uniform draw per token from a per-request generator (``random.Random`` seeded with
the request's seed; inverse CDF), so a request's tokens depend on its seed and prompt only, not on what
else is in the batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import transformers

from sao.algos.sampling import LogprobKind, sampling_logprobs
from sao.models.routing import RoutingRecorder, moe_routers
from sao.rollout.cpus import check_cpus, pin_thread
from sao.rollout.engine import FinishReason, FutureEngine, Generation, SamplingParams, VersionSpan
from sao.rollout.kv_cache import SLOT_ATTENTION, SlotCache, SlotLayout, chunked_columns

__all__ = ["EngineStats", "TorchEngine", "TorchEngineConfig", "attention_window", "check_request", "engine_support"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TorchEngineConfig:
    """Settings of the torch engine.

    Attributes:
        max_batch: most requests decoded together; more wait for a free slot.
        recompute_kv_on_update: recompute in-flight requests' KV caches when weights change (exact
            per-version log-probabilities) instead of keeping the stale cache.
        threads: torch intra-op threads for the engine thread (None = torch's default). Keep other
            threads of the process at one torch thread: with more OpenMP workers than cores (a team in
            the engine thread and another in, say, the main thread), libgomp sleeps its workers after
            each parallel region and small decode-step kernels run about three times slower.
        max_prefill_tokens: most context tokens of joining requests run in one step (waiting requests
            join the next step whenever slots are free; their contexts share the decode step's forward
            pass, and this caps how long one step can take).
        record_routing: return the experts each token was routed to (``Generation.routed_experts``);
            None: on for a mixture-of-experts model, off for a dense one. True on a dense model is an error.
        decode_kernel: compute the running requests' one-token attention with the compiled kernel
            (:func:`sao.rollout.kernels.decode_attention`: each row read once, up to its own length) when
            the model is float32; False, or another dtype: batched products in chunks of rows (below).
        attention_chunk: chunked path (see ``decode_kernel``): running requests per decode-attention
            call. Each call reads the cache up to the longest request of its own chunk, not of the whole
            batch, and the engine keeps the running requests grouped by length (see ``reorder_slack``),
            so short requests are not padded to the longest one. Smaller chunks read less padding but
            make more calls (16: measured best of 8 and 16 on the tiny policy at 16 and 64 requests).
        reorder_slack: chunked path: regroup the running requests by length (the longest
            ``attention_chunk`` in the first chunk, and so on; the rows in the wrong chunk move, cache
            included) when the decode attention of the current grouping would read more than
            ``1 + reorder_slack`` times the cache columns of that one. Checked only after requests join
            or leave. None: never regroup.
        cpus: run the engine thread on these CPUs only (Linux; see :mod:`sao.rollout.cpus`). A Serve
            replica and the engine's child process then keep their other threads off them. None: the OS
            places it.
    """

    max_batch: int = 64
    recompute_kv_on_update: bool = True
    threads: int | None = None
    max_prefill_tokens: int = 2048
    record_routing: bool | None = None
    decode_kernel: bool = True
    attention_chunk: int = 16
    reorder_slack: float | None = 0.15
    cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.cpus is not None:
            object.__setattr__(self, "cpus", check_cpus(self.cpus))
        if self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.reorder_slack is not None and self.reorder_slack < 0:
            raise ValueError(f"reorder_slack must be >= 0 or None, got {self.reorder_slack}")


def check_request(prompt_ids: Sequence[int], sampling: SamplingParams, vocab_size: int,
                  max_positions: int | None, window: int | None = None) -> list[int]:
    """The prompt as a list of ints, or ``ValueError`` naming what is wrong with the request.
    ``window``: the model's sliding attention window or attention chunk (:func:`attention_window`), which
    the engine's attention does not apply: a longer sequence is refused rather than attended to differently."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids holds token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if max_positions is not None and len(prompt) + sampling.max_tokens > max_positions:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"max_position_embeddings ({max_positions})"
        )
    if window is not None and len(prompt) + sampling.max_tokens > window:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's attention "
            f"window ({window} tokens: a sliding window or an attention chunk), which the torch engine does not apply"
        )
    return prompt


def attention_window(config: object) -> int | None:
    """The most tokens a Hugging Face model config's layers attend over, or None when every layer attends
    to the whole sequence: its sliding attention window (``layer_types`` says which layers slide; without
    it, ``sliding_window`` set and not switched off by ``use_sliding_window: false``, as Mistral's), or its
    attention chunk (Llama 4's ``chunked_attention`` layers attend within chunks of
    ``attention_chunk_size``), whichever is smaller. Up to that length every layer attends as causal
    attention over the whole sequence does, which is what the engine computes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:
        return window if window and getattr(text, "use_sliding_window", True) else None
    spans = [window if "sliding_attention" in layer_types else None,
             getattr(text, "attention_chunk_size", None) if "chunked_attention" in layer_types else None]
    return min((span for span in spans if span), default=None)


@dataclasses.dataclass
class EngineStats:
    """Counters of a torch engine (:meth:`TorchEngine.stats`).

    Attributes:
        decode_steps: forward passes of the running batch (one token per running request).
        decoded_rows: sum over decode steps of the requests in the batch (mean batch = rows / steps).
        prefills: forward passes that admitted requests (joins and recomputes after a weight update).
        prefilled_requests: requests those passes admitted.
        reorders: times the running requests were regrouped by length (``TorchEngineConfig.reorder_slack``).
        busy_s: seconds the engine thread spent working (weights, prefills, sampling, decode steps).
        idle_s: seconds it waited for work (no requests, or paused).
    """

    decode_steps: int = 0
    decoded_rows: int = 0
    prefills: int = 0
    prefilled_requests: int = 0
    reorders: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    generator: random.Random
    future: concurrent.futures.Future[Generation]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    spans: list[list[int]] = dataclasses.field(default_factory=list)  # [version, start, end]
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.monotonic)

    def append(self, token: int, logprob: float, version: int) -> None:
        n = len(self.tokens)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n + 1
        else:
            self.spans.append([version, n, n + 1])

    def finish(self, reason: FinishReason, error: str | None = None,
               routed_experts: torch.Tensor | None = None) -> None:
        if self.future.done():
            return
        self.future.set_result(
            Generation(
                token_ids=tuple(self.tokens),
                logprobs=tuple(self.logprobs),
                logprob_kind=self.sampling.logprob_kind,
                finish_reason=reason,
                spans=tuple(VersionSpan(v, s, e) for v, s, e in self.spans),
                error=error,
                routed_experts=routed_experts,
            )
        )


class TorchEngine(FutureEngine):
    """Continuous-batching engine over a causal LM (see the module docstring).

    Args:
        model: a Hugging Face causal LM (``forward(input_ids, attention_mask, position_ids,
            past_key_values, use_cache)``); the engine puts it in eval mode and owns it.
        version: the policy version of ``model``'s current weights.
        config: engine settings.
        seed: seeds requests that come without a seed of their own.
        on_version: called (on the engine thread) with each version whose weights it starts using.
    """

    name = "torch"

    def __init__(self, model: torch.nn.Module, version: int = 0, config: TorchEngineConfig | None = None,
                 seed: int = 0, on_version: Callable[[int], None] | None = None) -> None:
        self.config = config or TorchEngineConfig()
        self._on_version = on_version
        self.model = model.eval()
        unsupported = engine_support(model)
        if unsupported:
            raise ValueError(f"the torch engine cannot run this model: {unsupported}")
        model.set_attn_implementation(SLOT_ATTENTION)
        self._window = attention_window(model.config)
        self._version = version
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._pending_weights: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._paused = False
        self._stopping = False
        self._by_id: dict[str, _Request] = {}
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._stats = EngineStats()
        # Running batch: request i holds slot i of the KV cache, its length and its next-token logits.
        slots = self.config.max_batch
        self._rows: list[_Request] = []
        self._kv = SlotCache(model.config, slots, next(model.parameters()).dtype)
        # Rows per decode-attention chunk; None: the compiled kernel reads each row to its own length.
        self._chunk = None if self.config.decode_kernel and self._kv.dtype == torch.float32 else self.config.attention_chunk
        self._lengths = torch.zeros(slots, dtype=torch.long)
        self._slot_ids = torch.arange(slots)
        config = model.config  # a multimodal model's sizes are its text model's
        self._text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._next_logits = torch.zeros(slots, self._text.vocab_size)
        self._reordered = True  # whether the running rows were checked for length order since they changed
        # Routing record: (slots, columns, MoE layers, top_k) uint8 expert ids, laid out like the KV cache.
        routers = moe_routers(model)
        record = self.config.record_routing
        if record and not routers:
            raise ValueError("TorchEngineConfig.record_routing=True, but the model has no MoE router to record")
        self._recorder = RoutingRecorder(model).attach() if record is not False and routers else None
        self._routing = torch.zeros(slots, 0, len(routers), routers[0].top_k if routers else 0, dtype=torch.uint8)
        self.weight_updates_applied = 0
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        if self.config.cpus is not None:
            try:
                pin_thread(self.config.cpus, self._thread.native_id)
            except ValueError:
                self.close()
                raise

    # ----- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def records_routing(self) -> bool:
        """Whether generations carry ``routed_experts``."""
        return self._recorder is not None

    @property
    def engine_version(self) -> str:
        return f"torch-{torch.__version__}+transformers-{transformers.__version__}"

    def healthy(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """A copy of the engine's counters since it started."""
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._rows) + len(self._pending)

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
               request_id: str | None = None) -> concurrent.futures.Future[Generation]:
        """Queue a request; the future resolves with its :class:`Generation`."""
        prompt = check_request(prompt_ids, sampling, self._text.vocab_size,
                               getattr(self._text, "max_position_embeddings", None), self._window)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is closed")
            seed = sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            request = _Request(
                request_id=request_id or uuid.uuid4().hex,
                prompt=prompt,
                sampling=sampling,
                generator=random.Random(seed),
                future=concurrent.futures.Future(),
            )
            if request.request_id in self._by_id:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._by_id[request.request_id] = request
            request.future.add_done_callback(lambda _f, rid=request.request_id: self._forget(rid))
            self._pending.append(request)
            self._cond.notify_all()
        return request.future

    def progress(self, request_id: str) -> int | None:
        """Tokens sampled so far for an in-flight request (None when it is not in flight)."""
        with self._cond:
            request = self._by_id.get(request_id)
            return None if request is None else len(request.tokens)

    def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._cond:
            self._pending_weights = (version, weights)
            self._cond.notify_all()

    def wait_for_version(self, version: int, timeout: float = 60.0) -> None:
        """Block until weights of ``version`` are in use (useful after :meth:`load_weights`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._version >= version or self._stopping, timeout):
                raise TimeoutError(f"engine did not reach version {version} within {timeout} s")

    def cancel(self, request_id: str) -> bool:
        with self._cond:
            request = self._by_id.get(request_id)
            if request is None:
                return False
            request.cancelled = True
            if request in self._pending:
                self._pending.remove(request)
                request.finish(FinishReason.CANCELLED)
            self._cond.notify_all()
            return True

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the engine thread; requests still in flight end as ``cancelled``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for request in list(self._pending) + list(self._rows):
            request.finish(FinishReason.CANCELLED)

    # ----- engine thread ------------------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._by_id.pop(request_id, None)

    def _run(self) -> None:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        stats = self._stats
        while True:
            waited = time.perf_counter()
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping
                    or (not self._paused and (self._rows or self._pending or self._pending_weights))
                )
                if self._stopping:
                    return
                weights, self._pending_weights = self._pending_weights, None
            began = time.perf_counter()
            stats.idle_s += began - waited
            joiners: list[_Request] = []
            try:
                with torch.inference_mode():
                    if weights is not None:
                        self._apply_weights(*weights)
                    pending_tokens = self._sample_and_retire() if self._rows else []
                    with self._cond:
                        joiners = self._take_joiners()
                    if self._rows or joiners:
                        self._forward(pending_tokens, joiners)
            except Exception as exc:  # a broken step must not hang callers
                log.exception("torch engine step failed")
                for request in self._rows + joiners:
                    request.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
                self._rows = []
            stats.busy_s += time.perf_counter() - began

    def _take_joiners(self) -> list[_Request]:
        """Waiting requests that join this step: as many as there are free slots, up to the prefill budget
        (at least one, so a context longer than the budget still runs)."""
        room = self.config.max_batch - len(self._rows)
        budget = self.config.max_prefill_tokens
        taken: list[_Request] = []
        while self._pending and len(taken) < room:
            size = len(self._pending[0].prompt) + len(self._pending[0].tokens)
            if taken and size > budget:
                break
            budget -= size
            taken.append(self._pending.pop(0))
        return taken

    def _apply_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights), strict=True)
        with self._cond:
            self._version = version
            self.weight_updates_applied += 1
            if self._rows and self.config.recompute_kv_on_update:
                # Their next tokens must come from the new weights: run their contexts again, first in line.
                self._pending[:0] = self._rows
                self._rows = []
            self._cond.notify_all()
        if self._on_version is not None:
            self._on_version(version)

    def _sample_and_retire(self) -> list[int]:
        """Sample one token per running request, retire the finished ones and compact the survivors into
        slots ``0 .. n-1``; returns the survivors' new tokens (their next decode input), in slot order."""
        tokens, logprobs = self._sample()
        version = self._version
        tokens_list, logprobs_list = tokens.tolist(), logprobs.tolist()
        keep: list[int] = []
        for i, request in enumerate(self._rows):
            if request.cancelled:
                request.finish(FinishReason.CANCELLED, routed_experts=self._slot_routing(i))
                continue
            token = tokens_list[i]
            request.append(token, logprobs_list[i], version)
            if token in request.sampling.stop_token_ids:
                request.finish(FinishReason.STOP, routed_experts=self._slot_routing(i))
            elif len(request.tokens) >= request.sampling.max_tokens:
                request.finish(FinishReason.LENGTH, routed_experts=self._slot_routing(i))
            else:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._compact(keep, tokens_list)
            self._reordered = False
        if not self._reordered and self.config.reorder_slack is not None and self._chunk is not None:
            self._order_by_length(tokens_list)
        return tokens_list[: len(self._rows)]

    def _forward(self, pending_tokens: list[int], joiners: list[_Request]) -> None:
        """One forward pass over every running request's new token and every joiner's whole context,
        packed into one sequence (see :func:`sao.rollout.kv_cache.slot_attention`); leaves next-token logits for all rows."""
        n = len(self._rows)
        positions = self._lengths[:n].clone()
        slots = self._slot_ids[: n + len(joiners)]
        if joiners:
            contexts = [r.prompt + r.tokens for r in joiners]
            sizes = torch.tensor([len(c) for c in contexts], dtype=torch.long)
            starts = torch.cumsum(sizes, 0) - sizes  # offset of each joiner's first token after the decode part
            ids = torch.tensor(pending_tokens + [t for c in contexts for t in c])
            token_slots = torch.cat([slots[:n], slots[n:].repeat_interleave(sizes)])
            token_positions = torch.cat([positions, torch.arange(int(sizes.sum())) - starts.repeat_interleave(sizes)])
            last = torch.cat([slots[:n], n + starts + sizes - 1])
        else:  # decode only: one token per row
            sizes = starts = self._slot_ids[:0]
            ids, token_slots, token_positions, last = torch.tensor(pending_tokens), slots, positions, slots
        layout = SlotLayout.build(n, positions, sizes, starts, self._kv.kv_heads, self._chunk,
                                   self._kv.dtype)
        self._kv.reserve(layout.width)
        self._kv.bind(token_slots, token_positions)
        if self._recorder is not None:
            self._recorder.calls.clear()
        out = self.model(input_ids=ids.unsqueeze(0), position_ids=token_positions.unsqueeze(0), past_key_values=self._kv,
                         use_cache=True, logits_to_keep=last, sao_slot_layout=layout)
        if self._recorder is not None:
            self._file_routing(token_slots, token_positions)
        self._lengths[:n] += 1
        if joiners:
            self._lengths[n : n + len(joiners)] = sizes
        self._next_logits[: n + len(joiners)] = out.logits[0]
        self._rows = self._rows + joiners
        if joiners:
            self._reordered = False
        stats = self._stats
        if n:
            stats.decode_steps += 1
            stats.decoded_rows += n
        if joiners:
            stats.prefills += 1
            stats.prefilled_requests += len(joiners)

    def _file_routing(self, token_slots: torch.Tensor, token_positions: torch.Tensor) -> None:
        """Write the routing of the forward just run under each packed token's slot and position."""
        if self._routing.shape[1] < self._kv.capacity:  # grow with the KV cache, contents kept
            grown = torch.zeros(self._routing.shape[0], self._kv.capacity, *self._routing.shape[2:], dtype=torch.uint8)
            grown[:, : self._routing.shape[1]] = self._routing
            self._routing = grown
        self._routing[token_slots, token_positions] = self._recorder.pop()

    def _slot_routing(self, row: int) -> torch.Tensor | None:
        """(tokens run, MoE layers, top_k) uint8 routing of running row ``row`` (None when not recording)."""
        if self._recorder is None:
            return None
        return self._routing[row, : int(self._lengths[row])].clone()

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per running row from its next-token logits and its recorded log-probability."""
        rows = self._rows
        logits = self._next_logits[: len(rows)]
        settings = {(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) for r in rows}
        if len(settings) == 1:  # the usual case: Python scalars, no per-row tensors
            logp = sampling_logprobs(logits, *settings.pop())
        else:
            temperature = torch.tensor([r.sampling.temperature for r in rows], dtype=logits.dtype)
            top_k = torch.tensor([r.sampling.top_k for r in rows])
            top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=logits.dtype)
            logp = sampling_logprobs(logits, temperature, top_k, top_p)
        probs = logp.exp()
        uniforms = torch.tensor([r.generator.random() for r in rows], dtype=torch.float64)
        cdf = probs.double().cumsum_(-1)
        # Inverse CDF: the first token whose cumulative mass exceeds u * total (never a zero-mass token,
        # since the cumulative mass strictly grows there).
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        tokens.clamp_(max=probs.shape[-1] - 1)
        recorded = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if bool(torch.isinf(recorded).any()):  # u * total rounded up to the total: the last token with mass
            last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(-1)
            tokens = torch.minimum(tokens, last_positive)
            recorded = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if any(r.sampling.logprob_kind is LogprobKind.RAW for r in rows):
            raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            is_raw = torch.tensor([r.sampling.logprob_kind is LogprobKind.RAW for r in rows])
            recorded = torch.where(is_raw, raw, recorded)
        return tokens, recorded

    def _order_by_length(self, tokens: list[int]) -> None:
        """Group the running rows by length into the decode attention's chunks (the longest rows in the first
        chunk, and so on) when the current grouping reads more than ``1 + reorder_slack`` times the cache
        columns of that one. Only rows in the wrong chunk move (into the places of rows that leave that
        chunk); order within a chunk does not matter. All lengths grow by one a step, so the grouping holds
        until rows join or leave."""
        self._reordered = True
        n = len(self._rows)
        chunk = self.config.attention_chunk
        if n <= chunk:
            return
        lengths = self._lengths[:n].tolist()
        ranked = sorted(range(n), key=lengths.__getitem__, reverse=True)
        if chunked_columns(lengths, chunk) <= (1 + self.config.reorder_slack) * chunked_columns(
                [lengths[i] for i in ranked], chunk):
            return
        target = [0] * n  # the chunk each row belongs to
        for rank, row in enumerate(ranked):
            target[row] = rank // chunk
        leaving = [row for row in range(n) if target[row] != row // chunk]
        free: dict[int, list[int]] = {}  # per chunk, the places its leaving rows free
        for row in leaving:
            free.setdefault(row // chunk, []).append(row)
        dst = [free[target[row]].pop() for row in leaving]
        rows = list(self._rows)
        moved_tokens = [tokens[row] for row in leaving]
        for row, place, token in zip(leaving, dst, moved_tokens, strict=True):
            rows[place] = self._rows[row]
            tokens[place] = token
        self._rows = rows
        self._move_rows(torch.tensor(leaving), torch.tensor(dst))
        self._stats.reorders += 1

    def _move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the cache, routing and length of running rows ``src`` into rows ``dst``."""
        width = int(self._lengths[src].max())
        self._kv.move(src, dst, width)
        if self._recorder is not None:
            self._routing[dst, :width] = self._routing[src, :width]
        self._lengths[dst] = self._lengths[src]

    def _compact(self, keep: list[int], tokens: list[int]) -> None:
        """Fill the slots of finished rows with the last running rows, so running rows are 0..n-1.

        Only the rows that move are copied (their cache, length and pending token)."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        rows = self._rows
        for hole, mover in zip(holes, movers, strict=True):
            rows[hole] = rows[mover]
            tokens[hole] = tokens[mover]
        if holes:
            self._move_rows(torch.tensor(movers), torch.tensor(holes))
        self._rows = rows[:n]


_MIXER_KINDS = ("linear", "mamba", "conv", "recurrent", "ssm", "rwkv", "hybrid", "delta")
"""Words of a config's layer kinds (``layer_types``, ``block_types``, ``layers_block_type``) that name a
layer mixing tokens otherwise than by attention (``linear_attention``, ``mamba``, ``conv``, ...)."""


_REFUSED_TYPES = {
    "doge": "adds an attention mask of its own, computed from the values (dynamic mask attention), which the "
            "engine's attention does not apply",
    "hrm_text": "runs each layer more than once per token (its reasoning cycles), each run with a cache slot "
                "of its own beyond the layers the engine's cache holds",
    "moshi": "failed every generation in the engine (a matrix shape error in its forward)",
}
"""Model types the structural checks above let through that the engine cannot run, found by running every
causal LM type of Transformers through it (``tests/rollout/test_engine_architectures.py``; the reasons as
measured with Transformers 5.20: Doge's samples had log-probabilities up to 0.19 off the model's, and
every generation of the other two failed)."""

_OTHER_TOWERS = re.compile(r"audio|vision|visual|speech|image", re.IGNORECASE)
"""Module paths of a multimodal model's encoders (Phi-4-multimodal's and Gemma 3n's audio towers hold
convolutions), which the text decoder's token mixing does not include."""


def _sequence_mixers(model: torch.nn.Module, text: Any) -> list[str]:
    """The layers of ``model``'s text decoder that mix tokens otherwise than by attention: the classes
    that hold a ``Conv1d`` outside an audio or vision tower (Mamba, Gated DeltaNet, short-convolution
    and RG-LRU layers in Transformers each convolve over the sequence), else the config's layer kinds
    that say so (:data:`_MIXER_KINDS`: MiniMax's ``linear_attention``)."""
    modules = dict(model.named_modules())
    found = [type(modules[path.rpartition(".")[0]]).__name__ for path, module in modules.items()
             if isinstance(module, torch.nn.Conv1d) and not _OTHER_TOWERS.search(path)]
    if not found:
        for key in ("layer_types", "block_types", "layers_block_type"):
            kinds = getattr(text, key, None) or ()
            found += [repr(kind) for kind in kinds
                      if isinstance(kind, str) and any(word in kind.lower() for word in _MIXER_KINDS)]
    return list(dict.fromkeys(found))


def _recurrent_state(model: torch.nn.Module) -> str | None:
    """The argument that carries a recurrent model's state from token to token through its forward
    (``cache_params`` of Mamba and xLSTM, ``state`` of RWKV), when it takes no ``past_key_values``: no
    attention to cache. None for a model that takes keys and values (every hybrid takes them)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "past_key_values" in parameters:
        return None
    return next((name for name in ("cache_params", "state") if name in parameters), None)


def engine_support(model: torch.nn.Module) -> str | None:
    """Why the torch engine cannot run a causal LM, or None when it can (a model built on the meta
    device answers as well: nothing is computed). The engine replaces the attention function through Transformers' attention interface and keeps its
    own KV cache with one head size for keys and values; it cannot run a model whose attention does not
    go through that interface (StableLM, Falcon, Bloom in Transformers 5), whose keys and values differ
    in size (DeepSeek's multi-head latent attention), that adds attention sinks (GPT-OSS), or that mixes
    tokens in layers other than attention: a convolution or a recurrence over the sequence (Mamba, Gated
    DeltaNet, short convolutions: Qwen3.5, Qwen3-Next, Nemotron-H, Jamba, LFM2, RecurrentGemma; RWKV and
    xLSTM, found by the state their forward carries: :func:`_recurrent_state`), whose
    state of its own the engine does not keep (it packs the running requests into one sequence and caches
    keys and values only). Such a model that reports the attention interface as well (RecurrentGemma,
    LFM2) would otherwise run: measured, its log-probabilities under concurrent requests were off by up
    to 0.13 from the model's own. Nor can it run a model whose layers without RoPE scale their queries by
    a position taken from the cache's length (Llama 4's attention temperature tuning), whose embeddings
    number positions from after the padding id (the RoBERTa family), or one of :data:`_REFUSED_TYPES`.
    ``tests/rollout/test_engine_architectures.py`` holds every causal LM type of Transformers that it can
    build small to this: refused here, or sampled as the model computes."""
    name = type(model).__name__
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mixers = _sequence_mixers(model, text)
    if mixers:
        return (f"{name} mixes tokens in {', '.join(mixers)} layers (a convolution or a recurrence over the "
                "sequence, with a state of its own), which the engine does not keep: it packs requests into one "
                "sequence and caches attention's keys and values only")
    state = _recurrent_state(model)
    if state is not None:
        return (f"{name} mixes tokens by a recurrence, not attention (its forward carries {state!r} from token to "
                "token, not keys and values), which the engine does not keep: it packs requests into one sequence "
                "and caches attention's keys and values only")
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{name}'s attention does not go through Transformers' attention interface "
                f"(transformers {transformers.__version__}), so the engine cannot put its KV cache in")
    if getattr(text, "kv_lora_rank", None):
        return f"{name} uses multi-head latent attention (keys and values of different sizes)"
    if any(parameter.endswith(".sinks") for parameter, _ in model.named_parameters()):
        return f"{name} adds learned attention sinks, which the engine's attention does not apply"
    if getattr(text, "attn_temperature_tuning", False) and 0 in list(getattr(text, "no_rope_layers", None) or [])[
            : text.num_hidden_layers]:
        return (f"{name} scales the queries of its layers without RoPE by a position it takes from the cache's "
                "length, not from each request's position (Llama 4's attention temperature tuning), which the "
                "engine's packed requests do not give")
    if any(hasattr(module, "create_position_ids_from_input_ids") for module in model.modules()):
        return (f"{name} numbers its positions from after its padding id (RoBERTa's embeddings), not from 0 as "
                "the engine gives them")
    refused = _REFUSED_TYPES.get(getattr(text, "model_type", None))
    return f"{name} {refused}" if refused else None
