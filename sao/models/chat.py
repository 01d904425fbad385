"""The conversation format as token ids: what the agent loop, the SFT and the evaluator share.

A trajectory is ``prompt | action | observation | action | ... | action``:

    prompt       <|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n      (chat template)
    action       <tool_call>{code}</tool_call>                     sampled; ends at a stop id
    observation  <|im_end|>\\n<|im_start|>tool\\n<tool_response>{output}</tool_response><|im_end|>\\n
                 <|im_start|>assistant\\n                                        inserted, action_mask 0
    action       <answer>{number}</answer>                           sampled; the natural end

An action segment ends when the policy samples one of :attr:`ChatTokens.stop_token_ids`:
``</tool_call>`` (a tool call: the environment answers with an observation), ``</answer>`` (a final
answer: the episode is over) or ``<|im_end|>`` (the turn, and the episode, is over). The observation
closes the assistant turn itself (the ``<|im_end|>`` after ``</tool_call>`` is inserted, never
sampled), so the concatenation of the segments equals the chat template's rendering of the same
conversation, token for token (tested), up to the ``<|im_end|>`` that would follow a final answer.

Why the answer tag stops generation: the episode's outcome is decided once ``</answer>`` is sampled, so
nothing after it can change the reward. Measured in RL runs without it: a policy that answered
correctly then failed to sample ``<|im_end|>`` and ran to the token budget got reward 0, and the
negative advantages on such long tails fed back into longer tails (reward collapsed from 0.7 to 0.2 in
a few steps at policy lr 3e-4-4e-4). Demonstrations still end with ``</answer><|im_end|>``.

Tool output is encoded with special tokens split into ordinary text, so a program that prints
``<|im_end|>`` cannot forge a turn boundary.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # transformers is only needed by callers that hold a tokenizer
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
ANSWER_START, ANSWER_END = "<answer>", "</answer>"
THINK_END = "</think>"
"""Where a reply's reasoning ends in the templates that open it with ``<think>`` (Qwen3, GLM-4.5 and others)."""
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
"""The token before a reply's calls in Mistral's layouts (:func:`template_tool_calls`): before its list,
or before each call."""
MISTRAL_ARGS, MISTRAL_CALL_ID = "[ARGS]", "[CALL_ID]"
"""The tokens before a call's arguments and before its id in Mistral's per-call layout (:func:`template_tool_calls`)."""
MISTRAL_THINK, MISTRAL_THINK_END = "[THINK]", "[/THINK]"
"""Where a reply's reasoning begins and ends in Mistral's reasoning models (Magistral's, Ministral 3's): its
calls come after."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Tokens that end an assistant turn in common chat templates (ChatML, Llama 3, Phi, Gemma, GPT-2)."""
# Every special token of the format; the order fixes the ids of our tokenizer (0 .. len - 1).
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    IM_START,
    IM_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
    ANSWER_START,
    ANSWER_END,
)

__all__ = [
    "END_OF_TURN_TOKENS",
    "SPECIAL_TOKENS",
    "ChatTokens",
    "FinalAnswer",
    "Message",
    "Reply",
    "ToolCall",
    "TEMPLATE_CLOCK",
    "action_text",
    "apply_template",
    "bare_json_calls",
    "bare_name_calls",
    "generation_end_ids",
    "observation_ids",
    "observation_text",
    "outside_tool_calls",
    "parse_action",
    "parse_chat",
    "prompt_ids",
    "renders_tool_calls",
    "template_tool_calls",
    "tool_call_layout",
    "tool_call_message",
    "tool_calls_problem",
    "without_turn_end",
]

Message = dict[str, Any]  # a Hugging Face chat message: {"role", "content", optional "tool_calls"}

TEMPLATE_CLOCK = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
"""The time a chat template is told when it reads the clock (``strftime_now``, as the templates of
Llama 3.2 and later do for the "Today Date" of their system turn): fixed, so that a conversation
renders the same tokens on any day. A multi-turn episode that runs past midnight does not split, a
resumed run renders its prompts as it began them, evaluation renders the same held-out prompts every
day, and ``sao replay --trajectory`` re-renders the stored prompt. Trajectories stored since it was
set were rendered with it: changing it makes their replays report another prompt (one of a template
that reads the clock stored before it, with that day's date, reports another prompt too)."""


def _template_strftime(format: str) -> str:
    return TEMPLATE_CLOCK.strftime(format)


def apply_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], **options: Any) -> Any:
    """``tokenizer.apply_chat_template(messages, **options)`` with the template's clock at
    :data:`TEMPLATE_CLOCK`: every rendering of a conversation in this project goes through here."""
    return tokenizer.apply_chat_template(list(messages), strftime_now=_template_strftime, **options)


