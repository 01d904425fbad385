"""Step replay: a past step recomputed from its checkpoint and frozen snapshot equals the recorded one."""

import json

import pyarrow as pa
import pytest
import torch
from deltalake import write_deltalake
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from sao.cli import app
from sao.lake.maintenance import compact, vacuum
from sao.lake.store import Lake
from sao.models.critic import CriticConfig
from sao.train.checkpoint import checkpoint_dir
from sao.train.config import UpdateConfig
from sao.train.loop import prepare_run, run_training
from sao.train.replay import ReplayError, RowSource, compare_metrics, replay_steps, what_if_steps
from sao.train.run_config import RunConfigError, read_run_config, run_config_path, write_run_config
from schemas import train_steps
from tests.train.test_loop import make_config, roll_out

runner = CliRunner()


def trained_run(tmp_path, policy_dir, tokenizer, steps: int):
    """A run with ``steps`` committed steps of 4 trajectories each (versions 0 -> steps), all rolled out
    by version 0: (its TrainConfig, its lake)."""
    cfg = make_config(tmp_path, policy_dir, total_steps=steps)
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 4 * steps)
    run_training(cfg)
    return cfg, lake


@pytest.fixture
def trained(tmp_path, policy_dir, tokenizer):
    """A run with two committed steps (versions 0 -> 1 -> 2) on eight real trajectories."""
    return trained_run(tmp_path, policy_dir, tokenizer, 2)


def cli(cfg, *args):
    return runner.invoke(app, ["replay", "--lake", cfg.lake.root, *args])


def test_a_past_step_replays_bit_for_bit_also_after_appends_compaction_and_vacuum(trained, policy_dir, tokenizer):
    cfg, lake = trained
    report = replay_steps(lake, cfg.run_id, 1)
    assert report.ok and report.start_version == 1 and report.source is RowSource.LAKE
    (step,) = report.steps
    versions = {r["version"]: r["weights_hash"] for r in lake.read("policy_versions").to_pylist()}
    assert step.replayed_hash == step.recorded_hash == versions[2]
    assert step.metrics_compared > 15 and not step.metric_mismatches  # losses, kept fractions, values...
    recorded = lake.read(train_steps.NAME, predicate="step = 1").to_pylist()[0]
    before = lake.version("trajectories")
    # More data arrives, the small files are compacted, and vacuum runs (default retention, then none).
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 6, seed=1)
    files_before = len(lake.table("trajectories").file_uris())
    compact(lake, ["trajectories"])
    vacuum(lake, ["trajectories"])
    vacuum(lake, ["trajectories"], retention_hours=0, force=True)  # recorded snapshots are still kept
    assert lake.version("trajectories") > before >= recorded["trajectories_version"]
    assert len(lake.table("trajectories").file_uris()) < files_before
    for step_number in (0, 1):
        again = replay_steps(lake, cfg.run_id, step_number)
        assert again.ok, again
    result = cli(cfg, "--run", cfg.run_id, "--step", "1")
    assert result.exit_code == 0, result.output
    assert "step 1 v1->v2 4 trajectories" in result.output and ": match" in result.output


def test_a_range_replays_steps_in_memory_and_reports_each(trained):
    cfg, lake = trained
    result = cli(cfg, "--run", cfg.run_id, "--steps", "0:1", "--json")
    assert result.exit_code == 0, result.output
    assert '"ok": true' in result.output
    report = replay_steps(lake, cfg.run_id, 0, 1)
    assert [s.step for s in report.steps] == [0, 1] and report.ok and report.start_version == 0


def test_a_tampered_checkpoint_is_reported_as_a_mismatch(trained):
    cfg, lake = trained
    weights = checkpoint_dir(cfg.checkpoint_root, 1) / "policy" / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(k for k in tensors if "mlp.experts" in k)[0]
    tensors[name] = tensors[name] + 1e-3 * torch.ones_like(tensors[name])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    report = replay_steps(lake, cfg.run_id, 1)
    assert not report.ok and not report.start_ok
    assert not report.steps[0].hash_ok
    result = cli(cfg, "--run", cfg.run_id, "--step", "1")
    assert result.exit_code == 1
    assert "MISMATCH start checkpoint v1" in result.output and "step 1 v1->v2" in result.output


