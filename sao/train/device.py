"""Where the trainer runs: ``train.device`` (:attr:`TrainConfig.device <sao.train.config.TrainConfig>`)
and ``train.bf16``.

Settings (:data:`DeviceSetting`):

- ``cpu``: every trainer worker on CPU: Ray Train workers without a GPU, a gloo process group.
- ``cuda``: ``train.gpus_per_worker`` GPUs per Ray Train worker (``ScalingConfig(use_gpu=True)``; a
  fraction shares one), an NCCL process group; each worker trains on the GPU Ray Train gives it
  (``ray.train.torch.get_device()``).
- ``auto`` (the default): ``cuda`` when the Ray cluster has a GPU (``ray.cluster_resources()["GPU"] > 0``)
  at the moment the trainer starts, else ``cpu``. Without a Ray instance (the in-process trainer called
  outside a pipeline, as the tests do) Ray sees no GPU, and ``auto`` is ``cpu``; ``cuda`` there means
  this process's current CUDA device.

The driver resolves the setting once, before any worker is launched (:func:`use_gpu`). GPUs that are
not there are a :class:`DeviceUnavailableError` then, naming ``train.device`` and what was found:
``cuda`` where the Ray cluster has no GPU, and on GPUs fewer than ``train.workers`` x
``train.gpus_per_worker``, which Ray Train would otherwise wait for forever. GPUs that the run's
rollout replicas hold (``rollout.gpus`` x ``rollout.num_replicas``) are not the trainer's: ``auto`` is
``cpu`` when the replicas hold every GPU, and ``cuda`` is refused then. A worker that was
given a GPU but whose torch sees no CUDA device (a CPU build of torch on a GPU node) fails the same way
as it starts (:func:`worker_device`).

``bf16``: the forward passes of the update run under ``torch.autocast("cuda", dtype=torch.bfloat16)``
(:func:`autocast`); the weights, their gradients and AdamW's moments stay float32 (master weights), and
log-probabilities and values are cast to float32 before any loss. The policy's output layer runs in
float32 (:func:`sao.train.step.scoring_logits`: its logits decide the DIS ratio) for the models whose
output layer it runs at the scoring positions (``PLAIN_HEAD_MODEL_TYPES``); any other model's logits
come from its whole forward under autocast, in bf16. It is refused on CPU (a
``ValueError`` naming ``train.bf16`` and ``train.device``): CPU autocast to bf16 is slow on most CPUs and
would only break the bit-for-bit replay the CPU path keeps.

What is reproduced and what is not:

- **CPU**: with ``deterministic`` (the default) a single-worker step is bit for bit the same every time;
  step replay (:mod:`sao.train.replay`) checks it with weight hashes and exact metrics.
- **GPU**: ``deterministic`` asks for deterministic CUDA kernels where torch has them
  (:func:`configure_torch` sets ``CUBLAS_WORKSPACE_CONFIG`` for cuBLAS and turns
  ``torch.use_deterministic_algorithms`` on with ``warn_only``: the MoE's expert grouping (``histc``),
  attention backward kernels and others have no deterministic CUDA version and warn instead of
  failing). A GPU step is therefore not promised to repeat bit for bit, not even on the same GPU, and
  never across GPU models, drivers, or torch and CUDA versions.
- **A GPU run's replay** runs on CPU in float32, whatever the run's ``train.device`` (checkpoints hold
  CPU tensors and load on CPU): its weights hash differs from the recorded one and its metrics agree
  within a tolerance only (``sao replay --metric-tolerance``), more loosely under ``bf16``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import typing
from typing import Literal

import torch

__all__ = [
    "DEVICE_SETTINGS",
    "CPU",
    "DeviceSetting",
    "DeviceUnavailableError",
    "autocast",
    "check_settings",
    "configure_torch",
    "resolve_device",
    "to_cpu",
    "use_gpu",
    "worker_device",
]

DeviceSetting = Literal["auto", "cpu", "cuda"]
"""The values of ``train.device`` (see the module docstring)."""

DEVICE_SETTINGS: tuple[str, ...] = typing.get_args(DeviceSetting)

CPU = torch.device("cpu")

# cuBLAS picks its reduction workspace per call unless this is set; with deterministic algorithms on,
# torch refuses cuBLAS matmuls without it (":4096:8" is the value the torch documentation gives).
_CUBLAS_WORKSPACE = ":4096:8"


class DeviceUnavailableError(RuntimeError):
    """``train.device`` asks for a GPU that this cluster or this process does not have."""


def check_settings(device: str, bf16: bool) -> None:
    """Raise ``ValueError`` for a ``train.device`` that is not one of :data:`DEVICE_SETTINGS`, or for
    ``train.bf16`` with ``train.device`` cpu (the checks that need no hardware)."""
    if device not in DEVICE_SETTINGS:
        raise ValueError(f"train.device must be one of {', '.join(DEVICE_SETTINGS)}; got {device!r}")
    if bf16 and device == "cpu":
        raise _bf16_on_cpu("train.device is 'cpu'")


def _bf16_on_cpu(why: str) -> ValueError:
    return ValueError(f"train.bf16 is true but {why}: bf16 autocast is for CUDA only; set train.bf16 to false, "
                      "or train.device to cuda on a machine with a GPU")


def _gpus_seen(setting: str) -> tuple[float, str]:
    """(GPUs, where they were counted) for a ``cuda`` or ``auto`` setting: the Ray cluster's when Ray is
    initialised; else this process's for ``cuda`` and none for ``auto`` (see the module docstring)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0)), "the Ray cluster"
    if setting == "cuda":
        return float(torch.cuda.device_count()), f"this process (no Ray instance; torch {torch.__version__})"
    return 0.0, "no Ray instance is running"


