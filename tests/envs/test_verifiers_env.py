"""verifiers environments (extra ``verifiers``): a single-turn and a tool environment built here (no hub),
their rows as the run's tasks, their rollout loop on the chat endpoint, their rubric as the reward; and
two SAO steps of each through Serve, the lake and Ray Train (slow tier)."""

import asyncio
import json
import textwrap

import pytest

pytest.importorskip("verifiers")

from sao.envs import verifiers_env  # noqa: E402
from sao.envs.dataset import DatasetEnv, DatasetEnvConfig  # noqa: E402
from sao.models.chat import prompt_ids  # noqa: E402
from sao.rollout.agent import AgentConfig  # noqa: E402
from sao.rollout.chat_endpoint import ChatEndpoint  # noqa: E402
from sao.rollout.torch_engine import TorchEngine  # noqa: E402
from sao.rollout.user_agent import UserAgentRunner, task_row  # noqa: E402

ENV_MODULE = '''
import verifiers as vf
from datasets import Dataset


def correct(completion, answer, **kwargs) -> float:
    replies = [m for m in completion if m["role"] == "assistant"]
    return 1.0 if replies and str(answer) in (replies[-1]["content"] or "") else 0.0


def python(code: str) -> str:
    """Run a print of an arithmetic expression.

    Args:
        code: the Python code, print(<expression>).
    """
    expression = code.strip().removeprefix("print(").removesuffix(")")
    if not set(expression) <= set("0123456789+-* "):
        return "error: only arithmetic"
    return str(eval(expression, {}))


def load_environment(kind="single", **kwargs):
    rows = [{"question": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(3, 7)]
    data = Dataset.from_list(rows)
    rubric = vf.Rubric(funcs=[correct], weights=[1.0])
    if kind == "single":
        return vf.SingleTurnEnv(dataset=data, rubric=rubric, **kwargs)
    return vf.ToolEnv(dataset=data, tools=[python], max_turns=3, rubric=rubric, **kwargs)
'''


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "arith_env.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    verifiers_env._ENVS.clear()


def test_the_environments_rows_are_the_runs_tasks(env_module):
    spec = {"id": "arith_env", "args": {"kind": "tool"}, "paths": [str(env_module)]}
    tasks = verifiers_env.tasks(spec, eval_fraction=0.25, seed=0)
    assert len(tasks) == 28 and {t.split for t in tasks} == {"train", "heldout"}
    assert sum(t.split == "heldout" for t in tasks) == 7
    task = tasks[0]
    assert task.env == "dataset" and task.task_id.startswith("arith_env-train-")
    row = json.loads(task.info)
    assert row["verifiers"] == spec and row["row"]["answer"] == task.answer
    assert json.loads(task.messages)[-1] == {"role": "user", "content": task.prompt}


def test_a_missing_environment_is_named(env_module):
    with pytest.raises(verifiers_env.VerifiersError, match="load_environment\\('no_such_env'\\) failed"):
        verifiers_env.load({"id": "no_such_env", "args": {}})