def test_a_tampered_metric_is_reported_as_a_mismatch(trained):
    cfg, lake = trained
    rows = lake.read(train_steps.NAME).to_pylist()
    for row in rows:
        if row["step"] == 0:
            row["metrics"] = [(k, v + 0.5 if k == "actor/kept_frac" else v) for k, v in row["metrics"]]
    write_deltalake(lake.table_uri(train_steps.NAME), pa.Table.from_pylist(rows, schema=train_steps.SCHEMA),
                    mode="overwrite")
    report = replay_steps(lake, cfg.run_id, 0)
    (step,) = report.steps
    assert step.hash_ok and not step.ok
    assert [m.name for m in step.metric_mismatches] == ["actor/kept_frac"]
    result = cli(cfg, "--run", cfg.run_id, "--step", "0")
    assert result.exit_code == 1 and "actor/kept_frac: recorded" in result.output


def test_usage_errors_exit_2_with_a_reason(trained):
    cfg, lake = trained
    cases = [
        (["--run", "nope", "--step", "0"], "unknown run 'nope'"),
        (["--run", cfg.run_id, "--step", "7"], "has no recorded step 7"),
        (["--run", cfg.run_id, "--steps", "1-2"], "--steps needs N:M"),
        (["--run", cfg.run_id, "--steps", "1:0"], "need 0 <= N <= M"),
        (["--run", cfg.run_id, "--step", "0", "--trajectory", "x"], "exactly one of"),
        (["--step", "0"], "--step needs --run"),
        (["--trajectory", "no-such-id"], "trajectory 'no-such-id' is not in"),
    ]
    for args, message in cases:
        result = cli(cfg, *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output
    run_config_path(cfg.checkpoint_root).unlink()
    with pytest.raises(ReplayError, match="no run configuration"):
        replay_steps(lake, cfg.run_id, 0)
    assert cli(cfg, "--run", cfg.run_id, "--step", "0").exit_code == 2


def test_the_run_configuration_round_trips_and_refuses_a_changed_resume(trained):
    cfg, _ = trained
    assert read_run_config(cfg.checkpoint_root) == cfg
    changed = cfg.__class__(**{**cfg.__dict__, "update": cfg.update.__class__(lr_policy=1.0, token_budget=4096)})
    with pytest.raises(RunConfigError, match="update"):
        prepare_run(changed)
    # Settings that do not change an update may differ on resume.
    prepare_run(cfg.__class__(**{**cfg.__dict__, "total_steps": 9, "wait_timeout_s": 1.0}))


def test_a_run_recorded_before_skip_reasons_existed_reads_as_passing_over_nothing(tmp_path, policy_dir):
    """Such a run trained on every end (its bootstrap_reasons may hold cancelled and error, which the
    new default passes over): it replays, and resumes with its recorded settings, as such."""
    old_update = UpdateConfig(bootstrap_reasons=["length", "turns", "timeout", "cancelled", "error"], skip_reasons=[])
    cfg = make_config(tmp_path, policy_dir, update=old_update)
    path = write_run_config(cfg)
    stored = json.loads(path.read_text())
    del stored["train"]["update"]["skip_reasons"]
    path.write_text(json.dumps(stored))
    assert read_run_config(cfg.checkpoint_root).update == old_update
    write_run_config(cfg)  # the recorded settings resume
    with pytest.raises(RunConfigError, match="update"):  # the new defaults are other settings
        write_run_config(cfg.__class__(**{**cfg.__dict__, "update": UpdateConfig()}))


def test_the_critic_setup_round_trips_and_a_run_recorded_before_it_reads_as_the_default(tmp_path, policy_dir):
    cfg = make_config(tmp_path, policy_dir, critic=CriticConfig(freeze_attention=False, train_norms=True))
    path = write_run_config(cfg)
    assert read_run_config(cfg.checkpoint_root) == cfg
    stored = json.loads(path.read_text())
    del stored["train"]["critic"]
    path.write_text(json.dumps(stored))
    assert read_run_config(cfg.checkpoint_root).critic == CriticConfig()


@pytest.mark.ray
def test_a_range_replay_reads_its_snapshot_through_ray_data(trained, policy_dir, tokenizer, ray_session):
    cfg, lake = trained
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 4, seed=2)  # rows the range did not use
    compact(lake, ["trajectories"])
    report = replay_steps(lake, cfg.run_id, 0, 1)  # a Ray instance is up: the range reads via Ray Data
    assert report.source is RowSource.RAY_DATA
    assert report.ok and [s.step for s in report.steps] == [0, 1]


