"""The chat endpoint: an OpenAI-compatible ``chat/completions`` API per episode, token-faithful.

An agent of one's own (:mod:`sao.rollout.user_agent`) talks to the policy through an ``openai`` client
pointed at this endpoint; every call it makes is recorded, and the episode becomes trajectories with
segments, masks and versions exactly as the built-in loop writes them.

    POST /v1/chat/completions     Authorization: Bearer <the episode's token>
    GET  /v1/models               the one model name, for clients that ask

The server listens on 127.0.0.1 only, on a port the OS picks, inside the rollout replica's process
and event loop. Each episode has its own random token; a call with an unknown token, or the token of an
episode that has ended, is refused (401); a call once the episode's budget is spent is answered 400
(``budget_exhausted``), and the episode ends.

**Token faithfulness.** The policy's sampled ids are never re-tokenised. An episode's record is the
prompt ids of its first call, then, call after call, the ids the engine sampled (actions: mask 1, the
engine's log-probabilities and the policy version of every token) and the ids of what the agent added
in between (tool results, user turns: observations, mask 0). A call extends the record when its
``messages`` start with the previous call's messages followed by the reply the endpoint gave, and the
chat template's rendering of the new conversation starts with the text of the ids recorded so far; the
template's text after that point is tokenised and appended as an observation (the template's own parts
with their special tokens, each added message's content as plain text: a tool result that prints
``<|im_end|>`` cannot forge a turn boundary, as in the built-in loop). Anything else (the agent
rewrote, dropped or truncated its history, or the template renders an earlier turn differently now) is
a **split**: the part so far is closed as one trajectory, and a new part starts from the full rendering
of the new request. The parts share ``episode_id`` (:mod:`schemas.trajectories`, version 4) and each
split is counted; a mask is never silently misaligned. Concurrent calls of one episode are served one
after the other (a second call that does not extend the first one's reply is a split).

**Requests.** ``messages`` (roles system, user, assistant, tool), ``tools`` (passed to the chat
template), ``tool_choice`` ``auto`` (the policy decides; another choice is refused), ``max_tokens`` / ``max_completion_tokens`` (capped by what is left of
the trajectory's budget), ``temperature`` and ``top_p`` (the run samples at its own settings, which
every trajectory records: another value is refused), ``stop`` (strings that are single tokens of the
policy's tokenizer), ``logprobs`` (the sampled token's; ``top_logprobs`` is refused), ``seed`` (that
call's sampling seed; without one, a call's seed derives from the rollout's, which the trajectory
records), ``n``
= 1, no streaming. Sampling controls the engine does not apply (``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``response_format`` other than text, ``min_p``,
``repetition_penalty``) are refused unless at their neutral value, and ``top_k`` unless it is the run's; other fields (``model``, ``user``,
``metadata``, ...) are not used. A malformed request is answered 400 with the reason and changes
nothing: the episode goes on.

**Replies.** A standard ``chat.completion``: the assistant's text, and with the built-in chat format
(:mod:`sao.models.chat`), a tool call ``<tool_call>code</tool_call>`` as a ``python`` function call
whose arguments are ``{"code": ...}`` (``finish_reason`` ``tool_calls``); with a model's own format and
``tools`` in the request, the calls of a reply in the Hermes JSON layout (Qwen2.5, Qwen3 and others:
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), the XML one (Qwen3.5 and later,
Qwen3-Coder, Nemotron 3: ``<tool_call><function=...><parameter=...>``), GLM-4.5's key-value lines
(``<tool_call>NAME\n<arg_key>...</arg_key>\n<arg_value>...</arg_value>``; with a template that renders
a call without arguments as ``<tool_call>NAME</tool_call>``, as GLM-4.7's does, that too, NAME an offered
tool) or, with a
template that renders calls so, a reply that is one bare JSON call (``{"name": ..., "parameters": ...}``: Llama 3.1 to
3.3's), a ``[TOOL_CALLS]`` list (Mistral 7B Instruct v0.3's and Mistral Small 3.1's) or calls each after
``[TOOL_CALLS]`` (``NAME[ARGS]{...}``, an id before ``[ARGS]`` or not: Mistral's templates from tokenizer
version 11 on) (in Mistral's layouts a call keeps the id its model wrote, which the list's templates and
version 11's render; an agent that sends back other ids has them rendered, and those templates refuse
one of another length, 9 characters or, Mistral Small 3.1's, fewer: the call is answered 400; version
13's render no ids) (:func:`sao.models.chat.template_tool_calls`; an XML call's values typed by the
offered tool's schema, as a GLM-4.5 call's are) as its ``tool_calls``, the text before them as its
content (a call's id is derived from the episode and the call's place in it: :func:`call_id`); ``usage``; ``logprobs`` when asked for. Sent
back, such a reply extends the record when the template renders it as it was sampled (the template's
own layout of a call: JSON as ``tojson`` writes it, or its XML lines); otherwise the episode splits
there. Every rendering tells a template that reads the clock the same fixed time
(:data:`sao.models.chat.TEMPLATE_CLOCK`: Llama 3.2's writes the date into its system turn), so an
episode does not split at midnight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from sao.models.chat import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ChatTokens,
    Message,
    apply_template,
    bare_name_calls,
    outside_tool_calls,
    template_tool_calls,
    tool_call_layout,
    without_turn_end,
)
from sao.rollout.agent import AgentConfig, _Trace
from sao.rollout.engine import Engine, FinishReason, SamplingParams, generate_until
from schemas.vocabulary import TerminationReason

__all__ = ["ChatEndpoint", "ChatRendering", "EndpointError", "Episode", "EpisodePart", "MODEL_NAME", "call_id"]

log = logging.getLogger(__name__)

MODEL_NAME = "policy"
"""The model name the endpoint reports (any name a client sends is accepted: there is one policy)."""

_ROLES = frozenset({"system", "user", "assistant", "tool"})
_FINISHED_KEPT = 4096  # ended episodes remembered, to tell "ended" from "unknown" in a refusal


class EndpointError(Exception):
    """A refused call: the HTTP status, an OpenAI-style error type and the message the client sees."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


