"""The torch engine in a process of its own, behind the same interface.

A Python process runs one thread at a time (the GIL). The torch engine's decode loop is many small
tensor operations, each a short stretch without the GIL and a handover back to Python, so any other
busy thread of its process slows it: in a Ray Serve replica the request-handling threads took about a
fifth of the process's time and the engine decoded at roughly half its speed in a process of its own
(docs/RESULTS.md, rollout section). The same split is why vLLM runs its engine core apart from its
API server. :class:`TorchEngineProcess` starts a child process (``spawn``) that builds the model and
runs a :class:`~sao.rollout.torch_engine.TorchEngine`; the parent keeps the engine interface
(``submit``, ``generate``, ``load_weights``, ``cancel``, ``pause`` / ``resume``, ``progress``,
``stats``, ``version``) and talks to the child over a pipe: one message per request and one per result
(its routing record as a numpy array, see :func:`_to_wire`), weights as one ``torch.save`` buffer per
version.

Requests are checked in the parent (:func:`~sao.rollout.torch_engine.check_request`), so a bad one is
refused at ``submit`` with the same message as the in-process engine. If the child dies, every request
in flight ends with ``finish_reason="error"`` naming the exit, and :meth:`TorchEngineProcess.healthy`
turns false (a Serve replica then fails its health check and is replaced).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import itertools
import logging
import multiprocessing
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sao.algos.sampling import LogprobKind
from sao.rollout.cpus import keep_process_off
from sao.rollout.engine import FinishReason, FutureEngine, Generation, SamplingParams
from sao.rollout.torch_engine import EngineStats, TorchEngineConfig, check_request

__all__ = ["TorchEngineProcess"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0


class TorchEngineProcess(FutureEngine):
    """A :class:`~sao.rollout.torch_engine.TorchEngine` running in a child process (see the module docstring).

    Args:
        model_factory: a picklable callable that builds the model in the child (for example
            ``functools.partial(load_policy, path)``).
        version: the policy version of the weights ``model_factory`` builds.
        config: engine settings (``threads`` are the child's engine-thread torch threads).
        seed: seeds requests that come without a seed of their own.
        start_timeout_s: how long to wait for the child to build the model.
    """

    name = "torch"

    def __init__(self, model_factory: Callable[[], torch.nn.Module], version: int = 0,
                 config: TorchEngineConfig | None = None, seed: int = 0,
                 start_timeout_s: float = _START_TIMEOUT_S) -> None:
        self.config = config or TorchEngineConfig()
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(target=_child_main, args=(child_conn, model_factory, version, self.config, seed),
                                        name="sao-torch-engine", daemon=True)
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._futures: dict[str, concurrent.futures.Future[Generation]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._version = version
        self.weight_updates_applied = 0
        self._closed = False
        self._dead: str | None = None
        if not self._conn.poll(start_timeout_s):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})") from None
        if kind == "failed":
            self._process.join(timeout=5)
            raise RuntimeError(f"the engine process could not start: {info}")
        self._vocab_size, self._max_positions, self.engine_version = info
        self._receiver = threading.Thread(target=self._receive, name="torch-engine-receiver", daemon=True)
        self._receiver.start()

    # ----- the engine interface --------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._futures)

    def healthy(self) -> bool:
        """Whether the child process is alive and answering."""
        return self._dead is None and self._process.is_alive()

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
               request_id: str | None = None) -> concurrent.futures.Future[Generation]:
        """Queue a request; the future resolves with its :class:`Generation`."""
        prompt = check_request(prompt_ids, sampling, self._vocab_size, self._max_positions)
        request_id = request_id or uuid.uuid4().hex
        future: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        with self._cond:
            if self._closed or self._dead is not None:
                raise RuntimeError(f"the engine is closed{'' if self._dead is None else ': ' + self._dead}")
            if request_id in self._futures:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._futures[request_id] = future
        self._send(("submit", request_id, prompt, sampling))
        return future

    def load_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        buffer = io.BytesIO()
        torch.save({name: tensor.detach().cpu() for name, tensor in weights.items()}, buffer)
        self._send(("weights", version, buffer.getvalue()))

    def wait_for_version(self, version: int, timeout: float = 60.0) -> None:
        """Block until weights of ``version`` are in use."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._version >= version or self._dead is not None, timeout):
                raise TimeoutError(f"engine did not reach version {version} within {timeout} s")
            if self._dead is not None:
                raise RuntimeError(f"the engine process died: {self._dead}")

    def cancel(self, request_id: str) -> bool:
        with self._cond:
            if request_id not in self._futures:
                return False
        self._send(("cancel", request_id))
        return True

    def pause(self) -> None:
        self._send(("pause",))

    def resume(self) -> None:
        self._send(("resume",))

    def progress(self, request_id: str) -> int | None:
        """Tokens sampled so far for an in-flight request (None when it is not in flight)."""
        return self._call("progress", request_id)

    def stats(self) -> EngineStats:
        return self._call("stats")

    def close(self) -> None:
        """Stop the child; requests still in flight end as ``cancelled``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._dead is None:
            try:
                self._send(("close",))
            except (OSError, RuntimeError):
                pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._receiver.join(timeout=5)
        self._fail_all(FinishReason.CANCELLED, None)
        self._conn.close()

    # ----- plumbing --------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self._dead is not None:
            raise RuntimeError(f"the engine process died: {self._dead}")
        with self._send_lock:
            self._conn.send(message)

    def _call(self, method: str, *args: object) -> Any:
        call_id = next(self._call_ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            self._calls[call_id] = future
        self._send(("call", call_id, method, args))
        return future.result(timeout=60)

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "done":
                _, request_id, generation = message
                with self._cond:
                    future = self._futures.pop(request_id, None)
                if future is not None:
                    future.set_result(_from_wire(generation))
            elif kind == "version":
                with self._cond:
                    self._version = message[1]
                    self.weight_updates_applied += 1
                    self._cond.notify_all()
            elif kind == "reply":
                _, call_id, ok, value = message
                with self._cond:
                    future = self._calls.pop(call_id)
                future.set_result(value) if ok else future.set_exception(value)
            elif kind == "closed":
                break
        self._process.join(timeout=5)
        if not self._closed:
            self._dead = f"exit code {self._process.exitcode}"
            log.error("the torch engine process died (%s)", self._dead)
            self._fail_all(FinishReason.ERROR, f"the engine process died ({self._dead})")

    def _fail_all(self, reason: FinishReason, error: str | None) -> None:
        with self._cond:
            futures, self._futures = self._futures, {}
            calls, self._calls = self._calls, {}
            self._cond.notify_all()
        for future in futures.values():
            if not future.done():
                future.set_result(Generation(token_ids=(), logprobs=(), logprob_kind=LogprobKind.SAMPLING, finish_reason=reason,
                                             spans=(), error=error))
        for call in calls.values():
            call.set_exception(RuntimeError(error or "the engine is closed"))


def _to_wire(generation: Generation) -> Generation:
    """The generation as the child sends it: routing as a numpy array. A torch tensor sent through a
    ``multiprocessing`` pipe travels through shared memory, and its file descriptor through a socket
    connection to the sender's resource-sharer thread for every result (about 0.2 ms of CPU per result
    across both processes, against 0.03 ms for a numpy array, which pickles by value)."""
    if generation.routed_experts is None:
        return generation
    return dataclasses.replace(generation, routed_experts=generation.routed_experts.numpy())


def _from_wire(generation: Generation) -> Generation:
    """The inverse of :func:`_to_wire`: routing back as a torch tensor."""
    if generation.routed_experts is None:
        return generation
    return dataclasses.replace(generation, routed_experts=torch.from_numpy(generation.routed_experts))


def _child_main(conn, model_factory: Callable[[], torch.nn.Module], version: int, config: TorchEngineConfig,
                seed: int) -> None:
    """The child: build the model, run the engine, serve the pipe until ``close`` or the parent goes."""
    from sao.rollout.torch_engine import TorchEngine

    torch.set_num_threads(1)  # parallel torch work on the engine thread only (TorchEngineConfig.threads)
    if config.cpus is not None:  # this thread reads the pipe: off the engine thread's CPUs
        keep_process_off(config.cpus)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            try:
                conn.send(message)
            except (OSError, ValueError):  # the parent is gone
                pass

    try:
        model = model_factory()
        engine = TorchEngine(model, version=version, config=config, seed=seed,
                             on_version=lambda v: send(("version", v)))
    except Exception as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(("ready", (model.config.vocab_size, getattr(model.config, "max_position_embeddings", None),
                    engine.engine_version)))

    def finished(request_id: str, future: concurrent.futures.Future[Generation]) -> None:
        send(("done", request_id, _to_wire(future.result())))

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "submit":
                _, request_id, prompt, sampling = message
                try:
                    future = engine.submit(prompt, sampling, request_id)
                except Exception as exc:  # checked in the parent already; never silently lost
                    send(("done", request_id, Generation(token_ids=(), logprobs=(), logprob_kind=sampling.logprob_kind,
                                                         finish_reason=FinishReason.ERROR, spans=(),
                                                         error=f"{type(exc).__name__}: {exc}")))
                    continue
                future.add_done_callback(lambda f, rid=request_id: finished(rid, f))
            elif kind == "weights":
                _, new_version, payload = message
                engine.load_weights(new_version, torch.load(io.BytesIO(payload), weights_only=True))
            elif kind == "cancel":
                engine.cancel(message[1])
            elif kind == "pause":
                engine.pause()
            elif kind == "resume":
                engine.resume()
            elif kind == "call":
                _, call_id, method, args = message
                try:
                    send(("reply", call_id, True, getattr(engine, method)(*args)))
                except Exception as exc:
                    send(("reply", call_id, False, exc))
            elif kind == "close":
                break
    finally:
        engine.close()
        send(("closed",))
        conn.close()
