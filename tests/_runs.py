"""What the end-to-end run tests share: a run from its config file, trained and audited."""

from pathlib import Path

from sao.config import RunConfig, resolve


def train_and_audit(config_file: Path, steps: int = 3) -> tuple[RunConfig, Path, list[dict]]:
    """Check the inputs, warm-start and train the run of ``config_file`` for ``steps`` steps, then audit it
    (``sao lake check`` must pass); returns the config, the version-0 policy directory and the run's
    stored trajectories."""
    from sao import runs
    from sao.audit import check_run
    from sao.lake.store import Lake

    config, _ = resolve(config_file)
    runs.prepare_inputs(config)
    version_zero = runs.warm_start(config)
    result = runs.train_async(config, version_zero)
    assert result.steps == steps and result.version == steps
    lake = Lake.open(config.lake.root)
    report = check_run(lake, config.run_id)
    assert report.ok, report
    return config, version_zero, lake.read("trajectories", predicate=f"run_id = '{config.run_id}'").to_pylist()
