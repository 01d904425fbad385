"""Reward functions named ``"module:function"``: the user's own, or the built-in ones here.

A reward function is called once per trajectory, when the episode ends, with keyword arguments:

    prompt      the task's prompt as the data gave it (a string, or a list of chat messages)
    completion  the final assistant text (the last action, its stop token removed)
    messages    the whole conversation: the prompt messages, then every action and tool output
    answer      the task's reference answer ('' when the data has none)
    info        the task's ``info`` object ({} when the data has none)
    task_id     the task's id

and must accept ``**kwargs`` (more arguments may be passed in later versions). It may be a plain or
an ``async`` function and returns a float. With several functions the reward is their weighted sum
(``reward.weights``, default 1 each). A function that raises, or returns something that is not a finite
number, is a :class:`RewardError`: the agent loop ends that trajectory with termination reason
``error`` and stores the message with it (never a silent 0, never a crashed replica).

Where functions are found: :func:`resolve_reward` imports the module from the working directory or an
installed package at start and records the folder it came from, so rollout replicas (other processes,
other working directories) import the same file (:class:`RewardSet`'s ``paths``).

Built in: :func:`exact_match` and :func:`math_verify` (``sao.rewards:exact_match``,
``sao.rewards:math_verify``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ANSWER_REWARDS", "RewardError", "RewardImportError", "RewardSet", "exact_match", "final_answer", "import_path", "math_verify",
           "resolve_function", "resolve_reward", "split_spec"]

_SPEC = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*):([A-Za-z_]\w*)$")


class RewardImportError(ValueError):
    """A reward function that cannot be used: a malformed name, a module or function that is not
    there, or a signature without ``**kwargs``; the message says what was tried."""


class RewardError(RuntimeError):
    """A reward function raised or returned a value that is not a finite number."""


def _module_folder(module: Any) -> str | None:
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    # A package's root, so that "pkg.sub:f" imports again from the folder holding "pkg".
    depth = module.__name__.count(".") + (1 if path.name == "__init__.py" else 0)
    return str(path.parents[depth])


def resolve_reward(spec: str, paths: Sequence[str] = ()) -> tuple[Callable[..., Any], str | None]:
    """The reward function ``spec`` names and the folder its top-level module was imported from (None
    for a module without a file). ``paths`` are searched before ``sys.path``; the working directory is
    searched too, as ``python -c`` would.

    Raises:
        RewardImportError: naming the spec and the places that were searched, or a function without
            ``**kwargs``.
    """
    return resolve_function(spec, paths, what="reward function", require_kwargs=True)


@contextlib.contextmanager
def import_path(folders: Sequence[str]) -> Iterator[None]:
    """``folders`` put first on ``sys.path`` (those not already on it) while the block imports."""
    added = [folder for folder in folders if folder not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for folder in added:
            if folder in sys.path:
                sys.path.remove(folder)


def split_spec(spec: str, what: str = "function") -> tuple[str, str]:
    """``module:function`` as (module, function). Raises :class:`RewardImportError` (``what`` names the
    spec) when it is not that."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise RewardImportError(f"{what} {spec!r}: expected MODULE:FUNCTION, e.g. my_rewards:correct "
                                "or sao.rewards:math_verify")
    module_name, function_name = match.groups()
    return module_name, function_name


def resolve_function(spec: str, paths: Sequence[str] = (), *, what: str = "function",
                     require_kwargs: bool = False) -> tuple[Callable[..., Any], str | None]:
    """:func:`resolve_reward` for any ``module:function`` (``what`` names it in messages)."""
    module_name, function_name = split_spec(spec, what)
    searched = [*paths, str(Path.cwd())]
    try:
        with import_path(searched):
            module = importlib.import_module(module_name)
    except ImportError as error:
        where = ", ".join(searched)
        raise RewardImportError(f"{what} {spec!r}: cannot import module {module_name!r} "
                                f"({type(error).__name__}: {error}); searched {where} and the installed "
                                "packages") from None
    except Exception as error:  # the user's module failed while importing
        raise RewardImportError(f"{what} {spec!r}: importing {module_name!r} raised "
                                f"{type(error).__name__}: {error}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardImportError(f"{what} {spec!r}: module {module_name!r} "
                                f"({getattr(module, '__file__', 'built in')}) has no function {function_name!r}")
    parameters = inspect.signature(function).parameters.values()
    if require_kwargs and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise RewardImportError(f"reward function {spec!r} must accept **kwargs (it is called with prompt, "
                                "completion, messages, answer, info, task_id and possibly more)")
    return function, _module_folder(module)


