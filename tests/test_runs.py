"""sao.runs: what a run's pipeline is built from."""

import json
import sys
from pathlib import Path

import pytest

from sao import runs
from sao.config import RunConfig
from sao.train.retention import RetentionConfig


def test_a_run_prunes_old_checkpoints_but_keeps_every_policy(tmp_path):
    settings = RunConfig(run_id="r", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")})
    train = runs.pipeline_config(settings, tmp_path / "sft").train
    assert train.retention == RetentionConfig() and train.retention.keep_policy_weights
    assert Path(train.checkpoint_root).is_absolute() and Path(train.lake.root).is_absolute()


def test_a_run_cancels_rollouts_too_stale_to_train_on_unless_told_not_to(tmp_path):
    def cancels(**rollout):
        settings = RunConfig(run_id="r", workdir=str(tmp_path), lake={"root": str(tmp_path / "lake")}, rollout=rollout)
        return runs.pipeline_config(settings, tmp_path / "sft").cancel_stale

    assert cancels() is True
    assert cancels(cancel_stale=False) is False


def test_the_trainer_takes_every_cpu_only_when_nothing_generates_during_its_update(tmp_path, monkeypatch):
    monkeypatch.setattr(runs.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    sync = {"synchronous": True, "max_staleness": 0}

    def threads(**train):
        settings = RunConfig(run_id="r", workdir=str(tmp_path), lake={"root": str(tmp_path / "lake")}, train=train)
        return runs.pipeline_config(settings, tmp_path / "sft").train.torch_threads

    assert threads() == 1  # asynchronous: the replicas generate while it updates
    assert threads(**sync) == 4
    assert threads(**sync, workers=2) == 2 and threads(**sync, workers=8) == 1
    assert threads(threads=3) == 3 and threads(**sync, threads=1) == 1  # as set


def test_a_resumed_synchronous_run_keeps_the_thread_count_its_steps_ran_with(tmp_path, monkeypatch):
    # The count is replay-relevant (a stored run refuses another): a run started on 4 CPUs and resumed
    # on 2, or with two workers, trains on with 4, instead of being refused inside the flow.
    from sao.train.run_config import write_run_config

    settings = RunConfig(run_id="r", workdir=str(tmp_path), lake={"root": str(tmp_path / "lake")},
                         train={"synchronous": True, "max_staleness": 0})
    monkeypatch.setattr(runs.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    first = runs.pipeline_config(settings, tmp_path / "sft").train
    assert first.torch_threads == 4
    write_run_config(first)  # what the run's start stored
    monkeypatch.setattr(runs.os, "sched_getaffinity", lambda pid: {0, 1})
    for resumed in (settings, settings.with_values({"train.workers": 2})):
        train = runs.pipeline_config(resumed, tmp_path / "sft").train
        assert train.torch_threads == 4
        write_run_config(train)  # accepted: no RunConfigError
    assert runs.pipeline_config(settings.with_values({"run_id": "other"}), tmp_path / "sft").train.torch_threads == 2


def test_a_finished_run_is_recognised_until_more_steps_are_asked_for(tmp_path):
    settings = RunConfig(run_id="done", workdir=str(tmp_path), train={"steps": 4})
    assert runs.finished(settings) is None
    runs.record_finished(settings, {"steps": 4, "version": 4, "summary": "s"})
    assert runs.finished(settings)["version"] == 4
    assert runs.finished(RunConfig(run_id="done", workdir=str(tmp_path), train={"steps": 3})) is not None
    assert runs.finished(RunConfig(run_id="done", workdir=str(tmp_path), train={"steps": 5})) is None  # train on
    assert not list((tmp_path / "done").glob(".*.tmp"))  # written atomically, nothing left beside


def test_a_warm_start_stopped_half_way_is_redone_not_reused(tmp_path, monkeypatch):
    """What a kill during SFT leaves (a partial directory) is never mistaken for the warm start."""
    import sao.train.sft as sft

    settings = RunConfig(run_id="w", workdir=str(tmp_path))
    calls = []

    def fake_sft(config, out_dir, on_log=None):
        calls.append(Path(out_dir))
        (Path(out_dir)).mkdir(parents=True)
        if len(calls) == 1:
            raise KeyboardInterrupt  # stopped half-way
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(sft, "sft_warm_start", fake_sft)
    monkeypatch.setattr("sao.models.policy.read_policy_metadata", lambda path: {"policy_version": 0})
    try:
        runs.warm_start(settings)
    except KeyboardInterrupt:
        pass
    assert not settings.sft_dir.exists()  # only the partial directory was written
    assert runs.warm_start(settings) == settings.sft_dir and (settings.sft_dir / "config.json").exists()
    assert calls[0] == calls[1] != settings.sft_dir
    assert runs.warm_start(settings) == settings.sft_dir and len(calls) == 2  # reused now


def test_the_evaluation_samples_with_eval_seed_and_else_with_the_runs_seed(tmp_path, monkeypatch):
    """Runs of different seeds evaluated with one eval.seed draw the same samples, so they compare
    pairwise; each seed's evaluation is kept under its own name."""
    import sao.models.policy as policy
    import sao.models.tokenizer as tokenizer
    import sao.train.evaluate as evaluate
    from sao.train.evaluate import EvalResult

    seen = []
    monkeypatch.setattr(policy, "load_policy", lambda path: None)
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(runs, "run_tasks", lambda config, split: [])
    monkeypatch.setattr(evaluate, "evaluate_math", lambda model, tok, tasks, config, env_factory: seen.append(
        config.seed) or EvalResult(accuracy=0.5, stderr=0.1, num_tasks=4, mean_tool_calls=1.0, terminations={},
                                 wall_s=0.0, episodes=()))
    for seed, eval_seed in ((7, None), (8, 3), (9, 3)):
        settings = RunConfig(run_id="e", workdir=str(tmp_path / str(seed)), seed=seed, eval={"seed": eval_seed})
        assert runs.evaluate(settings, 0).accuracy == 0.5
        expected = seed if eval_seed is None else eval_seed
        assert (settings.run_dir / "evaluations" / f"v000000-tasks{settings.eval.tasks}-seed{expected}"
                f"-tokens{settings.rollout.max_tokens}-turns{settings.rollout.max_turns}.json").exists()
    assert seen == [7, 3, 3]


def test_the_evaluation_keeps_each_tasks_reward_in_task_order(tmp_path, monkeypatch):
    """Per-task rewards (what paired comparisons of two runs resample) follow the held-out tasks'
    order, not the episodes' finishing order, and read back the same from the kept file."""
    import sao.models.policy as policy
    import sao.models.tokenizer as tokenizer
    import sao.train.evaluate as evaluate
    from sao.envs.base import Split, Task, Termination
    from sao.train.evaluate import Episode, EvalResult

    tasks = [Task(f"t{i}", "other", "p", "a", Split.HELDOUT) for i in range(4)]
    rewards = {"t0": 1.0, "t1": 0.0, "t2": 0.0, "t3": 1.0}
    finished = [Episode(t, rewards[t], Termination.STOP, 0, (), ()) for t in ("t2", "t0", "t1")]  # t3 not evaluated
    monkeypatch.setattr(policy, "load_policy", lambda path: None)
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(runs, "run_tasks", lambda config, split: tasks)
    monkeypatch.setattr(evaluate, "evaluate_math", lambda model, tok, tasks, config, env_factory: EvalResult(
        accuracy=1 / 3, stderr=0.3, num_tasks=3, mean_tool_calls=0.0, terminations={}, wall_s=0.0,
        episodes=tuple(finished)))
    settings = RunConfig(run_id="e", workdir=str(tmp_path), eval={"tasks": 3})
    first = runs.evaluate(settings, 0)
    assert first.rewards == (1.0, 0.0, 0.0)
    assert runs.evaluate(settings, 0) == first  # from the kept file


def test_tasks_without_a_reference_answer_are_refused_when_a_built_in_reward_compares_with_one(tmp_path):
    import json

    import pytest

    from sao.config import resolve
    from sao.data import DataError

    # The answers under another column name: the file loads (other columns are not read), so every
    # task's answer is empty and the built-in reward would score every reply the same.
    rows = [{"prompt": f"{i} + 1?", "solution": str(i + 1)} for i in range(5)]
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config, _ = resolve(None, [f"workdir={tmp_path / 'runs'}", f"data.train={data}", "env.max_tool_calls=0"])
    with pytest.raises(DataError, match=r"tasks have no reference answer .*\['sao.rewards:exact_match'\]"):
        runs.prepare_inputs(config)
    mine = tmp_path / "scores.py"
    mine.write_text("def length(completion, **kwargs):\n    return float(len(completion))\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:  # a reward function of one's own may need no answer
        runs.prepare_inputs(config.with_values({"reward.functions": ["scores:length"]}))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("scores", None)


def test_only_the_built_in_tool_loop_needs_the_projects_tool_tokens(tmp_path):
    # An agent of one's own or a verifiers environment calls tools through the chat endpoint with the
    # model's own template: a model without this project's tool tokens was refused for them before.
    base = RunConfig(run_id="r", workdir=str(tmp_path))
    own = base.with_values({"data.train": "tasks.jsonl"})
    assert runs.runs_tool_loop(base)  # the built-in math_tool task calls the Python tool
    assert runs.runs_tool_loop(own) and not runs.runs_tool_loop(own.with_values({"env.max_tool_calls": 0}))
    assert not runs.runs_tool_loop(own.with_values({"env.agent": "my_agent:run"}))
    assert not runs.runs_tool_loop(base.with_values({"env.verifiers": {"id": "some-env"}}))


def test_the_evaluation_gives_each_episode_the_budgets_of_a_rollout(tmp_path, monkeypatch):
    """An evaluated episode may spend what a rollout of the run may (``rollout.max_tokens`` over its
    whole completion, ``rollout.max_turns`` segments), so a model that reasons at length is scored on
    the answers it is trained to give."""
    import sao.models.policy as policy
    import sao.models.tokenizer as tokenizer
    import sao.train.evaluate as evaluate
    from sao.train.evaluate import EvalResult

    seen = []
    monkeypatch.setattr(policy, "load_policy", lambda path: None)
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(runs, "run_tasks", lambda config, split: [])
    monkeypatch.setattr(evaluate, "evaluate_math", lambda model, tok, tasks, config, env_factory: seen.append(
        config) or EvalResult(accuracy=0.5, stderr=0.1, num_tasks=4, mean_tool_calls=1.0, terminations={},
                              wall_s=0.0, episodes=()))
    settings = RunConfig(run_id="b", workdir=str(tmp_path), rollout={"max_tokens": 1000, "max_turns": 3})
    runs.evaluate(settings, 0)
    assert (seen[0].max_tokens, seen[0].max_turns) == (1000, 3)


def test_the_trainer_is_told_the_gpus_the_rollout_replicas_hold(tmp_path):
    settings = RunConfig(run_id="r", workdir=str(tmp_path), lake={"root": str(tmp_path / "lake")},
                         rollout={"gpus": 0.5, "num_replicas": 2})
    assert runs.pipeline_config(settings, tmp_path / "sft").train.rollout_gpus == 1.0
    assert runs.pipeline_config(settings.with_values({"rollout.gpus": 0}), tmp_path / "sft").train.rollout_gpus == 0


SCORED_AGENT = '''
async def agent(client, task):
    """One short call, then a score of its own that no reward function gives: 0.5, or 0.25 for the
    tasks whose answer is even; a task asking for an error raises."""
    reply = await client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=3,
                                                 temperature=0.7)  # the run's: served as in a rollout
    assert reply.choices[0].message is not None
    if task["info"].get("fail"):
        raise RuntimeError("the agent failed")
    return 0.25 if int(task["answer"]) % 2 == 0 else 0.5
'''


def test_an_agent_runs_evaluation_plays_the_agents_episodes(tmp_path, monkeypatch, tokenizer):
    """A run with an agent of one's own is evaluated on that agent's episodes against the chat endpoint
    (rewards no built-in loop gives: 0.5 and 0.25), with the run's budgets and sampling; an agent that
    raises scores 0 with ``error``; the result is kept under a name of its own."""
    from sao.models.policy import build_policy, save_policy

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "info": {"fail": i == 3}} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[8:]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:8]))
    (tmp_path / "half_scoring_agent.py").write_text(SCORED_AGENT)  # a module name no other test imports
    monkeypatch.chdir(tmp_path)  # agents are imported from the working directory, as a user's are
    monkeypatch.delitem(sys.modules, "half_scoring_agent", raising=False)  # and unloaded after the test
    settings = RunConfig(run_id="agent-eval", workdir=str(tmp_path / "runs"),
                         data={"train": "train.jsonl", "eval": "eval.jsonl"}, env={"agent": "half_scoring_agent:agent"},
                         eval={"tasks": 8}, rollout={"max_tokens": 40, "max_turns": 2, "temperature": 0.7})
    runs.prepare_inputs(settings)
    save_policy(build_policy(seed=0), settings.initial_policy_dir, tokenizer, policy_version=0)
    evaluation = runs.evaluate(settings, 0)
    held_out = runs.run_tasks(settings, "heldout")
    expected = [0.0 if task.answer == "4" else 0.25 if int(task.answer) % 2 == 0 else 0.5 for task in held_out]
    assert evaluation.num_tasks == 8 and list(evaluation.rewards) == expected
    assert evaluation.accuracy == pytest.approx(sum(expected) / 8)
    assert evaluation.terminations == {"error": 1, "stop": 7}
    kept = settings.run_dir / "evaluations" / "v000000-tasks8-seed0-tokens40-turns2-agent.json"
    assert json.loads(kept.read_text())["rewards"] == expected


