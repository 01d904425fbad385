"""The demonstration oracle: values worked by hand under a policy that spreads its probability evenly,
and the update it feeds."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from sao.envs.math_tool import generate_tasks
from sao.models.critic import Critic
from sao.models.policy import build_policy
from sao.models.tokenizer import build_tokenizer
from sao.train.batch import collate
from sao.train.config import UpdateConfig
from sao.train.loop import compute_update
from sao.train.oracle import DemonstrationOracle, attach_oracle, on_path, value_steps_off_path
from sao.train.step import Learner, critic_values, policy_logprobs


class Halves(torch.nn.Module):
    """Gives the input's own next token probability 1/2 (it reads ahead), so a demonstration's action
    token, teacher-forced, has probability exactly 1/2 and a state's oracle value is 2 ** -(action
    tokens still to come)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        logits = torch.zeros((*input_ids.shape, self.vocab))
        ahead = torch.roll(input_ids, -1, dims=1).unsqueeze(-1)
        logits.scatter_(-1, ahead, math.log(self.vocab - 1))  # e^x = the other tokens' total weight
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tasks():
    return {task.task_id: task for task in generate_tasks()[:4]}


def row(tid, task_id, prompt, completion, mask, reason="stop", reward=0.0):
    return {"trajectory_id": tid, "task_id": task_id, "prompt_ids": prompt, "completion_ids": completion,
            "action_mask": mask, "logprobs": [-1.0] * len(completion), "reward": reward, "termination_reason": reason,
            "min_policy_version": 0, "logprob_kind": "sampling",
            "sampling": {"temperature": 1.0, "top_k": None, "top_p": 1.0}}


def test_values_on_the_path_are_the_chance_of_completing_it_and_zero_after_leaving_it(tokenizer, tasks):
    vocab = len(tokenizer)
    oracle = DemonstrationOracle(Halves(vocab), tokenizer, tasks)
    task_id = next(iter(tasks))
    demo, mask = oracle.completion(task_id)
    assert 0 in mask and sum(mask) < len(mask)  # the tool's output sits between the two actions
    # it ends where a rollout's answer stops: at </answer>, without the <|im_end|> never sampled after it
    assert tokenizer.convert_ids_to_tokens(demo[-1]) == "</answer>"
    wrong = 3  # an action token of the tool call
    assert mask[wrong] == 1
    off = demo[:wrong] + [(demo[wrong] + 1) % vocab] + demo[wrong + 1 : wrong + 6]
    prompt = [1, 2, 3]
    rows = [row("whole", task_id, prompt, demo, mask, reward=1.0),
            row("off", task_id, prompt, off, [1] * len(off), reason="length"),
            row("first", task_id, prompt, [(demo[0] + 1) % vocab, demo[1]], [1, 1], reason="length")]
    batch = collate(rows, trainer_version=0, bootstrap_reasons=("length",))
    values, v_end = oracle(rows, batch)
    # the state before completion token j: 2 ** -(the demonstration's action tokens from j on)
    remaining = [sum(mask[j:]) for j in range(len(demo))]
    whole = [2.0 ** -remaining[j] if mask[j] else 0.0 for j in range(len(demo))]
    assert values[0, : len(demo)].tolist() == pytest.approx(whole, rel=1e-4, abs=0)
    assert v_end[0] == 1.0  # the whole demonstration: nothing left to sample
    expected = [2.0 ** -remaining[j] if j <= wrong else 0.0 for j in range(len(off))]
    assert values[1, : len(off)].tolist() == pytest.approx(expected, rel=1e-4, abs=0)
    assert float(values[1, wrong + 1 :].abs().sum()) == 0.0 and v_end[1] == 0.0  # off the path
    assert values[2, :2].tolist() == pytest.approx([2.0 ** -remaining[0], 0.0], rel=1e-4, abs=0)
    assert 2.0 ** -remaining[0] > 1e-12  # every figure above is far from zero: the check is not vacuous


class TokenValue(torch.nn.Module):
    """A critic whose value at a position is the token id there over 100: the value of the state a
    completion token was sampled in is the id of the token before it, over 100."""

    def forward(self, input_ids, attention_mask=None):
        return input_ids.float() / 100