def use_gpu(setting: str, *, bf16: bool = False, workers: int = 1, gpus_per_worker: float = 1.0,
            rollout_gpus: float = 0.0) -> bool:
    """Whether ``workers`` trainer workers train on GPUs under ``train.device`` ``setting`` (see the
    module docstring): what ``ScalingConfig(use_gpu=...)`` gets. Call it on the driver, before workers
    are launched. ``rollout_gpus``: GPUs the run's rollout replicas hold, which the trainer cannot have
    (``auto`` is ``cpu`` when they hold every GPU).

    Raises:
        ValueError: an unknown setting, or ``bf16`` where the setting resolves to CPU.
        DeviceUnavailableError: ``cuda`` where no GPU is left to the trainer; fewer GPUs than ``workers``.
    """
    check_settings(setting, bf16)
    if setting == "cpu":
        return False
    total, counted_by = _gpus_seen(setting)
    gpus = max(total - rollout_gpus, 0.0)
    left, fix = "", ""
    if rollout_gpus and total > 0:
        left = (f" left to the trainer (the rollout replicas hold {rollout_gpus:g} of its {total:g}: rollout.gpus x "
                "rollout.num_replicas)")
        fix = ", lower rollout.gpus or rollout.num_replicas"
    if gpus <= 0:
        if setting == "cuda":
            raise DeviceUnavailableError(
                f"train.device is 'cuda' but {counted_by} has no GPU{left} (GPU resources: {total:g}); set "
                f"train.device to cpu or auto{fix}, or start Ray on nodes with GPUs (ray start --num-gpus N)")
        if bf16:
            raise _bf16_on_cpu(f"train.device 'auto' resolved to cpu ({counted_by}: no GPU)")
        return False
    if gpus < workers * gpus_per_worker:
        raise DeviceUnavailableError(
            f"train.device {setting!r} trains on GPUs, {gpus_per_worker:g} per worker (train.gpus_per_worker), but "
            f"{counted_by} has {gpus:g} GPU(s){left} for {workers} workers (train.workers): lower train.workers to "
            f"{int(gpus / gpus_per_worker)} or fewer{fix}, or set train.device to cpu")
    return True


def worker_device(gpu: bool) -> torch.device:
    """The device of a Ray Train worker that was (``gpu``) or was not given a GPU: the one Ray Train
    assigned it (``ray.train.torch.get_device()``), or CPU.

    Raises:
        DeviceUnavailableError: ``gpu`` and torch in this worker sees no CUDA device.
    """
    if not gpu:
        return CPU
    _require_cuda("this Ray Train worker was given a GPU (train.device)")
    import ray.train.torch

    return ray.train.torch.get_device()


def resolve_device(setting: str, *, bf16: bool = False) -> torch.device:
    """The device a trainer in this process (not a Ray Train worker) trains on under ``train.device``
    ``setting``: the in-process trainer's, with :func:`use_gpu`'s resolution.

    Raises:
        ValueError, DeviceUnavailableError: as :func:`use_gpu`; also ``DeviceUnavailableError`` when a GPU
            is asked for (or ``auto`` finds one in the Ray cluster) but torch here sees no CUDA device.
    """
    if not use_gpu(setting, bf16=bf16):
        return CPU
    gpus, counted_by = _gpus_seen(setting)
    _require_cuda(f"train.device is {setting!r} and {counted_by} has {gpus:g} GPU(s)")
    return torch.device("cuda", torch.cuda.current_device())


def _require_cuda(why: str) -> None:
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"{why}, but torch on {socket.gethostname()} sees no CUDA device (torch {torch.__version__}, built "
            f"for CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
            "install a CUDA build of torch there, or set train.device to cpu")


def configure_torch(device: torch.device, *, threads: int, deterministic: bool) -> None:
    """A worker's torch settings: ``threads`` intra-op threads and, with ``deterministic``,
    deterministic kernels (on CUDA as far as they exist: see the module docstring)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
    else:
        torch.use_deterministic_algorithms(deterministic)


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """The context of a forward pass: bf16 autocast on CUDA with ``bf16``, else nothing at all (the
    float32 path is untouched).

    Raises:
        ValueError: ``bf16`` on a device that is not CUDA.
    """
    if not bf16:
        return contextlib.nullcontext()
    if device.type != "cuda":
        raise _bf16_on_cpu(f"the models are on {device}")
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16)


def to_cpu(value):
    """``value`` (tensors inside dicts, lists and tuples, as in an optimiser's ``state_dict``) with
    every tensor on CPU; tensors already there are the same objects (no copy)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(item) for item in value)
    return value
