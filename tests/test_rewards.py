"""sao.rewards: finding reward functions, calling them, the built-in ones."""

import asyncio
import sys

import pytest

from sao.rewards import (
    RewardError,
    RewardImportError,
    RewardSet,
    exact_match,
    final_answer,
    math_verify,
    resolve_reward,
)


def write_module(folder, name, body):
    (folder / f"{name}.py").write_text(body)
    return folder


def test_a_module_in_the_working_directory_is_found_and_its_folder_recorded(tmp_path, monkeypatch):
    write_module(tmp_path, "user_rewards_a", "def score(completion, **kwargs):\n    return len(completion) / 10\n")
    monkeypatch.chdir(tmp_path)
    function, folder = resolve_reward("user_rewards_a:score")
    assert function(completion="abcde") == 0.5 and folder == str(tmp_path)
    assert str(tmp_path) not in sys.path  # searched, not left behind


def test_a_module_from_a_recorded_folder_is_found_from_elsewhere(tmp_path, monkeypatch):
    write_module(tmp_path, "user_rewards_b", "def score(**kwargs):\n    return 1\n")
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(RewardImportError):
        resolve_reward("user_rewards_b:score")
    assert resolve_reward("user_rewards_b:score", paths=[str(tmp_path)])[0]() == 1


@pytest.mark.parametrize(("spec", "message"), [
    ("no_colon", "expected MODULE:FUNCTION"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz' .*searched .*and the installed packages"),
    ("sao.rewards:no_such_function", "has no function 'no_such_function'"),
    ("sao.rewards:final_answer", "must accept \\*\\*kwargs"),
])
def test_an_unusable_reward_function_is_refused_with_what_was_tried(spec, message):
    with pytest.raises(RewardImportError, match=message):
        resolve_reward(spec)


def test_a_module_that_fails_to_import_says_so(tmp_path, monkeypatch):
    write_module(tmp_path, "user_rewards_c", "raise RuntimeError('broken module')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardImportError, match="importing 'user_rewards_c' raised RuntimeError: broken module"):
        resolve_reward("user_rewards_c:f")


def test_sync_and_async_functions_are_weighted_and_summed(tmp_path, monkeypatch):
    write_module(tmp_path, "user_rewards_d", "async def later(**kwargs):\n    return 0.5\n"
                                             "def now(answer, **kwargs):\n    return float(answer)\n")
    monkeypatch.chdir(tmp_path)
    rewards = RewardSet(["user_rewards_d:later", "user_rewards_d:now"], weights=[2, 0.5])
    assert rewards.score(answer="3") == 2 * 0.5 + 0.5 * 3.0
    assert rewards.paths == (str(tmp_path),)


def test_scoring_from_inside_a_running_event_loop_thread_pool_works(tmp_path, monkeypatch):
    """Environments step in the agent loop's tool threads while the loop runs elsewhere."""
    write_module(tmp_path, "user_rewards_e", "async def later(**kwargs):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    rewards = RewardSet(["user_rewards_e:later"])

    async def main():
        return await asyncio.get_running_loop().run_in_executor(None, lambda: rewards.score())

    assert asyncio.run(main()) == 1.0


@pytest.mark.parametrize("value", ["float('inf')", "None", "'1'", "True"])
def test_a_value_that_is_not_a_finite_number_is_an_error(tmp_path, monkeypatch, value):
    name = f"user_rewards_f{abs(hash(value))}"  # one module per case: imports are cached
    write_module(tmp_path, name, f"def f(**kwargs):\n    return {value}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match="not a finite number"):
        RewardSet([f"{name}:f"]).score()


def test_weights_must_match_the_functions():
    with pytest.raises(RewardImportError, match="2 values for 1 functions"):
        RewardSet(["sao.rewards:exact_match"], weights=[1, 2])
    with pytest.raises(RewardImportError, match="no reward function"):
        RewardSet([])


@pytest.mark.parametrize(("completion", "expected"), [
    ("<answer> 42 </answer>", "42"), ("x <answer>1</answer> y <answer>2</answer>", "2"),
    ("so \\boxed{7}", "7"), ("  plain  ", "plain"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), ("\\boxed{1} then \\boxed{\\sqrt{4}}", "\\sqrt{4}"),
    ("\\boxed{3} and \\boxed{unclosed", "3"),
])
def test_final_answer(completion, expected):
    assert final_answer(completion) == expected


def test_the_built_in_rewards():
    assert exact_match(completion="<answer>42</answer>", answer="42") == 1.0
    assert exact_match(completion="<answer>42.0</answer>", answer="42") == 0.0
    assert math_verify(completion="<answer>42.0</answer>", answer="42") == 1.0
    assert math_verify(completion="\\boxed{\\frac{1}{2}}", answer="0.5") == 1.0
    assert math_verify(completion="<answer>41</answer>", answer="42") == 0.0
    assert math_verify(completion="no number here", answer="42") == 0.0


@pytest.mark.parametrize("reward", [exact_match, math_verify])
def test_a_built_in_reward_without_a_reference_answer_is_an_error_not_a_zero(reward):
    # A task file whose answers sit under another column loads with empty answers: before, every reply
    # scored 0 (and exact_match scored an empty answer 1).
    for empty in ("", "  "):
        with pytest.raises(RewardError, match="the task has no reference answer"):
            reward(completion="<answer></answer>", answer=empty)


def test_math_verify_refuses_a_reference_answer_it_cannot_parse():
    with pytest.raises(RewardError, match="cannot parse the task's reference answer 'forty-two'"):
        math_verify(completion="<answer>42</answer>", answer="forty-two")
