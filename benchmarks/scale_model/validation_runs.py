"""The real pipeline, run here at small configurations and measured, for :mod:`.validation` to compare
the model with (``sao bench scale --validate``: about 4-6 minutes)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.scale_model.measurement import RunMeasurement, measure_run
from benchmarks.scale_model.paths import ROOT

__all__ = ["MAX_IN_FLIGHT", "VALIDATION_CONFIGS", "WARMUP_CONFIG", "run_validation"]

VALIDATION_CONFIGS: tuple[tuple[int, int], ...] = ((2, 16), (1, 16), (2, 32))  # (replicas, batch); first = calibration
WARMUP_CONFIG = (1, 8)  # run first, not measured: Ray's worker pool, Serve and the first torch calls warm up
MAX_IN_FLIGHT = 64


def _policy_dir(workdir: Path) -> Path:
    """The SFT policy of the learning benchmark when it is on disk (the trajectories of a trained
    policy), else a random tiny policy."""
    sft = ROOT / "runs" / "bench" / "bench-learning" / "sft"
    if (sft / "config.json").exists():
        return sft
    from sao.models.policy import build_policy, save_policy
    from sao.models.tokenizer import build_tokenizer

    return save_policy(build_policy(seed=0), workdir / "policy", build_tokenizer())


def run_validation(workdir: Path, configs: Sequence[tuple[int, int]], steps: int) -> list[RunMeasurement]:
    """The real pipeline (Serve replicas, lake writer, Ray Train trainer) at each ``(replicas, batch)``,
    one after the other in one local Ray instance; each measured from its lake."""
    from sao.lake.config import LakeConfig
    from sao.lake.store import Lake
    from sao.pipeline import PipelineConfig, run_pipeline
    from sao.rollout.agent import AgentConfig
    from sao.runs import math_tasks
    from sao.runtime import RayConfig, init_ray, shutdown_ray
    from sao.train.config import TrainConfig

    policy = _policy_dir(workdir)
    lake_config = LakeConfig(root=str(workdir / "lake"))
    tasks = math_tasks("train")
    init_ray(RayConfig())
    measured: list[RunMeasurement] = []
    try:
        for index, (replicas, batch) in enumerate([WARMUP_CONFIG, *configs]):
            warmup = index == 0
            run_id = f"scale-warmup-r{replicas}-b{batch}" if warmup else f"scale-r{replicas}-b{batch}"
            run_steps = 6 if warmup else steps
            print(f"validation run {run_id}: {run_steps} steps ...", file=sys.stderr)
            train = TrainConfig(run_id=run_id, lake=lake_config, checkpoint_root=str(workdir / run_id / "ckpt"),
                                policy_path=str(policy), batch_size=batch, max_staleness=2, total_steps=run_steps)
            run_pipeline(PipelineConfig(train=train, num_replicas=replicas,
                                        agent=AgentConfig(max_tokens=96, max_turns=4), max_in_flight=MAX_IN_FLIGHT,
                                        app_name=f"rollout-{run_id}"), tasks)
            if warmup:
                continue
            load = os.getloadavg()[0]  # the machine's 1-minute load at the end of the run (other jobs too)
            measured.append(dataclasses.replace(measure_run(Lake.open(lake_config), run_id, replicas, MAX_IN_FLIGHT),
                                                load_average=load))
    finally:
        shutdown_ray()
    return measured

