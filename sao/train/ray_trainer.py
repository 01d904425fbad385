"""Training on Ray Train: :func:`sao.train.loop.train_worker` as the per-worker loop of a TorchTrainer.

Every worker reads its shard of each step's trajectories from the pinned Delta snapshot; gradients are
summed across workers over the gloo (CPU) or NCCL (GPU) process group that TorchTrainer sets up. Where
the workers train is decided once, on the driver, before they are launched (``train.device``,
:func:`sao.train.device.use_gpu`): on GPUs each worker asks Ray for ``train.gpus_per_worker``
(``ScalingConfig(use_gpu=True)``; a fraction shares one) and trains on the one Ray Train assigns it. Rank 0
commits the step to the lake and publishes the weights. Committed steps are also reported to Ray Train
(``ray.train.report``, at most every ``TrainConfig.report_interval_s``: a report can block the step
until Ray Train's controller polls) so the Ray dashboard shows progress; the lake has every step.

The train-loop config reaches the workers :func:`sealed`: Ray Train's controller, a process of its own
that starts before the workers, unpickles the config it passes on, and an object of this package in
it made that process import the training stack (torch's models, transformers, ``sao.train``) that only
the workers use: the controller's start took 6.5-7.7 s instead of 2.9-3.7 s on 2 cores, before the
training's first step and before value pretraining's fit alike (docs/HISTORY.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sao.train.config import TrainConfig
from sao.train.device import use_gpu, worker_device
from sao.train.loop import train_worker

__all__ = ["fit", "run_fit", "scaling_config", "sealed", "torch_config", "unsealed"]

log = logging.getLogger(__name__)


def sealed(config: Mapping[str, Any]) -> dict[str, bytes]:
    """A train-loop config as Ray Train's controller passes it on without unpickling what it holds (see
    the module docstring); :func:`unsealed` gives it back in the worker."""
    from ray import cloudpickle

    return {"sealed": cloudpickle.dumps(dict(config))}


def unsealed(config: Mapping[str, bytes]) -> dict[str, Any]:
    """The train-loop config :func:`sealed` wrapped."""
    from ray import cloudpickle

    return cloudpickle.loads(config["sealed"])


def _train_func(config: dict) -> None:
    import ray.train

    config = unsealed(config)
    cfg: TrainConfig = config["config"]
    device = worker_device(config["gpu"])

    def report(step_report) -> None:
        if step_report.report_due:  # at most every TrainConfig.report_interval_s: each report can block
            ray.train.report({"step": step_report.step, "version": step_report.version, **step_report.metrics})

    train_worker(cfg, device=device, max_steps=config.get("max_steps"), on_step=report)


def fit(cfg: TrainConfig, *, storage_path: str | None = None, max_steps: int | None = None):
    """Run the training loop on ``cfg.num_workers`` Ray Train workers; returns the Ray Train result.

    Ray must be initialised (:func:`sao.runtime.init_ray`).

    Raises:
        DeviceUnavailableError: ``train.device`` cuda and the Ray cluster has no GPU, or GPUs fewer than
            workers (before any worker starts; :mod:`sao.train.device`).
    """
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    gpu = use_gpu(cfg.device, bf16=cfg.bf16, workers=cfg.num_workers, gpus_per_worker=cfg.gpus_per_worker,
                  rollout_gpus=cfg.rollout_gpus)
    storage = storage_path or str(Path(cfg.checkpoint_root).resolve().parent / "ray_train")
    trainer = TorchTrainer(
        _train_func,
        train_loop_config=sealed({"config": cfg, "gpu": gpu, "max_steps": max_steps}),
        scaling_config=scaling_config(cfg.num_workers, cfg.cpus_per_worker, gpu, cfg.resources_per_worker,
                                      cfg.gpus_per_worker),
        torch_config=torch_config(gpu),
        run_config=RunConfig(name=f"train-{cfg.run_id}", storage_path=storage),
    )
    return run_fit(trainer)


def scaling_config(num_workers: int, cpus_per_worker: float, gpu: bool,
                   resources: Mapping[str, float] | None = None, gpus_per_worker: float = 1.0
                   ):  # -> ray.train.ScalingConfig
    """Ray Train's ``ScalingConfig`` of the trainer (and of value pretraining): ``cpus_per_worker`` CPUs,
    ``gpus_per_worker`` GPUs each with ``gpu``, and the custom ``resources`` of each worker."""
    from ray.train import ScalingConfig

    per_worker = {**(resources or {}), "CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpu else {})}
    return ScalingConfig(num_workers=num_workers, use_gpu=gpu, resources_per_worker=per_worker)


def torch_config(gpu: bool):  # -> ray.train.torch.TorchConfig
    """The workers' process group: NCCL between GPUs, gloo between CPUs (Ray Train's own default,
    written out)."""
    from ray.train.torch import TorchConfig

    return TorchConfig(backend="nccl" if gpu else "gloo")


def run_fit(trainer):
    """``trainer.fit()`` on a thread of its own, waited for here. Called on the main thread, Ray Train's
    ``fit`` installs a SIGINT handler of its own (it aborts the run and exits) in place of the run's
    (:mod:`sao.interrupt`) and never restores it; off the main thread it does not."""
    if threading.current_thread() is not threading.main_thread():
        return trainer.fit()
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # raised again on the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)  # short waits: a Ctrl-C reaches this (main) thread's handler
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
