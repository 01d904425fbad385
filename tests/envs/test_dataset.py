"""The dataset environment: the user's tasks, their prompt messages, tool calls, reward functions."""

import json

import pytest

from sao.envs import make_env
from sao.envs.base import Task, Termination
from sao.envs.dataset import DatasetEnv, DatasetEnvConfig, task_messages
from sao.rewards import RewardError

CALLS = []


def recorder(**kwargs):
    CALLS.append(kwargs)
    return 0.25


def raises(**kwargs):
    raise ValueError("no reward for you")


def nan(**kwargs):
    return float("nan")


TASK = Task("t1", "dataset", "What is 6 * 7?", "42", "train", info=json.dumps({"level": 1}))


def test_an_answer_is_scored_by_the_weighted_reward_functions_with_every_argument():
    CALLS.clear()
    env = DatasetEnv(DatasetEnvConfig(rewards=("tests.envs.test_dataset:recorder", "sao.rewards:exact_match"),
                                      weights=(2.0, 1.0)))
    assert env.reset(TASK) == [{"role": "user", "content": "What is 6 * 7?"}]
    result = env.step("<answer>42</answer>")
    assert result.done and result.termination is Termination.STOP
    assert result.reward == 2.0 * 0.25 + 1.0  # worked by hand: recorder 0.25 twice, exact match 1
    (call,) = CALLS
    assert call == {"prompt": "What is 6 * 7?", "completion": "<answer>42</answer>",
                    "messages": [{"role": "user", "content": "What is 6 * 7?"},
                                 {"role": "assistant", "content": "<answer>42</answer>"}],
                    "answer": "42", "info": {"level": 1}, "task_id": "t1"}


def test_a_tool_call_runs_in_the_sandbox_and_the_conversation_holds_it():
    CALLS.clear()
    env = make_env("dataset", rewards=["tests.envs.test_dataset:recorder"], max_tool_calls=1)
    env.reset(TASK)
    observed = env.step("<tool_call>print(6 * 7)</tool_call>")
    assert not observed.done and "42" in observed.observation
    assert env.step("<answer>42</answer><|im_end|>").reward == 0.25
    roles = [m["role"] for m in CALLS[0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert CALLS[0]["completion"] == "<answer>42</answer>"  # the stop token is not part of the text


def test_the_tool_budget_ends_with_turns_without_scoring():
    CALLS.clear()
    env = make_env("dataset", rewards=["tests.envs.test_dataset:recorder"], max_tool_calls=0)
    env.reset(TASK)
    result = env.step("<tool_call>print(1)</tool_call>")
    assert result.done and result.termination is Termination.TURNS and result.reward == 0.0 and not CALLS


def test_chat_message_prompts_are_kept_as_given():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    task = Task("t2", "dataset", "2 + 2?", "4", "train", messages=json.dumps(messages))
    assert task_messages(task, system_prompt="ignored") == messages
    assert task_messages(TASK, system_prompt="Think.")[0] == {"role": "system", "content": "Think."}
    CALLS.clear()
    env = DatasetEnv(DatasetEnvConfig(rewards=("tests.envs.test_dataset:recorder",)))
    env.reset(task)
    env.step("4")
    assert CALLS[0]["prompt"] == messages  # as the data gave it


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.envs.test_dataset:raises", "raised ValueError: no reward for you"),
    ("tests.envs.test_dataset:nan", "returned nan, not a finite number"),
])
def test_a_failing_reward_function_is_an_error_naming_it(spec, message):
    env = DatasetEnv(DatasetEnvConfig(rewards=(spec,)))
    env.reset(TASK)
    with pytest.raises(RewardError, match=message):
        env.step("<answer>42</answer>")


def test_a_task_of_another_environment_is_refused():
    env = DatasetEnv()
    with pytest.raises(ValueError, match="belongs to env 'math_tool'"):
        env.reset(Task("m", "math_tool", "1 + 1?", "2", "train"))


def lookup(key):
    return {"a": 41}[key] + 1


