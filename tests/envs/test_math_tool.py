"""math_tool: deterministic tasks, a dataset file, and episodes scored through the real sandbox."""

from __future__ import annotations

import json
import re

import pytest

from sao.envs.base import Environment, Split, Task, Termination, read_tasks, write_tasks
from sao.envs.math_tool import (
    ENV_NAME,
    TEMPLATES,
    MathToolConfig,
    MathToolEnv,
    check_answer,
    demonstration,
    ensure_dataset,
    failure_class,
    generate_tasks,
)
from sao.envs.sandbox import run_python

SMALL = MathToolConfig(num_train=300, num_heldout=50)


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(SMALL)


def test_generation_is_deterministic_and_seeded(tasks):
    assert generate_tasks(SMALL) == tasks
    assert generate_tasks(MathToolConfig(num_train=300, num_heldout=50, seed=1)) != tasks


def test_splits_sizes_and_distinct_problems(tasks):
    assert sum(t.split is Split.HELDOUT for t in tasks) == 50
    assert sum(t.split is Split.TRAIN for t in tasks) == 300
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert len({t.prompt for t in tasks}) == len(tasks)  # a held-out problem never appears in train


def test_answers_are_the_value_of_the_solution_and_positive(tasks):
    for task in tasks:
        assert task.env == ENV_NAME
        assert task.solution.startswith("print(") and task.solution.endswith(")")
        value = eval(task.solution[len("print(") : -1])  # noqa: S307 - generated digits and operators
        assert str(value) == task.answer
        assert value > 0


def test_every_template_is_used_and_numbers_appear_in_prompt_order(tasks):
    used = set()
    for task in tasks:
        assert re.findall(r"\d+", task.prompt) == re.findall(r"\d+", task.solution), task
        used.update(i for i, (text, _) in enumerate(TEMPLATES) if text.split("{")[0] in task.prompt)
    assert used == set(range(len(TEMPLATES)))


def test_the_sandbox_prints_exactly_the_reference_answer(tasks):
    for task in tasks[:10]:
        assert run_python(task.solution).observation == task.answer


def test_dataset_file_round_trip_and_mismatch(tmp_path, tasks):
    path = tmp_path / "math.jsonl"
    assert ensure_dataset(SMALL, path) == tasks
    assert read_tasks(path) == tasks
    assert read_tasks(path, split="heldout") == [t for t in tasks if t.split is Split.HELDOUT]
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["task_id", "env", "prompt", "answer", "split", "solution"]
    assert ensure_dataset(SMALL, path) == tasks  # existing identical file is accepted
    with pytest.raises(ValueError, match="different dataset"):
        ensure_dataset(MathToolConfig(num_train=300, num_heldout=50, seed=9), path)


