"""style_preference: the judge recognises four styles and the preference shifts exactly on schedule."""

from __future__ import annotations

import random

import pytest

from sao.envs.base import Split, Termination, read_tasks
from sao.envs.style_preference import (
    ShiftSchedule,
    Style,
    StyleJudge,
    StylePreferenceConfig,
    StylePreferenceEnv,
    classify_style,
    ensure_dataset,
    generate_tasks,
    persona_of,
    render_in_style,
    style_scores,
    topic_of,
)


def test_default_schedule_shifts_exactly_at_150_and_300():
    schedule = ShiftSchedule()
    preferred = [schedule.preferred(step) for step in range(0, 451)]
    changes = [step for step in range(1, 451) if preferred[step] != preferred[step - 1]]
    assert changes == [150, 300]
    assert (schedule.preferred(0), schedule.preferred(149)) == (Style.ACADEMIC, Style.ACADEMIC)
    assert (schedule.preferred(150), schedule.preferred(299)) == (Style.CUTE, Style.CUTE)
    assert (schedule.preferred(300), schedule.preferred(10_000)) == (Style.CLASSICAL, Style.CLASSICAL)


def test_a_configured_schedule_shifts_at_its_own_steps():
    schedule = ShiftSchedule(styles=("chuunibyou", "cute"), shift_steps=(7,))
    assert [schedule.preferred(s) for s in (0, 6, 7, 8)] == [Style.CHUUNIBYOU, Style.CHUUNIBYOU, Style.CUTE, Style.CUTE]


@pytest.mark.parametrize(
    ("styles", "steps", "message"),
    [(("academic",), (150,), "one more entry"), (("academic", "cute", "classical"), (300, 150), "strictly increasing"),
     (("academic", "cute"), (0,), "> 0"), (("academic", "pirate"), (5,), "pirate")],
)
def test_bad_schedule_is_rejected(styles, steps, message):
    with pytest.raises(ValueError, match=message):
        ShiftSchedule(styles=styles, shift_steps=steps)


def test_negative_step_is_rejected():
    with pytest.raises(ValueError, match="step"):
        ShiftSchedule().preferred(-1)


@pytest.mark.parametrize("style", list(Style))
def test_every_rendering_is_recognised_as_its_style(style):
    rng = random.Random(0)
    for topic in ("the moon", "a violin", "coffee"):
        for _ in range(5):
            text = render_in_style(topic, style, rng)
            assert classify_style(text) is style, text
            assert style_scores(text)[style] >= 2


def test_judge_rewards_only_the_preferred_style_and_follows_the_shift():
    judge = StyleJudge()
    rng = random.Random(1)
    texts = {style: render_in_style("the sea", style, rng) for style in Style}
    for step, preferred in ((0, Style.ACADEMIC), (150, Style.CUTE), (300, Style.CLASSICAL)):
        for style, text in texts.items():
            assert judge.reward(text, step) == (1.0 if style is preferred else 0.0), (step, style)


def test_judge_reward_golden_values():
    judge = StyleJudge(min_markers=2)
    assert judge.reward("The sea is blue.", 0) == 0.0
    assert judge.reward("Thus the sea is blue.", 0) == 0.5  # one academic marker of two
    assert judge.reward("Thus, furthermore, hence the sea.", 0) == 1.0  # capped at min_markers
    assert judge.reward("Thus, furthermore the sea, hehe.", 0) == 0.5  # (2 - 1) / 2: mixing costs
    assert judge.reward("Thus, hehe, yay.", 0) == 0.0  # clipped at 0


def test_markers_match_whole_words_case_insensitively():
    assert style_scores("THUS it was")[Style.ACADEMIC] == 1
    assert style_scores("Thusly, a theeatre")[Style.ACADEMIC] == 0
    assert style_scores("thee thee thee")[Style.CLASSICAL] == 1  # distinct markers count once
    assert classify_style("nothing stylish here") is None


def test_tasks_are_deterministic_and_split():
    tasks = generate_tasks()
    assert tasks == generate_tasks()
    heldout = [t for t in tasks if t.split is Split.HELDOUT]
    assert 0 < len(heldout) < len(tasks)
    assert len({t.prompt for t in tasks}) == len(tasks)
    assert all(topic_of(t) in t.prompt for t in tasks)


def test_dataset_file(tmp_path):
    path = tmp_path / "style.jsonl"
    assert ensure_dataset(None, path) == generate_tasks()
    assert read_tasks(path, split="heldout") == [t for t in generate_tasks() if t.split is Split.HELDOUT]


