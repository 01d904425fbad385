"""Tasks from the user's files: JSON Lines, Parquet, a saved Hugging Face ``datasets`` directory or a
Delta table, with the ecosystem's columns (TRL, verifiers, prime-rl):

    prompt    a string (one user message) or a list of chat messages ({"role", "content"})
    answer    optional: the reference answer, a string (numbers are taken as their text)
    info      optional: an object of task facts, handed to the reward functions
    task_id   optional: a unique string; else a stable hash of the row

Other columns are not read. Every row of a file is checked before any rollout starts; a
:class:`DataError` lists the bad rows with their file, row number (1-based; the line of a JSONL file)
and field, all of them, not just the first (past :data:`_MAX_REPORTED`, how many more). Tasks become
:class:`sao.envs.base.Task` rows of the ``dataset`` environment; :func:`split_heldout` holds out a seeded fraction when no evaluation file is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sao.envs.base import Split, Task
from sao.envs.dataset import ENV_NAME

__all__ = ["COLUMNS", "DataError", "load_demonstrations", "load_tasks", "read_rows", "split_heldout"]

COLUMNS = ("prompt", "answer", "info", "task_id")
_ROLES = ("system", "user", "assistant", "tool")
_MAX_REPORTED = 50


class DataError(ValueError):
    """Bad task data: every problem found, one per line, each naming the file, row and field."""


def _format(path: Path) -> str:
    if path.is_dir():
        if (path / "_delta_log").is_dir():
            return "delta"
        if (path / "dataset_info.json").exists() or (path / "state.json").exists() or (
                path / "dataset_dict.json").exists():
            return "datasets"
        raise DataError(f"{path}: a folder that is neither a Delta table (_delta_log/) nor a saved datasets "
                        "directory (dataset_info.json, from Dataset.save_to_disk)")
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if path.suffix in (".parquet", ".pq"):
        return "parquet"
    raise DataError(f"{path}: unknown task file type {path.suffix!r}; use .jsonl, .parquet, a saved datasets "
                    "directory or a Delta table")


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a task file, rows as parsed (a JSONL line that is not JSON is a DataError)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such task file or folder")
    kind = _format(path)
    if kind == "jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as error:
                    yield number, _Unparsed(f"not JSON ({error.msg} at column {error.colno})")
        return
    if kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    elif kind == "delta":
        from deltalake import DeltaTable

        table = DeltaTable(str(path)).to_pyarrow_table()
    else:
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise DataError(f"{path}: a DatasetDict with splits {sorted(loaded)}; point at one split's folder")
        table = loaded.data.table
    yield from enumerate(table.to_pylist(), start=1)


@dataclasses.dataclass(frozen=True)
class _Unparsed:
    problem: str


def _check_messages(value: list, problems: list[str]) -> None:
    if not value:
        problems.append("field 'prompt': an empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            problems.append(f"field 'prompt[{i}]': a message must be an object, got {type(message).__name__}")
        elif message.get("role") not in _ROLES:
            problems.append(f"field 'prompt[{i}].role': must be one of {list(_ROLES)}, got {message.get('role')!r}")
        elif not isinstance(message.get("content"), str):
            problems.append(f"field 'prompt[{i}].content': must be a string, got "
                            f"{type(message.get('content')).__name__}")


def _task(row: Any, split: Split) -> tuple[Task | None, list[str]]:
    if isinstance(row, _Unparsed):
        return None, [row.problem]
    if not isinstance(row, dict):
        return None, [f"a row must be an object with a 'prompt', got {type(row).__name__}"]
    problems: list[str] = []
    prompt = row.get("prompt")
    if prompt is None:
        problems.append("field 'prompt': missing")
    elif isinstance(prompt, list):
        _check_messages(prompt, problems)
    elif not isinstance(prompt, str) or not prompt.strip():
        problems.append(f"field 'prompt': must be a non-empty string or a list of messages, got {prompt!r}")
    answer = row.get("answer")
    if answer is None:
        answer = ""
    elif isinstance(answer, bool) or not isinstance(answer, str | int | float):
        problems.append(f"field 'answer': must be a string or a number, got {type(answer).__name__}")
    elif isinstance(answer, float) and not math.isfinite(answer):
        problems.append(f"field 'answer': must be a finite number, got {answer!r}")
    info = row.get("info")
    if info is None:
        info = {}
    elif not isinstance(info, dict):
        problems.append(f"field 'info': must be an object, got {type(info).__name__}")
    task_id = row.get("task_id")
    if task_id is not None and (not isinstance(task_id, str) or not task_id):
        problems.append(f"field 'task_id': must be a non-empty string, got {task_id!r}")
    if problems:
        return None, problems
    try:
        info_text = json.dumps(info, sort_keys=True) if info else ""
    except TypeError as error:
        return None, [f"field 'info': not JSON-serialisable ({error})"]
    if task_id is None:
        content = {"prompt": prompt, "answer": answer, "info": info}
        task_id = "t" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    text = prompt if isinstance(prompt, str) else next(
        (m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])
    messages = json.dumps(prompt) if isinstance(prompt, list) else ""
    return Task(task_id=task_id, env=ENV_NAME, prompt=text, answer=str(answer), split=split, messages=messages,
                info=info_text), []


def _refuse(problems: list[str], what: str) -> None:
    """Raise a :class:`DataError` listing ``problems`` (the first :data:`_MAX_REPORTED`), if any."""
    if problems:
        shown = problems[:_MAX_REPORTED]
        more = f"\n... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise DataError(f"{len(problems)} problem(s) in {what}:\n" + "\n".join(shown) + more)


def load_tasks(path: str | Path, split: Split | str = Split.TRAIN) -> list[Task]:
    """Every task of ``path`` (see the module docstring), checked in full.

    Raises:
        DataError: listing every bad row (file, row number, field), duplicate task ids, or an empty file.
    """
    path = Path(path)
    tasks: list[Task] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for number, row in read_rows(path):
        task, found = _task(row, Split(split))
        problems += [f"{path}: row {number}: {problem}" for problem in found]
        if task is None:
            continue
        if task.task_id in seen:
            problems.append(f"{path}: row {number}: field 'task_id': {task.task_id!r} repeats row {seen[task.task_id]}"
                            " (an identical row without a task_id hashes to the same id)")
            continue
        seen[task.task_id] = number
        tasks.append(task)
    _refuse(problems, "the task data")
    if not tasks:
        raise DataError(f"{path}: no tasks (an empty file)")
    return tasks


def load_demonstrations(path: str | Path) -> list[tuple[Task, str]]:
    """(task, completion) per row of a demonstration file (``sft.data``): the task columns (see the
    module docstring; a prompt may repeat) and ``completion``, the assistant's reply, a non-empty string.

    Raises:
        DataError: listing every bad row (file, row number, field), or an empty file.
    """
    path = Path(path)
    found: list[tuple[Task, str]] = []
    problems: list[str] = []
    for number, row in read_rows(path):
        task, bad = _task(row, Split.TRAIN)
        completion = row.get("completion") if isinstance(row, dict) else None
        if isinstance(row, dict) and (not isinstance(completion, str) or not completion.strip()):
            bad = [*bad, f"field 'completion': must be a non-empty string (the assistant's reply), got {completion!r}"]
        problems += [f"{path}: row {number}: {problem}" for problem in bad]
        if task is not None and not bad:
            found.append((task, completion))
    _refuse(problems, "the demonstrations")
    if not found:
        raise DataError(f"{path}: no demonstrations (an empty file)")
    return found


def split_heldout(tasks: Sequence[Task], fraction: float, seed: int) -> list[Task]:
    """``tasks`` with a seeded ``fraction`` of them (at least one) moved to the held-out split."""
    if len(tasks) < 2:
        raise DataError(f"{len(tasks)} task(s): too few to hold some out; give data.eval")
    count = min(len(tasks) - 1, max(1, round(fraction * len(tasks))))
    held = set(random.Random(seed).sample(range(len(tasks)), count))
    return [dataclasses.replace(t, split=Split.HELDOUT if i in held else Split.TRAIN) for i, t in enumerate(tasks)]