def test_value_steps_off_path_by_hand(tokenizer, tasks):
    vocab = len(tokenizer)
    demonstrations = DemonstrationOracle(Halves(vocab), tokenizer, tasks)
    task_id = next(iter(tasks))
    demo, mask = demonstrations.completion(task_id)
    observation = mask.index(0)
    assert mask[:4] == [1, 1, 1, 1] and observation > 4
    wrong, wrong_last = (demo[3] + 1) % vocab, (demo[2] + 5) % vocab
    prompt = [1, 2, 30]
    rows = [
        # off the path at action token 3, two on-path actions after it
        row("digit", task_id, prompt, demo[:3] + [wrong] + demo[4:6], [1] * 6),
        row("whole", task_id, prompt, demo, mask, reward=1.0),  # never off the path: not counted
        # off the path at the tool's output (an observation): not counted
        row("observation", task_id, prompt, demo[:observation] + [demo[observation] + 1], mask[: observation + 1]),
        # off the path at its last action token: V after it is V(s_end), the value at its last position
        row("last", task_id, prompt, demo[:2] + [wrong_last], [1, 1, 1], reason="length"),
    ]
    assert [on_path(r["completion_ids"], demo) for r in rows] == [3, len(demo), observation, 2]
    result = value_steps_off_path(TokenValue(), demonstrations, rows)
    # "digit": V(before token 3) = demo[2]; after it (the state of token 4) = the wrong token itself
    # "last": V(before token 2) = demo[1]; after it, V(s_end) = the id at its last position, wrong_last
    # on the path: V(j + 1) - V(j) for j before the wrong one, V(0) = the prompt's last token (30)
    on_digit = [demo[0] - 30, demo[1] - demo[0], demo[2] - demo[1]]
    on_last = [demo[0] - 30, demo[1] - demo[0]]
    assert result["rollouts"] == 2 and result["not_counted"] == 2
    assert result["value_before"] == pytest.approx((demo[2] + demo[1]) / 200)
    assert result["step_off_path"] == pytest.approx(((wrong - demo[2]) + (wrong_last - demo[1])) / 200)
    assert result["step_on_path"] == pytest.approx(sum(on_digit + on_last) / 500)
    assert result["step_off_path"] != pytest.approx(result["step_on_path"])  # the two are told apart
    assert "oracle_step_off_path" not in result
    # the oracle's value before token j on the path is 2 ** -(the demonstration's action tokens from j on),
    # and 0 after leaving it: its step off the path is minus its value before
    worth = [2.0 ** -sum(mask[j:]) for j in range(len(demo))]
    oracle = value_steps_off_path(TokenValue(), demonstrations, rows, oracle_too=True)
    assert {key: oracle[key] for key in result} == result  # the critic's figures are the same
    assert oracle["oracle_value_before"] == pytest.approx((worth[3] + worth[2]) / 2, rel=1e-4)
    assert oracle["oracle_step_off_path"] == pytest.approx(-(worth[3] + worth[2]) / 2, rel=1e-4)
    on_path_steps = [worth[1] - worth[0], worth[2] - worth[1], worth[3] - worth[2], worth[1] - worth[0],
                     worth[2] - worth[1]]
    assert oracle["oracle_step_on_path"] == pytest.approx(sum(on_path_steps) / 5, rel=1e-4)
    assert worth[2] > 1e-12  # far from zero: the oracle's figures are not vacuous
    empty = value_steps_off_path(TokenValue(), demonstrations, [], oracle_too=True)
    assert empty == {"rollouts": 0, "not_counted": 0, "value_before": None, "step_off_path": None,
                     "step_on_path": None, "oracle_value_before": None, "oracle_step_off_path": None,
                     "oracle_step_on_path": None}


def test_a_task_without_a_demonstration_is_an_error_not_a_zero(tokenizer, tasks):
    oracle = DemonstrationOracle(Halves(len(tokenizer)), tokenizer, tasks)
    rows = [row("t", "someone-elses-task", [1, 2], [5, 6], [1, 1])]
    with pytest.raises(ValueError, match="'someone-elses-task' has no demonstration"):
        oracle(rows, collate(rows, trainer_version=0))


