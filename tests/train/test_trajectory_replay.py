"""Trajectory replay on real torch-engine rollouts, including weights swapped mid-generation."""

import asyncio
import dataclasses
import time

import pytest
import torch
from typer.testing import CliRunner

from sao.cli import app
from sao.envs import make_env
from sao.envs.base import write_tasks
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.envs.style_preference import StylePreferenceConfig
from sao.envs.style_preference import generate_tasks as style_tasks
from sao.lake.config import WriterConfig
from sao.lake.reader import read_trajectories
from sao.lake.records import RecordedSampling, Segment, Timings, TrajectoryRecord, utc_now
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from sao.models.chat import IM_END, ChatTokens, prompt_ids
from sao.models.policy import build_policy, save_policy
from sao.models.tokenizer import chat_template_version, tokenizer_version
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.torch_engine import TorchEngine
from sao.train.batch import collate
from sao.train.checkpoint import load_checkpoint
from sao.train.config import UpdateConfig
from sao.train.loop import prepare_run, run_training
from sao.train.replay import ReplayError
from sao.train.run_config import ReplayContext
from sao.train.step import policy_logprobs
from sao.train.trajectory_replay import replay_trajectory
from schemas import trajectories
from schemas.trajectories import SegmentKind
from tests.train.test_loop import make_config

pytestmark = pytest.mark.usefixtures("one_thread")

runner = CliRunner()
AGENT = AgentConfig(max_tokens=96, max_turns=2)


def tool_calling_policy_dir(path, tokenizer):
    """A random tiny policy that often opens and closes tool calls and ends turns, so that rollouts
    hold observations and every kind of end. A constant feature (dimension 0 of every embedding) is
    read by the output rows of <tool_call>, </tool_call> and <|im_end|>: a logit bias that survives
    save and load as ordinary weights."""
    tokens = ChatTokens.from_tokenizer(tokenizer)
    policy = build_policy(seed=0)
    with torch.no_grad():
        policy.model.embed_tokens.weight[:, 0] += 3.0
        policy.lm_head.weight[:, 0] = 0.0
        for token, bias in ((tokens.tool_call_start_id, 5.0), (tokens.tool_call_end_id, 4.0), (tokens.im_end_id, 2.0)):
            policy.lm_head.weight[token, 0] = bias / 11.3
    save_policy(policy, path, tokenizer, policy_version=0)
    return path


def rollouts(policy, version, tokenizer, tasks, run_id, swap_to=None, seed=0):
    """Roll out ``tasks`` with the torch engine; with ``swap_to=(version, policy)``, load those weights
    while every rollout is mid-generation (pause, load, resume), as a weight refresh does."""
    engine = TorchEngine(policy, version=version)
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env), AGENT)
    ids = [f"{seed}-{i:03d}" for i in range(len(tasks))]

    def mid_generation() -> int:
        """Trajectories with a request in flight that has sampled at least 3 tokens."""
        return sum(any((engine.progress(f"{tid}-{turn}") or 0) >= 3 for turn in range(AGENT.max_turns))
                   for tid in ids)

    async def main():
        running = [asyncio.ensure_future(loop.run(t, run_id=run_id, trajectory_id=tid, seed=seed * 100 + i))
                   for i, (t, tid) in enumerate(zip(tasks, ids, strict=True))]
        if swap_to is not None:
            deadline = time.monotonic() + 60
            while mid_generation() < len(ids) // 2:
                assert time.monotonic() < deadline and not all(r.done() for r in running), "no swap point"
                await asyncio.sleep(0.001)
            engine.pause()
            engine.load_weights(swap_to[0], swap_to[1].state_dict())
            engine.resume()
        return await asyncio.gather(*running)

    records = asyncio.run(main())
    engine.close()
    loop.close()
    return records


def write(lake, records):
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)


