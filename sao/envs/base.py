"""What every environment provides, and the task dataset files the rollout side reads.

An environment instance runs one episode at a time (create one per concurrent episode; they are cheap
and share the process-wide sandbox):

    messages = env.reset(task)            # the prompt, as chat messages
    result = env.step(action_text)        # after each action segment (decoded, special tokens kept)
    # result.done is False: result.observation is the tool output to insert (sao.models.chat)
    # result.done is True: result.reward is the episode's reward, result.termination why it ended

Rewards are terminal: 0.0 until ``done``. Environments end episodes with ``stop`` (answer given or turn
closed) or ``turns`` (tool-call budget spent); the agent loop adds ``length``, ``timeout``, ``cancelled``
and ``error`` (DESIGN.md "termination reason").

Dataset files are JSON Lines, one :class:`Task` per line with exactly the fields of
:data:`TASK_FIELDS`; :func:`read_tasks` validates every row and names the line and field that is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from sao.models.chat import Message

__all__ = [
    "TASK_FIELDS",
    "Environment",
    "Split",
    "StepResult",
    "Task",
    "Termination",
    "ensure_tasks",
    "read_tasks",
    "write_tasks",
]


class Termination(enum.StrEnum):
    """Why a trajectory ended (DESIGN.md). Only ``stop`` ends with value 0; the others bootstrap."""

    STOP = "stop"
    LENGTH = "length"
    TURNS = "turns"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    ERROR = "error"


class Split(enum.StrEnum):
    TRAIN = "train"
    HELDOUT = "heldout"


@dataclasses.dataclass(frozen=True)
class Task:
    """One prompt of an environment's dataset.

    Attributes:
        task_id: unique within the dataset, stable across regenerations with the same config.
        env: the environment's name (``math_tool``, ``style_preference``).
        prompt: the user message.
        answer: the reference answer ('' where the judge needs none).
        split: ``train`` or ``heldout``.
        solution: a reference action used for SFT demonstrations (math_tool: the tool code), or ''.
        messages: the prompt as chat messages, JSON text ('' when ``prompt`` is the one user message).
        info: an object of task facts for the reward functions, JSON text ('' for none).
    """

    task_id: str
    env: str
    prompt: str
    answer: str
    split: Split
    solution: str = ""
    messages: str = ""
    info: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", Split(self.split))


TASK_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(Task))
OPTIONAL_TASK_FIELDS: tuple[str, ...] = ("solution", "messages", "info")
"""Fields a task file's row may leave out (written by an older version, or empty)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one action segment.

    Attributes:
        observation: the tool output to insert when the episode continues; ``None`` when ``done``.
        done: the episode is over.
        reward: the terminal reward when ``done``, else 0.0.
        termination: why the episode ended (``stop`` or ``turns``); ``None`` while it continues.
        info: per-step facts for the trajectory record (tool status, tool_wall_s, delay_s, ...).
    """

    observation: str | None
    done: bool
    reward: float = 0.0
    termination: Termination | None = None
    info: Mapping[str, str | float | int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.done != (self.observation is None):
            raise ValueError(f"StepResult: observation must be None exactly when done (done={self.done})")
        if self.done != (self.termination is not None):
            raise ValueError(f"StepResult: termination must be set exactly when done (done={self.done})")
        if not self.done and self.reward != 0.0:
            raise ValueError(f"StepResult: rewards are terminal, got reward={self.reward} before done")


@runtime_checkable
class Environment(Protocol):
    """A task environment; one instance per concurrent episode."""

    name: str

    def reset(self, task: Task) -> list[Message]:
        """Start an episode on ``task``; returns the prompt messages (system/user)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Consume one decoded action segment; returns an observation or the episode's end."""
        ...


def write_tasks(path: str | Path, tasks: Iterable[Task]) -> Path:
    """Write ``tasks`` as JSON Lines (keys in :data:`TASK_FIELDS` order); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    lines = []
    for task in tasks:
        if task.task_id in seen:
            raise ValueError(f"write_tasks: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        row = {name: str(getattr(task, name)) for name in TASK_FIELDS
               if name not in OPTIONAL_TASK_FIELDS or getattr(task, name)}
        lines.append(json.dumps(row, ensure_ascii=False))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_tasks(path: str | Path, *, split: Split | str | None = None) -> list[Task]:
    """Read and validate a task file; ``split`` keeps only that split. Raises naming the line and field."""
    path = Path(path)
    wanted = None if split is None else Split(split)
    tasks = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            where = f"{path}:{number}"
            required = set(TASK_FIELDS) - set(OPTIONAL_TASK_FIELDS)
            if not isinstance(row, dict) or not required <= set(row) <= set(TASK_FIELDS):
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{where}: expected the fields {list(TASK_FIELDS)} (optional: "
                                 f"{list(OPTIONAL_TASK_FIELDS)}), got {keys}")
            for name in row:
                if not isinstance(row[name], str):
                    raise ValueError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")
            if row["split"] not in set(Split):
                raise ValueError(f"{where}: field 'split' must be one of {[s.value for s in Split]}, got {row['split']!r}")
            task = Task(**row)
            if wanted is None or task.split is wanted:
                tasks.append(task)
    return tasks


def ensure_tasks(path: str | Path, tasks: list[Task]) -> list[Task]:
    """Write ``tasks`` to ``path`` if it is absent; an existing file must hold exactly these tasks.

    Raises ``ValueError`` naming the file if it holds different tasks (another seed or size): delete
    it or use another path.
    """
    path = Path(path)
    if not path.exists():
        write_tasks(path, tasks)
        return list(tasks)
    stored = read_tasks(path)
    if stored != list(tasks):
        raise ValueError(f"{path} holds a different dataset than this config generates; delete it or use another path")
    return stored
