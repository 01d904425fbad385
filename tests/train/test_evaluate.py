"""The evaluator: batched KV-cached sampling matches single-sequence decoding; the tool loop scores right."""

from __future__ import annotations

import types

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sao.envs.base import Split, Task, Termination
from sao.envs.dataset import DatasetEnv, DatasetEnvConfig
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
    episodes = run_math_episodes(model, tokenizer, tasks[:4], EvalConfig(max_tokens=3, max_turns=1))
    assert all(e.termination in (Termination.LENGTH, Termination.STOP, Termination.TURNS) for e in episodes)
    assert all(len(e.token_ids) == len(e.action_mask) for e in episodes)
    lengths = [sum(e.action_mask) for e in episodes]
    assert max(lengths) <= 3


def test_evaluation_is_reproducible(tokenizer, tasks):
    model = build_policy(seed=0)
    config = EvalConfig(num_tasks=4, max_tokens=8)
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


class ScriptedLM(OracleLM):
    """Replies with the text given for the question its context holds (any chat format)."""

    def __init__(self, tokenizer, replies: dict[str, str]) -> None:
        torch.nn.Module.__init__(self)
        self.tokenizer, self.replies, self.vocab = tokenizer, replies, len(tokenizer)

    def plan(self, ids: list[int]) -> list[int]:
        context = self.tokenizer.decode(ids)
        reply = next(text for question, text in self.replies.items() if question in context)
        return self.tokenizer.encode(reply, add_special_tokens=False)


def reward_that_fails_on_seven(completion: str, answer: str, **kwargs) -> float:
    """A user's reward function with a bug: it raises on the answer 7."""
    if answer == "7":
        raise ZeroDivisionError("division by zero")
    return float(completion.strip() == answer)


def dataset_tasks(*questions_and_answers: tuple[str, str]) -> list[Task]:
    return [Task(f"t{i}", "dataset", question, answer, Split.HELDOUT)
            for i, (question, answer) in enumerate(questions_and_answers)]


def test_a_reward_function_that_raises_ends_that_episode_with_error_and_the_evaluation_goes_on(tokenizer):
    tasks = dataset_tasks(("What is 1 + 2?", "3"), ("What is 3 + 4?", "7"), ("What is 2 + 3?", "5"))
    model = ScriptedLM(tokenizer, {"1 + 2": "3<|im_end|>", "3 + 4": "7<|im_end|>", "2 + 3": "6<|im_end|>"})
    config = DatasetEnvConfig(rewards=("tests.train.test_evaluate:reward_that_fails_on_seven",), max_tool_calls=0)
    result = evaluate_math(model, tokenizer, tasks, EvalConfig(num_tasks=3), env_factory=lambda task: DatasetEnv(config))
    assert [e.reward for e in result.episodes] == [1.0, 0.0, 0.0]  # right, reward failed, wrong
    assert [e.termination for e in result.episodes] == [Termination.STOP, Termination.ERROR, Termination.STOP]
    assert result.terminations == {"stop": 2, "error": 1} and result.accuracy == 1 / 3
    assert result.episodes[1].error == ("reward function tests.train.test_evaluate:reward_that_fails_on_seven raised "
                                        "ZeroDivisionError: division by zero")
    assert result.episodes[0].error is None and result.episodes[2].error is None

    class Broken(DatasetEnv):  # a fault of the environment itself, not of a reward function
        def step(self, action_text):
            raise ValueError("broken environment")

    with pytest.raises(ValueError, match="broken environment"):
        evaluate_math(model, tokenizer, tasks, EvalConfig(num_tasks=3), env_factory=lambda task: Broken(config))