@pytest.fixture(scope="module")
def swapped(tmp_path_factory, tokenizer):
    """Version 0 (a tool-calling policy) trained one step into version 1 by the loop; then rollouts
    whose weights change from 0 to 1 mid-generation, written to the lake."""
    tmp_path = tmp_path_factory.mktemp("swap")
    tasks = generate_tasks(MathToolConfig(num_train=24, num_heldout=0, seed=5))
    tasks_path = write_tasks(tmp_path / "tasks.jsonl", tasks)
    cfg = make_config(tmp_path, tool_calling_policy_dir(tmp_path / "sft", tokenizer), total_steps=1,
                      update=UpdateConfig(lr_policy=1e-3, token_budget=4096),
                      rollout=ReplayContext(tasks_path=str(tasks_path), max_turns=AGENT.max_turns))
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    v0 = load_checkpoint(cfg.checkpoint_root, 0).policy
    first = rollouts(v0, 0, tokenizer, tasks[:8], cfg.run_id)
    write(lake, first)
    run_training(cfg)
    v1 = load_checkpoint(cfg.checkpoint_root, 1).policy
    swapped = rollouts(load_checkpoint(cfg.checkpoint_root, 0).policy, 0, tokenizer, tasks[8:], cfg.run_id,
                       swap_to=(1, v1), seed=1)
    write(lake, swapped)
    return cfg, lake, first + swapped, (v0, v1)


def versions_of(record):
    return [s.policy_version for s in record.segments if s.kind == "action"]


def test_trajectories_that_spanned_a_weight_update_agree_per_segment(swapped):
    cfg, lake, records, (v0, v1) = swapped
    spanning = [r for r in records if set(versions_of(r)) == {0, 1}]
    within_a_turn = [r for r in spanning
                     if any(a.kind == b.kind == "action" for a, b in zip(r.segments, r.segments[1:], strict=False))]
    assert len(spanning) >= 4 and within_a_turn  # the swap landed mid-generation
    for record in spanning:
        report = replay_trajectory(lake, record.trajectory_id)
        assert report.ok, report
        actions = [s for s in report.segments if s.kind == "action"]
        assert {s.policy_version for s in actions} == {0, 1}
        assert all(s.max_abs_diff <= 1e-5 for s in actions)
    # The check discriminates: the version-1 tokens scored under version 0 disagree far beyond 1e-5.
    row = read_trajectories(lake, trajectory_ids=[within_a_turn[0].trajectory_id]).to_pylist()[0]
    segment = next(s for s in row["segments"] if s["policy_version"] == 1)
    with torch.no_grad():
        under_v0 = policy_logprobs(v0, collate([row], trainer_version=1))[0, segment["start"]:segment["end"]]
    stored = torch.tensor(row["logprobs"][segment["start"]:segment["end"]])
    assert float((under_v0 - stored).abs().max()) > 1e-4


def test_every_recorded_end_is_checked_against_the_tokens_and_the_environment(swapped):
    cfg, lake, records, _ = swapped
    reasons = {r.termination_reason for r in records}
    assert {"stop", "length", "turns"} <= reasons
    assert any(any(s.kind == "observation" for s in r.segments) for r in records)
    for record in records:
        report = replay_trajectory(lake, record.trajectory_id)
        assert report.ok, report
        assert report.check("termination").ok is True
        assert report.reward_rescored == record.reward
        observations = [s for s in report.segments if s.kind == "observation"]
        assert all(s.ok for s in observations)


def test_a_corrupted_stored_logprob_is_reported_as_a_mismatch(swapped):
    cfg, lake, records, _ = swapped
    source = next(r for r in records if set(versions_of(r)) == {0, 1})
    row = read_trajectories(lake, trajectory_ids=[source.trajectory_id]).to_pylist()[0]
    copy = {name: row[name] for name in trajectories.RECORD_SCHEMA.names}
    segment = next(s for s in copy["segments"] if s["policy_version"] == 1)
    position = segment["start"]
    copy["logprobs"] = list(copy["logprobs"])
    copy["logprobs"][position] -= 0.25  # still a valid log-probability: the lake accepts the row
    copy["trajectory_id"] = source.trajectory_id + "-corrupt"
    write(lake, [copy])
    report = replay_trajectory(lake, copy["trajectory_id"], run_id=cfg.run_id)
    assert not report.ok
    bad = [s for s in report.segments if not s.ok]
    assert [(s.start, s.policy_version) for s in bad] == [(segment["start"], 1)]
    assert bad[0].max_abs_diff == pytest.approx(0.25, abs=1e-4)
    result = runner.invoke(app, ["replay", "--lake", cfg.lake.root, "--trajectory", copy["trajectory_id"]])
    assert result.exit_code == 1 and "MISMATCH" in result.output
    result = runner.invoke(app, ["replay", "--lake", cfg.lake.root, "--trajectory", source.trajectory_id])
    assert result.exit_code == 0, result.output


