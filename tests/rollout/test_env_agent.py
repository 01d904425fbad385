"""The built-in environments on the chat endpoint (what every replica runs) give the agent loop's
records, token for token, for the same seeds: prompts, actions, observations, masks, log-probabilities,
versions, rewards and ends."""

import asyncio
import concurrent.futures
import json

import numpy as np
import pytest

from sao.envs import make_env
from sao.envs.base import Split, Task
from sao.rollout.agent import AgentConfig, AgentLoop
from sao.rollout.chat_endpoint import ChatEndpoint
from sao.rollout.env_agent import environment_agent
from sao.rollout.torch_engine import TorchEngine
from sao.rollout.user_agent import UserAgentRunner
from tests.models.test_chat import xml_call
from tests.rollout.test_chat_endpoint import (
    GLM45_TEMPLATE,
    GLM47_STYLE,
    LLAMA31_TEMPLATE,
    LLAMA32_TEMPLATE,
    LLAMA_TEMPLATES,
    MISTRAL11_TEMPLATE,
    MISTRAL13_TEMPLATE,
    MISTRAL_LIST_TEMPLATES,
    MISTRAL_TEMPLATE,
    MISTRAL_TEMPLATES,
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    QWEN_STYLE,
    TEMPLATES,
    glm_style_tokenizer,
    llama_style_tokenizer,
    mistral_style_tokenizer,
)
from tests.test_user_agent import PROMPTS

TASKS = [Task(task_id=f"t{i}", env="math_tool", prompt=p["prompt"], answer=p["answer"], split=Split.TRAIN)
         for i, p in enumerate(PROMPTS[:12])]  # the prompts the policy below was taught on


@pytest.fixture(scope="module")
def engine(tokenizer, tmp_path_factory):
    """The tiny policy taught to open with a tool call and answer after its output (tests/test_user_agent.py)."""
    from sao.models.policy import load_policy
    from tests.test_user_agent import tool_calling_policy

    engine = TorchEngine(load_policy(tool_calling_policy(tokenizer, tmp_path_factory.mktemp("taught") / "model")))
    yield engine
    engine.close()


def both_paths(engine, tokenizer, config, env_options):
    loop = AgentLoop(engine, tokenizer, lambda task: make_env(task.env, **env_options), config)
    tools = concurrent.futures.ThreadPoolExecutor(4)

    async def go():
        endpoint = ChatEndpoint(engine, tokenizer)
        runner = UserAgentRunner(endpoint, config, "local")
        try:
            pairs = []
            for seed, task in enumerate(TASKS):
                looped = await loop.run(task, "r", f"t{seed}", seed)
                for built_in in (True, False):  # the built-in client, and the openai client an own agent gets
                    env = make_env(task.env, **env_options)
                    (served,) = await runner.run(environment_agent(env, task, tools), env, task, "r", f"t{seed}",
                                                 seed, built_in=built_in)
                    pairs.append((looped, served))
            return pairs
        finally:
            await runner.close()
            await endpoint.close()

    try:
        return asyncio.run(go())
    finally:
        loop.close()
        tools.shutdown()


@pytest.mark.parametrize("config, options, end", [
    (AgentConfig(max_tokens=160, max_turns=3), {}, "stop"),
    (AgentConfig(max_tokens=18, max_turns=4), {}, "length"),
    (AgentConfig(max_tokens=160, max_turns=1), {}, "turns"),
    (AgentConfig(max_tokens=160, max_turns=3), {"max_tool_calls": 0}, "turns"),
], ids=["stop", "length budget", "turn budget", "environment's turn budget"])
def test_the_endpoint_path_records_what_the_agent_loop_records(engine, tokenizer, config, options, end):
    pairs = both_paths(engine, tokenizer, config, options)
    reasons, observations = set(), 0
    for looped, served in pairs:
        assert list(served.prompt_ids) == list(looped.prompt_ids)
        assert list(served.completion_ids) == list(looped.completion_ids), looped.trajectory_id
        np.testing.assert_array_equal(served.action_mask, looped.action_mask)
        np.testing.assert_array_equal(served.logprobs, looped.logprobs)
        assert served.segments == looped.segments
        assert (served.reward, served.termination_reason, served.num_turns) == (
            looped.reward, looped.termination_reason, looped.num_turns)
        assert served.episode_id == looped.trajectory_id and looped.episode_id is None
        reasons.add(looped.termination_reason)
        observations += sum(s.kind == "observation" for s in looped.segments)
    assert end in reasons, reasons
    assert observations > 0 or end != "stop"  # tool calls and their outputs compared too