@pytest.fixture
def trained3(tmp_path, policy_dir, tokenizer):
    """A run with three committed steps (versions 0 -> 3) on twelve real trajectories."""
    return trained_run(tmp_path, policy_dir, tokenizer, 3)


def test_a_what_if_replay_without_changes_is_the_recorded_run(trained3):
    cfg, lake = trained3
    report = what_if_steps(lake, cfg.run_id, 0, 2, {})
    assert [s.step for s in report.steps] == [0, 1, 2]
    for step in report.steps:
        assert step.weight_distance == 0.0 and step.recorded_update_norm > 0.0
        mismatches, compared = compare_metrics(step.recorded, step.rerun)
        assert compared > 10 and not mismatches


def test_a_what_if_replay_with_a_tighter_dis_bound_masks_more_and_moves_elsewhere(trained3):
    cfg, lake = trained3
    report = what_if_steps(lake, cfg.run_id, 0, 2, {"eps_low": 1e-9, "eps_high": 1e-9})
    assert report.overrides == {"eps_low": 1e-9, "eps_high": 1e-9} and report.start_version == 0
    # Steps 1 and 2 train on version-0 data with a newer policy: rho != 1, so a 1e-9 interval masks tokens
    # that the recorded interval (0.7, 6.0) kept; the weights then part from the recorded ones.
    stale = report.steps[1:]
    assert all(s.rerun["actor/kept_frac"] < s.recorded["actor/kept_frac"] for s in stale)
    assert report.steps[-1].weight_distance > 0.0


@pytest.mark.parametrize(("overrides", "message"), [
    ({"eps_hi": 1.0}, "not update settings"),
    ({"token_budget": 128}, "cannot change \\['token_budget'\\]"),
    ({"algorithm": "grpo"}, "has no critic, unlike the run's 'sao'"),
    ({"gamma": 2.0}, "gamma must lie in"),
])
def test_a_what_if_replay_refuses_what_it_cannot_do(trained3, overrides, message):
    cfg, lake = trained3
    with pytest.raises(ReplayError, match=message):
        what_if_steps(lake, cfg.run_id, 0, 0, overrides)


def test_sao_replay_set_prints_both_sides_and_records_the_what_if_run(trained3):
    cfg, lake = trained3
    result = cli(cfg, "--run", cfg.run_id, "--steps", "1:2", "--set", "algorithm.eps_high=0.01", "--as", "wi")
    assert result.exit_code == 0, result.output
    assert f"what-if replay of run {cfg.run_id} steps 1..2 with algorithm.eps_high=0.01, as run wi" in result.output
    assert "actor/kept_frac" in result.output and "recorded" in result.output and "re-run" in result.output
    (row,) = lake.read("runs", predicate="run_id = 'wi'").to_pylist()
    assert (row["event"], row["parent_run_id"], row["parent_steps"]) == ("what_if", cfg.run_id, "1:2")
    assert json.loads(row["changed"]) == {"algorithm.eps_high": [None, 0.01]}  # the parent has no runs row
    refused = cli(cfg, "--run", cfg.run_id, "--steps", "0:0", "--set", "train.steps=9")
    assert refused.exit_code == 2 and "update settings only (algorithm.*)" in refused.stderr
    again = cli(cfg, "--run", cfg.run_id, "--steps", "1:2", "--set", "algorithm.eps_high=0.02", "--as", "wi")
    assert again.exit_code == 2 and "run 'wi' has recorded steps already" in again.stderr