@pytest.mark.parametrize("kind", ["single", "tool"])
def test_its_rollout_loop_runs_on_the_chat_endpoint_and_its_rubric_scores(kind, env_module, tokenizer, tmp_path):
    from sao.models.policy import load_policy
    from tests.test_user_agent import tool_calling_policy

    spec = {"id": "arith_env", "args": {"kind": kind}, "paths": [str(env_module)]}
    tasks = [t for t in verifiers_env.tasks(spec, eval_fraction=0.25, seed=0) if t.split == "train"][:4]
    engine = TorchEngine(load_policy(tool_calling_policy(tokenizer, tmp_path / "model")))

    async def go():
        endpoint = ChatEndpoint(engine, tokenizer)
        runner = UserAgentRunner(endpoint, AgentConfig(max_tokens=96, max_turns=3), "w0")
        agent = runner.agent(verifiers_env.AGENT, ())
        try:
            return [await runner.run(agent, DatasetEnv(DatasetEnvConfig()), task, "r", f"e{i}", i)
                    for i, task in enumerate(tasks)]
        finally:
            await runner.close()
            await endpoint.close()

    try:
        episodes = asyncio.run(go())
    finally:
        engine.close()
    records = [r for parts in episodes for r in parts]
    assert len(records) == 4 and all(r.termination_reason == "stop" and r.error is None for r in records)
    infos = [json.loads(r.agent_info) for r in records]
    assert all(info["metrics"]["correct"] == r.reward for info, r in zip(infos, records, strict=True))
    assert all(list(r.prompt_ids) == prompt_ids(tokenizer, task_row(t)["messages"])
               for r, t in zip(records, tasks, strict=True))
    if kind == "tool":  # the taught policy calls the tool; verifiers runs it and answers on the endpoint
        called = [r for r in records if len(r.segments) >= 3]
        assert called and all(info["metrics"]["python_calls"] >= 1 for info in infos if info is not None)
        tool_text = tokenizer.decode(called[0].completion_ids[called[0].segments[1].start:called[0].segments[1].end])
        assert "<tool_response>" in tool_text
    else:
        assert all(r.num_turns == 1 for r in records)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "tool"])
def test_two_sao_steps_on_a_verifiers_environment(kind, env_module, tokenizer, ray_session, tmp_path):
    import yaml

    from sao import runs
    from sao.audit import check_run
    from sao.config import resolve
    from sao.lake.store import Lake
    from tests.test_user_agent import tool_calling_policy

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "run_id": f"vf-{kind}", "workdir": str(tmp_path / "runs"),
        "model": {"path": str(tool_calling_policy(tokenizer, tmp_path / "model"))},
        "env": {"verifiers": {"id": "arith_env", "args": {"kind": kind}}},
        "train": {"steps": 2, "batch_size": 4, "max_staleness": 1},
        "rollout": {"num_replicas": 1, "max_tokens": 96, "max_turns": 3, "max_in_flight": 4},
        "value_pretraining": {"samples": 0}, "lake": {"root": str(tmp_path / "lake")}}))
    config, _ = resolve(tmp_path / "run.yaml")
    runs.prepare_inputs(config)
    result = runs.train_async(config, runs.warm_start(config))
    assert result.steps == 2
    report = check_run(Lake.open(config.lake.root), config.run_id)
    assert report.ok, report
    rows = Lake.open(config.lake.root).read("trajectories", predicate=f"run_id = '{config.run_id}'").to_pylist()
    assert rows and all(row["error"] is None for row in rows)
    assert all(json.loads(row["agent_info"])["metrics"]["correct"] == row["reward"] for row in rows
               if row["termination_reason"] == "stop")


def test_a_verifiers_runs_evaluation_plays_its_rollout_loop(env_module, tokenizer, tmp_path):
    """The held-out evaluation of a verifiers run runs the environment's own rollout loop on the chat
    endpoint and its rubric scores: the taught policy's replies end, and each reward is the rubric's."""
    from sao import runs
    from sao.config import RunConfig
    from tests.test_user_agent import tool_calling_policy

    settings = RunConfig(run_id="vf-eval", workdir=str(tmp_path / "runs"), eval={"tasks": 2},
                         env={"verifiers": {"id": "arith_env", "args": {"kind": "single"}}},
                         rollout={"max_tokens": 96, "max_turns": 3})
    runs.prepare_inputs(settings)
    tool_calling_policy(tokenizer, settings.initial_policy_dir)
    evaluation = runs.evaluate(settings, 0)
    assert evaluation.num_tasks == 2 and evaluation.terminations == {"stop": 2}
    assert set(evaluation.rewards) <= {0.0, 1.0} and evaluation.accuracy == sum(evaluation.rewards) / 2
    assert (settings.run_dir / "evaluations" / "v000000-tasks2-seed0-tokens96-turns3-agent.json").exists()