# A model's own tool-call format -------------------------------------------------------------------------

OWN_TASK = Task(task_id="own0", env="dataset", prompt="What is 2 + 3?", answer="5", split=Split.TRAIN)
OWN_OPTIONS = {"max_tool_calls": 2, "tools": ["examples.tool_use.shop:price"]}


def own_format_episode(replies, options=OWN_OPTIONS, config=None, template=QWEN_STYLE, tokenizer=None):
    """One built-in dataset episode of OWN_TASK on a Qwen2.5-style tokenizer (a Llama 3 one for Llama's
    templates, a GLM-4.5 one for GLM-4.5's, a Mistral one for Mistral's) with ``template`` (no tool-call tokens of this project; or ``tokenizer``) whose engine
    replies ``replies`` in turn: (records, tokenizer, the tools offered)."""
    from sao.models.chat import ChatTokens
    from sao.rollout.env_agent import tool_schema
    from tests.rollout.test_chat_endpoint import ScriptedEngine, qwen_style_tokenizer

    tokenizer = tokenizer or (llama_style_tokenizer(template) if template in LLAMA_TEMPLATES
                              else glm_style_tokenizer(template) if template in (GLM45_TEMPLATE, GLM47_STYLE)
                              else mistral_style_tokenizer(template) if template in MISTRAL_TEMPLATES
                              else qwen_style_tokenizer(template))
    engine = ScriptedEngine(tokenizer, replies)
    tools = concurrent.futures.ThreadPoolExecutor(2)
    config = config or AgentConfig(max_tokens=400, max_turns=4)

    async def go():
        endpoint = ChatEndpoint(engine, tokenizer)
        runner = UserAgentRunner(endpoint, config, "local")
        try:
            env = make_env("dataset", **options)
            schema = tool_schema(env, ChatTokens.from_tokenizer(tokenizer))
            records = await runner.run(environment_agent(env, OWN_TASK, tools, schema), env, OWN_TASK, "r", "ep-own",
                                       7, built_in=True)
            return records, schema
        finally:
            await runner.close()
            await endpoint.close()

    try:
        records, schema = asyncio.run(go())
    finally:
        tools.shutdown()
    return records, tokenizer, schema


QWEN35_TEMPLATE = (TEMPLATES / "qwen3_5.jinja").read_text()
"""Qwen3.5's chat template as TRL ships it (thinking on: the generation prompt opens ``<think>``); tool calls
in the XML layout."""
QWEN35_NOTHINK_TEMPLATE = (TEMPLATES / "qwen3_5_nothink.jinja").read_text()
"""The same with thinking off (the generation prompt holds an empty ``<think>`` block)."""
XML_TEMPLATES = (QWEN35_TEMPLATE, QWEN35_NOTHINK_TEMPLATE)

OWN_TEMPLATES = pytest.mark.parametrize(
    "template", [QWEN_STYLE, QWEN25_TEMPLATE, QWEN3_TEMPLATE, QWEN35_NOTHINK_TEMPLATE],
    ids=["qwen-parts", "qwen2.5", "qwen3", "qwen3.5"])
"""Templates whose tool calls come in ``<tool_call>`` blocks after a ChatML turn's start."""


