"""SFT warm start: demonstrations laid out like trajectories, loss on action tokens only, version 0 saved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sao.envs.base import Split, Task
from sao.envs.math_tool import ENV_NAME, MathToolConfig, demonstration
from sao.envs.style_preference import (
    ShiftSchedule,
    Style,
    StyleJudge,
    StylePreferenceConfig,
    classify_style,
)
from sao.envs.style_preference import generate_tasks as style_tasks
from sao.models.chat import ChatTokens
from sao.models.policy import PolicyConfig, load_policy, read_policy_metadata
from sao.models.tokenizer import build_tokenizer, load_tokenizer, tokenizer_version
from sao.train.sft import (
    Example,
    SFTConfig,
    collate,
    conversation_example,
    demonstration_example,
    demonstrations,
    sft_loss,
    sft_warm_start,
    success_probability,
)

TASK = Task("t-1", ENV_NAME, "What is 483 * 27 + 915?", "13956", Split.TRAIN, "print(483*27+915)")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_demonstration_example_matches_the_template_and_masks_only_actions(tokenizer):
    example = demonstration_example(tokenizer, TASK)
    rendered = tokenizer.apply_chat_template(demonstration(TASK), tokenize=True, return_dict=False)
    assert example.input_ids + tokenizer.encode("\n", add_special_tokens=False) == list(rendered)
    actions = tokenizer.decode([t for t, m in zip(example.input_ids, example.action_mask, strict=True) if m])
    assert actions == "<tool_call>print(483*27+915)</tool_call><answer>13956</answer><|im_end|>"


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a parameter: the loss can be checked by hand."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return type("Out", (), {"logits": self.logits})()


def test_a_demonstration_for_a_model_of_ones_own_ends_at_the_end_of_its_turn(tokenizer):
    # A model directory of this project's tool format (a policy from an earlier run): its stop ids begin
    # with </tool_call>, and the demonstration ended on that instead of the turn's end.
    from sao.train.sft import own_example

    chat = ChatTokens.from_tokenizer(tokenizer)
    assert chat.supports_tools and chat.stop_token_ids[0] != chat.im_end_id
    task = Task(task_id="t", env="dataset", prompt="1 + 1?", answer="2", split=Split.TRAIN)
    example = own_example(tokenizer, chat, task, "2")
    assert example.input_ids[-1] == chat.im_end_id and example.action_mask[-1] == 1


def test_a_demonstration_for_a_model_that_calls_tools_in_its_own_format_has_its_rollouts_prompt():
    """With the tools a run of one's own offers (the built-in tool loop in the model's own format), a
    demonstration's prompt is the one the chat endpoint gave the rollout: the tools written in."""
    from sao.models.chat import ChatTokens as Tokens
    from sao.train.sft import own_example
    from tests.rollout.test_env_agent import OWN_TASK, own_format_episode

    (record,), tokenizer, tools = own_format_episode(["5<|im_end|>"])
    example = own_example(tokenizer, Tokens.from_tokenizer(tokenizer), OWN_TASK, "5", tools=tools)
    prompt = list(record.prompt_ids)
    assert example.input_ids[: len(prompt)] == prompt and example.action_mask[: len(prompt)] == [0] * len(prompt)
    assert example.input_ids[len(prompt):] == list(record.completion_ids)  # the reply as sampled, its end included
    plain = own_example(tokenizer, Tokens.from_tokenizer(tokenizer), OWN_TASK, "5")
    assert len(plain.input_ids) < len(example.input_ids)  # without tools: the prompt of a single-turn run


def test_sft_loss_is_the_token_mean_nll_of_action_tokens_only():
    vocab = 5
    input_ids = torch.tensor([[0, 1, 2, 3, 4]])
    action_mask = torch.tensor([[False, False, True, False, True]])
    logits = torch.randn(1, 5, vocab, generator=torch.Generator().manual_seed(0))
    model = FixedLogits(logits)
    loss, count = sft_loss(model, input_ids, torch.ones_like(input_ids), action_mask)
    logp = torch.log_softmax(logits, dim=-1)
    expected = -(logp[0, 1, 2] + logp[0, 3, 4]) / 2  # token 2 from position 1, token 4 from position 3
    assert count == 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    rows_with_gradient = model.logits.grad[0].abs().sum(-1).nonzero().flatten().tolist()
    assert rows_with_gradient == [1, 3]  # prompt and observation positions get no gradient


def test_success_probability_is_the_product_over_action_tokens():
    logits = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(1))
    model = FixedLogits(logits)
    example = Example([0, 1, 2, 1], [0, 1, 0, 1])
    logp = torch.log_softmax(logits, dim=-1)
    expected = torch.exp(logp[0, 0, 1] + logp[0, 2, 1]).item()
    assert success_probability(model, [example], pad_id=0) == pytest.approx(expected, rel=1e-5)


