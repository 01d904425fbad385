"""The torch engine: KV-cached, continuously batched decoding of a Hugging Face causal LM.

One background thread owns the model. Each loop iteration:

1. applies queued weights, if any (the policy version changes between decode steps; in-flight
   requests continue and their next tokens start a new version span);
2. admits waiting requests (prefilled together, left-padded, and merged into the running batch);
3. samples one token for every running request from its next-token logits, records the token's
   log-probability under the request's distribution (``sampling`` or ``raw``), and retires requests
   that stopped, reached their budget or were cancelled;
4. runs one decode step for the remaining requests.

Departure from engines that keep the KV cache across a weight update (vLLM in-place reloads): after
new weights are loaded, the cache of every in-flight request is recomputed with them (one prefill), so
a token sampled after the update is drawn from exactly pi_new(. | prefix). The recorded log-probability
of every token therefore equals a teacher-forced recomputation under the version its span names. Set
``recompute_kv_on_update=False`` to keep the stale cache (cheaper, approximate).

Sampling uses one uniform draw per token from a per-request generator (inverse CDF), so a request's
tokens depend on its seed and prompt only, not on what else is in the batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
import transformers
from transformers.cache_utils import DynamicCache

from sao.algos.sampling import LogprobKind, sampling_logprobs
from sao.rollout.engine import FinishReason, Generation, SamplingParams, VersionSpan

__all__ = ["TorchEngine", "TorchEngineConfig"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TorchEngineConfig:
    """Settings of the torch engine.

    Attributes:
        max_batch: most requests decoded together; more wait for a free slot.
        recompute_kv_on_update: recompute in-flight requests' KV caches when weights change (exact
            per-version log-probabilities) instead of keeping the stale cache.
        threads: torch intra-op threads for the engine thread (None = torch's default).
        admit_batch: while requests are decoding, waiting ones join in groups of at least this many
            (or all that fit), since every join costs a prefill and a copy of the batch's KV cache ...
        admit_wait_s: ... unless the oldest has waited this long. An idle engine admits at once.
    """

    max_batch: int = 64
    recompute_kv_on_update: bool = True
    threads: int | None = None
    admit_batch: int = 8
    admit_wait_s: float = 0.02


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
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

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
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
            )
        )


class TorchEngine:
    """Continuous-batching engine over a causal LM (see the module docstring).

    Args:
        model: a Hugging Face causal LM (``forward(input_ids, attention_mask, position_ids,
            past_key_values, use_cache)``); the engine puts it in eval mode and owns it.
        version: the policy version of ``model``'s current weights.
        config: engine settings.
        seed: seeds requests that come without a seed of their own.
    """

    name = "torch"

    def __init__(self, model: torch.nn.Module, version: int = 0, config: TorchEngineConfig | None = None,
                 seed: int = 0) -> None:
        self.config = config or TorchEngineConfig()
        self.model = model.eval()
        self._version = version
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._pending_weights: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._paused = False
        self._stopping = False
        self._by_id: dict[str, _Request] = {}
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._steps = itertools.count()
        # Running batch: rows, their KV cache, attention mask (B, L) and next-token logits (B, V).
        self._rows: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._next_logits: torch.Tensor | None = None
        self.weight_updates_applied = 0
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()

    # ----- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def engine_version(self) -> str:
        return f"torch-{torch.__version__}+transformers-{transformers.__version__}"

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._rows) + len(self._pending)

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
               request_id: str | None = None) -> concurrent.futures.Future[Generation]:
        """Queue a request; the future resolves with its :class:`Generation`."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_ids holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and len(prompt) + sampling.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
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
                generator=torch.Generator().manual_seed(seed),
                future=concurrent.futures.Future(),
            )
            if request.request_id in self._by_id:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._by_id[request.request_id] = request
            request.future.add_done_callback(lambda _f, rid=request.request_id: self._forget(rid))
            self._pending.append(request)
            self._cond.notify_all()
        return request.future

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str | None = None) -> Generation:
        future = self.submit(prompt_ids, sampling, request_id)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.cancel(request_id) if request_id else None
            raise

    def generate_sync(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                      request_id: str | None = None, timeout: float | None = None) -> Generation:
        return self.submit(prompt_ids, sampling, request_id).result(timeout)

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
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping
                    or (not self._paused and (self._rows or self._pending or self._pending_weights))
                )
                if self._stopping:
                    return
                weights, self._pending_weights = self._pending_weights, None
                room = self.config.max_batch - len(self._rows)
                admitted: list[_Request] = []
                if self._admit_now(room):
                    admitted, self._pending = self._pending[:room], self._pending[room:]
            try:
                with torch.inference_mode():
                    if weights is not None:
                        self._apply_weights(*weights)
                    if admitted:
                        self._admit(admitted)
                    if self._rows:
                        self._step()
            except Exception as exc:  # a broken step must not hang callers
                log.exception("torch engine step failed")
                for request in self._rows + admitted:
                    request.finish(FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
                self._reset_batch()

    def _admit_now(self, room: int) -> bool:
        """Whether waiting requests join the batch in this iteration (see ``admit_batch``)."""
        if not self._pending or room <= 0:
            return False
        if not self._rows:
            return True
        cfg = self.config
        enough = len(self._pending) >= min(cfg.admit_batch, room)
        return enough or time.monotonic() - self._pending[0].submitted >= cfg.admit_wait_s

    def _apply_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights), strict=True)
        with self._cond:
            self._version = version
            self.weight_updates_applied += 1
            self._cond.notify_all()
        if self._rows and self.config.recompute_kv_on_update:
            rows = self._rows
            self._reset_batch()
            self._admit(rows)

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._mask, self._next_logits = [], None, None, None

    def _admit(self, requests: list[_Request]) -> None:
        """Prefill ``requests`` (their prompt plus tokens sampled so far) and join the batch."""
        contexts = [r.prompt + r.tokens for r in requests]
        width = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.long)
        for i, context in enumerate(contexts):
            ids[i, width - len(context):] = torch.tensor(context)
            mask[i, width - len(context):] = 1
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        if not self._rows:
            self._rows, self._cache, self._mask, self._next_logits = list(requests), cache, mask, logits
            return
        self._cache, self._mask = _merge(self._cache, self._mask, cache, mask, self.model.config)
        self._rows = self._rows + list(requests)
        self._next_logits = torch.cat([self._next_logits, logits])

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from ``_next_logits`` and its recorded log-probability."""
        rows = self._rows
        logits = self._next_logits
        temperature = torch.tensor([r.sampling.temperature for r in rows], dtype=logits.dtype)
        top_k = torch.tensor([r.sampling.top_k for r in rows])
        top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=logits.dtype)
        logp = sampling_logprobs(logits, temperature, top_k, top_p)
        probs = logp.exp()
        uniforms = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in rows])
        cdf = probs.double().cumsum(-1)
        tokens = (cdf < (uniforms * cdf[:, -1]).unsqueeze(-1)).sum(-1)
        last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(-1)
        tokens = torch.minimum(tokens, last_positive)
        recorded = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if any(r.sampling.logprob_kind is LogprobKind.RAW for r in rows):
            raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            is_raw = torch.tensor([r.sampling.logprob_kind is LogprobKind.RAW for r in rows])
            recorded = torch.where(is_raw, raw, recorded)
        return tokens, recorded

    def _step(self) -> None:
        tokens, logprobs = self._sample()
        version = self._version
        keep: list[int] = []
        for i, request in enumerate(self._rows):
            if request.cancelled:
                request.finish(FinishReason.CANCELLED)
                continue
            token = int(tokens[i])
            request.append(token, float(logprobs[i]), version)
            if token in request.sampling.stop_token_ids:
                request.finish(FinishReason.STOP)
            elif len(request.tokens) >= request.sampling.max_tokens:
                request.finish(FinishReason.LENGTH)
            else:
                keep.append(i)
        if not keep:
            self._reset_batch()
            return
        if len(keep) < len(self._rows):
            index = torch.tensor(keep)
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
            self._mask = self._mask[index]
            tokens = tokens[index]
            self._rows = [self._rows[i] for i in keep]
        self._trim()
        mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=self._mask.dtype)], dim=1)
        # A decode step's causal mask is just the padding mask: pass it ready-made as (B, 1, 1, L) so
        # the model does not rebuild a 4D mask from the 2D one at every step.
        out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask.bool()[:, None, None, :],
                         position_ids=mask.sum(-1, keepdim=True) - 1, past_key_values=self._cache, use_cache=True)
        self._mask = mask
        self._next_logits = out.logits[:, -1].float()
        next(self._steps)

    def _trim(self) -> None:
        """Drop leading cache columns that are padding in every row."""
        used = self._mask.any(dim=0)
        first = int(used.long().argmax())
        if first > 0:
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


def _merge(cache_a: DynamicCache, mask_a: torch.Tensor, cache_b: DynamicCache, mask_b: torch.Tensor,
           config: object) -> tuple[DynamicCache, torch.Tensor]:
    """Stack two batches' caches along the batch axis, left-padding the shorter to the same length."""
    width = max(mask_a.shape[1], mask_b.shape[1])

    def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
        missing = width - t.shape[-dim_from_end]
        if missing == 0:
            return t
        spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
        return F.pad(t, spec)

    merged = DynamicCache(config=config)
    for index, (la, lb) in enumerate(zip(cache_a.layers, cache_b.layers, strict=True)):
        keys = torch.cat([pad(la.keys, 2), pad(lb.keys, 2)])
        values = torch.cat([pad(la.values, 2), pad(lb.values, 2)])
        merged.update(keys, values, index)
    mask = torch.cat([pad(mask_a, 1), pad(mask_b, 1)])
    return merged, mask