def _bad(message: str) -> EndpointError:
    return EndpointError(400, "invalid_request_error", message)


@dataclasses.dataclass
class EpisodePart:
    """One trajectory of an episode: its prompt, what was recorded after it, the conversation
    (normalised messages, last reply included) and rendered text that the next call must extend, and
    when it began (``time.monotonic``: the agent's time outside generation is its ``tool_s``)."""

    prompt: list[int]
    trace: _Trace = dataclasses.field(default_factory=_Trace)
    messages: list[Message] = dataclasses.field(default_factory=list)
    text: str = ""
    began: float = dataclasses.field(default_factory=time.monotonic)


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{i}]: only text parts are supported, got {part!r}"[:300])
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call as the chat template wants it (``arguments`` as an object, not JSON text)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _bad(f"{where}: a tool call needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise _bad(f"{where}.function.arguments is not JSON: {error}") from None
    if not isinstance(arguments, Mapping):
        raise _bad(f"{where}.function.arguments: expected an object")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": function["name"], "arguments": dict(arguments)}}


# Sampling controls of the OpenAI API (and of vLLM's) that the engine does not apply, with the values that
# ask for nothing: a request with another value is refused rather than sampled differently than it asked.
_NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}), "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
}


def normalise_messages(messages: Any) -> list[Message]:
    """The request's messages as the chat template takes them: ``role``, ``content`` as text, an
    assistant's ``tool_calls`` (arguments as objects), a tool message's ``tool_call_id`` and ``name``;
    a message's other fields are not passed on. Raises :class:`EndpointError` (400) naming the message
    and field that is wrong."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: expected a non-empty list of chat messages")
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise _bad(f"{where}: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in _ROLES:
            raise _bad(f"{where}.role: expected one of {sorted(_ROLES)}, got {role!r}")
        normal: Message = {"role": role, "content": _text_content(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls: expected a list")
            normal["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
        if role == "tool" and message.get("tool_call_id") is not None:
            normal["tool_call_id"] = str(message["tool_call_id"])
        if message.get("name") is not None:
            normal["name"] = str(message["name"])
        out.append(normal)
    return out


def _same_turn(sent: Message, kept: Message) -> bool:
    """Whether a message the agent sent back is the one the conversation holds (tool-call ids aside:
    clients may rewrite them)."""
    def core(message: Message) -> tuple:
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                      for c in message.get("tool_calls", ()))
        return message["role"], message["content"], calls

    return core(sent) == core(kept)


class Episode:
    """The record of one agent episode on the endpoint (see the module docstring).

    Args:
        episode_id: the id the rollout was issued under (part 0's trajectory id).
        token: the bearer token its calls must carry.
        deadline: ``time.monotonic()`` time at which the episode times out.
        config: the trajectory budgets (``max_tokens`` per part, ``max_turns`` per episode) and sampling.
        seed: the rollout's sampling seed (each call without a seed of its own gets one derived from
            it), or None.
    """

    def __init__(self, endpoint: ChatEndpoint, episode_id: str, token: str, deadline: float,
                 config: AgentConfig, seed: int | None) -> None:
        self.endpoint = endpoint
        self.episode_id = episode_id
        self.token = token
        self.deadline = deadline
        self.config = config
        self.seed = seed
        self.parts: list[EpisodePart] = []
        self.turns = 0
        self.splits = 0
        self.ended: TerminationReason | None = None
        self.error: str | None = None
        self._lock = asyncio.Lock()

    @property
    def last_messages(self) -> list[Message]:
        """The conversation of the last call, its reply included (for the reward functions)."""
        return list(self.parts[-1].messages) if self.parts else []

    def end(self, reason: TerminationReason, error: str | None = None) -> None:
        """End the episode (the first reason given stands)."""
        if self.ended is None:
            self.ended, self.error = reason, error

    # One call ------------------------------------------------------------------------------------

    async def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve one ``chat/completions`` request body; raises :class:`EndpointError` to refuse it."""
        request = self.endpoint.parse_request(body, self.config)
        async with self._lock:
            if self.ended is not None:
                raise EndpointError(401, "episode_ended", f"episode {self.episode_id} has ended "
                                    f"({self.ended}); its token is no longer valid")
            # The agent loop's order: what the agent added is kept if it fits, then the budgets are checked.
            part, added = self._extend(request["messages"], request["tools"])
            if len(part.trace.completion) + len(added) > self.config.max_tokens:
                self.end(TerminationReason.LENGTH)
                raise EndpointError(400, "budget_exhausted", f"what the agent added does not fit in the "
                                    f"trajectory's budget of {self.config.max_tokens} tokens (rollout.max_tokens); "
                                    "the episode has ended")
            if added:
                part.trace.add_observation(added)
            remaining = self.config.max_tokens - len(part.trace.completion)
            if remaining <= 0:
                self.end(TerminationReason.LENGTH)
                raise EndpointError(400, "budget_exhausted", f"the trajectory's budget of {self.config.max_tokens} "
                                    "tokens (rollout.max_tokens) is spent; the episode has ended")
            if self.turns >= self.config.max_turns:
                self.end(TerminationReason.TURNS)
                raise EndpointError(400, "budget_exhausted", f"the episode's budget of {self.config.max_turns} "
                                    "calls (rollout.max_turns) is spent; the episode has ended")
            return await self._generate(part, request, remaining)

    def _extend(self, messages: list[Message], tools: list | None) -> tuple[EpisodePart, list[int]]:
        """The part this call continues and the ids the agent added since the last reply; a new part
        (a split) when the call does not extend the record (the module docstring)."""
        render = self.endpoint.render
        text = render(messages, tools)
        if self.parts:
            part = self.parts[-1]
            kept = part.messages
            extends = (len(messages) > len(kept) and all(_same_turn(m, k) for m, k in zip(messages, kept, strict=False))
                       and text.startswith(part.text))
            if extends:
                added = self.endpoint.encode_added(messages, len(kept), tools, part.text, text[len(part.text):])
                part.messages = list(messages)
                part.text = text
                return part, added
            self.splits += 1
            log.info("episode %s: the agent rewrote its history at call %d; split into part %d",
                     self.episode_id, self.turns + 1, len(self.parts))
        part = EpisodePart(prompt=self.endpoint.encode(text), messages=list(messages), text=text)
        self.parts.append(part)
        return part, []

    async def _generate(self, part: EpisodePart, request: dict[str, Any], remaining: int) -> dict[str, Any]:
        endpoint, cfg = self.endpoint, self.config
        max_tokens = min(request["max_tokens"] or remaining, remaining)
        seed = request["seed"] if request["seed"] is not None else (
            None if self.seed is None else self.seed * 1009 + self.turns)
        sampling = SamplingParams(
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_tokens=max_tokens, seed=seed,
            stop_token_ids=tuple(dict.fromkeys(endpoint.tokens.stop_token_ids + request["stop_ids"])),
            logprob_kind=cfg.logprob_kind)
        ids = part.prompt + part.trace.completion
        request_id = f"{self.episode_id}-{self.turns}"
        began = time.monotonic()
        generation, timed_out = await generate_until(endpoint.engine, ids, sampling, request_id, self.deadline)
        part.trace.generation_s += time.monotonic() - began
        part.trace.add_action(generation.token_ids, generation.logprobs, generation.spans)
        part.trace.add_routing(generation.routed_experts)
        part.trace.turns += 1
        self.turns += 1
        if timed_out:
            self.end(TerminationReason.TIMEOUT)
            raise EndpointError(408, "timeout", f"the episode's wall-clock budget of {cfg.timeout_s:g} s "
                                "(rollout.timeout_s) ran out during this call; the episode has ended")
        if generation.finish_reason is FinishReason.CANCELLED:
            self.end(TerminationReason.CANCELLED)
            raise EndpointError(503, "cancelled", "the engine cancelled the generation (the replica is "
                                "stopping); the episode has ended")
        if generation.finish_reason is FinishReason.ERROR:
            self.end(TerminationReason.ERROR, f"engine: {generation.error}")
            raise EndpointError(500, "engine_error", f"the engine failed: {generation.error}")
        if generation.finish_reason is FinishReason.LENGTH and max_tokens == remaining:
            self.end(TerminationReason.LENGTH)  # the trajectory's budget; the reply is still given
        reply, finish = endpoint.reply(generation.token_ids, generation.finish_reason, request["stop_ids"],
                                       request["tools"], f"{self.episode_id}/{self.turns}")
        part.messages = [*part.messages, reply]
        part.text += endpoint.decode(generation.token_ids)
        return endpoint.response(reply, finish, generation, len(ids), request["logprobs"])