def test_a_tool_function_of_ones_own_is_callable_from_the_sandboxed_code():
    env = make_env("dataset", rewards=["sao.rewards:exact_match"], tools=["tests.envs.test_dataset:lookup"])
    env.reset(TASK)
    assert env.step("<tool_call>print(lookup('a'))</tool_call>").observation.strip() == "42"
    failed = env.step("<tool_call>print(lookup('b'))</tool_call>").observation
    assert "KeyError" in failed  # the tool's own error, as the policy sees it
    assert env.step("<answer>42</answer>").reward == 1.0


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.envs.test_dataset:no_such_tool", "has no function 'no_such_tool'"),
    ("tests.envs.test_dataset:DatasetEnv", "must be a top-level def"),
])
def test_an_unusable_tool_function_is_refused(spec, message):
    from sao.rewards import RewardImportError

    with pytest.raises(RewardImportError, match=message):
        make_env("dataset", tools=[spec])


def convert(amount: float, currency: str = "EUR") -> float:
    """Convert ``amount`` dollars
    into ``currency``.

    Raises KeyError for a currency it does not know (not in the line a model sees)."""
    return amount * {"EUR": 0.9}[currency]


def test_a_tool_function_is_described_by_its_signature_and_its_docstring_s_first_paragraph():
    from sao.envs.dataset import tool_signatures

    assert tool_signatures(("tests.envs.test_dataset:convert", "tests.envs.test_dataset:lookup")) == (
        "convert(amount: float, currency: str = 'EUR') -> float: Convert ``amount`` dollars into ``currency``.",
        "lookup(key)")  # no docstring: the signature alone


_SENTINEL = object()


def marked(key, default=_SENTINEL):
    """Look ``key`` up."""
    return key


def test_a_default_with_a_memory_address_is_described_alike_in_every_process():
    """The tool's description is in every prompt: a default's repr like ``<object object at 0x...>`` would
    make it differ between replicas (and from a replay's)."""
    from sao.envs.dataset import tool_signatures

    assert " at 0x" in repr(_SENTINEL)
    assert tool_signatures(("tests.envs.test_dataset:marked",)) == (
        "marked(key, default=<object object>): Look ``key`` up.",)


def allowed(item, among={"pen", "ink", "pad", "nib", "cap"}, kinds=frozenset({"a", "b", "c"}), none=set(),  # noqa: B006
            pair=("r", frozenset({"x", "y", "z", "w"})), numbers={20, 3, 1}):  # noqa: B006
    """Whether ``item`` is sold."""
    return item in among


def test_a_set_default_is_described_alike_under_every_hash_seed():
    """A set of strings is written in an order its process's hash seed decides: the description sorts
    its elements (a set inside a tuple too; numbers by value), so replicas, the trainer and a replay
    (each a process of its own) render one prompt."""
    import os
    import subprocess
    import sys

    code = ("from sao.envs.dataset import tool_signatures; "
            "print(tool_signatures(('tests.envs.test_dataset:allowed',))[0])")
    lines = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(4)}
    assert lines == {"allowed(item, among={'cap', 'ink', 'nib', 'pad', 'pen'}, kinds=frozenset({'a', 'b', 'c'}), "
                     "none=set(), pair=('r', frozenset({'w', 'x', 'y', 'z'})), numbers={1, 3, 20}): Whether ``item`` "
                     "is sold.\n"}
    raw = {subprocess.run([sys.executable, "-c", "print({'pen', 'ink', 'pad', 'nib', 'cap'})"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(4)}
    assert len(raw) > 1  # what the sorting is for


def test_a_tool_functions_annotations_are_described_as_written_under_postponed_evaluation(tmp_path, monkeypatch):
    """A module with ``from __future__ import annotations`` keeps its annotations as strings: the line
    says ``item: str``, not ``item: 'str'``."""
    import sys

    from sao.envs.dataset import tool_signatures

    (tmp_path / "postponed_tools.py").write_text(
        "from __future__ import annotations\n\ndef price(item: str) -> int:\n    return 1\n")
    monkeypatch.delitem(sys.modules, "postponed_tools", raising=False)
    assert tool_signatures(("postponed_tools:price",), (str(tmp_path),)) == ("price(item: str) -> int",)
    monkeypatch.delitem(sys.modules, "postponed_tools", raising=False)