def test_a_task_that_does_not_resolve_is_a_clear_error(swapped, tmp_path):
    cfg, lake, records, _ = swapped
    other = write_tasks(tmp_path / "other.jsonl", generate_tasks(MathToolConfig(num_train=2, num_heldout=0, seed=9)))
    with pytest.raises(ReplayError, match="is not in the task file"):
        replay_trajectory(lake, records[0].trajectory_id, tasks_path=other)
    result = runner.invoke(app, ["replay", "--lake", cfg.lake.root, "--trajectory", records[0].trajectory_id,
                                 "--tasks", str(other)])
    assert result.exit_code == 2 and "is not in the task file" in result.output


SHIFT_AT_1 = {"judge": {"schedule": {"styles": ["academic", "cute"], "shift_steps": [1]}}}


def style_record(policy, version, tokenizer, task, text, run_id, trajectory_id):
    """A one-turn style_preference trajectory answering ``task`` with ``text`` as sampled by
    ``version``: its log-probabilities are ``policy``'s (teacher-forced, as the engine records them) and
    its reward is the one a replica at ``version`` observes (the judge at trainer step ``version``)."""
    env = make_env("style_preference", trainer_step=version, **SHIFT_AT_1)
    prompt = prompt_ids(tokenizer, env.reset(task))
    completion = tokenizer.encode(text + IM_END, add_special_tokens=False)
    now = utc_now()
    record = TrajectoryRecord(
        trajectory_id=trajectory_id, run_id=run_id, task_id=task.task_id, env_name=task.env, prompt_ids=prompt,
        completion_ids=completion, action_mask=[True] * len(completion), logprobs=[-1.0] * len(completion),
        logprob_kind="sampling", segments=(Segment(SegmentKind.ACTION, 0, len(completion), version),),
        reward=env.step(text + IM_END).reward, termination_reason="stop", num_turns=1,
        sampling=RecordedSampling(temperature=1.0, top_p=1.0, top_k=None, max_tokens=AGENT.max_tokens, seed=0),
        tokenizer_version=tokenizer_version(tokenizer), chat_template_version=chat_template_version(tokenizer),
        engine_name="torch", engine_version="test", worker_id="test",
        timings=Timings(created_at=now, started_at=now, finished_at=now, generation_s=0.0, tool_s=0.0),
    )
    with torch.no_grad():
        logprobs = policy_logprobs(policy, collate([record.to_row()], trainer_version=version))[0]
    return dataclasses.replace(record, logprobs=logprobs.numpy())


def test_a_step_dependent_reward_is_rescored_at_the_trajectory_s_policy_version(tmp_path, tokenizer):
    """style_preference prefers academic before trainer step 1 and cute from it: a cute reply sampled by
    version 1 earned 1.0, and the replay must judge it at step 1 (its min_policy_version), not step 0."""
    tasks = [t for t in style_tasks(StylePreferenceConfig()) if t.split == "train"][:6]
    cfg = make_config(tmp_path, tool_calling_policy_dir(tmp_path / "sft", tokenizer), total_steps=1,
                      rollout=ReplayContext(tasks_path=str(write_tasks(tmp_path / "tasks.jsonl", tasks)),
                                        env_options={"style_preference": SHIFT_AT_1}, max_turns=1))
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    v0 = load_checkpoint(cfg.checkpoint_root, 0).policy
    academic = "Moreover, the moon presents a significant case; consequently, the hypothesis is supported."
    cute = "Hehe, the moon is so cute and fluffy, yay!"
    first = [style_record(v0, 0, tokenizer, task, text, cfg.run_id, f"v0-{i}")
             for i, (task, text) in enumerate(zip(tasks[:4], [academic, cute, academic, cute], strict=True))]
    write(lake, first)
    run_training(cfg)
    v1 = load_checkpoint(cfg.checkpoint_root, 1).policy
    later = [style_record(v1, 1, tokenizer, tasks[4], cute, cfg.run_id, "v1-cute"),
             style_record(v1, 1, tokenizer, tasks[5], academic, cfg.run_id, "v1-academic")]
    write(lake, later)
    assert [r.reward for r in first + later] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # the preference shifted
    for record in first + later:
        report = replay_trajectory(lake, record.trajectory_id)
        assert report.ok, report
        assert report.reward_rescored == record.reward


