"""The evaluator: batched KV-cached sampling matches single-sequence decoding; the tool loop scores right."""

from __future__ import annotations

import types

import pytest
import torch

from sao.envs.base import Termination
from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.models.chat import ChatTokens, observation_ids, parse_chat, prompt_ids
from sao.models.policy import build_policy
from sao.models.tokenizer import build_tokenizer
from sao.train.evaluate import (
    EvalConfig,
    action_segments,
    evaluate_math,
    run_math_episodes,
    sample_segments,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tasks():
    return [t for t in generate_tasks(MathToolConfig(num_train=0, num_heldout=6)) if t.split == "heldout"]


def test_left_padded_batch_decodes_like_each_sequence_alone(tokenizer):
    # Near-greedy sampling makes the draw deterministic, so batch and single runs must agree exactly.
    model = build_policy(seed=0)
    contexts = [tokenizer.encode(text, add_special_tokens=False) for text in ("What is 1 + 2?", "Hi", "A shop has 12 boxes")]
    kwargs = dict(stop_token_ids=(2, 4), max_new_tokens=12, temperature=1e-4, pad_id=0)
    batched = sample_segments(model, contexts, generator=torch.Generator().manual_seed(0), **kwargs)
    for context, expected in zip(contexts, batched, strict=True):
        alone = sample_segments(model, [context], generator=torch.Generator().manual_seed(0), **kwargs)
        assert alone == [expected]
    # The same tokens come out of a plain full-sequence greedy decode without any cache.
    ids = list(contexts[0])
    for token in batched[0][0]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert int(logits.argmax()) == token
        ids.append(token)


class OracleLM(torch.nn.Module):
    """Emits the ideal action for each row: the task's tool call, then the tool's output as the answer.

    Stands in for a trained policy so the multi-turn loop, the sandbox and the reward are tested
    exactly; ``offset`` corrupts the answer to check the reward goes to 0.
    """

    def __init__(self, tokenizer, tasks, offset: int = 0) -> None:
        super().__init__()
        self.tokenizer, self.offset = tokenizer, offset
        self.solutions = {t.prompt: t.solution for t in tasks}
        self.vocab = len(tokenizer)

    def plan(self, ids: list[int]) -> list[int]:
        messages = parse_chat(self.tokenizer.decode(ids))
        if messages[-1]["role"] == "user":
            text = f"<tool_call>{self.solutions[messages[-1]['content']]}</tool_call>"
        else:
            text = f"<answer>{int(messages[-1]['content']) + self.offset}</answer><|im_end|>"
        return self.tokenizer.encode(text, add_special_tokens=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        if past_key_values is None:  # prefill: one plan per row, from its unpadded context
            plans = [self.plan([t for t, m in zip(row, mask, strict=True) if m]) for row, mask in
                     zip(input_ids.tolist(), attention_mask.tolist(), strict=True)]
            past_key_values = {"plans": plans, "step": 0}
        else:
            past_key_values["step"] += 1
        step = past_key_values["step"]
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        for row, plan in enumerate(past_key_values["plans"]):
            logits[row, 0, plan[min(step, len(plan) - 1)]] = 0.0
        return types.SimpleNamespace(logits=logits, past_key_values=past_key_values)


def test_oracle_solves_every_task_through_the_real_tool(tokenizer, tasks):
    result = evaluate_math(OracleLM(tokenizer, tasks), tokenizer, tasks, EvalConfig(num_tasks=6, batch_size=4))
    assert result.accuracy == 1.0
    assert result.mean_tool_calls == 1.0
    assert result.terminations == {"stop": 6}


def test_wrong_answers_score_zero(tokenizer, tasks):
    result = evaluate_math(OracleLM(tokenizer, tasks, offset=1), tokenizer, tasks, EvalConfig(num_tasks=6))
    assert result.accuracy == 0.0 and result.stderr == 0.0


def test_episode_layout_prompt_actions_and_observations(tokenizer, tasks):
    chat = ChatTokens.from_tokenizer(tokenizer)
    episode = run_math_episodes(OracleLM(tokenizer, tasks), tokenizer, tasks[:1], EvalConfig())[0]
    task = tasks[0]
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": task.prompt}])
    call = tokenizer.encode(f"<tool_call>{task.solution}</tool_call>", add_special_tokens=False)
    observation = observation_ids(tokenizer, task.answer)
    answer = tokenizer.encode(f"<answer>{task.answer}</answer>", add_special_tokens=False)  # </answer> stops
    assert list(episode.token_ids) == prompt + call + observation + answer
    assert list(episode.action_mask) == [0] * len(prompt) + [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    assert episode.token_ids[-1] == chat.answer_end_id
    assert episode.termination is Termination.STOP and episode.reward == 1.0


def test_budgets_end_episodes_with_length_and_turns(tokenizer, tasks):
    model = build_policy(seed=0)  # untrained: rambles
    episodes = run_math_episodes(model, tokenizer, tasks[:4], EvalConfig(max_new_tokens=3, max_turns=1))
    assert all(e.termination in (Termination.LENGTH, Termination.STOP, Termination.TURNS) for e in episodes)
    assert all(len(e.token_ids) == len(e.action_mask) for e in episodes)
    lengths = [sum(e.action_mask) for e in episodes]
    assert max(lengths) <= 3


def test_evaluation_is_reproducible(tokenizer, tasks):
    model = build_policy(seed=0)
    config = EvalConfig(num_tasks=4, max_new_tokens=8)
    first = run_math_episodes(model, tokenizer, tasks[:4], config)
    assert run_math_episodes(model, tokenizer, tasks[:4], config) == first


def test_config_errors():
    with pytest.raises(ValueError, match="temperature"):
        EvalConfig(temperature=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        EvalConfig(batch_size=0)


def test_action_segments_are_the_sampled_runs_decoded(tokenizer, tasks):
    episode = run_math_episodes(OracleLM(tokenizer, tasks), tokenizer, tasks[:1], EvalConfig())[0]
    assert action_segments(episode, tokenizer) == [f"<tool_call>{tasks[0].solution}</tool_call>",
                                                   f"<answer>{tasks[0].answer}</answer>"]


@pytest.mark.parametrize(("offset", "expected"), [(0, {"tool_call": 0, "answer": 0, "structure": 0}),
                                                  (1, {"tool_call": 0, "answer": 6, "structure": 0})])
def test_failures_are_counted_by_class(tokenizer, tasks, offset, expected):
    """The oracle calls the tool right; with ``offset`` it then answers the tool's output plus one."""
    from sao.runs import failure_counts

    result = evaluate_math(OracleLM(tokenizer, tasks, offset=offset), tokenizer, tasks, EvalConfig(num_tasks=6))
    assert failure_counts(result.episodes, {t.task_id: t for t in tasks}, tokenizer) == expected
