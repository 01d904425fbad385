"""sao.online: the smoothed reward curve and the recovery after a shift, worked by hand, and the shift
schedule's options."""

import pytest

from sao.online import recovery, shift_options, smooth, style_config


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0], 5) == [2.0]


def test_recovery_worked_by_hand():
    # pre-shift (steps 2, 3) mean 1.0 -> threshold 0.9; with window 1 the curve is the rewards:
    # dips below 0.9 at step 4, back at >= 0.9 at step 6 -> 2 steps to recover
    rewards = [1.0, 1.0, 1.0, 1.0, 0.2, 0.5, 0.95, 1.0]
    row = recovery(rewards, window=1, shift=4, end=8, pre_window=2, fraction=0.9)
    assert row["pre_shift_reward"] == 1.0 and row["threshold"] == pytest.approx(0.9)
    assert row["dip_step"] == 4 and row["recovered_step"] == 6 and row["steps_to_recover"] == 2
    assert row["min_smoothed"] == pytest.approx(0.2)
    never = recovery([1.0, 1.0, 0.1, 0.1], window=1, shift=2, end=4, pre_window=2, fraction=0.9)
    assert never["recovered_step"] is None and never["steps_to_recover"] is None
    steady = recovery([1.0, 1.0, 1.0, 1.0], window=1, shift=2, end=4, pre_window=2, fraction=0.9)
    assert steady["dip_step"] is None and steady["steps_to_recover"] == 0


def test_shift_options_cycle_the_styles_and_check_the_steps():
    options = shift_options([150, 300])["style_preference"]["judge"]["schedule"]
    assert options == {"styles": ["academic", "cute", "classical"], "shift_steps": [150, 300]}
    assert len(shift_options([1, 2, 3, 4, 5])["style_preference"]["judge"]["schedule"]["styles"]) == 6
    with pytest.raises(ValueError, match="increasing"):
        shift_options([300, 150])


def test_shift_options_per_persona_start_each_reader_at_its_own_style():
    from sao.envs.style_preference import Style, generate_tasks, persona_of

    options = shift_options({"Ada": [150], "Basil": [225, 400], "Cleo": []}, graded=True, answer_tag=True)
    env = options["style_preference"]
    assert env["personas"] == ["Ada", "Basil", "Cleo"] and env["answer_tag"] is True
    assert env["judge"]["graded"] is True and "schedule" not in env["judge"]
    assert env["judge"]["persona_schedules"] == {
        "Ada": {"styles": ["academic", "cute"], "shift_steps": [150]},
        "Basil": {"styles": ["cute", "classical", "chuunibyou"], "shift_steps": [225, 400]},
        "Cleo": {"styles": ["classical"], "shift_steps": []}}
    config = style_config(options)
    assert config.answer_tag and config.judge.graded
    assert config.judge.schedule_of("Basil").preferred(224) is Style.CUTE
    assert config.judge.schedule_of("Basil").preferred(225) is Style.CLASSICAL
    assert {persona_of(t) for t in generate_tasks(config)} == {"Ada", "Basil", "Cleo"}
    assert "graded" not in shift_options([150])["style_preference"]["judge"]  # off: the options as before
    with pytest.raises(ValueError, match="of persona 'Ada' must be increasing"):
        shift_options({"Ada": [20, 10]})


def test_a_shift_can_name_the_style_the_reader_moves_to():
    judge = shift_options({"Ada": [(150, "cute"), 300], "Cleo": [(300, "academic")]})["style_preference"]["judge"]
    assert judge["persona_schedules"] == {
        "Ada": {"styles": ["academic", "cute", "classical"], "shift_steps": [150, 300]},
        "Cleo": {"styles": ["cute", "academic"], "shift_steps": [300]}}
    with pytest.raises(ValueError, match="names style 'sarcastic', not one of academic, cute"):
        shift_options({"Ada": [(150, "sarcastic")]})
    with pytest.raises(ValueError, match="moves to 'academic', the style it already prefers"):
        shift_options({"Ada": [(150, "academic")]})
    with pytest.raises(ValueError, match="must be increasing"):
        shift_options({"Ada": [(150, "cute"), (100, "academic")]})


def test_a_reply_that_runs_out_of_tokens_is_not_bootstrapped():
    """style_preference scores a reply when it ends, so a length end is an outcome; other budget ends keep
    SAO.md's bootstrap, and what else the settings say is kept."""
    from sao.config import RunConfig
    from sao.online import online_settings

    settings = RunConfig(run_id="online-test").with_values({"algorithm.lr_policy": 1e-4})
    adjusted = online_settings(settings)
    assert "length" in settings.algorithm.bootstrap_reasons
    assert list(adjusted.algorithm.bootstrap_reasons) == [r for r in settings.algorithm.bootstrap_reasons if r != "length"]
    assert adjusted.algorithm.lr_policy == 1e-4 and adjusted.run_id == "online-test"
    assert online_settings(adjusted).algorithm.bootstrap_reasons == adjusted.algorithm.bootstrap_reasons


def test_the_warm_start_bias_favours_each_readers_first_style():
    from sao.envs.style_preference import Style, classify_style, generate_tasks, persona_of
    from sao.train.sft import SFTConfig, demonstrations

    options = shift_options({"Ada": [150], "Basil": [225]}, warm_start_bias=2)
    assert options["style_preference"]["warm_start_bias"] == 2
    style = style_config(options)
    assert style.warm_start_bias == 2
    config = SFTConfig(env="style_preference", style=style)
    tasks = [t for t in generate_tasks(style) if t.split.value == "train"]
    for task, conversations in zip(tasks, demonstrations(config), strict=True):
        replies = [classify_style(c[1]["content"]) for c in conversations]
        first = Style.ACADEMIC if persona_of(task) == "Ada" else Style.CUTE
        assert len(replies) == 6 and replies.count(first) == 3 and set(replies) == set(Style)
    plain = demonstrations(SFTConfig(env="style_preference", style=style_config(shift_options({"Ada": [150]}))))
    assert {len(c) for c in plain} == {4}
    with pytest.raises(ValueError, match="name the readers"):
        shift_options([150], warm_start_bias=1)