def calls(template, *called):
    """A reply that makes the calls ``called`` ((name, arguments) each) in ``template``'s layout, as its
    model samples them (Hermes JSON, XML for Qwen3.5's, one bare JSON call for Llama's, key-value lines
    after an empty thinking block for GLM-4.5's, the same on one line for the GLM-4.7-style one, a ``[TOOL_CALLS]`` list with ids of 9 characters for
    Mistral's, ``[TOOL_CALLS]`` before each call for Mistral's later ones, with such ids where the template
    renders them), then ends its turn."""
    if template in MISTRAL_LIST_TEMPLATES:
        listed = [{"name": name, "arguments": arguments, "id": f"call{k:05d}"} for k, (name, arguments) in enumerate(called)]
        return "[TOOL_CALLS] " + json.dumps(listed) + "</s>"
    if template in MISTRAL_TEMPLATES:
        return "".join(f"[TOOL_CALLS]{name}" + (f"[CALL_ID]call{k:05d}" if template == MISTRAL11_TEMPLATE else "")
                       + f"[ARGS]{json.dumps(arguments)}" for k, (name, arguments) in enumerate(called)) + "</s>"
    if template == GLM47_STYLE:  # each call on one line
        return "\n<think></think>" + "".join(
            f"\n<tool_call>{name}" + "".join(f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"
                                             for key, value in arguments.items()) + "</tool_call>"
            for name, arguments in called) + "<|observation|>"
    if template in LLAMA_TEMPLATES:
        ((name, arguments),) = called
        return json.dumps({"name": name, "parameters": arguments}) + "<|eot_id|>"
    if template == GLM45_TEMPLATE:
        lines = ("".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in arguments.items())
                 for _, arguments in called)
        return "\n<think></think>" + "".join(f"\n<tool_call>{name}\n{body}</tool_call>"
                                             for (name, _), body in zip(called, lines, strict=True)) + "<|observation|>"
    if template in XML_TEMPLATES:
        return "\n".join(xml_call(name, **arguments) for name, arguments in called) + "<|im_end|>"
    return "\n".join(f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
                     for name, arguments in called) + "<|im_end|>"


def python(code):
    return ("python", {"code": code})


def final(template, text):
    """A final reply ``text`` that ends its turn as ``template``'s model does."""
    return text + ("<|eot_id|>" if template in LLAMA_TEMPLATES else "<|user|>" if template in (GLM45_TEMPLATE, GLM47_STYLE)
                   else "</s>" if template in MISTRAL_TEMPLATES else "<|im_end|>")


ALL_TEMPLATES = pytest.mark.parametrize(
    "template", [QWEN_STYLE, QWEN25_TEMPLATE, QWEN3_TEMPLATE, QWEN35_NOTHINK_TEMPLATE, GLM45_TEMPLATE, GLM47_STYLE,
                 LLAMA31_TEMPLATE, LLAMA32_TEMPLATE, *MISTRAL_TEMPLATES],
    ids=["qwen-parts", "qwen2.5", "qwen3", "qwen3.5", "glm4.5", "glm4.7-style", "llama3.1", "llama3.2", "mistral",
         "mistral-small3.1", "mistral11", "mistral13"])
"""The templates of :data:`OWN_TEMPLATES`, GLM-4.5's and a GLM-4.7-style one (each call on one line),
Llama 3.1's and 3.2's (which render one call a reply) and Mistral's (its list, as Mistral 7B v0.3's and
Small 3.1's render it; its calls one by one, with ids and without)."""


@OWN_TEMPLATES
def test_a_models_own_format_runs_the_built_in_tool_loop_as_one_trajectory(template):
    """With a tokenizer that lacks this project's tool-call tokens, every request offers the python tool,
    the template renders it into the prompt, a call of it in the template's layout runs in the sandbox (the run's own tool
    functions defined), a call of an unknown tool is answered without a step, and the results come back
    as the template's tool turns: one trajectory, observations masked, the reply scored."""
    from sao.rollout.env_agent import python_tool

    unknown, run = calls(template, ("add", {"a": 2})), calls(template, python("print(price('pen') - 115)"))
    (record,), tokenizer, schema = own_format_episode([unknown, run, "5<|im_end|>"], template=template)
    assert schema == [python_tool(("price(item: str) -> int: The price of one ``item`` in cents; a KeyError for an "
                                   "item the shop does not sell.",))]  # how to call it: signature and docstring
    prompt = tokenizer.decode(list(record.prompt_ids))
    assert prompt.startswith("<|im_start|>system\n") and '{"type": "function", "function": {"name": "python"' in prompt
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert [s.kind for s in record.segments] == ["action", "observation", "action", "observation", "action"]
    observations = [tokenizer.decode(list(record.completion_ids[s.start:s.end])) for s in record.segments
                    if s.kind == "observation"]
    assert observations[0].startswith("\n<|im_start|>user\n<tool_response>\nerror: no tool 'add'")
    assert observations[1].startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                      "<|im_start|>assistant\n")
    assert prompt.endswith(observations[1][observations[1].index("<|im_start|>assistant"):])  # generation prompt
    assert (record.reward, record.termination_reason, record.num_turns) == (1.0, "stop", 3)
    mask = np.asarray(record.action_mask)
    for segment in record.segments:
        assert set(mask[segment.start:segment.end]) == {segment.kind == "action"}