def demo_rows(tokenizer, tasks, policy):
    """Two trajectories per task: the demonstration (reward 1) and one cut short after a wrong token,
    with ``policy``'s log-probabilities as the rollout's (DIS keeps every token)."""
    oracle = DemonstrationOracle(None, tokenizer, tasks)
    rows = []
    for index, task_id in enumerate(tasks):
        demo, mask = oracle.completion(task_id)
        prompt = [1, 2, 3 + index]
        rows.append(row(f"r{index}", task_id, prompt, demo, mask, reward=1.0))
        rows.append(row(f"w{index}", task_id, prompt, demo[:2] + [7, 8], [1, 1, 1, 1]))
    with torch.no_grad():
        logp = policy_logprobs(policy, collate(rows, trainer_version=0))
    for index, r in enumerate(rows):
        r["logprobs"] = logp[index, : len(r["completion_ids"])].tolist()
    return rows


def test_the_critics_own_values_given_as_the_oracles_change_nothing_but_rounding(tokenizer, tasks):
    policy = build_policy(seed=0)
    critic = Critic.from_policy(policy)
    config = UpdateConfig(token_budget=4096)
    learners = [Learner(config, copy.deepcopy(policy), copy.deepcopy(critic)) for _ in range(2)]
    batch = collate(demo_rows(tokenizer, tasks, policy), trainer_version=0)
    with torch.no_grad():
        own = critic_values(learners[1].critic, batch)
    torch.manual_seed(0)
    plain = learners[0].update(batch)
    torch.manual_seed(0)
    given = learners[1].update(batch, policy_values=own)
    # the same values to float rounding (the learner's forward runs micro-batch by micro-batch)
    assert given["oracle/critic_abs_error"] < 1e-6
    changed = {k for k in plain if not k.startswith("time/") and given[k] != pytest.approx(plain[k], rel=1e-4, abs=1e-6)}
    assert not changed
    # Adam's first step moves a parameter by about lr * sign(gradient), so rounding in a gradient near
    # zero can move it the other way: parameters agree to a few steps' size, the metrics above closely
    for a, b in zip(learners[0].policy.parameters(), learners[1].policy.parameters(), strict=True):
        assert torch.allclose(a, b, atol=3 * config.lr_policy)


def test_with_oracle_values_the_update_takes_the_oracles_values(tokenizer, tasks):
    policy = build_policy(seed=0)
    critic = Critic.from_policy(policy)
    config = UpdateConfig(token_budget=4096, oracle_values=True)
    learner = Learner(config, copy.deepcopy(policy), copy.deepcopy(critic))
    plain = Learner(UpdateConfig(token_budget=4096), copy.deepcopy(policy), copy.deepcopy(critic))
    rows = demo_rows(tokenizer, tasks, policy)
    with pytest.raises(ValueError, match="has no oracle"):
        compute_update(learner, rows, version=0)
    attach_oracle(learner, tokenizer)
    oracle = DemonstrationOracle(copy.deepcopy(policy), tokenizer)
    expected, _ = oracle(rows, collate(rows, trainer_version=0))
    metrics = compute_update(learner, rows, version=0)
    action = collate(rows, trainer_version=0).action_mask
    assert metrics["oracle/value_mean"] == pytest.approx(float(expected[action].mean()), rel=1e-5)
    assert 0.0 < metrics["oracle/value_mean"] < 1.0
    assert metrics["oracle/critic_abs_error"] > 0.0
    assert {"oracle/explained_variance", "critic/explained_variance"} <= set(metrics)
    critics = compute_update(plain, rows, version=0)  # the critic's values instead: another actor loss
    assert abs(metrics["actor/advantage_mean"] - critics["actor/advantage_mean"]) > 0.01
    assert all(torch.equal(a, b) for a, b in zip(learner.critic.parameters(), plain.critic.parameters(), strict=True))


def test_oracle_values_need_a_critic_estimator():
    with pytest.raises(ValueError, match="oracle_values replaces a critic's values"):
        UpdateConfig(algorithm="grpo", oracle_values=True)