def test_read_tasks_names_the_line_and_field(tmp_path, tasks):
    path = write_tasks(tmp_path / "t.jsonl", tasks[:2])
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row["split"] = "validation"
    path.write_text(lines[0] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: field 'split'"):
        read_tasks(path)
    del row["answer"]
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1: expected the fields"):
        read_tasks(path)
    with pytest.raises(ValueError, match="duplicate task_id"):
        write_tasks(tmp_path / "d.jsonl", [tasks[0], tasks[0]])


@pytest.mark.parametrize(
    ("given", "expected", "correct"),
    [("13956", "13956", True), (" 13,956 ", "13956", True), ("013956", "13956", True), ("13957", "13956", False),
     ("", "13956", False), ("thirteen", "13956", False)],
)
def test_check_answer(given, expected, correct):
    assert check_answer(given, expected) is correct


def _task() -> Task:
    return Task("t-1", ENV_NAME, "What is 483 * 27 + 915?", "13956", Split.TRAIN, "print(483*27+915)")


RIGHT_CALL, WRONG_CALL = "<tool_call>print(483*27+915)</tool_call>", "<tool_call>print(438*27+915)</tool_call>"


@pytest.mark.parametrize(("actions", "expected"), [
    ([RIGHT_CALL, "<answer>13956</answer><|im_end|>"], None),
    (["<answer>13,956</answer><|im_end|>"], None),  # right without the tool is still right
    ([WRONG_CALL, RIGHT_CALL, "<answer>13956</answer><|im_end|>"], None),
    ([WRONG_CALL, "<answer>12741</answer><|im_end|>"], "tool_call"),  # 438*27+915, copied from the tool
    ([WRONG_CALL, WRONG_CALL, WRONG_CALL], "tool_call"),
    (["<tool_call>print(483 * 27 + 915)</tool_call>", "<answer>13965</answer><|im_end|>"], "answer"),
    ([WRONG_CALL, RIGHT_CALL, "<answer>13965</answer><|im_end|>"], "answer"),
    (["<answer>13957</answer><|im_end|>"], "structure"),  # guessed without the tool
    (["I do not know<|im_end|>"], "structure"),
    ([RIGHT_CALL, "The answer is 13956<|im_end|>"], "structure"),
    ([RIGHT_CALL, "<answer>1395"], "structure"),  # ran out of tokens
    ([], "structure"),
])
def test_failure_class_of_an_episode(actions, expected):
    assert failure_class(_task(), actions) == expected


def test_a_correct_episode_through_the_tool_earns_reward_one():
    env = MathToolEnv()
    assert isinstance(env, Environment)
    assert env.reset(_task()) == [{"role": "user", "content": "What is 483 * 27 + 915?"}]
    tool = env.step("<tool_call>print(483*27+915)</tool_call>")
    assert not tool.done and tool.observation == "13956" and tool.reward == 0.0
    assert tool.info["tool_status"] == "ok"
    final = env.step("<answer>13956</answer><|im_end|>")
    assert final.done and final.reward == 1.0 and final.termination is Termination.STOP


def test_wrong_answer_or_no_answer_earns_zero():
    env = MathToolEnv()
    env.reset(_task())
    assert env.step("<answer>13957</answer><|im_end|>").reward == 0.0
    env.reset(_task())
    result = env.step("I do not know<|im_end|>")
    assert result.done and result.reward == 0.0 and result.termination is Termination.STOP


def test_tool_errors_are_observations_and_the_episode_continues():
    env = MathToolEnv()
    env.reset(_task())
    result = env.step("<tool_call>import os</tool_call>")
    assert not result.done
    assert "refused" in result.observation
    assert env.step("<tool_call>print(1/0)</tool_call>").observation == "ZeroDivisionError: division by zero"


def test_tool_call_budget_ends_with_turns():
    env = MathToolEnv(MathToolConfig(num_train=0, num_heldout=0, max_tool_calls=2))
    env.reset(_task())
    assert not env.step("<tool_call>1</tool_call>").done
    assert not env.step("<tool_call>2</tool_call>").done
    result = env.step("<tool_call>3</tool_call>")
    assert result.done and result.reward == 0.0 and result.termination is Termination.TURNS


def test_without_the_tool_the_first_action_ends_the_episode():
    env = MathToolEnv(MathToolConfig(num_train=0, num_heldout=0, max_tool_calls=0))
    env.reset(_task())
    result = env.step("<tool_call>print(483*27+915)</tool_call>")  # not run: the tool is off
    assert result.done and result.reward == 0.0 and result.termination is Termination.TURNS
    env.reset(_task())
    result = env.step("<answer>13956</answer>")
    assert result.done and result.reward == 1.0 and result.termination is Termination.STOP
    env.reset(_task())
    assert env.step("13956<|im_end|>").reward == 0.0  # an answer needs its tags, as with the tool


def test_demonstration_is_the_ideal_conversation():
    messages = demonstration(_task())
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"]["code"] == "print(483*27+915)"
    assert messages[2]["content"] == "13956"
    assert messages[3]["content"] == "<answer>13956</answer>"


def test_reset_rejects_another_environment_task_and_step_needs_reset():
    env = MathToolEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<answer>1</answer>")
    with pytest.raises(ValueError, match="style_preference"):
        env.reset(Task("s-1", "style_preference", "Write.", "", Split.TRAIN))


def test_system_prompt_option():
    env = MathToolEnv(MathToolConfig(num_train=0, num_heldout=0, system_prompt="Use the tool."))
    assert env.reset(_task())[0] == {"role": "system", "content": "Use the tool."}


@pytest.mark.parametrize(
    ("field", "value"),
    [("a_range", (5, 1)), ("num_train", -1), ("max_tool_calls", -1)],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MathToolConfig(**{field: value})


def test_too_many_tasks_for_the_ranges():
    with pytest.raises(ValueError, match="distinct tasks"):
        generate_tasks(MathToolConfig(a_range=(10, 11), b_range=(10, 10), c_range=(10, 10), num_train=100, num_heldout=0))
