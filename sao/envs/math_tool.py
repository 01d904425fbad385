"""math_tool: arithmetic word problems whose reliable solution is a call to the sandboxed Python tool.

Each task asks for ``a * b + c``, ``a * b - c`` or ``a + b * c`` with multi-digit operands, either
written as an expression or as a short word problem (the words decide the operator: "more" adds,
"missing" subtracts). A tiny model cannot multiply 3 digits by 2 in its head, but it can copy the
numbers into a tool call and copy the tool's output into its answer:

    user       A shop has 483 boxes with 27 pens in each box and 915 loose pens. How many pens ...?
    assistant  <tool_call>print(483*27+915)</tool_call>
    tool       <tool_response>13956</tool_response>
    assistant  <answer>13956</answer>

Reward 1.0 for a final answer equal to the reference (as integers), else 0.0. Up to
``max_tool_calls`` tool calls per episode (a further call ends it with ``turns``, reward 0); a turn that
ends without a tool call or an answer ends the episode with reward 0. With ``max_tool_calls=0`` the task
is single-turn, the same prompts answered without the tool: the first action ends the episode (a tool
call with ``turns`` and reward 0, unrun), which is the shape single-turn trainers such as TRL's
GRPOTrainer support (``sao bench peer``).

Tasks come from a seeded generator (:func:`generate_tasks`), deduplicated, split into ``train`` and
``heldout``, and stored as JSON Lines (:func:`ensure_dataset`): the same config always writes the same
file.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

from sao.envs.base import Split, StepResult, Task, Termination, ensure_tasks
from sao.envs.latency import LatencyConfig, LatencyModel
from sao.envs.sandbox import Sandbox, SandboxConfig, shared_sandbox
from sao.models.chat import FinalAnswer, Message, ToolCall, parse_action, tool_call_message

__all__ = [
    "ENV_NAME",
    "FAILURE_CLASSES",
    "TEMPLATES",
    "MathToolConfig",
    "MathToolEnv",
    "check_answer",
    "demonstration",
    "failure_class",
    "ensure_dataset",
    "generate_tasks",
]

ENV_NAME = "math_tool"

# (prompt template, expression). The expression lists a, b, c in the order the prompt mentions them.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("What is {a} * {b} + {c}?", "{a}*{b}+{c}"),
    ("Compute {a} * {b} - {c}.", "{a}*{b}-{c}"),
    ("What is {a} + {b} * {c}?", "{a}+{b}*{c}"),
    ("A shop has {a} boxes with {b} pens in each box and {c} loose pens. How many pens are there in total?",
     "{a}*{b}+{c}"),
    ("A farmer plants {a} rows with {b} trees in each row and then {c} more trees. How many trees are there "
     "in total?", "{a}*{b}+{c}"),
    ("A library has {a} shelves with {b} books on each shelf but {c} books are missing. How many books are "
     "left?", "{a}*{b}-{c}"),
    ("There are {a} buses with {b} seats each and {c} seats are broken. How many seats are left?",
     "{a}*{b}-{c}"),
    ("A baker makes {a} trays with {b} cookies per tray and eats {c} cookies. How many cookies are left?",
     "{a}*{b}-{c}"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MathToolConfig:
    """Task generation and episode rules of math_tool.

    Attributes:
        seed: seeds the task generator.
        num_train / num_heldout: tasks per split.
        a_range / b_range / c_range: inclusive operand ranges (a and c up to 3 digits, b 2 digits).
        max_tool_calls: tool calls allowed per episode; one more ends it with ``turns``. 0: no tool
            (single-turn: the first action must be the answer).
        system_prompt: an optional system message before the question ('' = none, the default).
        sandbox: limits of the Python tool.
        latency: injected per-call delay (off by default).
    """

    seed: int = 0
    num_train: int = 20000
    num_heldout: int = 1000
    a_range: tuple[int, int] = (10, 999)
    b_range: tuple[int, int] = (10, 99)
    c_range: tuple[int, int] = (10, 999)
    max_tool_calls: int = 3
    system_prompt: str = ""
    sandbox: SandboxConfig = SandboxConfig()
    latency: LatencyConfig = LatencyConfig()

    def __post_init__(self) -> None:
        for name in ("a_range", "b_range", "c_range"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"MathToolConfig.{name} must be (low, high) with 0 <= low <= high, got {(low, high)}")
        if self.num_train < 0 or self.num_heldout < 0:
            raise ValueError(f"MathToolConfig: num_train and num_heldout must be >= 0, got {self.num_train}, {self.num_heldout}")
        if self.max_tool_calls < 0:
            raise ValueError(f"MathToolConfig.max_tool_calls must be >= 0 (0: no tool), got {self.max_tool_calls}")


def _draw(rng: random.Random, config: MathToolConfig) -> tuple[int, int, int, int]:
    """One (template index, a, b, c) whose answer is positive."""
    while True:
        template = rng.randrange(len(TEMPLATES))
        a, b, c = (rng.randint(*config.a_range), rng.randint(*config.b_range), rng.randint(*config.c_range))
        if eval(TEMPLATES[template][1].format(a=a, b=b, c=c)) > 0:  # noqa: S307 - our own digits
            return template, a, b, c


def generate_tasks(config: MathToolConfig | None = None) -> list[Task]:
    """``num_heldout`` held-out tasks then ``num_train`` train tasks, distinct problems, deterministic.

    Raises ``ValueError`` if the operand ranges cannot supply that many distinct problems.
    """
    config = config or MathToolConfig()
    rng = random.Random(config.seed)
    total = config.num_heldout + config.num_train
    seen: set[tuple[int, int, int, int]] = set()
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < total:
        attempts += 1
        if attempts > 20 * total + 1000:
            raise ValueError(f"MathToolConfig: the operand ranges cannot supply {total} distinct tasks")
        key = _draw(rng, config)
        if key in seen:
            continue
        seen.add(key)
        template, a, b, c = key
        prompt, expression = (text.format(a=a, b=b, c=c) for text in TEMPLATES[template])
        index = len(tasks)
        tasks.append(
            Task(
                task_id=f"{ENV_NAME}-{config.seed}-{index:06d}",
                env=ENV_NAME,
                prompt=prompt,
                answer=str(eval(expression)),  # noqa: S307 - our own digits
                split=Split.HELDOUT if index < config.num_heldout else Split.TRAIN,
                solution=f"print({expression})",
            )
        )
    return tasks


def ensure_dataset(config: MathToolConfig | None, path: str | Path) -> list[Task]:
    """The tasks of ``config``, written to ``path`` (JSON Lines) if absent; an existing file must match."""
    return ensure_tasks(path, generate_tasks(config))


def check_answer(given: str, expected: str) -> bool:
    """Whether ``given`` equals ``expected`` as an integer (commas and spaces ignored)."""
    def normal(text: str) -> str:
        return text.strip().replace(",", "").replace(" ", "")

    given, expected = normal(given), normal(expected)
    try:
        return int(given) == int(expected)
    except ValueError:
        return given != "" and given == expected


FAILURE_CLASSES = ("tool_call", "answer", "structure")


def failure_class(task: Task, actions: Sequence[str]) -> str | None:
    """Why an episode of ``task`` failed, from its action segments as sampled (special tokens kept);
    None if its final answer is right:

    - ``tool_call``: it called the tool, never with the task's expression (a digit or an operator
      copied wrongly from the prompt);
    - ``answer``: it called the tool with the task's expression and then answered something else than
      the tool printed (the answer copied wrongly);
    - ``structure``: it never called the tool, or never answered after a right call (a reply without
      tags, a run to the token or turn budget).
    """
    parsed = [parse_action(text) for text in actions]
    final = parsed[-1] if parsed else None
    if isinstance(final, FinalAnswer) and check_answer(final.answer, task.answer):
        return None
    calls = [action.code for action in parsed if isinstance(action, ToolCall)]
    if not calls:
        return "structure"
    solution = _code(task.solution or "")
    if all(_code(code) != solution for code in calls):
        return "tool_call"
    return "answer" if isinstance(final, FinalAnswer) else "structure"


def _code(code: str) -> str:
    return "".join(code.split())


def demonstration(task: Task) -> list[Message]:
    """The ideal conversation for ``task``: tool call, tool output, answer (what SFT imitates)."""
    if not task.solution:
        raise ValueError(f"task {task.task_id} has no solution to demonstrate")
    return [
        {"role": "user", "content": task.prompt},
        tool_call_message(task.solution),
        {"role": "tool", "content": task.answer},
        {"role": "assistant", "content": f"<answer>{task.answer}</answer>"},
    ]


class MathToolEnv:
    """One math_tool episode at a time (see the module docstring)."""

    name = ENV_NAME

    def __init__(self, config: MathToolConfig | None = None, sandbox: Sandbox | None = None) -> None:
        self.config = config or MathToolConfig()
        self.sandbox = sandbox or shared_sandbox(self.config.sandbox)
        self.latency = LatencyModel(self.config.latency)
        self.task: Task | None = None
        self.tool_calls = 0

    def reset(self, task: Task) -> list[Message]:
        if task.env != ENV_NAME:
            raise ValueError(f"MathToolEnv.reset: task {task.task_id} belongs to env {task.env!r}, not {ENV_NAME!r}")
        self.task, self.tool_calls = task, 0
        messages: list[Message] = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return [*messages, {"role": "user", "content": task.prompt}]

    def tool_code(self, code: str) -> str:
        """What the sandbox runs for a tool call of ``code`` (the code itself here)."""
        return code

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("MathToolEnv.step called before reset")
        action = parse_action(action_text)
        if isinstance(action, ToolCall):
            if self.tool_calls >= self.config.max_tool_calls:
                return StepResult(None, True, 0.0, Termination.TURNS, {"tool_calls": self.tool_calls})
            delay = self.latency.sleep(self.task.task_id, self.tool_calls)
            self.tool_calls += 1
            result = self.sandbox.run(self.tool_code(action.code))
            info = {"tool_status": str(result.status), "tool_wall_s": result.wall_s, "delay_s": delay}
            return StepResult(result.observation, False, info=info)
        correct = isinstance(action, FinalAnswer) and check_answer(action.answer, self.task.answer)
        info = {"tool_calls": self.tool_calls, "answered": int(isinstance(action, FinalAnswer))}
        return StepResult(None, True, 1.0 if correct else 0.0, Termination.STOP, info)
