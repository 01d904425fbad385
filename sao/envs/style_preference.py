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

Options for online-learning experiments in which a critic has something to follow (all off by default):

- ``personas``: every prompt names the reader it is for ("... It is for Ada."), and the judge can keep
  a schedule per persona (``StyleJudge.persona_schedules``), so preferences depend on the prompt and
  shift at different steps for different readers;
- ``StyleJudge.graded``: ``reward = 0.2 + 0.8 * clip((min(n_pref, m) - min(n_other, m) / 2) / m, 0, 1)``
  for a finished reply: a reply in the old style keeps the floor after a shift instead of scoring 0, and
  each preferred marker, or one fewer marker of another style, earns more;
- ``answer_tag``: replies end on a closing tag, ``<answer>...</answer>`` (the demonstrations are written
  so, and ``</answer>`` stops generation as in math_tool); a reply that does not close scores 0;
- ``warm_start_bias``: the warm start's demonstrations favour each reader's first style, so the
  version-0 policy starts to tell the readers apart.

This is a simulation: the judge is a word counter, never a live user.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import json
import random
import re
from pathlib import Path

from sao.envs.base import Split, StepResult, Task, Termination, ensure_tasks
from sao.models.chat import ANSWER_END, ANSWER_START, FinalAnswer, Message, Reply, parse_action

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
    "persona_of",
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
_PERSONA_PROMPT = "{instruction} It is for {persona}."
GRADED_FLOOR = 0.2
"""A finished reply's reward under ``StyleJudge.graded`` whatever its style."""


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
        object.__setattr__(self, "shift_steps", tuple(int(s) for s in self.shift_steps))
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
    """Scores a response against the style preferred at a trainer step (formulas in the module docstring).

    Attributes:
        schedule: the preference shifts (of every persona without a schedule of its own).
        min_markers: distinct preferred-style markers for full reward (``m``).
        persona_schedules: (persona, schedule) pairs: that persona's preference shifts. A mapping of
            persona to schedule (or to a schedule's fields, as in environment options) is accepted.
        graded: the graded reward (a finished reply scores at least :data:`GRADED_FLOOR`).
    """

    schedule: ShiftSchedule = ShiftSchedule()
    min_markers: int = 2
    persona_schedules: tuple[tuple[str, ShiftSchedule], ...] = ()
    graded: bool = False

    def __post_init__(self) -> None:
        if self.min_markers < 1:
            raise ValueError(f"StyleJudge.min_markers must be >= 1, got {self.min_markers}")
        pairs = self.persona_schedules
        pairs = pairs.items() if isinstance(pairs, dict) else pairs
        pairs = tuple((str(name), schedule if isinstance(schedule, ShiftSchedule) else ShiftSchedule(**schedule))
                      for name, schedule in pairs)
        if len({name for name, _ in pairs}) != len(pairs):
            raise ValueError(f"StyleJudge.persona_schedules names a persona twice: {[n for n, _ in pairs]}")
        object.__setattr__(self, "persona_schedules", pairs)

    def schedule_of(self, persona: str | None) -> ShiftSchedule:
        """The schedule ``persona`` is judged by (None: the default one)."""
        return dict(self.persona_schedules).get(persona, self.schedule) if persona else self.schedule

    def reward(self, text: str, step: int, persona: str | None = None) -> float:
        preferred = self.schedule_of(persona).preferred(step)
        scores = style_scores(text)
        n_pref = scores.pop(preferred)
        n_other = sum(scores.values())
        m = self.min_markers
        if self.graded:
            style = max(0.0, min(1.0, (min(n_pref, m) - min(n_other, m) / 2) / m))
            return GRADED_FLOOR + (1 - GRADED_FLOOR) * style
        return max(0.0, min(1.0, (min(n_pref, m) - min(n_other, m)) / m))


