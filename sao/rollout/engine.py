"""The engine protocol: what the agent loop and the Serve app need from a generation backend.

Backends: :class:`sao.rollout.torch_engine.TorchEngine` (default, CPU or GPU) and
:class:`sao.rollout.vllm_engine.VLLMEngine` (extra ``vllm``). Both record, for every sampled token, the
engine's log-probability at generation time and the policy version whose weights sampled it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from sao.algos.sampling import LogprobKind, check_sampling

__all__ = [
    "Engine",
    "FinishReason",
    "FutureEngine",
    "Generation",
    "SamplingParams",
    "VersionSpan",
    "generate_until",
]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request; every trajectory records them.

    Attributes:
        temperature: divides the logits (> 0).
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus mass to keep (1.0 = off).
        max_tokens: budget of new tokens for this request; reaching it ends with ``length``.
        seed: per-request seed; the same seed and prompt give the same tokens whatever else is in the batch.
        stop_token_ids: sampling one of these ends the request with ``stop`` (the token is kept).
        logprob_kind: record log-probabilities of the sampling distribution or of the raw model.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprob_kind: LogprobKind = LogprobKind.SAMPLING

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "logprob_kind", LogprobKind(self.logprob_kind))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


class FinishReason(enum.StrEnum):
    """Why one generation call ended (the agent loop maps these to termination reasons)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class VersionSpan:
    """Tokens ``[start, end)`` of a generation were sampled by policy ``version``."""

    version: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class Generation:
    """The result of one generation call.

    Attributes:
        token_ids: the sampled tokens, in order (a stop token is included).
        logprobs: the engine's log-probability of each sampled token, of kind ``logprob_kind``.
        logprob_kind: ``sampling`` or ``raw``.
        finish_reason: ``stop``, ``length``, ``cancelled`` or ``error``.
        spans: which policy version sampled which tokens; they cover ``token_ids`` without gaps.
        error: a message when ``finish_reason`` is ``error``.
        routed_experts: for a mixture-of-experts model whose engine records routing, ``(R, layers,
            top_k)`` uint8 expert ids the router chose for the first ``R`` tokens of ``prompt_ids +
            token_ids``: every token the engine ran through the model, in order, normally the prompt and
            all sampled tokens but the last (never an input). Within a layer, ids are in the router's
            top-k order. A token run more than once (a recompute after a weight update) holds its latest
            routing. None when not recorded (dense model, recording off, the vLLM engine).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    logprob_kind: LogprobKind
    finish_reason: FinishReason
    spans: tuple[VersionSpan, ...]
    error: str | None = None
    routed_experts: torch.Tensor | None = None


@runtime_checkable
class Engine(Protocol):
    """A generation backend that records log-probabilities and policy versions."""

    name: str

    @property
    def version(self) -> int:
        """The policy version of the weights that sample the next token."""
        ...

    @property
    def engine_version(self) -> str:
        """Backend and library version, recorded in every trajectory."""
        ...

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``; concurrent calls are decoded together."""
        ...

    def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Queue new weights; they take effect between decode steps, in-flight requests continue."""
        ...

    def cancel(self, request_id: str) -> bool:
        """End a request early with ``cancelled``; False if it is not in flight."""
        ...

    def pause(self) -> None:
        """Stop decoding after the current step; requests stay in flight."""
        ...

    def resume(self) -> None:
        """Continue decoding after :meth:`pause`."""
        ...


async def generate_until(engine: Engine, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str,
                         deadline: float) -> tuple[Generation, bool]:
    """``engine.generate`` until a stop id, the budget, cancellation, or ``deadline`` (``time.monotonic``),
    at which the request is cancelled and what was sampled is kept. A caller cancelled while it waits
    cancels the request in the engine too. Returns (generation, whether the deadline ended it)."""
    task = asyncio.ensure_future(engine.generate(prompt_ids, sampling, request_id))
    try:
        done, _ = await asyncio.wait({task}, timeout=max(deadline - time.monotonic(), 0.0))
    except asyncio.CancelledError:
        engine.cancel(request_id)
        raise
    if done:
        return task.result(), False
    engine.cancel(request_id)
    return await task, True


class FutureEngine:
    """``generate`` and ``generate_sync`` for an engine whose ``submit`` returns a concurrent future.

    A subclass provides ``submit(prompt_ids, sampling, request_id) -> concurrent.futures.Future`` and
    ``cancel(request_id)``. A request gets an id when it comes without one, so that a cancelled
    ``generate`` (its task cancelled by the caller) cancels the request in the engine too.
    """

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
               request_id: str | None = None) -> concurrent.futures.Future[Generation]:
        raise NotImplementedError

    def cancel(self, request_id: str) -> bool:
        raise NotImplementedError

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str | None = None) -> Generation:
        request_id = request_id or uuid.uuid4().hex
        future = self.submit(prompt_ids, sampling, request_id)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.cancel(request_id)
            raise

    def generate_sync(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                      request_id: str | None = None, timeout: float | None = None) -> Generation:
        return self.submit(prompt_ids, sampling, request_id).result(timeout)