def test_a_verifiers_runs_evaluation_plays_the_environments_rollout_loop(tmp_path, monkeypatch):
    import sao.models.policy as policy
    import sao.models.tokenizer as tokenizer
    import sao.train.evaluate as evaluate
    from sao.envs.verifiers_env import AGENT
    from sao.train.evaluate import EvalResult

    played = []
    monkeypatch.setattr(policy, "load_policy", lambda path: None)
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(runs, "run_tasks", lambda config, split: [])
    monkeypatch.setattr(evaluate, "evaluate_math", lambda *args, **kwargs: pytest.fail("the built-in loop played"))
    monkeypatch.setattr(evaluate, "evaluate_agent", lambda model, tok, tasks, config, env_factory, agent, agent_config:
                        played.append((agent, agent_config.timeout_s)) or EvalResult(
                            accuracy=0.5, stderr=0.1, num_tasks=4, mean_tool_calls=1.0, terminations={}, wall_s=0.0,
                            episodes=()))
    settings = RunConfig(run_id="v", workdir=str(tmp_path), env={"verifiers": {"id": "some-env"}},
                         rollout={"timeout_s": 33.0})
    assert runs.evaluate(settings, 0).accuracy == 0.5
    assert played == [(AGENT, 33.0)]


def test_a_later_stage_runs_with_the_settings_the_lake_recorded_for_the_run(tmp_path):
    """The evaluate flow (and the UI's form for it) names a run; its tasks, model and budgets are the
    ones the run recorded, with the stage's own values on top."""
    lake = str(tmp_path / "lake")
    assert runs.recorded_settings("own", lake) is None  # no lake
    own = RunConfig(run_id="own", workdir=str(tmp_path / "runs"), lake={"root": lake},
                    data={"train": str(tmp_path / "tasks.jsonl")}, rollout={"max_tokens": 77})
    runs.record_start(own)
    settings = runs.recorded_settings("own", lake, **{"eval.tasks": 9, "seed": 4})
    assert settings.data.train == own.data.train and settings.rollout.max_tokens == 77
    assert (settings.eval.tasks, settings.seed) == (9, 4)
    assert runs.recorded_settings("other", lake) is None  # a run the lake does not know
    assert runs.recorded_settings("own", lake).seed == own.seed  # only the values given replace the recorded


