"""Checkpoint retention: old trainer state goes, what replay and stored trajectories need stays."""

import asyncio

import pytest

from sao.envs import make_env
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.config import WriterConfig
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.torch_engine import TorchEngine
from sao.train.checkpoint import (
    CheckpointPrunedError,
    complete_versions,
    has_full_state,
    load_checkpoint,
    pruned_parts,
    weights_hash,
)
from sao.train.config import TrainConfig
from sao.train.loop import prepare_run, run_training
from sao.train.replay import replay_steps
from sao.train.retention import RetentionConfig, apply_retention, referenced_versions
from tests.train.test_loop import make_config, roll_out


def roll_out_version(cfg, tokenizer, lake, version, count, seed):
    """``count`` trajectories sampled by checkpointed ``version``."""
    engine = TorchEngine(load_checkpoint(cfg.checkpoint_root, version, with_state=False).policy, version=version)
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env), AgentConfig(max_tokens=24, max_turns=2))
    tasks = generate_tasks(MathToolConfig(num_train=count, num_heldout=0, seed=seed))

    async def many():
        return await asyncio.gather(*[loop.run(t, run_id=cfg.run_id, seed=i) for i, t in enumerate(tasks)])

    records = asyncio.run(many())
    engine.close()
    loop.close()
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)


def test_retention_in_the_loop_keeps_referenced_weights_and_every_step_replayable(tmp_path, policy_dir, tokenizer):
    retention = RetentionConfig(keep_last=1, keep_every=0, keep_policy_weights=False, policy_grace=0)
    cfg = make_config(tmp_path, policy_dir, total_steps=1, retention=retention)
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 8)  # sampled by version 0
    run_training(cfg)  # step 0: version 1
    roll_out_version(cfg, tokenizer, lake, 1, 4, seed=1)  # sampled by version 1
    run_training(TrainConfig(**{**cfg.__dict__, "total_steps": 3}))  # steps 1, 2: versions 2, 3
    root = cfg.checkpoint_root
    assert complete_versions(root) == [0, 1, 2, 3] and referenced_versions(lake, cfg.run_id) == {0, 1}
    # Version 0 (every replay chain's start) and the newest stay whole; version 1 keeps its weights
    # (a stored trajectory names it); version 2 is named by nothing and loses them too.
    assert [pruned_parts(root, v) for v in range(4)] == [
        (), ("critic", "trainer_state"), ("critic", "policy", "trainer_state"), ()]
    assert has_full_state(root, 0) and has_full_state(root, 3) and not has_full_state(root, 1)
    recorded = {r["version"]: r["weights_hash"] for r in lake.read("policy_versions").to_pylist()}
    assert weights_hash(load_checkpoint(root, 1, with_state=False).policy) == recorded[1]
    with pytest.raises(CheckpointPrunedError, match="trainer_state"):
        load_checkpoint(root, 1, require_state=True)
    with pytest.raises(CheckpointPrunedError, match="policy"):
        load_checkpoint(root, 2)
    assert load_checkpoint(root, 3, require_state=True).trainer_state is not None  # resume
    # Step 2 started from version 2, whose state is gone: replay starts at version 0 and re-runs
    # steps 0 and 1 on the way, each checked against its recorded hash.
    report = replay_steps(lake, cfg.run_id, 2)
    assert report.ok and report.start_version == 0
    assert [(s.step, s.lead_in) for s in report.steps] == [(0, True), (1, True), (2, False)]


def test_retention_keeps_every_nth_version_and_all_weights_by_default(tmp_path, policy_dir, tokenizer):
    cfg = make_config(tmp_path, policy_dir, total_steps=3)
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    roll_out(policy_dir, tokenizer, lake, cfg.run_id, 12)
    run_training(cfg)
    plan = apply_retention(lake, cfg.run_id, cfg.checkpoint_root, RetentionConfig(keep_last=1, keep_every=2),
                           dry_run=True)
    assert (plan.keep_full, plan.prune_state, plan.prune_policy) == ((0, 2, 3), (1,), ())
    assert pruned_parts(cfg.checkpoint_root, 1) == ()  # a dry run deletes nothing
    apply_retention(lake, cfg.run_id, cfg.checkpoint_root, RetentionConfig(keep_last=1, keep_every=2))
    assert pruned_parts(cfg.checkpoint_root, 1) == ("critic", "trainer_state")
    assert replay_steps(lake, cfg.run_id, 1).start_version == 0  # one lead-in step
    assert replay_steps(lake, cfg.run_id, 2).start_version == 2  # kept in full: no lead-in


def test_retention_settings_are_validated():
    with pytest.raises(ValueError, match="keep_last"):
        RetentionConfig(keep_last=0)
    with pytest.raises(ValueError, match="keep_every"):
        RetentionConfig(keep_every=-1)


def test_retention_after_every_step_looks_at_each_version_a_bounded_number_of_times(tmp_path, monkeypatch):
    """The trainer passes each plan's ``settled`` to the next: the outcome is a full sweep's, and a
    version is looked into while it is among the newest only, not at every later step."""
    import collections

    import sao.train.retention as retention
    from sao.train.checkpoint import checkpoint_dir

    looked = collections.Counter()
    real = retention.pruned_parts

    def counting(root, version):
        looked[version] += 1
        return real(root, version)

    monkeypatch.setattr(retention, "pruned_parts", counting)
    root, config, after = tmp_path / "ckpt", RetentionConfig(keep_last=3, keep_every=5), -1
    for version in range(40):
        path = checkpoint_dir(root, version)
        (path / "critic").mkdir(parents=True)
        (path / "COMPLETE").write_text("")
        after = apply_retention(None, "run-0", root, config, after=after).settled
        assert after == max(-1, version - 3)
    full = {0, 37, 38, 39} | set(range(0, 40, 5))
    assert [v for v in range(40) if pruned_parts(root, v) == ()] == sorted(full)
    assert all(pruned_parts(root, v) == ("critic", "trainer_state") for v in range(40) if v not in full)
    assert retention.plan_retention(None, "run-0", root, config).prune_state == ()  # a full sweep: nothing left
    assert max(looked.values()) <= config.keep_last + 1