@ALL_TEMPLATES
def test_a_models_own_format_is_replayed_as_the_endpoint_rendered_it(template):
    """Trajectory replay re-runs the environment on the stored replies through the chat template: the
    prompt, each observation's tokens, the reward and the end it finds are the recorded ones; a tool
    description that differs now shows as another prompt."""
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns

    run = calls(template, python("print(2 + 3)"))
    (record,), tokenizer, _ = own_format_episode([run, run, final(template, "5")], template=template)
    row = record.to_row()
    context = ReplayContext(env_options={"dataset": OWN_OPTIONS})
    prompt_check, expected, ended, pending, problems = _simulate(row, OWN_TASK, tokenizer, context, _turns(row["segments"]))
    assert prompt_check.ok and not problems and pending is None
    observed = {i: list(record.completion_ids[s.start:s.end]) for i, s in enumerate(record.segments)
                if s.kind == "observation"}
    assert expected == observed and len(observed) == 2
    assert (ended.reward, ended.termination) == (1.0, "stop")
    edited = {**OWN_OPTIONS, "tools": []}  # the description of the python tool changes: another prompt
    prompt_check, *_ = _simulate(row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": edited}),
                                 _turns(row["segments"]))
    assert prompt_check.ok is False


@ALL_TEMPLATES
def test_a_models_own_format_spends_the_environments_tool_budget(template):
    """Three calls against max_tool_calls 2 end the episode with turns, as the built-in format does."""
    (record,), _, _ = own_format_episode([calls(template, python("print(1)"))] * 3, template=template)
    assert (record.termination_reason, record.reward, record.num_turns) == ("turns", 0.0, 3)


def test_a_single_turn_run_of_a_models_own_offers_no_tools():
    """env.max_tool_calls 0: the prompt renders as before this loop existed (no tools offered)."""
    (record,), tokenizer, schema = own_format_episode(["5<|im_end|>"], options={"max_tool_calls": 0})
    assert schema is None and "Tools:" not in tokenizer.decode(list(record.prompt_ids))
    assert (record.termination_reason, record.reward, record.num_turns) == ("stop", 1.0, 1)


@pytest.mark.parametrize(
    "template", [QWEN_STYLE, QWEN25_TEMPLATE, QWEN3_TEMPLATE, QWEN35_NOTHINK_TEMPLATE, GLM45_TEMPLATE],
    ids=["qwen-parts", "qwen2.5", "qwen3", "qwen3.5", "glm4.5"])
def test_several_calls_in_one_reply_run_in_order_and_replay(template):
    """Two python calls in one reply are two environment steps, answered in order (Qwen2.5's template
    puts both results in one user turn, GLM-4.5's after one <|observation|>); the replay renders the
    same observation."""
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns

    two = calls(template, python("print(2)"), python("print(3)"))
    (record,), tokenizer, _ = own_format_episode([two, final(template, "5")], template=template)
    assert (record.reward, record.termination_reason, record.num_turns) == (1.0, "stop", 2)
    (observation,) = [s for s in record.segments if s.kind == "observation"]
    text = tokenizer.decode(list(record.completion_ids[observation.start:observation.end]))
    assert text.index("<tool_response>\n2\n</tool_response>") < text.index("<tool_response>\n3\n</tool_response>")
    row = record.to_row()
    _, expected, ended, _, problems = _simulate(row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": OWN_OPTIONS}),
                                                _turns(row["segments"]))
    assert not problems and expected == {1: list(record.completion_ids[observation.start:observation.end])}
    assert ended.reward == 1.0


IDS_TEMPLATE = QWEN_STYLE.replace("{{- '<|im_start|>user\n<tool_response>\n' + message.content",
                                  "{{- '<|im_start|>user\n<tool_response id=' + message.tool_call_id + ' name=' "
                                  "+ message.name + '>\n' + message.content")
"""QWEN_STYLE with each tool result naming the call it answers (its id and the function's name), as
templates such as Mistral's do."""