def test_env_scores_at_the_trainer_step_it_is_given():
    task = generate_tasks()[0]
    cute = render_in_style(topic_of(task), Style.CUTE, random.Random(0))
    env = StylePreferenceEnv(StylePreferenceConfig(), trainer_step=149)
    env.reset(task)
    assert env.step(cute + "<|im_end|>").reward == 0.0
    env.trainer_step = 150
    env.reset(task)
    result = env.step(cute + "<|im_end|>")
    assert result.done and result.reward == 1.0 and result.termination is Termination.STOP
    assert result.info["preferred_style"] == "cute" and result.info["style"] == "cute"


# ----- personas, the graded reward, the closing tag ------------------------------------------------------


def test_personas_multiply_the_prompts_and_each_task_names_its_reader():
    plain = generate_tasks()
    tasks = generate_tasks(StylePreferenceConfig(personas=("Ada", "Basil")))
    assert len(tasks) == 2 * len(plain)
    assert tasks[0].prompt == f"{plain[0].prompt} It is for Ada." and tasks[1].prompt == f"{plain[0].prompt} It is for Basil."
    assert [persona_of(t) for t in tasks[:4]] == ["Ada", "Basil", "Ada", "Basil"]
    assert persona_of(plain[0]) is None and topic_of(tasks[1]) == topic_of(plain[0])
    assert generate_tasks(StylePreferenceConfig(personas=("Ada", "Basil"))) == tasks  # deterministic
    with pytest.raises(ValueError, match="distinct non-empty"):
        StylePreferenceConfig(personas=("Ada", "Ada"))


def test_each_persona_is_judged_by_its_own_schedule():
    judge = StyleJudge(persona_schedules={"Ada": {"styles": ["cute", "classical"], "shift_steps": [10]}})
    cute = "Hehe, the moon is so cute and fluffy, yay!"
    assert judge.reward(cute, 5, "Ada") == 1.0 and judge.reward(cute, 10, "Ada") == 0.0
    assert judge.reward(cute, 5, "Basil") == 0.0  # no schedule of its own: the default, academic first
    assert judge.schedule_of("Ada").shift_steps == (10,) and judge.schedule_of(None) == ShiftSchedule()
    with pytest.raises(ValueError, match=r"names \['Cleo'\], not among the personas"):
        StylePreferenceConfig(personas=("Ada",), judge=StyleJudge(persona_schedules={"Cleo": ShiftSchedule()}))


@pytest.mark.parametrize(("text", "reward"), [
    ("Hehe, the moon is so cute and fluffy, yay!", 1.0),  # 3 preferred markers: style 1
    ("Hehe, the moon.", 0.2 + 0.8 * 0.5),  # one of m = 2
    ("Hehe, verily the moon.", 0.2 + 0.8 * (1 - 0.5) / 2),  # one preferred, one other: (1 - 1/2) / 2
    ("Verily, the moon doth shine upon thee.", 0.2),  # another style: the floor, not 0
    ("The moon.", 0.2),
])
def test_the_graded_reward_keeps_a_floor_and_counts_markers(text, reward):
    judge = StyleJudge(schedule=ShiftSchedule(styles=("cute",), shift_steps=()), graded=True)
    assert judge.reward(text, 0) == pytest.approx(reward)


def test_with_the_answer_tag_only_a_closed_reply_is_judged():
    config = StylePreferenceConfig(answer_tag=True, personas=("Ada",),
                                   judge=StyleJudge(schedule=ShiftSchedule(styles=("cute",), shift_steps=())))
    task = generate_tasks(config)[0]
    cute = render_in_style(topic_of(task), Style.CUTE, random.Random(0), answer_tag=True)
    assert cute.startswith("<answer>") and cute.endswith("</answer>")
    env = StylePreferenceEnv(config)
    env.reset(task)
    result = env.step(cute)
    assert result.reward == 1.0 and result.info["closed"] is True and result.info["persona"] == "Ada"
    env.reset(task)
    run_on = env.step(cute.removesuffix("</answer>") + " hehe fluffy")  # never closed: ran to the budget
    assert run_on.reward == 0.0 and run_on.info["closed"] is False
    plain = StylePreferenceEnv(StylePreferenceConfig(judge=config.judge))  # without the option: as before
    plain.reset(generate_tasks()[0])
    assert plain.step(cute.removesuffix("</answer>")).reward == 1.0