@dataclasses.dataclass(frozen=True)
class ChatTokens:
    """The special token ids of a tokenizer that follows this format.

    A tokenizer with every token of the format (ours) gets tool calls and answers; any other (a model
    of the user's own) gets the plain format: an action ends at the end of the assistant's turn, and
    tool calls and answer tags are plain text (:attr:`supports_tools` is False).

    Attributes:
        pad_id: padding (``<|endoftext|>``; plain format: the tokenizer's pad token, else its EOS),
            never sampled on purpose.
        im_start_id / im_end_id: turn delimiters; ``im_end_id`` is the natural end of an episode.
        tool_call_start_id / tool_call_end_id: around the code of a tool call; the end is a stop id.
        tool_response_start_id / tool_response_end_id: around a tool's output in an observation.
        answer_start_id / answer_end_id: around a final answer.
        end_ids: plain format only: the ids that end the assistant's turn (the tokenizer's EOS, the
            end-of-turn tokens it has: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ..., and the
            ids its model's ``generation_config.json`` ends generation at: :func:`generation_end_ids`).
    """

    pad_id: int
    im_start_id: int | None
    im_end_id: int | None
    tool_call_start_id: int | None = None
    tool_call_end_id: int | None = None
    tool_response_start_id: int | None = None
    tool_response_end_id: int | None = None
    answer_start_id: int | None = None
    answer_end_id: int | None = None
    end_ids: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> ChatTokens:
        """Resolve the ids: this format's when the tokenizer has every token of it, else the plain
        format; raises ``ValueError`` when the tokenizer has no token that could end a turn."""
        names = {
            "pad_id": PAD_TOKEN,
            "im_start_id": IM_START,
            "im_end_id": IM_END,
            "tool_call_start_id": TOOL_CALL_START,
            "tool_call_end_id": TOOL_CALL_END,
            "tool_response_start_id": TOOL_RESPONSE_START,
            "tool_response_end_id": TOOL_RESPONSE_END,
            "answer_start_id": ANSWER_START,
            "answer_end_id": ANSWER_END,
        }
        vocab = tokenizer.get_vocab()
        if all(token in vocab for token in names.values()):
            return cls(**{field: vocab[token] for field, token in names.items()})
        ends = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ends += [vocab[token] for token in END_OF_TURN_TOKENS if token in vocab]
        ends += generation_end_ids(tokenizer)
        ends = list(dict.fromkeys(int(i) for i in ends))
        if not ends:
            raise ValueError("the tokenizer has no EOS token and none of the end-of-turn tokens "
                             f"{list(END_OF_TURN_TOKENS)}: nothing could end an action")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
        return cls(pad_id=int(pad), im_start_id=vocab.get(IM_START), im_end_id=vocab.get(IM_END), end_ids=tuple(ends))

    @property
    def supports_tools(self) -> bool:
        """Whether actions can call the Python tool in this project's format (the tokenizer has its
        tokens; a model of one's own may call it in its own format: :func:`renders_tool_calls`)."""
        return self.tool_call_end_id is not None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an action segment: ``</tool_call>`` (tool call), ``<|im_end|>`` (end of turn)
        and ``</answer>`` (final answer; see the module docstring); in the plain format, the end of
        the assistant's turn (:attr:`end_ids`)."""
        if not self.supports_tools:
            return self.end_ids
        return (self.tool_call_end_id, self.im_end_id, self.answer_end_id)