def test_the_evaluate_flow_refuses_a_run_of_ones_own_that_its_lake_does_not_know(tmp_path):
    """Evaluated as a run of the built-in task, it would be scored on math_tool's tasks."""
    from flows.evaluate import evaluate

    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "tasks.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"run 'mine' has tasks of its own .* give lake_root"):
        evaluate.fn(run_id="mine", workdir=str(tmp_path / "runs"), lake_root=str(tmp_path / "no-lake"))


def test_a_run_whose_model_calls_tools_in_its_own_format_is_evaluated_on_that_loop(tmp_path, monkeypatch):
    """A model of one's own whose chat template renders Hermes tool calls, on tasks that allow tool
    calls: the run's inputs pass the tool check, and its evaluation plays the built-in tool loop in the
    model's own format on the chat endpoint (the python tool offered in every prompt), not the loop of
    this project's format."""
    import shutil

    import sao.train.evaluate as evaluate
    from tests.rollout.test_chat_endpoint import qwen_style_tokenizer
    from tests.test_own_model import model_directory

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[4:]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))
    model = model_directory(tmp_path, "qwen2", qwen_style_tokenizer(), positions=1024)  # the tools' prompt is long
    settings = RunConfig(run_id="own-tools", workdir=str(tmp_path / "runs"), model={"path": str(model)},
                         data={"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
                         env={"max_tool_calls": 2}, eval={"tasks": 4}, rollout={"max_tokens": 24, "max_turns": 3})
    runs.prepare_inputs(settings)
    shutil.copytree(model, settings.initial_policy_dir)
    monkeypatch.setattr(evaluate, "evaluate_math", lambda *args, **kwargs: pytest.fail("this project's format played"))
    played, prompts = [], []
    real = evaluate.evaluate_agent

    def spy(model, tok, tasks, config, env_factory, agent, agent_config):
        result = real(model, tok, tasks, config, env_factory, agent, agent_config)
        played.append(agent)
        prompts.extend(tok.decode(list(episode.token_ids)) for episode in result.episodes)
        return result

    monkeypatch.setattr(evaluate, "evaluate_agent", spy)
    evaluation = runs.evaluate(settings, 0)
    assert played == [None] and evaluation.num_tasks == 4 and len(prompts) == 4
    assert all('{"type": "function", "function": {"name": "python"' in prompt for prompt in prompts)
    assert sum(evaluation.terminations.values()) == 4