def call_id(key: str, index: int) -> str:
    """The id of the ``index``-th tool call of the reply ``key`` names (``episode_id/call number``): the
    same on every replay of the episode, so a chat template that renders call ids renders them again
    as they were recorded (:mod:`sao.train.trajectory_replay`)."""
    return f"call_{hashlib.sha256(f'{key}/{index}'.encode()).hexdigest()[:24]}"


MISTRAL_LAYOUTS = frozenset({"mistral", "mistral_args"})
"""Mistral's tool-call layouts (:func:`sao.models.chat.tool_call_layout`), whose templates render a call's
id of 9 characters (all but version 13's, which render none)."""


def _calling(content: str, calls: list[dict[str, Any]], key: str, layout: str | None = None) -> tuple[Message, str]:
    """The assistant message that calls ``calls`` (``{"name", "arguments"}`` each, ids from ``key``:
    :func:`call_id`) after ``content``, and its finish reason. In Mistral's layouts (``layout``) a call
    keeps the ``"id"`` its model wrote, when the template can render it back as written (9 characters,
    as Mistral's templates require, none that JSON escapes) and no earlier call of the reply has
    it (a result answers its call by id); else it gets the last 9 characters of :func:`call_id`'s (a
    template that renders no ids, version 13's, ignores them)."""
    mistral = layout in MISTRAL_LAYOUTS
    ids: list[str] = []
    for k, call in enumerate(calls):
        written = call.get("id") if mistral else None
        kept = (isinstance(written, str) and len(written) == 9 and json.dumps(written)[1:-1] == written
                and written not in ids)
        ids.append(written if kept else call_id(key, k)[-9:] if mistral else call_id(key, k))
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": ids[k], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        for k, call in enumerate(calls)]}, "tool_calls"


