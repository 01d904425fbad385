"""style_preference: the online-learning simulation of SAO.md section 5.

The policy writes one sentence about a topic. A simulated judge rewards the *currently preferred*
writing style, and the preference shifts on a schedule driven by the trainer's step (never the wall
clock): by default academic until step 150, cute until step 300, classical after.

Four styles, each recognisable from its wording (:data:`STYLE_MARKERS`): academic ("furthermore",
"hypothesis"), cute ("hehe", "fluffy"), classical ("verily", "thou"), chuunibyou ("dark flame",
"abyss"). With ``n_pref`` distinct markers of the preferred style and ``n_other`` distinct markers of
all other styles in a response, and ``m = min_markers``:

    reward = clip((min(n_pref, m) - min(n_other, m)) / m, 0, 1)

so a response purely in the preferred style with at least ``m`` markers scores 1, mixing in other
styles costs reward, and a response in another style scores 0.

This is a simulation: the judge is a word counter, never a live user.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import random
import re
from pathlib import Path

from sao.envs.base import Split, StepResult, Task, Termination, ensure_tasks
from sao.models.chat import Message, Reply, parse_action

__all__ = [
    "ENV_NAME",
    "STYLE_MARKERS",
    "ShiftSchedule",
    "Style",
    "StyleJudge",
    "StylePreferenceConfig",
    "StylePreferenceEnv",
    "classify_style",
    "ensure_dataset",
    "generate_tasks",
    "render_in_style",
    "style_scores",
]

ENV_NAME = "style_preference"


class Style(enum.StrEnum):
    ACADEMIC = "academic"
    CUTE = "cute"
    CLASSICAL = "classical"
    CHUUNIBYOU = "chuunibyou"


STYLE_MARKERS: dict[Style, tuple[str, ...]] = {
    Style.ACADEMIC: ("furthermore", "moreover", "thus", "hence", "we observe", "hypothesis", "evidence",
                     "in conclusion", "significant", "consequently", "notably", "empirical"),
    Style.CUTE: ("hehe", "yay", "nyaa", "fluffy", "cute", "adorable", "sparkle", "kitty", "super duper",
                 "uwu", "teehee", "cozy"),
    Style.CLASSICAL: ("verily", "thou", "thee", "thy", "doth", "hath", "hark", "forsooth", "prithee",
                      "methinks", "alas", "o gentle"),
    Style.CHUUNIBYOU: ("behold", "dark flame", "sealed", "abyss", "forbidden", "my right arm", "fate",
                       "awakens", "cursed eye", "chosen one", "darkness", "demon king"),
}  # fmt: skip
_PATTERNS = {
    style: re.compile(r"\b(" + "|".join(re.escape(m) for m in markers) + r")\b", re.IGNORECASE)
    for style, markers in STYLE_MARKERS.items()
}

_STYLE_TEMPLATES: dict[Style, tuple[str, ...]] = {
    Style.ACADEMIC: (
        "Furthermore, we observe that {topic} is consistent with the hypothesis; thus, the evidence is significant.",
        "In conclusion, the empirical evidence on {topic} is notably significant; hence, we observe a pattern.",
        "Moreover, {topic} presents a significant case; consequently, the hypothesis is supported.",
    ),
    Style.CUTE: (
        "Hehe, {topic} is so cute and fluffy, yay!",
        "Nyaa, {topic} is super duper adorable, teehee!",
        "Yay, {topic} feels so cozy, like a sparkle kitty, uwu!",
    ),
    Style.CLASSICAL: (
        "Verily, {topic} doth shine upon thee, and thy heart hath spoken.",
        "Hark, forsooth, {topic} hath a grace that thou canst not deny.",
        "Alas, methinks {topic} doth move thee, o gentle friend.",
    ),
    Style.CHUUNIBYOU: (
        "Behold! {topic} awakens the dark flame sealed in my right arm!",
        "The abyss trembles, for {topic} is bound to my forbidden power and fate itself!",
        "Darkness obeys me; {topic} is the sealed key of the demon king, behold!",
    ),
}

_TOPICS: tuple[str, ...] = (
    "the moon", "the sea", "the forest", "the city", "a cat", "a dog", "the rain", "a book", "the river",
    "the mountain", "the garden", "music", "coffee", "winter", "summer", "the wind", "a bridge", "the stars",
    "a train", "bread", "the market", "a letter", "the clock", "a lamp", "the snow", "a candle", "the road",
    "a song", "the harbor", "a kite", "the desert", "an apple", "the library", "a bicycle", "the sunrise",
    "a teapot", "the meadow", "a lighthouse", "the island", "a violin",
)  # fmt: skip
_INSTRUCTIONS: tuple[str, ...] = (
    "Write one sentence about {topic}.",
    "Describe {topic} in one line.",
    "Say something about {topic}.",
)


@dataclasses.dataclass(frozen=True)
class ShiftSchedule:
    """The preferred style as a function of the trainer step.

    Attributes:
        styles: preferred style in each phase, in order (one more than ``shift_steps``).
        shift_steps: trainer steps at which the next phase starts (strictly increasing, > 0).
    """

    styles: tuple[Style, ...] = (Style.ACADEMIC, Style.CUTE, Style.CLASSICAL)
    shift_steps: tuple[int, ...] = (150, 300)

    def __post_init__(self) -> None:
        object.__setattr__(self, "styles", tuple(Style(s) for s in self.styles))
        if len(self.styles) != len(self.shift_steps) + 1:
            raise ValueError(
                f"ShiftSchedule: styles needs one more entry than shift_steps, got {len(self.styles)} styles "
                f"and {len(self.shift_steps)} shift_steps"
            )
        steps = list(self.shift_steps)
        if any(s <= 0 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"ShiftSchedule.shift_steps must be strictly increasing and > 0, got {self.shift_steps}")

    def preferred(self, step: int) -> Style:
        """The style preferred at trainer step ``step`` (a shift at step s applies from s on)."""
        if step < 0:
            raise ValueError(f"ShiftSchedule.preferred: step must be >= 0, got {step}")
        return self.styles[bisect.bisect_right(self.shift_steps, step)]


def style_scores(text: str) -> dict[Style, int]:
    """Number of distinct markers of each style that ``text`` contains (case-insensitive, whole words)."""
    return {style: len({m.lower() for m in pattern.findall(text)}) for style, pattern in _PATTERNS.items()}


def classify_style(text: str) -> Style | None:
    """The style with the most distinct markers; ``None`` for no markers or a tie at the top."""
    scores = style_scores(text)
    best = max(scores.values())
    leaders = [style for style, score in scores.items() if score == best]
    return leaders[0] if best > 0 and len(leaders) == 1 else None


@dataclasses.dataclass(frozen=True)
class StyleJudge:
    """Scores a response against the style preferred at a trainer step (formula in the module docstring).

    Attributes:
        schedule: the preference shifts.
        min_markers: distinct preferred-style markers for full reward (``m``).
    """

    schedule: ShiftSchedule = ShiftSchedule()
    min_markers: int = 2

    def __post_init__(self) -> None:
        if self.min_markers < 1:
            raise ValueError(f"StyleJudge.min_markers must be >= 1, got {self.min_markers}")

    def reward(self, text: str, step: int) -> float:
        preferred = self.schedule.preferred(step)
        scores = style_scores(text)
        n_pref = scores.pop(preferred)
        n_other = sum(scores.values())
        m = self.min_markers
        return max(0.0, min(1.0, (min(n_pref, m) - min(n_other, m)) / m))


@dataclasses.dataclass(frozen=True)
class StylePreferenceConfig:
    """Tasks and judge of style_preference.

    Attributes:
        seed: seeds the split of (instruction, topic) prompts into train and held-out.
        heldout_fraction: share of the prompts held out.
        judge: the simulated judge and its shift schedule.
    """

    seed: int = 0
    heldout_fraction: float = 0.2
    judge: StyleJudge = StyleJudge()

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"StylePreferenceConfig.heldout_fraction must lie in [0, 1), got {self.heldout_fraction}")


def generate_tasks(config: StylePreferenceConfig | None = None) -> list[Task]:
    """Every (instruction, topic) prompt once, split by a seeded shuffle; deterministic."""
    config = config or StylePreferenceConfig()
    prompts = [instruction.format(topic=topic) for topic in _TOPICS for instruction in _INSTRUCTIONS]
    order = list(range(len(prompts)))
    random.Random(config.seed).shuffle(order)
    heldout = set(order[: round(config.heldout_fraction * len(prompts))])
    return [
        Task(
            task_id=f"{ENV_NAME}-{index:04d}",
            env=ENV_NAME,
            prompt=prompt,
            answer="",
            split=Split.HELDOUT if index in heldout else Split.TRAIN,
        )
        for index, prompt in enumerate(prompts)
    ]


def ensure_dataset(config: StylePreferenceConfig | None, path: str | Path) -> list[Task]:
    """The tasks of ``config``, written to ``path`` (JSON Lines) if absent; an existing file must match."""
    return ensure_tasks(path, generate_tasks(config))


def topic_of(task: Task) -> str:
    """The topic a style_preference prompt asks about."""
    for topic in _TOPICS:
        if topic in task.prompt:
            return topic
    raise ValueError(f"task {task.task_id} names no known topic: {task.prompt!r}")


def render_in_style(topic: str, style: Style, rng: random.Random) -> str:
    """A sentence about ``topic`` in ``style`` (demonstrations and tests)."""
    return rng.choice(_STYLE_TEMPLATES[Style(style)]).format(topic=topic)


class StylePreferenceEnv:
    """One style_preference episode: a single reply, scored at ``trainer_step``.

    ``trainer_step`` is the trainer's step when the reward is observed; the agent loop sets it (at
    construction or by assignment) before :meth:`step`.
    """

    name = ENV_NAME

    def __init__(self, config: StylePreferenceConfig | None = None, trainer_step: int = 0) -> None:
        self.config = config or StylePreferenceConfig()
        self.trainer_step = trainer_step
        self.task: Task | None = None

    def reset(self, task: Task) -> list[Message]:
        if task.env != ENV_NAME:
            raise ValueError(f"StylePreferenceEnv.reset: task {task.task_id} belongs to env {task.env!r}, not {ENV_NAME!r}")
        self.task = task
        return [{"role": "user", "content": task.prompt}]

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("StylePreferenceEnv.step called before reset")
        action = parse_action(action_text)
        text = action.text if isinstance(action, Reply) else action_text
        reward = self.config.judge.reward(text, self.trainer_step)
        preferred = self.config.judge.schedule.preferred(self.trainer_step)
        info = {"preferred_style": str(preferred), "style": str(classify_style(text) or "none")}
        return StepResult(None, True, reward, Termination.STOP, info)