def test_collate_pads_right_and_keeps_masks():
    input_ids, attention_mask, action_mask = collate([Example([5, 6, 7], [0, 1, 1]), Example([8], [0])], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert action_mask.tolist() == [[False, True, True], [False, False, False]]


SHORT = SFTConfig(
    max_steps=40,
    target_success=None,
    eval_every=20,
    validation_tasks=16,
    batch_size=16,
    learning_rate=3e-3,
    warmup_steps=5,
    math=MathToolConfig(num_train=200, num_heldout=10),
)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    return sft_warm_start(SHORT, tmp_path_factory.mktemp("sft"))


def test_short_sft_learns_and_writes_policy_version_zero(short_run, tokenizer):
    assert short_run.steps == 40 and not short_run.reached_target
    assert [p.step for p in short_run.log] == [20, 40]
    assert short_run.log[-1].loss < short_run.log[0].loss < 6.0
    assert short_run.log[-1].success >= short_run.log[0].success
    model = load_policy(short_run.path)
    loaded_tokenizer = load_tokenizer(short_run.path)
    assert tokenizer_version(loaded_tokenizer) == tokenizer_version(tokenizer)
    metadata = read_policy_metadata(short_run.path)
    assert metadata.policy_version == 0
    assert metadata.tokenizer_version == tokenizer_version(tokenizer)
    assert metadata.extra["sft_metrics"]["steps"] == 40
    assert model.config.vocab_size == PolicyConfig().vocab_size


def test_sft_is_deterministic(short_run, tmp_path):
    again = sft_warm_start(SHORT, tmp_path)
    assert [p.loss for p in again.log] == [p.loss for p in short_run.log]
    first, second = load_policy(short_run.path).state_dict(), load_policy(again.path).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_sft_stops_at_the_first_measurement_that_reaches_the_target(tmp_path):
    target = 1e-300  # tiny: reached within a few steps, once the product no longer underflows to 0
    config = dataclasses.replace(SHORT, target_success=target, eval_every=2)
    result = sft_warm_start(config, tmp_path)
    assert result.reached_target and result.steps < config.max_steps
    assert result.steps == result.log[-1].step
    assert result.log[-1].success >= target
    assert all(point.success < target for point in result.log[:-1])


@pytest.mark.parametrize(("field", "value"), [("max_steps", 0), ("target_success", 1.5), ("learning_rate", 0.0), ("validation_tasks", 0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SFTConfig(**{field: value})


def test_too_few_train_tasks_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="validation_tasks"):
        sft_warm_start(dataclasses.replace(SHORT, validation_tasks=500), tmp_path)


def test_style_demonstrations_answer_every_train_task_in_every_style(tokenizer):
    config = SFTConfig(env="style_preference")
    per_task = demonstrations(config)
    train = [t for t in style_tasks(config.style) if t.split is Split.TRAIN]
    assert len(per_task) == len(train) and per_task == demonstrations(config)  # deterministic
    for task, group in zip(train, per_task, strict=True):
        assert [m[0]["content"] for m in group] == [task.prompt] * len(Style)
        replies = [m[1]["content"] for m in group]
        assert [classify_style(r) for r in replies] == list(Style)  # one per style, no style favoured
        for style, reply in zip(Style, replies, strict=True):  # each earns full reward when its style is preferred
            assert StyleJudge(ShiftSchedule(styles=(style,), shift_steps=())).reward(reply, step=0) == 1.0
    example = conversation_example(tokenizer, per_task[0][1])
    actions = tokenizer.decode([t for t, m in zip(example.input_ids, example.action_mask, strict=True) if m])
    assert actions == per_task[0][1][1]["content"] + "<|im_end|>"
    with pytest.raises(ValueError, match="SFTConfig.env"):
        SFTConfig(env="chess")


def test_style_demonstrations_with_personas_and_the_answer_tag_close_every_reply(tokenizer):
    config = SFTConfig(env="style_preference", style=StylePreferenceConfig(personas=("Ada", "Basil"), answer_tag=True))
    per_task = demonstrations(config)
    train = [t for t in style_tasks(config.style) if t.split is Split.TRAIN]
    assert len(per_task) == len(train) and per_task[0][0][0]["content"] == train[0].prompt
    assert train[0].prompt.endswith((" It is for Ada.", " It is for Basil."))
    replies = [m[1]["content"] for group in per_task for m in group]
    assert all(r.startswith("<answer>") and r.endswith("</answer>") for r in replies)
    example = conversation_example(tokenizer, per_task[0][1])
    actions = tokenizer.decode([t for t, m in zip(example.input_ids, example.action_mask, strict=True) if m])
    assert actions == per_task[0][1][1]["content"] + "<|im_end|>"


def test_a_short_style_sft_learns_and_saves_version_zero(tmp_path):
    config = dataclasses.replace(SHORT, env="style_preference", max_steps=20, eval_every=10, validation_tasks=4,
                                 style=StylePreferenceConfig(seed=3))
    result = sft_warm_start(config, tmp_path)
    assert result.steps == 20 and result.log[-1].loss < result.log[0].loss
    assert read_policy_metadata(result.path).extra["sft_config"]["env"] == "style_preference"
    with pytest.raises(ValueError, match="SFTConfig.style has .* validation_tasks=500"):
        sft_warm_start(dataclasses.replace(config, validation_tasks=500), tmp_path)


def test_chat_tokens_of_the_sft_tokenizer(tokenizer):
    assert ChatTokens.from_tokenizer(tokenizer).pad_id == SHORT.policy.pad_token_id
