"""Value pretraining (SAO.md section 3): fit the critic on trajectories of the initial policy before RL.

``pretrain_value(cfg, PretrainConfig(...))``:

1. **Data**: the trajectories of ``data_run_id`` (the run itself by default) sampled entirely by policy
   version 0 (``max_policy_version = 0``), read from one pinned ``trajectories`` snapshot with
   ``ray.data.read_delta(table_uri, version=...)``, filtered to the run, ordered by arrival
   (``ingest_seq``), without the ends ``UpdateConfig.skip_reasons`` names (``cancelled`` and ``error``
   by default: RL does not train on them either), and cut to the first ``num_samples``; the newest ``heldout_fraction`` of them are held
   out. (The paper used about 6k samples; the default here is laptop-sized.)
2. **Training** on Ray Train workers (``TorchTrainer`` with ``datasets=``; each worker streams its
   shard, ``resources_per_worker={"CPU": cpus_per_worker}`` leaves CPUs for the read tasks; on the
   device the run's ``train.device`` and ``train.bf16`` give, resolved as for RL by
   :func:`sao.train.device.use_gpu` before the data is read), one critic
   optimiser step per batch of ``batch_size`` trajectories, ``epochs`` passes, through the same
   :meth:`sao.train.step.Learner.critic_update` as RL (frozen attention, ``lr_critic`` with warm-up,
   gradient clipping, gradients summed across workers, token denominators of the whole batch).
3. **Output**: the fitted critic replaces the critic of the run's version-0 checkpoint
   (:func:`sao.train.checkpoint.replace_critic`), which is what the training loop loads for version
   0 (``_load_models``) and what replay of step 0 starts from; so pretraining must run after
   ``prepare_run`` and before the first step (refused otherwise). ``sao_pretrain.json`` beside it
   records the data, the settings and the figures.

Targets (:class:`ValueTarget`), a choice the paper leaves open:

- ``monte_carlo`` (default): the observed return of each action token, ``sum_k gamma^k r_{t+k}`` over
  the following action tokens, with no bootstrap, budget ends included. That is skip-observation GAE
  with values 0 and lambda 1 (computed by the same function), the paper's lam_critic = 1. It is
  VAPO's value pretraining, and the natural choice here: the critic being pretrained is untrained,
  so bootstrapping budget ends from it would regress onto its own noise.
- ``lambda_return``: the critic's own ``lam_critic`` returns, recomputed before every step exactly as
  in RL (bootstrapped with V(s_end) on the ends ``UpdateConfig.bootstrap_reasons`` names).

Figures: on the held-out trajectories, before and after, the value loss ``0.5 * (V - R)^2`` averaged
over action tokens and the explained variance ``1 - Var(R - V) / Var(R)`` (None when the returns do
not vary), both against the Monte-Carlo return (a fixed target that does not move with the critic).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

from sao.algos.advantages import skip_observation_gae
from sao.lake.store import Lake
from sao.train.batch import TrainBatch, collate, split_by_token_budget
from sao.train.checkpoint import critic_dir, load_checkpoint, replace_critic
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.device import configure_torch, use_gpu, worker_device
from sao.train.loop import TRAIN_COLUMNS, prepare_run
from sao.train.step import Learner, critic_values, explained_variance
from schemas import trajectories

__all__ = [
    "REPORT_FILE",
    "PretrainConfig",
    "PretrainReport",
    "ValueTarget",
    "fit_critic",
    "monte_carlo_returns",
    "pretrain_value",
    "select_samples",
    "value_metrics",
]

REPORT_FILE = "sao_pretrain.json"


class ValueTarget(enum.StrEnum):
    """What the critic regresses onto (see the module docstring)."""

    MONTE_CARLO = "monte_carlo"
    LAMBDA_RETURN = "lambda_return"


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Value pretraining.

    Attributes:
        num_samples: trajectories of version 0 to use, train and held-out together (paper: about 6k).
        heldout_fraction: share of them held out for the before/after figures (at least one).
        epochs: passes over the training trajectories.
        batch_size: trajectories per critic optimiser step (across all workers).
        lr: critic learning rate (None: ``UpdateConfig.lr_critic``; warm-up and clipping as in RL).
        target: the regression target.
        data_run_id: run whose trajectories to use (None: the run being pretrained).
        trajectories_version: the ``trajectories`` snapshot to read (None: the latest at the start).
        num_workers: Ray Train workers (data parallel).
        cpus_per_worker: Ray CPUs per worker (a fraction leaves CPUs for Ray Data's read tasks).

    The device is not a setting here: value pretraining trains where the run does
    (``TrainConfig.device`` and ``TrainConfig.bf16``).
    """

    num_samples: int = 512
    heldout_fraction: float = 0.2
    epochs: int = 3
    batch_size: int = 16
    lr: float | None = None
    target: ValueTarget = ValueTarget.MONTE_CARLO
    data_run_id: str | None = None
    trajectories_version: int | None = None
    num_workers: int = 1
    cpus_per_worker: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", ValueTarget(self.target))
        if self.num_samples < 2:
            raise ValueError(f"PretrainConfig.num_samples must be >= 2 (train and held-out), got {self.num_samples}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"PretrainConfig.heldout_fraction must lie in (0, 1), got {self.heldout_fraction}")
        for name in ("epochs", "batch_size", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"PretrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"PretrainConfig.lr must be > 0 or None, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class PretrainReport:
    """What one value pretraining did (also written as ``sao_pretrain.json`` beside the critic)."""

    run_id: str
    data_run_id: str
    trajectories_version: int
    num_train: int
    num_heldout: int
    epochs: int
    optimizer_steps: int
    target: str
    loss_before: float
    loss_after: float
    explained_variance_before: float | None
    explained_variance_after: float | None
    critic_path: str
    seconds: float


# ----- the core: no Ray ---------------------------------------------------------------------------


def monte_carlo_returns(batch: TrainBatch, gamma: float) -> torch.Tensor:
    """(B, T) observed return of each action token (no bootstrap), 0 elsewhere: skip-observation GAE
    with values 0 and lambda 1."""
    zeros = torch.zeros_like(batch.rewards)
    no_bootstrap = torch.zeros(zeros.shape[0], device=zeros.device)
    _, returns = skip_observation_gae(batch.rewards, zeros, batch.action_mask, no_bootstrap, gamma, 1.0)
    return returns


def _collate(rows: Sequence[Mapping], update: UpdateConfig) -> TrainBatch:
    return collate(rows, trainer_version=0, bootstrap_reasons=update.bootstrap_reasons)


@torch.no_grad()
def value_metrics(critic: torch.nn.Module, rows: Sequence[Mapping], update: UpdateConfig
                  ) -> tuple[float, float | None]:
    """(value loss, explained variance) of ``critic`` on ``rows`` against Monte-Carlo returns, over
    every action token (micro-batches by ``update.micro_batch_tokens``, run on the critic's device in float32;
    the figures are reduced on CPU)."""
    batch = _collate(rows, update)
    returns = monte_carlo_returns(batch, update.gamma).double()
    values = torch.zeros_like(returns)
    device = next(critic.parameters()).device
    for index in split_by_token_budget(batch, update.micro_batch_tokens(torch.get_num_threads())):
        micro = batch.select(index).to(device)
        micro_values, _ = critic_values(critic, micro)
        values[index, : micro_values.shape[1]] = micro_values.double().cpu()
    mask = batch.action_mask
    target, predicted = returns[mask], values[mask]
    loss = float(0.5 * (predicted - target).square().mean())
    return loss, explained_variance(target, predicted)


def fit_critic(learner: Learner, batches: Callable[[int], Iterable[Sequence[Mapping]]], epochs: int,
               target: ValueTarget) -> tuple[int, dict[str, float]]:
    """Run ``epochs`` passes of one critic step per batch (``batches(epoch)`` yields lists of rows);
    returns (optimiser steps, the last step's metrics)."""
    steps, metrics = 0, {}
    for epoch in range(epochs):
        for rows in batches(epoch):
            batch = _collate(rows, learner.config)
            returns = monte_carlo_returns(batch, learner.config.gamma) if target is ValueTarget.MONTE_CARLO else None
            metrics = learner.critic_update(batch, returns=returns, steps=1)
            steps += 1
    return steps, metrics


# ----- Ray Data: the pinned snapshot ---------------------------------------------------------------


def select_samples(lake: Lake, run_id: str, pcfg: PretrainConfig, skip_reasons: Sequence[str] = ()):
    """(train dataset, held-out dataset, snapshot version): the first ``num_samples`` version-0
    trajectories of ``run_id`` by arrival whose termination reason is not in ``skip_reasons``, read with
    Ray Data at one pinned snapshot; the newest ``heldout_fraction`` held out. Ray must be initialised."""
    import ray.data

    _quiet_ray_data()
    _wait_for_a_free_cpu()
    version = lake.version(trajectories.NAME) if pcfg.trajectories_version is None else pcfg.trajectories_version
    columns = ["run_id", "ingest_seq", "max_policy_version", *[c for c in TRAIN_COLUMNS if c != "ingest_seq"]]
    dataset = ray.data.read_delta(lake.table_uri(trajectories.NAME), version=version,
                                  storage_options=dict(lake.storage_options) or None, columns=columns)

    def of_version_zero(batch: pa.Table) -> pa.Table:
        keep = pc.and_(pc.equal(batch["run_id"], run_id), pc.equal(batch["max_policy_version"], 0))
        if skip_reasons:
            passed = pc.is_in(batch["termination_reason"], value_set=pa.array(list(skip_reasons), pa.string()))
            keep = pc.and_(keep, pc.invert(passed))
        return batch.filter(pc.fill_null(keep, False))

    chosen = (dataset.map_batches(of_version_zero, batch_format="pyarrow").sort("ingest_seq")
              .limit(pcfg.num_samples).select_columns(list(TRAIN_COLUMNS)).materialize())
    count = chosen.count()
    if count < 2:
        raise ValueError(f"value pretraining needs at least 2 trajectories sampled by version 0 in run {run_id!r} "
                         f"(trajectories version {version}, ends in {tuple(skip_reasons)} left out); found {count}")
    heldout = min(count - 1, max(1, round(count * pcfg.heldout_fraction)))
    train, held = chosen.split_at_indices([count - heldout])
    return train, held, version


def _quiet_ray_data() -> None:
    """No progress bars or per-operator progress logs from this short read (the run logs its own
    progress); Ray Data's warnings still show, but for its note that progress bars are off, which is
    marked as said already (``log_once`` under the key Ray Data uses for it)."""
    import ray.data
    from ray.util.debug import log_once

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    log_once("ray_data_progress_manager_disabled")


def _wait_for_a_free_cpu(timeout_s: float = 30.0) -> None:
    """Ray Data reads on a free CPU. Value pretraining starts right after the collecting replicas
    are deleted, and Ray releases their CPUs a moment later; reading before that makes Ray Data warn
    that the cluster "does not have any available CPUs" and "the Dataset job will hang" until it has.
    Wait for one instead (a cluster whose CPUs stay taken still gets Ray's warning after ``timeout_s``)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) <= 0.0 and time.monotonic() < deadline:
        time.sleep(0.2)


# ----- Ray Train: the workers ---------------------------------------------------------------------


def _rows(iterator, batch_size: int | None = None) -> Iterable[list[dict]]:
    for batch in iterator.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
        if batch.num_rows:
            yield batch.to_pylist()


def _train_func(config: dict) -> None:
    import ray.train

    from sao.train.ray_trainer import unsealed

    config = unsealed(config)
    cfg: TrainConfig = config["train"]
    pcfg: PretrainConfig = config["pretrain"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = worker_device(config["gpu"])
    configure_torch(device, threads=cfg.torch_threads, deterministic=cfg.deterministic)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    checkpoint = load_checkpoint(cfg.checkpoint_root, 0, with_critic=True, with_state=False)
    update = cfg.update if pcfg.lr is None else dataclasses.replace(cfg.update, lr_critic=pcfg.lr)
    learner = Learner(update, checkpoint.policy.to(device), checkpoint.critic.to(device), bf16=cfg.bf16)
    heldout = [row for rows in _rows(ray.train.get_dataset_shard("heldout")) for row in rows]
    loss_before, explained_before = value_metrics(learner.critic, heldout, update)
    shard = ray.train.get_dataset_shard("train")
    per_worker = max(1, pcfg.batch_size // world)

    def batches(epoch: int) -> Iterable[list[dict]]:
        yield from _rows(shard, per_worker)
        ray.train.report({"epoch": epoch})  # every worker: a collective call in Ray Train

    steps, _ = fit_critic(learner, batches, pcfg.epochs, pcfg.target)
    loss_after, explained_after = value_metrics(learner.critic, heldout, update)
    if rank == 0:
        path = critic_dir(cfg.checkpoint_root, 0)
        report = {**config["report"], "num_heldout": len(heldout), "optimizer_steps": steps,
                  "loss_before": loss_before, "loss_after": loss_after,
                  "explained_variance_before": explained_before, "explained_variance_after": explained_after,
                  "critic_path": str(path.resolve()), "seconds": time.perf_counter() - started}
        # The report marks the critic done: it goes in with the critic, so a crash between them cannot
        # leave a fitted critic that a resumed run would fit again (or a report without its critic).
        replace_critic(cfg.checkpoint_root, 0, learner.critic,
                       files={REPORT_FILE: json.dumps(report, indent=2, sort_keys=True) + "\n"})


def pretrain_value(cfg: TrainConfig, pcfg: PretrainConfig | None = None, *,
                   storage_path: str | None = None) -> PretrainReport:
    """Pretrain the critic of run ``cfg.run_id`` and write it as its version-0 critic (see the module
    docstring). Ray must be initialised (:func:`sao.runtime.init_ray`).

    It trains where the run trains: ``cfg.device`` and ``cfg.bf16`` (``train.device``, ``train.bf16``).

    Raises:
        ValueError: the algorithm has no critic, the run has already trained, or too few trajectories.
        DeviceUnavailableError: ``train.device`` cuda and the Ray cluster has no GPU, or GPUs fewer than
            workers (before anything is read).
    """
    from ray.train import DataConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from sao.train.ray_trainer import run_fit, scaling_config, sealed, torch_config

    pcfg = pcfg or PretrainConfig()
    if not cfg.update.uses_critic:
        raise ValueError(f"algorithm {cfg.update.algorithm.value!r} has no critic to pretrain")
    # No rollout_gpus: the data was collected and its rollout app is gone; the fit has every GPU.
    gpu = use_gpu(cfg.device, bf16=cfg.bf16, workers=pcfg.num_workers, gpus_per_worker=cfg.gpus_per_worker)
    started = time.perf_counter()
    if prepare_run(cfg) != 0:
        raise ValueError(f"run {cfg.run_id!r} has trained already: value pretraining writes the version-0 critic "
                         "and must run before the first step")
    lake = Lake.open(cfg.lake)
    data_run = pcfg.data_run_id or cfg.run_id
    train, heldout, version = select_samples(lake, data_run, pcfg, cfg.update.skip_reasons)
    num_train = train.count()
    storage = storage_path or str(Path(cfg.checkpoint_root).resolve().parent / "ray_train")
    trainer = TorchTrainer(
        _train_func,
        train_loop_config=sealed({"train": cfg, "pretrain": pcfg, "gpu": gpu, "report": {
            "run_id": cfg.run_id, "data_run_id": data_run, "trajectories_version": version, "num_train": num_train,
            "epochs": pcfg.epochs, "target": str(pcfg.target)}}),
        scaling_config=scaling_config(pcfg.num_workers, pcfg.cpus_per_worker, gpu, gpus_per_worker=cfg.gpus_per_worker),
        torch_config=torch_config(gpu),
        run_config=RunConfig(name=f"pretrain-value-{cfg.run_id}", storage_path=storage),
        datasets={"train": train, "heldout": heldout},
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    run_fit(trainer)
    written = json.loads((critic_dir(cfg.checkpoint_root, 0) / REPORT_FILE).read_text())
    written["seconds"] = time.perf_counter() - started
    report = PretrainReport(**written)
    for name in ("loss_before", "loss_after"):
        if not math.isfinite(getattr(report, name)):
            raise RuntimeError(f"value pretraining of run {cfg.run_id!r} produced a non-finite {name}")
    return report