_MARK = "\ue000"
"""Marks where a message's content is in a rendering (:meth:`ChatRendering.encode_added`): a character of
Unicode's private use area, which a template writes as it is, in JSON strings too."""


class ChatRendering:
    """What the chat endpoint does with a tokenizer alone: a conversation rendered by the chat template
    and tokenised, what an agent added encoded as observations, a reply read back as an assistant
    message. The endpoint serves with it; trajectory replay renders a built-in episode in a model's own
    format with it again (:mod:`sao.train.trajectory_replay`).

    Args:
        tokenizer: the policy's tokenizer (its chat template renders requests).
        tokens: its :class:`~sao.models.chat.ChatTokens`, when the caller has them (else read from it).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tokens: ChatTokens | None = None) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens or ChatTokens.from_tokenizer(tokenizer)

    @functools.cached_property
    def layout(self) -> str | None:
        """The layout the template renders a tool call in (:func:`sao.models.chat.tool_call_layout`, which
        renders a probe conversation: asked once); None with this project's format. A reply that is one
        bare JSON call, or a ``[TOOL_CALLS]`` list or calls each after ``[TOOL_CALLS]``, is a call only
        where the template renders calls so (Llama 3's, Mistral's)."""
        return None if self.tokens.supports_tools else tool_call_layout(self.tokenizer)

    @functools.cached_property
    def bare_names(self) -> bool:
        """Whether a word alone in ``<tool_call>`` tags is a call without arguments of the offered tool it
        names: the template renders such a call so (GLM-4.7's; :func:`sao.models.chat.bare_name_calls`)."""
        return self.layout == "tagged" and bare_name_calls(self.tokenizer)

    def render(self, messages: Sequence[Message], tools: list | None) -> str:
        """The chat template's text of ``messages`` and the assistant's generation prompt."""
        try:
            return apply_template(self.tokenizer, messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # the template refused the conversation (a role, a missing field)
            raise _bad(f"the chat template cannot render these messages: {type(error).__name__}: {error}") from None

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def encode_added(self, messages: Sequence[Message], kept: int, tools: list | None, before: str,
                     text: str) -> list[int]:
        """The ids of ``text``, what the template renders for the agent's messages after the first ``kept``
        (``before`` is the rendering up to them): the template's own parts with their special tokens,
        each added message's content as plain text (a tool result that prints ``<|im_end|>`` cannot
        forge a turn boundary), as the built-in loop encodes observations. Where the contents are is
        found by rendering the messages again with a marker for each. Each content is found, in order,
        as it is, as the JSON string a template writes it as (Llama 3's writes every tool result with
        ``tojson``: the plain text is then the escaped content, without the quotes), or trimmed (as
        Llama 3's and Qwen3.5's write a message's content); a template that renders a content otherwise
        gets the whole text encoded as it is."""
        contents = [str(m.get("content") or "") for m in messages[kept:]]
        marked = [*messages[:kept], *({**m, "content": f"{_MARK}{k}{_MARK}"} for k, m in enumerate(messages[kept:]))]
        around = self.render(marked, tools)
        if not around.startswith(before):
            return self.encode(text)
        parts = around[len(before):].split(_MARK)  # template, index, template, index, ..., template
        if len(parts) % 2 == 0 or not all(p.isdigit() and int(p) < len(contents) for p in parts[1::2]):
            return self.encode(text)
        pieces, at = [], 0
        for k, part in enumerate(parts):
            if k % 2 == 0:
                if not text.startswith(part, at):
                    return self.encode(text)
                pieces.append((part, False))
                at += len(part)
                continue
            content = contents[int(part)]
            forms = dict.fromkeys((content, json.dumps(content, ensure_ascii=False)[1:-1], content.strip()))
            form = next((f for f in forms if text.startswith(f + parts[k + 1], at)), None)
            if form is None:
                return self.encode(text)
            pieces.append((form, True))
            at += len(form)
        if at != len(text):
            return self.encode(text)
        ids: list[int] = []
        for piece, plain in pieces:
            if piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=plain)
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def reply(self, ids: Sequence[int], finish: FinishReason, stop_ids: tuple[int, ...],
              tools: list | None, key: str) -> tuple[Message, str]:
        """The assistant message of sampled ``ids`` and its OpenAI finish reason: with this project's
        chat format, a ``<tool_call>`` that ends the reply is a ``python`` call; with a model's own format
        and ``tools`` in the request, the calls in a reply that stopped, in the Hermes JSON, the XML,
        GLM-4.5's or (with a template that renders calls so) the bare JSON or one of Mistral's layouts, are its
        tool calls (:func:`sao.models.chat.template_tool_calls`; an XML or GLM-4.5 call's arguments typed
        by the offered tool's schema), with ids from ``key`` (:func:`call_id`; in Mistral's layouts the id
        its model wrote: :func:`_calling`)."""
        text = self.decode(ids)
        last = ids[-1] if ids else None
        head, opened, code = text.rpartition(TOOL_CALL_START)
        if self.tokens.supports_tools and last == self.tokens.tool_call_end_id and opened:  # a whole call
            return _calling(head, [{"name": "python", "arguments": {"code": code.removesuffix(TOOL_CALL_END)}}], key)
        ends = set(self.tokens.end_ids) | ({self.tokens.im_end_id} if self.tokens.im_end_id is not None else set())
        if finish is FinishReason.STOP and last not in stop_ids:
            text = without_turn_end(text, ids, ends, self.tokenizer)
            parsed = (template_tool_calls(text, tools, layout=self.layout, bare_names=self.bare_names)
                      if tools and not self.tokens.supports_tools else None)
            if parsed is not None:
                if outside_tool_calls(text[len(parsed[0]):]).strip():
                    log.info("reply %s: text between or after its tool calls is not in its message (an OpenAI "
                             "message holds text before its calls only); sent back, the episode splits there", key)
                if self.layout == "mistral" and parsed[0].strip():
                    log.info("reply %s: the templates that render Mistral's [TOOL_CALLS] list (Mistral 7B Instruct "
                             "v0.3's, Mistral Small 3.1's) render a message that calls tools without its text; sent "
                             "back, the episode splits there", key)
                return _calling(*parsed, key, layout=self.layout)
        return {"role": "assistant", "content": text}, "stop" if finish is FinishReason.STOP else "length"


class ChatEndpoint(ChatRendering):
    """The HTTP server of one rollout replica and its episodes (see the module docstring).

    Args:
        engine: the replica's engine.
        tokenizer: the policy's tokenizer (its chat template renders requests).
    """

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(tokenizer)
        self.engine = engine
        self.url: str | None = None
        self.episodes: dict[str, Episode] = {}
        self.splits = 0  # history rewrites counted over every episode this endpoint served
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._runner: web.AppRunner | None = None
        self._starting: asyncio.Lock | None = None

    # Lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> str:
        """Start listening (once, in the running event loop); returns the base URL (``.../v1``)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.url is None:
                app = web.Application(client_max_size=64 * 1024 * 1024)
                app.router.add_route("*", "/{path:.*}", self._handle)
                runner = web.AppRunner(app, access_log=None, handle_signals=False)
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                port = site._server.sockets[0].getsockname()[1]  # the port the OS picked
                self._runner, self.url = runner, f"http://127.0.0.1:{port}/v1"
                log.info("chat endpoint listening on %s", self.url)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.url = None, None

    def open(self, episode_id: str, config: AgentConfig, seed: int | None = None) -> Episode:
        """A new episode with a fresh token, timed from now."""
        token = secrets.token_urlsafe(24)
        episode = Episode(self, episode_id, token, time.monotonic() + config.timeout_s, config, seed)
        self.episodes[token] = episode
        return episode

    def finish(self, episode: Episode) -> None:
        """Close ``episode``: its token is refused from now on (a second call changes nothing)."""
        if self.episodes.pop(episode.token, None) is None:
            return
        self.splits += episode.splits
        self._finished[episode.token] = episode.episode_id
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)

    # HTTP ----------------------------------------------------------------------------------------

    async def serve(self, method: str, path: str, authorization: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """One HTTP request, whichever way it came (the socket, or the episode client's in-process
        transport): (status, JSON reply)."""
        try:
            episode = self._episode_of(authorization)
            if method == "GET" and path.endswith("/models"):
                return 200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "sao"}]}
            if method != "POST" or not path.endswith("/chat/completions"):
                raise EndpointError(404, "not_found", f"{method} {path}: this endpoint serves POST "
                                    "/v1/chat/completions and GET /v1/models")
            try:
                request = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise _bad(f"the request body is not JSON: {error}") from None
            if not isinstance(request, dict):
                raise _bad(f"the request body must be a JSON object, got {type(request).__name__}")
            return 200, await episode.complete(request)
        except EndpointError as error:
            return error.status, error.payload()

    async def _handle(self, request: web.Request) -> web.Response:
        status, payload = await self.serve(request.method, request.path, request.headers.get("Authorization", ""),
                                           await request.read())
        return web.json_response(payload, status=status)

    def _episode_of(self, authorization: str) -> Episode:
        token = authorization.removeprefix("Bearer ").strip() if authorization.startswith("Bearer ") else ""
        episode = self.episodes.get(token)
        if episode is not None:
            return episode
        if token in self._finished:
            raise EndpointError(401, "episode_ended", f"episode {self._finished[token]} has ended; its token "
                                "is no longer valid")
        raise EndpointError(401, "invalid_api_key", "unknown episode token: each episode's client carries its "
                            "own (sao.rollout.user_agent)")

    def transport(self):
        """An httpx transport that hands an episode client's requests to :meth:`serve` in this process,
        without a socket (the same requests, replies and refusals as over 127.0.0.1; about 3 ms less per
        call, measured by ``sao bench endpoint``)."""
        import httpx

        endpoint = self

        class _InProcess(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                status, payload = await endpoint.serve(request.method, request.url.path,
                                                       request.headers.get("authorization", ""), await request.aread())
                return httpx.Response(status, content=json.dumps(payload).encode(),
                                      headers={"content-type": "application/json"})

        return _InProcess()

    # Requests and replies -------------------------------------------------------------------------

    def parse_request(self, body: Mapping[str, Any], config: AgentConfig) -> dict[str, Any]:
        """Check a request body against the episode's ``config`` (see the module docstring); raises
        :class:`EndpointError` (400)."""
        if body.get("stream"):
            raise _bad("stream: streaming is not supported; leave it unset")
        if body.get("n", 1) != 1:
            raise _bad(f"n: one choice per call, got {body.get('n')!r}")
        if body.get("top_logprobs"):
            raise _bad("top_logprobs: only the sampled token's log-probability is recorded; leave it unset")
        if body.get("tool_choice") not in (None, "auto"):
            raise _bad(f"tool_choice: the policy decides whether to call a tool ('auto'); got {body['tool_choice']!r}")
        for name, neutral in _NOT_APPLIED.items():
            if body.get(name) not in neutral:
                raise _bad(f"{name}: the engine samples at the run's settings only (recorded with every trajectory); "
                           f"got {body[name]!r}: leave it unset")
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise _bad(f"{name}: expected a number, got {value!r}")
            if value is not None and abs(float(value) - float(getattr(config, name))) > 1e-9:
                raise _bad(f"{name}: the run samples at rollout.{name} {getattr(config, name):g} (recorded with "
                           f"every trajectory); got {value!r}: leave it unset")
        top_k = body.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                                  or max(top_k, 0) != config.top_k):  # -1 and 0: off, as rollout.top_k 0
            raise _bad(f"top_k: the run samples at rollout.top_k {config.top_k} (recorded with every trajectory); "
                       f"got {top_k!r}: leave it unset")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise _bad(f"max_tokens: expected a positive integer, got {max_tokens!r}")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _bad(f"seed: expected an integer, got {seed!r}")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _bad("tools: expected a list of tool definitions")
        return {"messages": normalise_messages(body.get("messages")), "tools": tools or None,
                "max_tokens": max_tokens, "seed": seed, "stop_ids": self._stop_ids(body.get("stop")),
                "logprobs": bool(body.get("logprobs"))}

    def _stop_ids(self, stop: Any) -> tuple[int, ...]:
        if stop is None:
            return ()
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise _bad(f"stop: expected a string or a list of strings, got {stop!r}")
        ids = []
        for text in strings:
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise _bad(f"stop: {text!r} is {len(encoded)} tokens of the policy's tokenizer; only stop strings "
                           "that are one token can end a generation without re-tokenising it")
            ids.append(int(encoded[0]))
        return tuple(ids)

    def response(self, reply: Message, finish: str, generation, prompt_tokens: int, logprobs: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
        if reply.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in reply["tool_calls"]]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if logprobs:
            choice["logprobs"] = {"content": [
                {"token": self.decode([i]), "logprob": float(lp), "bytes": list(self.decode([i]).encode()),
                 "top_logprobs": []} for i, lp in zip(generation.token_ids, generation.logprobs, strict=True)]}
        n = len(generation.token_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL_NAME, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}