def test_call_ids_are_rendered_again_as_they_were_recorded():
    """A template that prints each result's call id and function name: the ids derive from the episode
    and the call's place, so the replay renders the same observation tokens (a refusal's included)."""
    from sao.rollout.chat_endpoint import call_id
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns

    assert "tool_call_id" in IDS_TEMPLATE  # the replacement took
    unknown = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>'
    run = '<tool_call>\n{"name": "python", "arguments": {"code": "print(5)"}}\n</tool_call><|im_end|>'
    (record,), tokenizer, _ = own_format_episode([unknown, run, "5<|im_end|>"], template=IDS_TEMPLATE)
    observations = [tokenizer.decode(list(record.completion_ids[s.start:s.end])) for s in record.segments
                    if s.kind == "observation"]
    assert f"<tool_response id={call_id('ep-own/1', 0)} name=add>" in observations[0]
    assert f"<tool_response id={call_id('ep-own/2', 0)} name=python>\n5\n" in observations[1]
    row = record.to_row()
    prompt_check, expected, ended, _, problems = _simulate(
        row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": OWN_OPTIONS}), _turns(row["segments"]))
    assert prompt_check.ok and not problems and ended.reward == 1.0
    assert expected == {i: list(record.completion_ids[s.start:s.end]) for i, s in enumerate(record.segments)
                        if s.kind == "observation"}


def test_a_split_episode_in_a_models_own_format_is_not_re_scored_part_by_part():
    """A reply the template renders otherwise than it was sampled (compact JSON) splits the episode; the
    replay of part 0 checks its prompt and says the reward and the end are settled by the parts
    together, and the later part's prompt is not the task's."""
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns, _Unsettled

    compact = '<tool_call>\n{"name":"python","arguments":{"code":"print(5)"}}\n</tool_call><|im_end|>'
    records, tokenizer, _ = own_format_episode([compact, "5<|im_end|>"])
    assert [r.episode_part for r in records] == [0, 1] and records[0].reward == 1.0
    for record in records:
        row = record.to_row()
        with pytest.raises(_Unsettled, match="split") as unsettled:
            _simulate(row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": OWN_OPTIONS}),
                      _turns(row["segments"]))
        assert unsettled.value.prompt.ok is (True if record.episode_part == 0 else None)


def test_text_after_a_models_own_tool_call_is_logged_and_splits_the_episode(caplog):
    """An OpenAI message holds text before its calls only: text after a Hermes call is said in the log,
    and sent back without it, the conversation no longer extends what was sampled (a split)."""
    after = ('<tool_call>\n{"name": "python", "arguments": {"code": "print(5)"}}\n</tool_call>\nand more'
             '<|im_end|>')
    with caplog.at_level("INFO", logger="sao.rollout.chat_endpoint"):
        records, _, _ = own_format_episode([after, "5<|im_end|>"])
    assert "text between or after its tool calls is not in its message" in caplog.text
    assert [r.episode_part for r in records] == [0, 1] and records[0].reward == 1.0


def test_a_reply_that_thinks_before_its_call_is_one_trajectory_with_qwen3s_template():
    """Qwen3 writes its reasoning in <think> before a call; its template renders that part again in the
    turns after the last user message, so the episode stays one trajectory, and the replay agrees."""
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns

    think = ('<think>\nI should add them with the tool.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": '
             '{"code": "print(2 + 3)"}}\n</tool_call><|im_end|>')
    (record,), tokenizer, _ = own_format_episode([think, "<think>\nIt printed 5.\n</think>\n\n5<|im_end|>"],
                                                  template=QWEN3_TEMPLATE)
    assert [s.kind for s in record.segments] == ["action", "observation", "action"]
    row = record.to_row()
    prompt_check, expected, ended, _, problems = _simulate(
        row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": OWN_OPTIONS}), _turns(row["segments"]))
    assert prompt_check.ok and not problems and list(expected) == [1]
    assert ended.termination == "stop" and ended.reward == record.reward == 0.0  # the reply with its thinking
    # is what the reward functions score: exact_match finds more than "5" there


def test_a_reply_that_thinks_before_its_xml_call_is_one_trajectory_with_qwen35s_template():
    """Qwen3.5's generation prompt opens <think>; the reply closes it, then calls in the XML layout. The
    template renders that reasoning again after the last user message, so the episode stays one
    trajectory, and the replay agrees."""
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns

    think = "I should add them with the tool.\n</think>\n\n" + calls(QWEN35_TEMPLATE, python("print(2 + 3)"))
    (record,), tokenizer, _ = own_format_episode([think, "It printed 5.\n</think>\n\n5<|im_end|>"],
                                                  template=QWEN35_TEMPLATE)
    assert tokenizer.decode(list(record.prompt_ids)).endswith("<|im_start|>assistant\n<think>\n")
    assert [s.kind for s in record.segments] == ["action", "observation", "action"]
    row = record.to_row()
    prompt_check, expected, ended, _, problems = _simulate(
        row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": OWN_OPTIONS}), _turns(row["segments"]))
    assert prompt_check.ok and not problems and list(expected) == [1]
    assert ended.termination == "stop" and ended.reward == record.reward


def assert_replayed(record, tokenizer):
    """Trajectory replay of a one-part episode of OWN_TASK renders its prompt and its observations as
    recorded, and finds its reward."""
    from sao.train.run_config import ReplayContext
    from sao.train.trajectory_replay import _simulate, _turns

    row = record.to_row()
    prompt_check, expected, ended, _, problems = _simulate(
        row, OWN_TASK, tokenizer, ReplayContext(env_options={"dataset": OWN_OPTIONS}), _turns(row["segments"]))
    assert prompt_check.ok and not problems and ended.reward == record.reward
    assert expected == {i: list(record.completion_ids[s.start:s.end]) for i, s in enumerate(record.segments)
                        if s.kind == "observation"}


def unknown_then(template, run):
    """OWN_TASK's episode in ``template``'s layout: a call of an unknown tool, then the reply ``run``, then
    the final reply "5", in one trajectory that scores 1 (checked), its observations replayed as
    recorded. Returns (its prompt as text, each observation's ids, the tokenizer)."""
    (record,), tokenizer, _ = own_format_episode([calls(template, ("add", {"a": 2})), run, final(template, "5")],
                                                 template=template)
    assert [s.kind for s in record.segments] == ["action", "observation", "action", "observation", "action"]
    assert (record.reward, record.termination_reason, record.num_turns) == (1.0, "stop", 3)
    second = record.segments[2]
    assert tokenizer.decode(list(record.completion_ids[second.start:second.end])) == run  # as sampled
    assert_replayed(record, tokenizer)
    observations = [list(record.completion_ids[s.start:s.end]) for s in record.segments if s.kind == "observation"]
    return tokenizer.decode(list(record.prompt_ids)), observations, tokenizer


def test_llama_32s_bare_json_calls_run_the_built_in_tool_loop_as_one_trajectory():
    """Llama 3.2's template writes the tools into the first user turn and renders a call as one bare JSON
    object with ``parameters``, each result as a JSON string in an ``ipython`` turn: an unknown tool is
    answered without a step, the python call runs, and the reply is scored, in one trajectory. A result
    that prints a quote, the end-of-turn token and a newline is encoded as the text of its JSON string,
    escapes and all (no forged turn), and the replay renders the same observations."""
    run = calls(LLAMA32_TEMPLATE, python("print('\"<|eot_id|>\\n' + str(price('pen') - 115))"))
    prompt, observations, tokenizer = unknown_then(LLAMA32_TEMPLATE, run)
    assert "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions" in prompt
    assert '"name": "python"' in prompt and prompt.endswith("What is 2 + 3?<|eot_id|><|start_header_id|>assistant"
                                                           "<|end_header_id|>\n\n")
    texts = [tokenizer.decode(ids) for ids in observations]
    assert texts[0].startswith('<|start_header_id|>ipython<|end_header_id|>\n\n"error: no tool \'add\'')
    assert texts[1] == ('<|start_header_id|>ipython<|end_header_id|>\n\n"\\"<|eot_id|>\\n5"<|eot_id|>'
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert observations[1].count(eot) == 1  # the template's own end of the turn; the printed one is text


def test_two_bare_json_calls_in_one_reply_are_a_final_reply():
    """Llama 3.2's template renders one call a reply; two JSON objects in one reply are no call of the
    layout: the reply is the episode's final reply, scored as text."""
    two = (json.dumps({"name": "python", "parameters": {"code": "print(5)"}}) + "; "
           + json.dumps({"name": "python", "parameters": {"code": "print(6)"}}) + "<|eot_id|>")
    (record,), _, _ = own_format_episode([two], template=LLAMA32_TEMPLATE)
    assert [s.kind for s in record.segments] == ["action"]
    assert (record.termination_reason, record.reward, record.num_turns) == ("stop", 0.0, 1)


def test_glm_45s_calls_run_the_built_in_tool_loop_as_one_trajectory():
    """GLM-4.5's template writes the tools into a system turn, opens each reply with a thinking block and
    renders a call as its name and key-value lines; a turn that calls ends at <|observation|>, which
    its model's generation config stops at. An unknown tool is answered without a step, the python call
    runs (a value that prints the closing tag stays whole), and the reply is scored: one trajectory,
    and the replay renders the same observations."""
    run = calls(GLM45_TEMPLATE, python("print('</arg_value>' + str(price('pen') - 115))"))
    prompt, observations, tokenizer = unknown_then(GLM45_TEMPLATE, run)
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools") and '"name": "python"' in prompt
    assert prompt.endswith("<|user|>\nWhat is 2 + 3?<|assistant|>")
    texts = [tokenizer.decode(ids) for ids in observations]
    assert texts[1] == "\n<tool_response>\n</arg_value>5\n</tool_response><|assistant|>"
    assert texts[0].startswith("\n<tool_response>\nerror: no tool 'add'")


def test_a_call_without_arguments_in_glm_47s_layout_is_answered_and_the_episode_goes_on():
    """GLM-4.7's layout writes a call without arguments as its name alone in the tags: the built-in loop
    reads it as a call of python without code, answers it without a step, and the episode goes on as
    one trajectory."""
    bare = "\n<think></think>\n<tool_call>python</tool_call><|observation|>"
    run = calls(GLM47_STYLE, python("print(price('pen') - 115)"))
    (record,), tokenizer, _ = own_format_episode([bare, run, final(GLM47_STYLE, "5")], template=GLM47_STYLE)
    assert [s.kind for s in record.segments] == ["action", "observation", "action", "observation", "action"]
    first = record.segments[1]
    assert tokenizer.decode(list(record.completion_ids[first.start:first.end])).startswith(
        "\n<tool_response>\nerror: no tool 'python' with these arguments")
    assert (record.reward, record.termination_reason, record.num_turns) == (1.0, "stop", 3)
    assert_replayed(record, tokenizer)


def test_mistrals_calls_run_the_built_in_tool_loop_as_one_trajectory():
    """Mistral's template writes the tools before the user's turn and renders a call as a ``[TOOL_CALLS]``
    list with its id, each result naming that id: the ids the model wrote are the calls' ids, so the
    conversation renders as it was sampled. An unknown tool is answered without a step, two python calls
    in one reply run in order (a result that prints the closing tag is text), and the reply is scored:
    one trajectory, and the replay renders the same observations."""
    two = calls(MISTRAL_TEMPLATE, python("print(2)"), python("print('[/TOOL_RESULTS]' + str(price('pen') - 115))"))
    prompt, observations, tokenizer = unknown_then(MISTRAL_TEMPLATE, two)
    assert prompt.startswith("<s>[AVAILABLE_TOOLS] [") and '"name": "python"' in prompt
    assert prompt.endswith("What is 2 + 3?[/INST]")
    texts = [tokenizer.decode(ids) for ids in observations]
    assert texts[0].startswith('[TOOL_RESULTS] {"content": error: no tool \'add\'')
    assert texts[0].endswith(', "call_id": "call00000"}[/TOOL_RESULTS]')
    assert texts[1] == ('[TOOL_RESULTS] {"content": 2, "call_id": "call00000"}[/TOOL_RESULTS][TOOL_RESULTS] '
                        '{"content": [/TOOL_RESULTS]5, "call_id": "call00001"}[/TOOL_RESULTS]')
    closing = tokenizer.convert_tokens_to_ids("[/TOOL_RESULTS]")
    assert observations[1].count(closing) == 2  # the template's own; the printed one is text


@pytest.mark.parametrize("template", [MISTRAL11_TEMPLATE, MISTRAL13_TEMPLATE], ids=["mistral11", "mistral13"])
def test_mistrals_calls_one_by_one_run_the_built_in_tool_loop_as_one_trajectory(template):
    """Mistral's later templates write a system prompt that reads the date and the tools after it, and
    render each call after ``[TOOL_CALLS]``, its id before ``[ARGS]`` or none, each result after its
    call's id or alone: an unknown tool is answered without a step, two python calls in one reply run
    in order (a result that prints the closing tag is text), and the reply is scored: one trajectory,
    and the replay renders the same observations."""
    from sao.models.chat import TEMPLATE_CLOCK

    two = calls(template, python("print(2)"), python("print('[/TOOL_RESULTS]' + str(price('pen') - 115))"))
    prompt, observations, tokenizer = unknown_then(template, two)
    assert prompt.startswith(f"<s>[SYSTEM_PROMPT]You are a helpful assistant. Today is {TEMPLATE_CLOCK:%Y-%m-%d}."
                             "[/SYSTEM_PROMPT][AVAILABLE_TOOLS]") and '"name": "python"' in prompt
    assert prompt.endswith("[INST]What is 2 + 3?[/INST]")
    texts = [tokenizer.decode(ids) for ids in observations]
    ids = ("call00000[TOOL_CONTENT]", "call00001[TOOL_CONTENT]") if template == MISTRAL11_TEMPLATE else ("", "")
    assert texts[0].startswith(f"[TOOL_RESULTS]{ids[0]}error: no tool 'add'") and texts[0].endswith("[/TOOL_RESULTS]")
    assert texts[1] == f"[TOOL_RESULTS]{ids[0]}2[/TOOL_RESULTS][TOOL_RESULTS]{ids[1]}[/TOOL_RESULTS]5[/TOOL_RESULTS]"
    closing = tokenizer.convert_tokens_to_ids("[/TOOL_RESULTS]")
    assert observations[1].count(closing) == 2  # the template's own; the printed one is text


@pytest.mark.parametrize("template", [MISTRAL11_TEMPLATE, MISTRAL13_TEMPLATE], ids=["mistral11", "mistral13"])
def test_text_before_mistrals_calls_one_by_one_stays_in_the_trajectory(template, caplog):
    """Mistral's later templates render a message's text right before its calls: a reply that says
    something, then calls, renders as sampled (one trajectory, nothing logged); in version 11's, a call
    without the id its template renders gets one the model did not sample, and the episode splits."""
    from sao.rollout.chat_endpoint import call_id

    run = "Let me check. " + calls(template, python("print(5)"))
    with caplog.at_level("INFO", logger="sao.rollout.chat_endpoint"):
        (record,), tokenizer, _ = own_format_episode([run, final(template, "5")], template=template)
    assert [s.kind for s in record.segments] == ["action", "observation", "action"] and record.reward == 1.0
    assert tokenizer.decode(list(record.completion_ids[:record.segments[0].end])) == run
    assert not [r for r in caplog.records if "splits" in r.getMessage()]
    bare = '[TOOL_CALLS]python[ARGS]{"code": "print(5)"}</s>'
    records, tokenizer, _ = own_format_episode([bare, final(template, "5")], template=template)
    if template == MISTRAL13_TEMPLATE:  # renders no ids: as sampled
        assert [r.episode_part for r in records] == [0]
        return
    assert [r.episode_part for r in records] == [0, 1] and records[0].reward == 1.0
    second = tokenizer.decode(list(records[1].prompt_ids))
    assert f'[TOOL_CALLS]python[CALL_ID]{call_id("ep-own/1", 0)[-9:]}[ARGS]{{"code": "print(5)"}}</s>' in second


def test_a_mistral_call_without_a_written_id_gets_one_and_splits_the_episode():
    """A call whose model wrote no id (or one its template would not render as written) gets the last 9
    characters of the derived id, which the template renders and the model did not sample: the episode goes on in a
    second part, the result naming that id."""
    from sao.rollout.chat_endpoint import call_id

    bare = '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(5)"}}]</s>'
    records, tokenizer, _ = own_format_episode([bare, final(MISTRAL_TEMPLATE, "5")], template=MISTRAL_TEMPLATE)
    assert [r.episode_part for r in records] == [0, 1] and records[0].reward == 1.0
    second = tokenizer.decode(list(records[1].prompt_ids))
    assert f', "id": "{call_id("ep-own/1", 0)[-9:]}"}}]</s>[TOOL_RESULTS] {{"content": 5, "call_id"' in second


def test_a_bare_json_call_after_the_python_tag_runs_and_splits_the_episode():
    """Llama 3.1's models may open a call with <|python_tag|>; it is read as the call it is, and the
    template renders the call back without the tag, so the episode goes on in a second part."""
    tagged = '<|python_tag|>{"name": "python", "parameters": {"code": "print(5)"}}<|eot_id|>'
    records, tokenizer, _ = own_format_episode([tagged, final(LLAMA31_TEMPLATE, "5")], template=LLAMA31_TEMPLATE)
    assert [r.episode_part for r in records] == [0, 1] and records[0].reward == 1.0
    assert '"5"' in tokenizer.decode(list(records[1].prompt_ids))  # the tool's output, in the second part's prompt