def generation_end_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids ``generation_config.json`` in the tokenizer's directory ends generation at (its
    ``eos_token_id``, one id or a list); [] without one. Some models end a turn at an id that only this
    file names: Llama 3.1's ``<|eom_id|>``, GLM-4's ``<|user|>`` and ``<|observation|>``; neither engine
    stops at the model's EOS unless it is a stop id (vLLM runs with ``ignore_eos``), so without them such
    a reply runs on to the token budget. Only ids of the tokenizer's special tokens count: a model saved
    from a default configuration can name an id (Llama's default 2) that is an ordinary token of its
    tokenizer. A policy directory this project writes keeps them (:func:`sao.models.policy.save_policy`
    writes the stop ids as its ``eos_token_id``).

    Raises:
        ValueError: the file is not JSON, or its ``eos_token_id`` is not an id or a list of ids.
    """
    folder = getattr(tokenizer, "name_or_path", "") or ""
    path = Path(folder) / "generation_config.json"
    if not folder or not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not a JSON generation config ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON generation config (a {type(data).__name__}, not an object)")
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    try:
        added = tokenizer.added_tokens_decoder
    except (AttributeError, NotImplementedError):  # a tokenizer class without the table
        added = {}
    special = {i for i, token in added.items() if token.special} | set(tokenizer.all_special_ids)
    return [i for i in ids if i in special]


class ToolCall(NamedTuple):
    """The action asked the Python tool to run ``code``."""

    code: str


class FinalAnswer(NamedTuple):
    """The action gave a final answer ``<answer>...</answer>`` (``answer`` stripped of whitespace)."""

    answer: str


class Reply(NamedTuple):
    """The action ended the turn with plain text (no complete tool call, no answer tags)."""

    text: str


_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_ANSWER = re.compile(re.escape(ANSWER_START) + r"(.*?)" + re.escape(ANSWER_END), re.DOTALL)


def without_turn_end(text: str, ids: Sequence[int], ends: Collection[int],
                     tokenizer: PreTrainedTokenizerBase) -> str:
    """``text`` (sampled ``ids`` decoded with special tokens kept) less its last token when that is one
    of ``ends``: the end of the turn is no part of the reply (what the chat endpoint answers, and what
    the evaluation scores)."""
    if ids and ids[-1] in ends:
        return text[: len(text) - len(tokenizer.decode([ids[-1]], skip_special_tokens=False))]
    return text


def template_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None, *, layout: str | None = None,
                        bare_names: bool = False) -> tuple[str, list[dict[str, Any]]] | None:
    """The tool calls of a reply in a layout that models' own chat templates render calls in. ``layout``
    is :func:`tool_call_layout`'s for the template: three layouts are read only where the template
    renders calls so, as vLLM reads each only with its model's parser:

    - "mistral": **Mistral's list**, as the templates of Mistral 7B Instruct v0.3 and Mistral Small 3.1
      write it: text, then ``[TOOL_CALLS]`` and one JSON list of ``{"name": ..., "arguments": {...},
      "id": ...}`` objects, then nothing (the template renders a call's id, 9 letters and digits, which
      the model writes too: an ``"id"`` it wrote is kept in the call, an ``"id"`` key beside ``name``
      and ``arguments``; vLLM's ``mistral`` parser reads the list so);
    - "mistral_args": **Mistral's calls one by one**, as the templates of its tokenizers from version 11
      on write them (version 11 with ids: Devstral Small 1.1's and others'; version 13 without: Ministral
      3's, Devstral 2's): text, then for each call ``[TOOL_CALLS]NAME[ARGS]{...}``, or
      ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` with the id the model wrote (kept in the call as
      ``"id"``), then nothing; the text before the first call is kept as it is (those templates render
      it right before the calls); whitespace around the names, ids and arguments is read (a template
      renders none: the episode splits there); vLLM's ``mistral`` parser reads such calls from a
      tokenizer of version 11 on as a name, ``[ARGS]`` and the arguments (an id the model wrote stays in
      its name there);
    - "bare_json": one **bare JSON** call
      that is the whole reply, ``{"name": ..., "parameters": {...}}``, as the templates of Llama 3.1, 3.2
      and 3.3 write one (``"arguments"`` is read as well, and a ``<|python_tag|>`` before it, as vLLM's
      ``llama3_json`` parser reads them: the templates render the call back without the tag, so the
      episode splits there; no other key, and nothing but whitespace around it; those templates render
      one call a reply).

    In both of Mistral's layouts the calls begin at the first ``[TOOL_CALLS]`` from which whole calls
    run to the end of the reply, outside its reasoning (a ``[TOOL_CALLS]`` in a ``[THINK]`` block that
    has not ended before it is text; a ``[/THINK]`` in a call's arguments is theirs).

    With any other layout (None, "tagged"), the calls are each a ``<tool_call>...</tool_call>`` block
    after optional text, holding either

    - **Hermes JSON**, as the templates of Qwen2.5, Qwen3, Hermes and others write it:
      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (whitespace around the JSON);
    - **XML**, as the templates of Qwen3.5 and later, Qwen3-Coder and Nemotron 3 write it:
      ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``, with a
      newline after each opening tag and before ``</parameter>`` (whitespace between the elements; a
      value ends at the ``</parameter>`` that the next parameter or ``</function>`` follows, so code
      that prints the tag stays in the value). A value is text; it takes the type the offered tool's
      schema gives its parameter (``tools``, OpenAI's function format), much as vLLM's ``qwen3_coder``
      parser converts it: a JSON number for integer or number, ``true`` / ``false`` (or the ``True`` /
      ``False`` a template writes) for boolean, ``null`` (or ``None``) for null, JSON for object or
      array; it stays text where it does not convert or no schema says; or
    - **GLM-4.5's** key-value lines, as its template writes them:
      ``<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call>`` (the
      name on the block's first line, the newline after it optional before a first key, as vLLM's
      ``glm47`` parser reads GLM-4.7's; a block that holds a word alone is text, unless ``bare_names``
      (a template that renders a call without arguments so, as GLM-4.7's does:
      :func:`bare_name_calls`), the word names an offered tool and the block comes after the reply's
      reasoning (its last ``</think>``): a call of that tool without arguments, as vLLM's ``glm47``
      parser reads one (it drops a word that names no offered tool, which stays text here);
      a value ends at the
      ``</arg_value>`` that the next key or the block's end follows), each value typed by the tool's
      schema as an XML value is (the template writes a string as it is and anything else as JSON), as
      vLLM's ``glm45`` parser reads it.

    Only blocks that begin as a call of one of these layouts count (``<tool_call>`` named in a reply's
    reasoning is text). Returns the text before the first call (the newlines that end it stripped:
    templates put them between the text and the first call; in Mistral's layouts the text as it is, or
    less its trailing whitespace before a list) and the calls as ``{"name", "arguments"}``;
    None when the text holds no call, or a block is not a whole call (the reply is then plain text, as
    vLLM's parsers leave it)."""
    if layout == "mistral":
        return _mistral_calls(text)
    if layout == "mistral_args":
        return _mistral_args_calls(text)
    call = _json_call(text) if layout == "bare_json" else None
    if call is not None:  # the whole reply (a <tool_call> inside its strings is its own)
        return "", [call]
    offered = {name for name in (_offered_name(tool) for tool in tools or ()) if name} if bare_names else set()
    reasoned = text.rfind(THINK_END) if bare_names else -1  # a word alone before the reasoning's end is prose
    first, calls = None, []
    for block in (_TEMPLATE_CALL_OR_NAME if bare_names else _TEMPLATE_CALL).finditer(text):
        body = block.group(1)
        if _TEMPLATE_CALL.fullmatch(block.group(0)) is None:  # a word alone (bare_names): a call of an offered tool
            if body.strip() not in offered or block.start() < reasoned:
                continue
            call = {"name": body.strip(), "arguments": {}}
        else:
            start = body.lstrip()
            call = (_hermes_call(body) if start.startswith("{") else _xml_call(body, tools) if start.startswith("<function=")
                    else _glm_call(body, tools))
            if call is None:
                return None
        first = block.start() if first is None else first
        calls.append(call)
    return (text[:first].rstrip("\n"), calls) if calls else None


def _mistral_starts(text: str) -> Iterator[int]:
    """Where the calls of a reply in Mistral's layouts may begin: each ``[TOOL_CALLS]`` of ``text`` that no
    ``[THINK]`` block still open before it holds (:func:`template_tool_calls`)."""
    at = text.find(MISTRAL_TOOL_CALLS)
    while at >= 0:
        if text.count(MISTRAL_THINK, 0, at) <= text.count(MISTRAL_THINK_END, 0, at):
            yield at
        at = text.find(MISTRAL_TOOL_CALLS, at + len(MISTRAL_TOOL_CALLS))


def _mistral_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """``text`` as a reply in Mistral's list layout (:func:`template_tool_calls`), else None."""
    for at in _mistral_starts(text):
        calls = _mistral_list(text[at + len(MISTRAL_TOOL_CALLS):])
        if calls is not None:
            return text[:at].rstrip(), calls
    return None


def _mistral_list(text: str) -> list[dict[str, Any]] | None:
    """``text`` (what follows ``[TOOL_CALLS]``) as a JSON list of Mistral's calls and nothing else, else None."""
    try:
        listed = json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's depth
        return None
    if not isinstance(listed, list) or not listed:
        return None
    calls = []
    for item in listed:
        if not (isinstance(item, dict) and set(item) <= {"name", "arguments", "id"} and isinstance(item.get("name"), str)
                and item["name"] and isinstance(item.get("arguments", {}), dict) and isinstance(item.get("id", ""), str)):
            return None
        calls.append({"name": item["name"], "arguments": item.get("arguments", {})}
                     | ({"id": item["id"]} if "id" in item else {}))
    return calls


def _mistral_args_span(text: str, at: int) -> tuple[list[dict[str, Any]], int] | None:
    """The calls in Mistral's per-call layout that begin at ``at`` of ``text``, one after another (whitespace
    between them), and where the last one ends; None when no whole call begins there."""
    calls: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    while (start := _MISTRAL_CALL.match(text, at)) is not None:
        try:
            arguments, end = decoder.raw_decode(text, start.end())
        except (ValueError, RecursionError):  # not JSON, cut off, or nested past the parser's depth
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append({"name": start.group(1), "arguments": arguments}
                     | ({"id": start.group(2)} if start.group(2) is not None else {}))
        at = len(text) - len(text[end:].lstrip())
    return (calls, len(text[:at].rstrip())) if calls else None


def _mistral_args_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """``text`` as a reply in Mistral's per-call layout (:func:`template_tool_calls`), else None."""
    for at in _mistral_starts(text):
        read = _mistral_args_span(text, at)
        if read is not None and not text[read[1]:].strip():
            return text[:at], read[0]
    return None


def _hermes_call(block: str) -> dict[str, Any] | None:
    try:
        call = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments", {}), dict)):
        return None
    return {"name": call["name"], "arguments": call.get("arguments", {})}


_GLM_NAME = re.compile(r"[ \t]*([A-Za-z_][\w.\-]*)(?:[ \t]*\n\s*(?=<arg_key>|\Z)|\s*(?=<arg_key>))")
"""A call in GLM-4.5's layout begins with the function's name on the block's first line (GLM-4.7's
writes the first ``<arg_key>`` on that line)."""
_ARGUMENT = re.compile(r"\s*<arg_key>([^<>\n]+)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*(?=<arg_key>|\Z)", re.DOTALL)


def _glm_call(block: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
    name = _GLM_NAME.match(block)
    if name is None:
        return None
    arguments = _pairs(_ARGUMENT, block, name.end(), _parameter_schema(name.group(1), tools))
    return {"name": name.group(1), "arguments": arguments} if arguments is not None else None


def _pairs(pattern: re.Pattern[str], text: str, start: int, schema: Mapping[str, Any]) -> dict[str, Any] | None:
    """The key-value pairs ``pattern`` finds one after another in ``text`` from ``start`` to its end
    (whitespace around them), each value typed by ``schema`` (:func:`_typed`); None where anything else
    stands between or after them (not this layout)."""
    pairs: dict[str, Any] = {}
    position = start
    for pair in pattern.finditer(text, position):
        if pair.start() != position:
            return None
        position = pair.end()
        pairs[pair.group(1)] = _typed(pair.group(2), schema.get(pair.group(1)))
    return pairs if not text[position:].strip() else None


def _json_call(text: str) -> dict[str, Any] | None:
    """``text`` as one bare JSON call (:func:`template_tool_calls`), else None."""
    body = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return None
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
        return None
    keys = set(call) - {"name"}
    if len(keys) != 1 or not keys <= {"parameters", "arguments"} or not isinstance(call[keys.pop()], dict):
        return None
    return {"name": call["name"], "arguments": call.get("parameters", call.get("arguments"))}


_NAME = r"[A-Za-z_][\w.\-]*"
_MISTRAL_CALL = re.compile(re.escape(MISTRAL_TOOL_CALLS) + rf"\s*({_NAME})\s*(?:" + re.escape(MISTRAL_CALL_ID)
                           + r"\s*([^\[\]\s]*)\s*)?" + re.escape(MISTRAL_ARGS) + r"\s*")
"""A call's start in Mistral's per-call layout: ``[TOOL_CALLS]``, its name, an id and ``[ARGS]``."""
_CALL_BEGINS = (r"\s*(?:\{|<function=)|[ \t]*" + _NAME + r"(?:[ \t]*\n\s*" + re.escape(TOOL_CALL_END)
                + r"|\s*<arg_key>)")
_TEMPLATE_CALL = re.compile(re.escape(TOOL_CALL_START) + f"(?={_CALL_BEGINS})(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
"""A ``<tool_call>`` block that begins as a call of one of the layouts :func:`template_tool_calls` reads."""
_TEMPLATE_CALL_OR_NAME = re.compile(re.escape(TOOL_CALL_START) + rf"(?={_CALL_BEGINS}|\s*{_NAME}\s*"
                                    + re.escape(TOOL_CALL_END) + ")(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
"""The same, or a block that holds a word alone (:func:`template_tool_calls`' ``bare_names``)."""
_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>\n?(.*?)\n?</parameter>\s*(?=<parameter=|\Z)", re.DOTALL)
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _xml_call(block: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
    function = _FUNCTION.fullmatch(block)
    if function is None:
        return None
    name, body = function.group(1), function.group(2)
    arguments = _pairs(_PARAMETER, body, 0, _parameter_schema(name, tools))
    return {"name": name, "arguments": arguments} if arguments is not None else None


def _offered_name(tool: Any) -> str | None:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


def _parameter_schema(name: str, tools: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any]:
    """The ``properties`` of the offered tool ``name``'s parameters ({} when it is not offered)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            return properties if isinstance(properties, Mapping) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """An XML parameter's text as the type ``schema`` gives it (text when it is a string, unknown, or
    the text does not convert)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)]
    if not kinds or "string" in kinds:
        return value
    word = value.strip()
    if "null" in kinds and word in ("null", "None"):
        return None
    if "boolean" in kinds and word in ("true", "false", "True", "False"):
        return word.lower() == "true"
    number = _JSON_NUMBER.fullmatch(word)
    if number is not None and ("integer" in kinds or "number" in kinds):
        if not number.group(1) and not number.group(2):
            return int(word)
        if "number" in kinds and math.isfinite(float(word)):  # 1e999 is no finite JSON number
            return float(word)
    wanted = tuple(python for kind, python in (("object", dict), ("array", list)) if kind in kinds)
    if wanted:
        try:
            parsed = json.loads(word)
        except (ValueError, RecursionError):
            return value
        if isinstance(parsed, wanted):
            return parsed
    return value


def renders_tool_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template writes the ``tools`` it is given into the prompt and
    renders an assistant's tool call in a layout that :func:`template_tool_calls` reads back (Hermes
    JSON: Qwen2.5, Qwen3, Hermes and others; XML: Qwen3.5 and later; key-value lines: GLM-4.5; one
    bare JSON call: Llama 3.1 to 3.3; a ``[TOOL_CALLS]`` list: Mistral 7B Instruct v0.3 and Mistral Small 3.1;
    ``[TOOL_CALLS]`` before each call: Mistral's templates from tokenizer version 11 on), and the tool's result
    after it, with the reply rendered as it follows the generation prompt it was sampled after (Nemotron
    3's opens a thinking block there that its rendering of a reply drops: every episode would split): a
    model whose template does can run the built-in tool loop in its own format (:mod:`sao.rollout.env_agent`). Renders one probe conversation; loads nothing. Why not:
    :func:`tool_calls_problem`."""
    return tool_calls_problem(tokenizer) is None


def tool_calls_problem(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """What keeps the tokenizer's chat template from the built-in tool loop in the model's own format
    (:func:`renders_tool_calls`), in words; None when nothing does."""
    return _probe(tokenizer)[0]


def tool_call_layout(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The layout the tokenizer's chat template renders a tool call in, when it can run the built-in tool
    loop (:func:`renders_tool_calls`): "tagged" (``<tool_call>`` blocks: Hermes JSON, XML, GLM-4.5's),
    "bare_json" (one bare JSON object that is the whole reply: Llama 3.1-3.3's), "mistral" (a
    ``[TOOL_CALLS]`` list: Mistral 7B Instruct v0.3's and Mistral Small 3.1's) or "mistral_args"
    (``[TOOL_CALLS]NAME[ARGS]{...}`` for each call, an id between them or not: Mistral's templates from
    tokenizer version 11 on); None when it cannot. :func:`template_tool_calls` reads the last three only
    for a template that renders calls so: with any other such a reply is text, as vLLM's parser for that
    template's layout leaves it."""
    problem, layout = _probe(tokenizer)
    return layout if problem is None else None


def bare_json_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders a tool call as one bare JSON object that is the
    whole reply (Llama 3.1-3.3's; :func:`tool_call_layout`)."""
    return tool_call_layout(tokenizer) == "bare_json"


def bare_name_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders a call without arguments as ``<tool_call>NAME</tool_call>``
    (GLM-4.7's key-value layout), so that :func:`template_tool_calls` reads a word alone in the tags as
    a call of the offered tool it names (``bare_names``); with any other template it is text. Renders
    one probe conversation."""
    tool = {"type": "function", "function": {"name": "clock", "description": "The time.",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        text, prompt = _probe_renderings(tokenizer, tool, {}, "noon")
    except Exception:  # noqa: BLE001 - a template that cannot render it renders no such call
        return False
    if not isinstance(text, str) or not isinstance(prompt, str):
        return False
    reply = text[len(os.path.commonprefix([prompt, text])):]  # not an example in the tools' instructions
    return f"{TOOL_CALL_START}clock{TOOL_CALL_END}" in reply


_PROBE_ID = "call00000"
"""The probe's call id: 9 letters and digits, as Mistral's templates require."""
_PROBE_QUESTION = {"role": "user", "content": "What is 6 * 7?"}
"""The probe conversation's first message."""


def _probe_renderings(tokenizer: PreTrainedTokenizerBase, tool: dict[str, Any], arguments: dict[str, Any],
                      result: str) -> tuple[Any, Any]:
    """The template's renderings, with ``tool`` offered, of a user's question, a call of ``tool`` with
    ``arguments`` and its ``result`` (then the generation prompt), and of the question alone (its
    generation prompt); raises what the template raises."""
    name = tool["function"]["name"]
    messages = [_PROBE_QUESTION,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": _PROBE_ID, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": _PROBE_ID, "name": name, "content": result}]
    return tuple(apply_template(tokenizer, shown, tools=[tool], add_generation_prompt=True, tokenize=False)
                 for shown in (messages, messages[:1]))


def _probe(tokenizer: PreTrainedTokenizerBase) -> tuple[str | None, str | None]:
    """(what keeps the template from the tool loop or None, the layout it renders a call in:
    :func:`tool_call_layout`'s, or None), from one probe conversation."""
    code, described = "print(6 * 7)", "Run Python code in the probe."
    tool = {"type": "function", "function": {"name": "python", "description": described, "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
    try:
        text, prompt = _probe_renderings(tokenizer, tool, {"code": code}, "42")
    except Exception as error:  # noqa: BLE001 - whatever the template raises, said as it said it
        return f"it fails on a conversation with a tool call and its result ({type(error).__name__}: {error})", None
    if not isinstance(text, str) or not isinstance(prompt, str):
        return "it does not render such a conversation as text", None
    call = {"name": "python", "arguments": {"code": code}}
    found = next(((span, "tagged") for span in _tagged_calls(text, call, [tool])), None)
    if found is None and text.startswith(prompt):
        found = next(((span, layout) for layout in ("bare_json", "mistral", "mistral_args")
                      if (span := _reply_call(text, len(prompt), call, tokenizer, layout)) is not None), None)
    if found is None:
        return ('it does not render tool calls in a layout the loop reads: Hermes JSON (<tool_call>{"name": ..., '
                '"arguments": ...}</tool_call>, as Qwen2.5\'s and Qwen3\'s templates do), XML (<tool_call>'
                "<function=...><parameter=...>...</parameter></function></tool_call>, as Qwen3.5's does), "
                "GLM-4.5's (<tool_call>NAME\\n<arg_key>...</arg_key>\\n<arg_value>...</arg_value></tool_call>), a "
                'reply that is one bare JSON call ({"name": ..., "parameters": ...}, as Llama 3.1-3.3\'s are) or '
                'Mistral\'s ([TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}], or [TOOL_CALLS]NAME[ARGS]{...} '
                f"for each call); it renders a call of python with code {code!r}, up to the result 42, as "
                f"{_rendered_call(tokenizer, tool, text, prompt, code)!r}"), None
    (start, end), layout = found
    if described not in text[:start]:
        return "it does not write the tools it is given into the prompt", layout
    if "42" not in text[end:]:
        return "it does not render a tool's result after the call", layout
    if not text.startswith(prompt):  # the reply, rendered, does not follow the prompt it was sampled after
        at = max(0, len(os.path.commonprefix([prompt, text])) - 20)
        return (f"it renders the assistant's reply otherwise than after the generation prompt it is sampled "
                f"after: where the prompt ends {prompt[at:]!r}, the conversation has {text[at:at + 40]!r} "
                "(a thinking block the prompt opens and the rendering drops, say), so every episode would "
                "split at its first call"), layout
    return None, layout


def _rendered_call(tokenizer: PreTrainedTokenizerBase, tool: dict[str, Any], text: str, prompt: str, code: str,
                   most: int = 240) -> str:
    """What the probe conversation's ``text`` holds after its question (the question's rendering without
    a generation prompt, else ``prompt``, the one with it: their common start), up to the tool's result
    ("42", after the call's ``code`` where the template writes it) and ``most`` characters at most (an
    ellipsis where it is cut): how the template renders the call."""
    try:
        question = apply_template(tokenizer, [_PROBE_QUESTION], tools=[tool],
                                  add_generation_prompt=False, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs the prompt: the common start with it
        question = prompt
    shown = text[len(os.path.commonprefix([question if isinstance(question, str) else prompt, text])):]
    result = shown.find("42", max(0, shown.find(code)))
    return shown[:result] if 0 <= result <= most else shown[:most] + ("…" if len(shown) > most else "")


def _tagged_calls(text: str, call: dict[str, Any], tools: list[dict[str, Any]]) -> Iterator[tuple[int, int]]:
    """(start, end) of each ``<tool_call>`` block of a chat template's ``text`` that reads back as ``call``."""
    for block in _TEMPLATE_CALL.finditer(text):
        parsed = template_tool_calls(block.group(0), tools)
        if parsed is not None and parsed[1] == [call]:
            yield block.span()


def _reply_call(text: str, at: int, call: dict[str, Any], tokenizer: PreTrainedTokenizerBase,
                layout: str) -> tuple[int, int] | None:
    """(start, end) of ``call`` as the whole reply rendered at ``at`` (after the generation prompt) in
    ``layout``: one bare JSON object ("bare_json"), ``[TOOL_CALLS]`` and a list of the call ("mistral"),
    or ``[TOOL_CALLS]`` and the call ("mistral_args"), with the probe's id or none; whitespace before
    it, and a special token of the tokenizer (the end of the turn) after it; None otherwise (a call in a
    list or behind a tag of the template's own is no reply the bare JSON layout reads)."""
    start = len(text) - len(text[at:].lstrip())
    if layout == "mistral_args":
        read = _mistral_args_span(text, start)
        if read is None:
            return None
        calls, end = read
    else:
        begin = start
        if layout == "mistral":
            if not text.startswith(MISTRAL_TOOL_CALLS, start):
                return None
            begin = len(text) - len(text[start + len(MISTRAL_TOOL_CALLS):].lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(text, begin)
        except (ValueError, RecursionError):
            return None
        calls = [_json_call(text[start:end])] if layout == "bare_json" else _mistral_list(text[begin:end])
    rest = text[end:].lstrip()
    specials = [token for token in (*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()) if token]
    read = calls == [call] if layout == "bare_json" else calls in ([call], [call | {"id": _PROBE_ID}])
    if not read or not any(rest.startswith(token) for token in specials):
        return None
    return start, end


def outside_tool_calls(text: str) -> str:
    """``text`` without its ``<tool_call>...</tool_call>`` blocks; "" for a reply that is one bare JSON
    call, or ``[TOOL_CALLS]`` and its list, or calls each after ``[TOOL_CALLS]`` (:func:`template_tool_calls`)."""
    if _json_call(text) is not None or (text.lstrip().startswith(MISTRAL_TOOL_CALLS)
                                        and (_mistral_calls(text) or _mistral_args_calls(text))):
        return ""
    return _TOOL_CALL.sub("", text)


def parse_action(text: str) -> ToolCall | FinalAnswer | Reply:
    """Read one decoded action segment (special tokens kept).

    A segment that ends with a complete ``<tool_call>...</tool_call>`` is a :class:`ToolCall` (the last
    one: the stop id ended it). Otherwise the first ``<answer>...</answer>`` is a :class:`FinalAnswer`;
    anything else (an unclosed tag, plain text) is a :class:`Reply` without the trailing ``<|im_end|>``.
    """
    body = text.strip()
    if body.endswith(TOOL_CALL_END):
        calls = _TOOL_CALL.findall(body)
        if calls:
            return ToolCall(calls[-1])
    answer = _ANSWER.search(body)
    if answer is not None:
        return FinalAnswer(answer.group(1).strip())
    return Reply(body.removesuffix(IM_END).rstrip())


def tool_call_message(code: str, content: str = "") -> Message:
    """An assistant message with one Python tool call, in the Hugging Face ``tool_calls`` format."""
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def action_text(message: Message) -> str:
    """The text of an assistant message as the policy samples it (without the turn's delimiters).

    A tool-call message ends at ``</tool_call>`` (its ``<|im_end|>`` belongs to the observation); any
    other assistant message ends with ``<|im_end|>``.
    """
    if message.get("role") != "assistant":
        raise ValueError(f"action_text needs an assistant message, got role {message.get('role')!r}")
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    for call in calls:
        text += f"{TOOL_CALL_START}{call['function']['arguments']['code']}{TOOL_CALL_END}"
    return text if calls else text + IM_END


def observation_text(tool_output: str) -> str:
    """The text inserted after a tool call: close the turn, the tool message, open the next turn."""
    return (
        f"{IM_END}\n{IM_START}tool\n{TOOL_RESPONSE_START}{tool_output}{TOOL_RESPONSE_END}{IM_END}\n"
        f"{IM_START}assistant\n"
    )


def observation_ids(tokenizer: PreTrainedTokenizerBase, tool_output: str) -> list[int]:
    """Token ids of :func:`observation_text`; special tokens inside ``tool_output`` stay plain text."""
    head = f"{IM_END}\n{IM_START}tool\n{TOOL_RESPONSE_START}"
    tail = f"{TOOL_RESPONSE_END}{IM_END}\n{IM_START}assistant\n"
    output = tokenizer.encode(tool_output, add_special_tokens=False, split_special_tokens=True)
    return tokenizer.encode(head, add_special_tokens=False) + output + tokenizer.encode(tail, add_special_tokens=False)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """The chat template's rendering of ``messages`` plus the assistant generation prompt, as ids."""
    ids = apply_template(tokenizer, messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(i) for i in ids]


_TURN = re.compile(re.escape(IM_START) + r"(\w+)\n(.*?)(?:" + re.escape(IM_END) + r"\n?|$)", re.DOTALL)


def _message(role: str, body: str) -> Message:
    if role == "tool":
        return {"role": "tool", "content": body.removeprefix(TOOL_RESPONSE_START).removesuffix(TOOL_RESPONSE_END)}
    if role != "assistant":
        return {"role": role, "content": body}
    codes = _TOOL_CALL.findall(body)
    if not codes:
        return {"role": "assistant", "content": body}
    message = tool_call_message(codes[0], _TOOL_CALL.sub("", body))
    message["tool_calls"] += [tool_call_message(code)["tool_calls"][0] for code in codes[1:]]
    return message


def parse_chat(text: str) -> list[Message]:
    """Invert the chat template: rendered text (or a decoded trajectory) back to messages.

    A last turn without ``<|im_end|>`` (a trajectory that ended inside a turn) is returned with what
    it holds; an empty one (the generation prompt) is dropped. Raises ``ValueError`` on text between
    turns that the template cannot have produced.
    """
    messages: list[Message] = []
    position = 0
    for match in _TURN.finditer(text):
        if text[position : match.start()].strip():
            raise ValueError(f"parse_chat: unexpected text at {position}: {text[position : match.start()]!r}")
        position = match.end()
        closed = match.group(0).rstrip("\n").endswith(IM_END)
        if closed or match.group(2):
            messages.append(_message(match.group(1), match.group(2)))
    if text[position:].strip():
        raise ValueError(f"parse_chat: unexpected trailing text {text[position:]!r}")
    return messages
