"""``verifiers`` environments (extra ``sao[verifiers]``): ``env.verifiers: {id: module, args: {...}}``.

The environment is loaded with ``verifiers.load_environment(id, **args)`` (a module on the import path
or the working directory that defines ``load_environment``; verifiers 0.3's classic API). Its dataset
is the run's task source: the train split from its dataset, the held-out split from its eval dataset
(without one, a seeded ``data.eval_fraction`` of the train rows). Each row is kept whole in its task
(``info``: the environment's id and args, and the row), so any replica, and trajectory replay, runs the
same row.

An episode is the environment's own rollout loop (:func:`agent`), an agent of one's own on the chat
endpoint (:mod:`sao.rollout.user_agent`): ``env.rollout(row, client, ...)`` with the episode's client,
then its rubric scores the state, and that score is the reward. verifiers turns a failed model call into
an error in its state instead of raising; :func:`agent` raises it, so the trajectory ends with ``error``
and its text (or with the budget that refused the call: ``turns``, ``length``, ``timeout``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sao.envs.base import Split, Task
from sao.rewards import import_path

__all__ = ["AGENT", "VerifiersError", "agent", "load", "module_folder", "module_name", "tasks"]

AGENT = "sao.envs.verifiers_env:agent"
"""The agent that runs a verifiers environment's rollout loop (what ``env.verifiers`` sets ``env.agent`` to)."""

_ENVS: dict[str, Any] = {}
_LOCK = threading.Lock()


class VerifiersError(ValueError):
    """verifiers is not installed, or the environment cannot be loaded or has no rows."""


@contextlib.contextmanager
def _no_signal_handlers():
    """verifiers' environments install SIGINT and SIGTERM handlers when built: in a rollout replica (not
    the main thread) that raises, and in the run's process it would replace the run's own Ctrl-C
    handling (:mod:`sao.interrupt`). They are not installed; the environment's teardown still runs at exit."""
    original = signal.signal
    signal.signal = lambda signalnum, handler: signal.getsignal(signalnum)  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = original


def _key(spec: Mapping[str, Any]) -> str:
    return json.dumps({"id": spec["id"], "args": dict(spec.get("args") or {})}, sort_keys=True)


def module_name(env_id: str) -> str:
    """The module environment ``env_id`` is loaded from (what ``load_environment`` imports)."""
    return env_id.replace("-", "_").split("/")[-1]


def module_folder(env_id: str) -> str | None:
    """The folder environment ``env_id``'s module is found in (the working directory first), or None
    for an installed package or a module that is not found."""
    import importlib.util

    name = module_name(env_id)
    local = Path.cwd() / f"{name}.py"
    if local.exists() or (Path.cwd() / name / "__init__.py").exists():
        return str(Path.cwd())
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if found is None or found.origin is None else str(Path(found.origin).parent)


def load(spec: Mapping[str, Any]) -> Any:
    """The environment of ``spec`` (``{"id", "args"}``, optionally ``"paths"`` to import it from), loaded
    once per process. Raises :class:`VerifiersError` naming what is missing."""
    paths = tuple(spec.get("paths") or ())
    key = _key(spec)
    with _LOCK:
        if key in _ENVS:
            return _ENVS[key]
        try:
            import verifiers as vf
        except ImportError as error:
            raise VerifiersError(f"env.verifiers needs the verifiers package: pip install 'sao[verifiers]' ({error})") \
                from None
        searched = [*paths, str(Path.cwd())]
        try:
            with import_path(searched), _no_signal_handlers():
                env = vf.load_environment(spec["id"], **dict(spec.get("args") or {}))
        except Exception as error:
            raise VerifiersError(f"env.verifiers: load_environment({spec['id']!r}) failed: {type(error).__name__}: "
                                 f"{error} (searched {', '.join(searched)} and the installed packages)") from None
        _ENVS[key] = env
        return env


def _task(spec: Mapping[str, Any], row: Mapping[str, Any], split: Split, index: int) -> Task:
    row = json.loads(json.dumps(dict(row), default=str))  # plain JSON data, as every replica will read it
    messages = row.get("prompt")
    if not isinstance(messages, list) or not messages:
        raise VerifiersError(f"env.verifiers {spec['id']!r}: row {index} of its {split} data has no prompt messages")
    users = [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
    example = row.get("example_id", index)
    return Task(task_id=f"{spec['id']}-{split}-{example}", env="dataset",
                prompt=users[-1] if users and isinstance(users[-1], str) else json.dumps(messages),
                answer=str(row.get("answer") or ""), split=split, messages=json.dumps(messages),
                info=json.dumps({"verifiers": dict(spec), "row": row}))


def tasks(spec: Mapping[str, Any], *, eval_fraction: float, seed: int) -> list[Task]:
    """The run's tasks from the environment's dataset (train) and eval dataset (held out)."""
    env = load(spec)
    train_rows = env.get_dataset() if getattr(env, "dataset", None) is not None else None
    eval_rows = env.get_eval_dataset() if getattr(env, "eval_dataset", None) is not None else None
    if train_rows is None and eval_rows is None:
        raise VerifiersError(f"env.verifiers {spec['id']!r}: the environment has neither a dataset nor an eval dataset")
    if train_rows is None:
        train_rows, eval_rows = eval_rows, None
    train = [_task(spec, row, Split.TRAIN, i) for i, row in enumerate(train_rows)]
    if eval_rows is None:
        from sao.data import split_heldout

        return split_heldout(train, eval_fraction, seed)
    return train + [_task(spec, row, Split.HELDOUT, i) for i, row in enumerate(eval_rows)]


async def agent(client: Any, task: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One rollout of the task's verifiers environment against the episode's client, scored by its rubric."""
    from verifiers.clients import OpenAIChatCompletionsClient

    spec, row = task["info"]["verifiers"], task["info"]["row"]
    env = load(spec)
    state = await env.rollout(row, OpenAIChatCompletionsClient(client), "policy", {})
    if state.get("error") is not None:
        raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
    await env.rubric.score_rollout(state)
    return float(state["reward"]), {"stop_condition": state.get("stop_condition"),
                                    "metrics": dict(state.get("metrics") or {})}
