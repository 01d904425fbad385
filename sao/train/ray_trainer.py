"""Training on Ray Train: :func:`sao.train.loop.train_worker` as the per-worker loop of a TorchTrainer.

Every worker reads its shard of each step's trajectories from the pinned Delta snapshot; gradients are
summed across workers over the gloo (CPU) or NCCL process group that TorchTrainer sets up. Rank 0
commits the step to the lake and publishes the weights. Committed steps are also reported to Ray Train
(``ray.train.report``, at most every ``TrainConfig.report_interval_s``: a report can block the step
until Ray Train's controller polls) so the Ray dashboard shows progress; the lake has every step.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from sao.train.config import TrainConfig
from sao.train.loop import train_worker

__all__ = ["fit", "run_fit"]

log = logging.getLogger(__name__)


def _train_func(config: dict) -> None:
    import ray.train

    cfg: TrainConfig = config["config"]

    def report(step_report) -> None:
        if step_report.report_due:  # at most every TrainConfig.report_interval_s: each report can block
            ray.train.report({"step": step_report.step, "version": step_report.version, **step_report.metrics})

    train_worker(cfg, max_steps=config.get("max_steps"), on_step=report)


def fit(cfg: TrainConfig, *, storage_path: str | None = None, max_steps: int | None = None):
    """Run the training loop on ``cfg.num_workers`` Ray Train workers; returns the Ray Train result.

    Ray must be initialised (:func:`sao.runtime.init_ray`).
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage = storage_path or str(Path(cfg.checkpoint_root).resolve().parent / "ray_train")
    trainer = TorchTrainer(
        _train_func,
        train_loop_config={"config": cfg, "max_steps": max_steps},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=False,
                                     resources_per_worker={**cfg.resources_per_worker, "CPU": cfg.cpus_per_worker}),
        run_config=RunConfig(name=f"train-{cfg.run_id}", storage_path=storage),
    )
    return run_fit(trainer)


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