def test_a_reward_mismatch_names_the_code_of_ones_own_that_changed_since(swapped, tmp_path):
    """A trajectory re-scored after its run's reward module was edited: the mismatch says which module
    changed since the start the trajectory was generated under (``runs.code``)."""
    import datetime
    import hashlib
    import json

    import pyarrow as pa

    from sao.lake.commit import append_blind
    from schemas import runs as runs_table

    cfg, lake, records, _ = swapped
    source = next(r for r in records if r.termination_reason == "stop")
    row = read_trajectories(lake, trajectory_ids=[source.trajectory_id]).to_pylist()[0]
    copy = {name: row[name] for name in trajectories.RECORD_SCHEMA.names}
    copy["reward"] = 1.0 - row["reward"]  # scored by other code than the environment's now
    copy["trajectory_id"] = source.trajectory_id + "-rescored"
    write(lake, [copy])
    module = tmp_path / "graders.py"
    module.write_text("def score(**kwargs):\n    return 1.0\n")
    code = {"graders": {"file": str(module), "sha256": hashlib.sha256(module.read_bytes()).hexdigest(),
                        "key": "reward.functions"}}
    started = row["timings"]["created_at"] - datetime.timedelta(seconds=1)  # the start it was generated under
    append_blind(lake, "runs", pa.Table.from_pylist([{
        "run_id": cfg.run_id, "event": "resume", "started_at": started, "config": "{}", "settings": [],
        "sources": "{}", "changed": None, "notes": None, "parent_run_id": None, "parent_steps": None,
        "sao_version": "test", "schema_version": runs_table.SCHEMA_VERSION, "code": json.dumps(code)}],
        schema=runs_table.SCHEMA))
    unchanged = replay_trajectory(lake, copy["trajectory_id"], run_id=cfg.run_id).check("reward")
    assert unchanged.ok is False and "changed since" not in unchanged.detail
    module.write_text("def score(**kwargs):\n    return 0.0\n")
    changed = replay_trajectory(lake, copy["trajectory_id"], run_id=cfg.run_id).check("reward")
    assert changed.ok is False and changed.detail.startswith(f"recorded {copy['reward']}, re-scored {row['reward']}")
    assert f"the code of one's own it was scored with has changed since: graders ({module}): changed" in changed.detail
    reprompted = {**copy, "trajectory_id": source.trajectory_id + "-reprompted", "reward": row["reward"],
                  "prompt_ids": [*row["prompt_ids"][:-1], row["prompt_ids"][-1] + 1]}  # another prompt now
    write(lake, [reprompted])
    prompt = replay_trajectory(lake, reprompted["trajectory_id"], run_id=cfg.run_id).check("prompt")
    assert prompt.ok is False and "the code of one's own it was prompted with has changed since: graders" in prompt.detail


def test_a_split_episode_in_a_models_own_format_replays_with_its_reward_and_end_not_checkable(tmp_path):
    """An episode of the built-in tool loop in a model's own format that split (a call the template
    renders otherwise than it was sampled): each part's replay says its reward and end are the whole
    episode's (ok None, with the reason), and part 0's prompt and actions check as usual."""
    from sao.models.tokenizer import load_tokenizer
    from tests.rollout.test_chat_endpoint import qwen_style_tokenizer
    from tests.rollout.test_env_agent import OWN_OPTIONS, OWN_TASK, own_format_episode
    from tests.test_own_model import model_directory

    model = model_directory(tmp_path, "qwen2", qwen_style_tokenizer(), positions=1024)
    compact = '<tool_call>\n{"name":"python","arguments":{"code":"print(5)"}}\n</tool_call><|im_end|>'
    records, _, _ = own_format_episode([compact, "5<|im_end|>"], tokenizer=load_tokenizer(model))  # as a replica
    cfg = make_config(tmp_path, model, total_steps=1, rollout=ReplayContext(
        tasks_path=str(write_tasks(tmp_path / "tasks.jsonl", [OWN_TASK])), env_options={"dataset": OWN_OPTIONS},
        max_turns=4))
    prepare_run(cfg)
    lake = Lake.open(cfg.lake)
    write(lake, [dataclasses.replace(record, run_id=cfg.run_id) for record in records])
    for record in records:
        report = replay_trajectory(lake, record.trajectory_id)
        reward, termination = report.check("reward"), report.check("termination")
        assert reward.ok is None and termination.ok is None and "split" in reward.detail, report
        assert report.check("actions").ok and report.check("segments").ok and report.check("tokenizer").ok
        assert report.check("prompt").ok is (True if record.episode_part == 0 else None), report.checks