@dataclasses.dataclass(frozen=True)
class StylePreferenceConfig:
    """Tasks and judge of style_preference.

    Attributes:
        seed: seeds the split of (instruction, topic) prompts into train and held-out.
        heldout_fraction: share of the prompts held out.
        judge: the simulated judge and its shift schedule.
        personas: readers named in the prompts, one prompt per (instruction, topic, persona); none:
            the prompts name no reader.
        answer_tag: replies end on ``</answer>`` (a reply that does not close scores 0).
        warm_start_bias: for a prompt that names a reader, this many more warm-start demonstrations in
            the style that reader prefers at step 0, beside one in every style (0: none, every style
            alike), so the version-0 policy starts to tell the readers apart.
    """

    seed: int = 0
    heldout_fraction: float = 0.2
    judge: StyleJudge = StyleJudge()
    personas: tuple[str, ...] = ()
    answer_tag: bool = False
    warm_start_bias: int = 0

    def __post_init__(self) -> None:
        if self.warm_start_bias < 0:
            raise ValueError(f"StylePreferenceConfig.warm_start_bias must be >= 0, got {self.warm_start_bias}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"StylePreferenceConfig.heldout_fraction must lie in [0, 1), got {self.heldout_fraction}")
        object.__setattr__(self, "personas", tuple(self.personas))
        if len(set(self.personas)) != len(self.personas) or not all(p.strip() for p in self.personas):
            raise ValueError(f"StylePreferenceConfig.personas must be distinct non-empty names, got {self.personas}")
        unknown = sorted({name for name, _ in self.judge.persona_schedules} - set(self.personas))
        if unknown:
            raise ValueError(f"StyleJudge.persona_schedules names {unknown}, not among the personas {self.personas}")


def generate_tasks(config: StylePreferenceConfig | None = None) -> list[Task]:
    """Every (instruction, topic) prompt once, split by a seeded shuffle; deterministic."""
    config = config or StylePreferenceConfig()
    prompts = [(instruction.format(topic=topic), "") for topic in _TOPICS for instruction in _INSTRUCTIONS]
    if config.personas:
        prompts = [(_PERSONA_PROMPT.format(instruction=prompt, persona=persona), json.dumps({"persona": persona}))
                   for prompt, _ in prompts for persona in config.personas]
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
            info=info,
        )
        for index, (prompt, info) in enumerate(prompts)
    ]


def persona_of(task: Task) -> str | None:
    """The reader a style_preference prompt is for (None: it names none)."""
    return json.loads(task.info).get("persona") if task.info else None


def ensure_dataset(config: StylePreferenceConfig | None, path: str | Path) -> list[Task]:
    """The tasks of ``config``, written to ``path`` (JSON Lines) if absent; an existing file must match."""
    return ensure_tasks(path, generate_tasks(config))


def topic_of(task: Task) -> str:
    """The topic a style_preference prompt asks about."""
    for topic in _TOPICS:
        if topic in task.prompt:
            return topic
    raise ValueError(f"task {task.task_id} names no known topic: {task.prompt!r}")


def render_in_style(topic: str, style: Style, rng: random.Random, answer_tag: bool = False) -> str:
    """A sentence about ``topic`` in ``style`` (demonstrations and tests); with ``answer_tag``, inside
    ``<answer>...</answer>``."""
    sentence = rng.choice(_STYLE_TEMPLATES[Style(style)]).format(topic=topic)
    return f"{ANSWER_START}{sentence}{ANSWER_END}" if answer_tag else sentence


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
        closed = isinstance(action, FinalAnswer) or not self.config.answer_tag
        if self.config.answer_tag and isinstance(action, FinalAnswer):
            text = action.answer
        else:
            text = action.text if isinstance(action, Reply) else action_text
        persona = persona_of(self.task)
        judge = self.config.judge
        reward = judge.reward(text, self.trainer_step, persona) if closed else 0.0
        preferred = judge.schedule_of(persona).preferred(self.trainer_step)
        info = {"preferred_style": str(preferred), "style": str(classify_style(text) or "none"),
                "persona": persona or "", "closed": closed}
        return StepResult(None, True, reward, Termination.STOP, info)
