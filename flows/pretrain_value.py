"""Prefect flow ``pretrain_value``: fit a run's version-0 critic on trajectories of its initial policy.

Calls :func:`sao.train.pretrain.pretrain_value` (Ray Data reads one pinned snapshot, Ray Train fits the
critic; see that module) after the warm start, and shows the held-out value loss and explained
variance before and after as a table artifact. It must run before the run's first step (it writes the
version-0 critic; a run that has trained is refused), on trajectories sampled by version 0: those of the
run itself, or of another run from the same warm start (``data_run_id``). It writes a checkpoint, so
its task is not retried. Its parameter ``config`` is the run config of the ``train`` run that follows
(the same form): it warm-starts that run's model on its data, and it prepares the run, which records
the settings a replay depends on, so that ``train`` run is accepted only with the same settings.
"""

from __future__ import annotations

from prefect import flow, task

from flows.train import show_pretrain_report, warm_start
from sao import runs
from sao.config import RunConfig
from sao.runtime import init_ray
from sao.train.pretrain import PretrainConfig, PretrainReport, ValueTarget, pretrain_value

_PRETRAIN = PretrainConfig()


@task(name="pretrain-value")
def pretrain_task(settings: RunConfig, policy_path: str, pretrain: PretrainConfig) -> PretrainReport:
    """Fit and write the version-0 critic (writes a checkpoint: not retried)."""
    init_ray(settings.ray_config())
    return pretrain_value(runs.pipeline_config(settings, policy_path).train, pretrain)


@flow(name="pretrain_value", log_prints=True)
def pretrain_value_flow(
    config: RunConfig = RunConfig(),  # noqa: B008
    data_run_id: str | None = None,
    num_samples: int | None = None,
    heldout_fraction: float = _PRETRAIN.heldout_fraction,
    epochs: int = _PRETRAIN.epochs,
    batch_size: int = _PRETRAIN.batch_size,
    target: ValueTarget = _PRETRAIN.target,
) -> dict:
    """Pretrain the critic of run ``config.run_id`` on version-0 trajectories (of ``data_run_id`` when
    given): at most ``num_samples`` (None: ``config.value_pretraining.samples``)."""
    settings = config
    run_id = config.run_id
    pretrain = PretrainConfig(num_samples=config.value_pretraining.samples if num_samples is None else num_samples,
                              heldout_fraction=heldout_fraction, epochs=epochs, batch_size=batch_size, target=target,
                              data_run_id=data_run_id)
    runs.check_resume(config)  # a run recorded with other settings is refused before anything is written, as by the train flow
    runs.prepare_inputs(config)  # the model, tasks and reward functions of the run, as the train flow checks them
    policy_path = warm_start(settings)
    report = pretrain_task(settings, policy_path, pretrain)
    show_pretrain_report(run_id, report)
    return {"run_id": run_id, "data_run_id": report.data_run_id, "num_train": report.num_train,
            "num_heldout": report.num_heldout, "loss_before": report.loss_before, "loss_after": report.loss_after,
            "explained_variance_before": report.explained_variance_before,
            "explained_variance_after": report.explained_variance_after, "critic_path": report.critic_path}