def test_a_what_if_run_is_recorded_like_a_trained_one_reconciled_and_replayed(trained3):
    """The what-if run has its own steps (the parent's snapshots and ids, data_run_id the parent),
    versions and checkpoints: `sao lake check` reconciles it, `sao replay` replays it bit for bit, and a
    step that read other data than its parent's is a finding."""
    from sao import runs
    from sao.audit import FindingKind, check_run
    from sao.lake.ledger import record_train_step
    from sao.lake.records import TrainStepRecord, utc_now

    cfg, lake = trained3
    report, new_run = runs.what_if(lake, cfg.run_id, 1, 2, {"algorithm.eps_high": 0.01}, as_run="wi")
    steps = lake.read("train_steps", predicate="run_id = 'wi'").to_pylist()
    parent = {r["step"]: r for r in lake.read("train_steps", predicate=f"run_id = '{cfg.run_id}'").to_pylist()}
    assert [r["step"] for r in sorted(steps, key=lambda r: r["step"])] == [1, 2]
    for row in steps:
        assert row["data_run_id"] == cfg.run_id and row["trajectory_ids"] == parent[row["step"]]["trajectory_ids"]
        assert row["trajectories_version"] == parent[row["step"]]["trajectories_version"]
        assert dict(row["metrics"])["actor/kept_frac"] == report.steps[row["step"] - 1].rerun["actor/kept_frac"]
    versions = {r["version"]: r for r in lake.read("policy_versions", predicate="run_id = 'wi'").to_pylist()}
    theirs = {r["version"]: r for r in lake.read("policy_versions", predicate=f"run_id = '{cfg.run_id}'").to_pylist()}
    assert sorted(versions) == [1, 2, 3] and "/wi/" in versions[3]["checkpoint_uri"]
    assert versions[1]["weights_hash"] == theirs[1]["weights_hash"]  # it starts where the parent's step 1 did
    assert versions[3]["weights_hash"] != theirs[3]["weights_hash"]  # and went elsewhere

    checked = check_run(lake, "wi")
    assert checked.ok, checked
    assert checked.consumed == 8 and checked.checkpoints_verified == 3 and checked.backlog is None
    assert any("what-if replay of run" in note for note in checked.notes)
    replayed = replay_steps(lake, "wi", 1, 2)
    assert replayed.ok and [s.step for s in replayed.steps] == [1, 2], replayed

    record_train_step(lake, TrainStepRecord(  # a "what-if" step 1 that read the parent's step 0 data
        run_id="forged", step=1, policy_version_before=1, policy_version_after=2,
        trajectories_version=parent[0]["trajectories_version"], trajectory_ids=parent[0]["trajectory_ids"],
        started_at=utc_now(), finished_at=utc_now(), data_run_id=cfg.run_id))
    forged = check_run(lake, "forged", verify_checkpoints=False)
    assert [f.kind for f in forged.findings] == [FindingKind.WHAT_IF_DATA]


def test_metrics_compare_over_the_recorded_names():
    """A metric newer code computes that the recording lacks is no mismatch (a lake recorded by an
    older version replays clean); a recorded metric the replay lacks, or a different value, is one."""
    recorded = {"actor/loss": 0.5, "critic/loss": 0.25, "time/step_s": 3.0}
    mismatches, compared = compare_metrics(recorded, {"actor/loss": 0.5, "critic/loss": 0.25,
                                                      "batch/flat_group_frac": 0.4, "time/step_s": 9.0})
    assert mismatches == () and compared == 2
    mismatches, _ = compare_metrics(recorded, {"actor/loss": 0.5000001})
    assert [(m.name, m.recorded, m.replayed) for m in mismatches] == [("actor/loss", 0.5, 0.5000001),
                                                                       ("critic/loss", 0.25, None)]