class RewardSet:
    """Reward functions and their weights, loaded once; :meth:`score` calls them on a trajectory."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] | None = None, paths: Sequence[str] = ()):
        if not specs:
            raise RewardImportError("no reward function given (reward.functions is empty)")
        if weights is not None and len(weights) != len(specs):
            raise RewardImportError(f"reward.weights has {len(weights)} values for {len(specs)} functions")
        self.specs = tuple(specs)
        self.weights = tuple(float(w) for w in weights) if weights is not None else (1.0,) * len(specs)
        resolved = [resolve_reward(spec, paths) for spec in specs]
        self.functions = [function for function, _ in resolved]
        self.paths = tuple(dict.fromkeys(folder for _, folder in resolved if folder is not None))

    def score(self, **kwargs: Any) -> float:
        """The weighted sum of every function's reward for one trajectory.

        Raises:
            RewardError: naming the function that raised or returned a non-finite value.
        """
        total = 0.0
        for spec, weight, function in zip(self.specs, self.weights, self.functions, strict=True):
            try:
                value = function(**kwargs)
                if inspect.isawaitable(value):
                    value = asyncio.run(_await(value))
            except Exception as error:
                raise RewardError(f"reward function {spec} raised {type(error).__name__}: {error}") from error
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardError(f"reward function {spec} returned {value!r}, not a finite number")
            total += weight * float(value)
        return total


async def _await(value: Any) -> Any:
    return await value


def final_answer(completion: str) -> str:
    """The answer in a completion: the last ``<answer>...</answer>``, else the last ``\\boxed{...}``,
    else the whole text, stripped."""
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.S)
    if tagged:
        return tagged[-1].strip()
    for start in reversed([m.end() for m in re.finditer(r"\\boxed\{", completion)]):
        depth = 0  # braces balanced: \boxed{\frac{1}{2}} is \frac{1}{2}; an unclosed one is passed over
        for end in range(start, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[end], 0)
            if depth < 0:
                return completion[start:end].strip()
    return completion.strip()


ANSWER_REWARDS = frozenset({"sao.rewards:exact_match", "sao.rewards:math_verify"})
"""The built-in reward functions that compare with the task's reference ``answer``: a run using them
refuses tasks without one at start (:func:`sao.runs.prepare_inputs`)."""


def _reference(answer: Any, reward: str) -> str:
    text = str(answer).strip()
    if not text:
        raise RewardError(f"{reward}: the task has no reference answer (the task data's 'answer' column) to "
                          "compare with")
    return text


def exact_match(completion: str, answer: str, **kwargs: Any) -> float:
    """1.0 when the completion's final answer (:func:`final_answer`) equals ``answer`` after stripping
    whitespace, else 0.0. A task without an answer is a :class:`RewardError`, not a 0."""
    return 1.0 if final_answer(completion) == _reference(answer, "exact_match") else 0.0


def math_verify(completion: str, answer: str, **kwargs: Any) -> float:
    """1.0 when the completion's final answer is mathematically equal to ``answer`` by
    `math-verify <https://github.com/huggingface/Math-Verify>`_ (numbers, fractions, LaTeX
    expressions, sets, ...), else 0.0. A reference answer that is missing or that math-verify cannot
    parse is a :class:`RewardError`, not a 0 for every reply."""
    from math_verify import parse, verify

    reference = _reference(answer, "math_verify")
    gold = parse(reference, parsing_timeout=None)
    if not gold:
        raise RewardError(f"math_verify: cannot parse the task's reference answer {reference!r}")
    given = parse(final_answer(completion), parsing_timeout=None)
    if not given:
        return 0.0
    return 1.0 if verify(gold, given, timeout_seconds=None) else 0.0


def call_arguments(prompt: str | list[Mapping[str, Any]], completion: str, messages: list[Mapping[str, Any]],
                   answer: str, info: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    """The keyword arguments a reward function is called with (the module docstring)."""
    return {"prompt": prompt, "completion": completion, "messages": messages, "answer": answer,
            "info": dict(info), "task_id": task_id}
