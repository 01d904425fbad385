"""The ``dataset`` environment: tasks from the user's files (:mod:`sao.data`), scored by reward
functions (:mod:`sao.rewards`).

An episode shows the task's prompt (its chat messages, or one user message), then takes the policy's
actions in the chat format of :mod:`sao.models.chat`: a tool call (``<tool_call>code</tool_call>``)
runs in the sandboxed Python tool, as in math_tool, while ``max_tool_calls`` allows (0: single-turn;
a model of one's own calls the tool in its own format, which the episode's agent turns into these
actions: :mod:`sao.rollout.env_agent`),
with the user's own tool functions (``tools``) defined before the code, so it can call them;
any other action ends the episode with ``stop``, and the reward functions score it. Calling more tools
than allowed ends it with ``turns`` (reward 0, the functions are not called).

A reward function that raises or returns a non-finite number raises :class:`~sao.rewards.RewardError`
out of :meth:`DatasetEnv.step`: the agent loop ends that trajectory with ``error`` and stores the
message (``trajectories.error``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import textwrap
import threading
from typing import Any

from sao.envs.base import StepResult, Task, Termination
from sao.envs.latency import LatencyConfig
from sao.envs.math_tool import MathToolEnv
from sao.envs.sandbox import SandboxConfig
from sao.models.chat import IM_END, Message, ToolCall, parse_action
from sao.rewards import RewardImportError, RewardSet, call_arguments, resolve_function

__all__ = ["ENV_NAME", "DatasetEnv", "DatasetEnvConfig", "task_messages", "tool_prelude", "tool_signatures"]

ENV_NAME = "dataset"


@dataclasses.dataclass(frozen=True)
class DatasetEnvConfig:
    """Episode rules and rewards of the ``dataset`` environment.

    Attributes:
        rewards: reward functions, ``module:function`` each (:mod:`sao.rewards`).
        weights: one weight per reward function (None: 1 each); the reward is the weighted sum.
        paths: folders the reward modules were imported from at start (set by the run, so replicas in
            other processes import the same files).
        max_tool_calls: sandboxed Python tool calls allowed per episode; one more ends it with
            ``turns``. 0: single-turn.
        tools: the user's tool functions, ``module:function`` each: their source is defined in the
            sandbox before each tool call's code, so the code can call them (they run under the
            sandbox's limits: self-contained functions of the allow-listed modules).
        system_prompt: a system message before the task's prompt ('' = none; a task that gives chat
            messages keeps its own).
        sandbox: limits of the Python tool.
        latency: injected per-call tool delay (off by default).
        agent: an agent of one's own, ``module:function`` (:mod:`sao.rollout.user_agent`): it runs the
            episode against the chat endpoint instead of the built-in tool loop ('' = the built-in loop).
    """

    rewards: tuple[str, ...] = ("sao.rewards:exact_match",)
    weights: tuple[float, ...] | None = None
    paths: tuple[str, ...] = ()
    max_tool_calls: int = 3
    tools: tuple[str, ...] = ()
    system_prompt: str = ""
    sandbox: SandboxConfig = SandboxConfig()
    latency: LatencyConfig = LatencyConfig()
    agent: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rewards", tuple(self.rewards))
        object.__setattr__(self, "paths", tuple(self.paths))
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if self.max_tool_calls < 0:
            raise ValueError(f"DatasetEnvConfig.max_tool_calls must be >= 0, got {self.max_tool_calls}")


_REWARD_SETS: dict[tuple, RewardSet] = {}
_REWARD_LOCK = threading.Lock()


def reward_set(config: DatasetEnvConfig) -> RewardSet:
    """The loaded reward functions of ``config``, imported once per process."""
    key = (config.rewards, config.weights, config.paths)
    with _REWARD_LOCK:
        if key not in _REWARD_SETS:
            _REWARD_SETS[key] = RewardSet(config.rewards, config.weights, config.paths)
        return _REWARD_SETS[key]


_PRELUDES: dict[tuple, str] = {}


def tool_prelude(tools: tuple[str, ...], paths: tuple[str, ...] = ()) -> str:
    """The source of the user's tool functions, defined before a tool call's code (imported once per
    process). Raises :class:`~sao.rewards.RewardImportError` for a tool that cannot be found or is not a
    top-level function with source."""
    key = (tools, paths)
    with _REWARD_LOCK:
        if key not in _PRELUDES:
            sources = []
            for spec in tools:
                function, _ = resolve_function(spec, paths, what="tool function")
                if not inspect.isfunction(function) or function.__qualname__ != function.__name__:
                    raise RewardImportError(f"tool function {spec!r}: must be a top-level def (its source is run "
                                            "in the sandbox)")
                try:
                    sources.append(textwrap.dedent(inspect.getsource(function)))
                except (OSError, TypeError) as error:
                    raise RewardImportError(f"tool function {spec!r}: no source to run in the sandbox ({error})") from None
            _PRELUDES[key] = "\n\n".join(sources)
        return _PRELUDES[key]


_SIGNATURES: dict[tuple, tuple[str, ...]] = {}


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


class _Described:
    """A default as the text that describes it (:func:`_alike`)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _alike(value: Any) -> Any:
    """``value``, or a stand-in whose ``repr`` writes each set in it (itself, or inside a list, tuple or
    dict) with its elements sorted: a set of strings is written in an order that each process's hash
    seed decides. Elements that compare are sorted by value (a set of numbers keeps the order it is
    written in), others by their ``repr``."""
    if isinstance(value, set | frozenset) and value:
        elements = [_alike(element) for element in value]
        try:
            ordered = [repr(element) for element in sorted(elements)]
        except TypeError:  # elements that do not compare (mixed kinds, or stand-ins)
            ordered = sorted(repr(element) for element in elements)
        text = "{" + ", ".join(ordered) + "}"
        return _Described(text if type(value) is set else f"{type(value).__name__}({text})")
    if type(value) in (list, tuple):
        items = [_alike(item) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        text = ", ".join(map(repr, items)) + ("," if type(value) is tuple and len(items) == 1 else "")
        return _Described(f"[{text}]" if type(value) is list else f"({text})")
    if type(value) is dict:
        alike = {key: _alike(item) for key, item in value.items()}
        if all(alike[key] is item for key, item in value.items()):
            return value
        return _Described("{" + ", ".join(f"{key!r}: {item!r}" for key, item in alike.items()) + "}")
    return value


def tool_signatures(tools: tuple[str, ...], paths: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Each of the user's tool functions as a line a model can call it from: its name and signature,
    then the first paragraph of its docstring (``price(item: str) -> int: The price of one item in
    cents.``); a default whose ``repr`` holds a memory address (``<object object at 0x...>``) is written
    without it, and a set's elements in sorted order (not the order of the process's hash seed), so
    every process describes the tool alike (the description is in every prompt, and a
    replay renders it again). Imported once per process, errors as :func:`tool_prelude`'s."""
    key = (tools, paths)
    with _REWARD_LOCK:
        if key not in _SIGNATURES:
            lines = []
            for spec in tools:
                function, _ = resolve_function(spec, paths, what="tool function")
                doc = " ".join((inspect.getdoc(function) or "").split("\n\n")[0].split())
                try:  # annotations as written, not as strings (a module with `from __future__ import annotations`)
                    signature = inspect.signature(function, eval_str=True)
                except Exception:  # noqa: BLE001 - an annotation that does not evaluate: as written
                    signature = inspect.signature(function)
                signature = signature.replace(parameters=[
                    parameter.replace(default=_alike(parameter.default)) for parameter in signature.parameters.values()])
                described = _ADDRESS.sub(">", str(signature))  # a default's address: alike in every process
                lines.append(f"{function.__name__}{described}" + (f": {doc}" if doc else ""))
            _SIGNATURES[key] = tuple(lines)
        return _SIGNATURES[key]


def task_messages(task: Task, system_prompt: str = "") -> list[Message]:
    """The prompt of ``task`` as chat messages."""
    if task.messages:
        return [dict(m) for m in json.loads(task.messages)]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": task.prompt}]


class DatasetEnv(MathToolEnv):
    """One ``dataset`` episode at a time (see the module docstring)."""

    name = ENV_NAME

    def __init__(self, config: DatasetEnvConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config or DatasetEnvConfig(), **kwargs)
        self.rewards = reward_set(self.config)
        self.prelude = tool_prelude(self.config.tools, self.config.paths)
        self.conversation: list[Message] = []

    def tool_code(self, code: str) -> str:
        return f"{self.prelude}\n\n{code}" if self.prelude else code

    def reset(self, task: Task) -> list[Message]:
        if task.env != ENV_NAME:
            raise ValueError(f"DatasetEnv.reset: task {task.task_id} belongs to env {task.env!r}, not {ENV_NAME!r}")
        self.task, self.tool_calls = task, 0
        self.conversation = task_messages(task, self.config.system_prompt)
        return list(self.conversation)

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("DatasetEnv.step called before reset")
        if isinstance(parse_action(action_text), ToolCall):
            result = super().step(action_text)
            self.conversation.append({"role": "assistant", "content": action_text})
            if not result.done:
                self.conversation.append({"role": "tool", "content": result.observation})
            return result
        completion = action_text.removesuffix(IM_END)
        self.conversation.append({"role": "assistant", "content": completion})
        task = self.task
        prompt: Any = json.loads(task.messages) if task.messages else task.prompt
        reward = self.rewards.score(**call_arguments(
            prompt=prompt, completion=completion, messages=list(self.conversation), answer=task.answer,
            info=json.loads(task.info) if task.info else {}, task_id=task.task_id))
        return StepResult(None, True, reward, Termination.STOP, {"tool_calls": self.tool_calls})