LLAMA3 = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
          "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def llama3_tokenizer():
    """A byte-level BPE tokenizer with Llama 3's turn tokens and template, none of ChatML's."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    backend.train_from_iterator(["What is 2 + 3? 5", "user assistant"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    tokenizer.chat_template = LLAMA3
    return tokenizer


class Recording(DatasetEnv):
    """The dataset environment, keeping every action text it was given."""

    def __init__(self, seen: list[str], config: DatasetEnvConfig) -> None:
        super().__init__(config)
        self.seen = seen

    def step(self, action_text):
        self.seen.append(action_text)
        return super().step(action_text)


def test_the_end_of_turn_token_of_another_chat_format_is_not_part_of_the_scored_reply(tokenizer):
    llama = llama3_tokenizer()
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert not ChatTokens.from_tokenizer(llama).supports_tools
    tasks, config, seen = dataset_tasks(("What is 2 + 3?", "5")), DatasetEnvConfig(max_tool_calls=0), []
    model = ScriptedLM(llama, {"2 + 3": "5<|eot_id|>"})
    episode = run_math_episodes(model, llama, tasks, EvalConfig(), env_factory=lambda task: Recording(seen, config))[0]
    assert seen == ["5"]  # exact_match compares '5' with '5', not '5<|eot_id|>'
    assert episode.reward == 1.0 and episode.termination is Termination.STOP
    assert episode.token_ids[-2:] == (llama.convert_tokens_to_ids("5"), eot) and episode.action_mask[-1] == 1  # kept
    # This format's tokenizer: the environment is given the text as before, <|im_end|> and all.
    seen.clear()
    model = ScriptedLM(tokenizer, {"2 + 3": "5<|im_end|>"})
    episode = run_math_episodes(model, tokenizer, tasks, EvalConfig(), env_factory=lambda task: Recording(seen, config))[0]
    assert seen == ["5<|im_end|>"] and episode.reward == 1.0


class Rambler(torch.nn.Module):
    """Always the same token, never a stop id: every segment runs to its limit."""

    def __init__(self, token: int, vocab: int) -> None:
        super().__init__()
        self.token, self.vocab = token, vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        logits[:, 0, self.token] = 0.0
        return types.SimpleNamespace(logits=logits, past_key_values=past_key_values)


def test_each_row_samples_at_most_its_own_limit(tokenizer):
    model = Rambler(tokenizer.convert_tokens_to_ids("a"), len(tokenizer))
    a = tokenizer.convert_tokens_to_ids("a")
    segments = sample_segments(model, [[5, 6], [7], [8, 9, 10]], stop_token_ids=(2,), max_new_tokens=[2, 5, 1],
                               temperature=1.0, generator=torch.Generator().manual_seed(0), pad_id=0)
    assert segments == [([a, a], False), ([a] * 5, False), ([a], False)]
    with pytest.raises(ValueError, match="limit >= 1"):
        sample_segments(model, [[5], [6]], stop_token_ids=(2,), max_new_tokens=[3, 0], temperature=1.0,
                        generator=torch.Generator().manual_seed(0), pad_id=0)


def test_an_episode_spends_one_token_budget_over_all_its_segments_and_observations(tokenizer, tasks):
    """The oracle's episode is call (c tokens), observation (o), answer (a): with a budget of exactly
    c + o + a it is solved; one token less cuts the answer (``length``, reward 0); a budget below
    c + o leaves the observation out (``length`` after the tool call), as the agent loop does."""
    task = tasks[0]
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": task.prompt}])
    call = tokenizer.encode(f"<tool_call>{task.solution}</tool_call>", add_special_tokens=False)
    observation = observation_ids(tokenizer, task.answer)
    answer = tokenizer.encode(f"<answer>{task.answer}</answer>", add_special_tokens=False)
    full = len(call) + len(observation) + len(answer)
    assert max(len(call), len(answer)) < full - 1  # each segment alone fits every budget below

    def episode(max_tokens: int):
        return run_math_episodes(OracleLM(tokenizer, tasks), tokenizer, [task], EvalConfig(max_tokens=max_tokens))[0]

    solved = episode(full)
    assert (solved.termination, solved.reward, len(solved.token_ids)) == (Termination.STOP, 1.0, len(prompt) + full)
    cut = episode(full - 1)
    assert (cut.termination, cut.reward) == (Termination.LENGTH, 0.0)
    assert list(cut.token_ids) == prompt + call + observation + answer[:-1]
    unobserved = episode(len(call) + len(observation) - 1)
    assert (unobserved.termination, unobserved.reward, unobserved.tool_calls) == (Termination.LENGTH, 0.0, 1)
    assert list(unobserved.token_ids) == prompt + call
    spent = episode(len(call) + len(observation))  # the observation fills it: no turn is left to sample
    assert spent.termination is Termination.LENGTH and list(spent.token_ids) == prompt + call + observation
