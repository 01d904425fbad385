"""The online-learning benchmark: the shift schedule it reads, what it measures after each shift (worked
by hand on made-up steps), the merge of seeds' parts, and a ``--quick`` run of all three methods end to
end (Serve rollouts on style_preference, the lake, the trainer) into tmp_path."""

from __future__ import annotations

import json

import pytest

from benchmarks.online import METHODS, _parse, analyse, events, main, merge, parse_shifts


def test_the_schedule_names_readers_for_every_step_or_for_none():
    assert parse_shifts("150,300") == [150, 300]
    assert parse_shifts("Ada:150, Basil:225,Ada:300,Cleo:") == {"Ada": [150, 300], "Basil": [225], "Cleo": []}
    with pytest.raises(ValueError, match="every step or for none"):
        parse_shifts("Ada:150,300")
    with pytest.raises(SystemExit):
        _parse(["--shifts", "Ada:500"])  # past the run's end
    with pytest.raises(SystemExit):
        _parse(["--shifts", "Ada:20,Ada:10"])
    assert parse_shifts("Ada:150:cute,Ada:300,Cleo:") == {"Ada": [(150, "cute"), 300], "Cleo": []}
    with pytest.raises(SystemExit):
        _parse(["--shifts", "Ada:150:sarcastic"])  # no such style
    with pytest.raises(SystemExit):
        _parse(["--shifts", "Ada:150:academic"])  # the style Ada already prefers


def test_by_default_each_reader_moves_to_a_style_another_reader_wants_at_that_moment():
    args = _parse([])
    assert args.warm_start_bias == 4 and _parse(["--shifts", "150,300"]).warm_start_bias == 0
    with pytest.raises(SystemExit):
        _parse(["--shifts", "150,300", "--warm-start-bias", "1"])  # no readers to favour
    shifts = events(args)
    assert [(e["persona"], e["shift"], e["old_style"], e["new_style"]) for e in shifts] == [
        ("Ada", 150, "academic", "cute"), ("Basil", 225, "cute", "classical"), ("Cleo", 300, "classical", "cute")]
    for shift in shifts:  # the reader's new style is preferred by another reader just before the shift
        others = [e for e in shifts if e["persona"] != shift["persona"]]
        wanted = {e["new_style"] if e["shift"] < shift["shift"] else e["old_style"] for e in others}
        assert shift["new_style"] in wanted


def test_saos_own_settings_reach_its_run_config_and_are_part_of_the_design_only_when_set():
    """Parts run before ``--lr-critic`` and ``--whiten`` existed (at the run config's settings) still
    merge with those run without them; a part at other settings never does."""
    from benchmarks._settings import bench_config
    from benchmarks.online import design, sao_settings

    plain = _parse([])
    assert sao_settings(plain) == {} and {"lr_critic", "whiten"}.isdisjoint(design(plain))
    args = _parse(["--lr-critic", "2e-3", "--whiten"])
    assert design(args)["lr_critic"] == 2e-3 and design(args)["whiten"] is True
    algorithm = bench_config().with_values(sao_settings(args)).algorithm
    assert algorithm.lr_critic == 2e-3 and algorithm.whiten_advantages
    with pytest.raises(SystemExit):
        _parse(["--lr-critic", "0"])


def test_each_shift_runs_to_the_readers_next_shift_or_the_end():
    args = _parse(["--shifts", "Ada:150,Basil:225,Ada:300", "--steps", "450"])
    assert [(e["persona"], e["shift"], e["end"], e["old_style"], e["new_style"]) for e in events(args)] == [
        ("Ada", 150, 300, "academic", "cute"), ("Basil", 225, 450, "cute", "classical"),
        ("Ada", 300, 450, "cute", "classical")]
    plain = _parse(["--shifts", "150,300"])
    assert [(e["persona"], e["shift"], e["end"]) for e in events(plain)] == [("", 150, 300), ("", 300, 450)]


def _row(persona, reward, style="none", end="stop"):
    return {"persona": persona, "task_id": f"t-{persona}", "reward": reward, "end": end, "style": style}


def test_the_area_after_a_shift_is_the_shifted_readers_mean_reward_until_the_phase_ends():
    rows = {"a0": _row("Ada", 1.0, "academic"), "b0": _row("Basil", 0.2), "a1": _row("Ada", 0.2, "academic"),
            "b1": _row("Basil", 1.0), "a2": _row("Ada", 0.6, "cute"), "a3": _row("Ada", 1.0, "cute")}
    steps = [{"trajectory_ids": ["a0", "b0"]}, {"trajectory_ids": ["a1", "b1"]}, {"trajectory_ids": ["a2"]},
             {"trajectory_ids": ["a3", "b1"]}]
    shift = {"persona": "Ada", "shift": 1, "end": 4, "old_style": "academic", "new_style": "cute"}
    out = analyse(steps, rows, [shift], pre_window=1)
    event = out["events"][0]
    assert event["before"] == 1.0  # step 0's Ada row
    assert event["after"] == pytest.approx((0.2 + 0.6 + 1.0) / 3) and event["trajectories_after"] == 3
    assert event["after_rewards"] == "0.2 0.6 1"
    assert event["new_share_at_end"] == 1.0 and event["old_share_at_end"] == 0.0  # step 3: one cute Ada reply
    assert out["persona_rewards"] == {"Ada": [1.0, 0.2, 0.6, 1.0], "Basil": [0.2, 1.0, None, 1.0]}


def test_the_merge_compares_sao_with_each_baseline_seed_by_seed():
    def run(after):
        return {"events": [{"persona": "Ada", "shift": 1, "end": 4, "old_style": "academic", "new_style": "cute",
                            "after": sum(after) / len(after), "before": 1.0, "after_rewards": " ".join(map(str, after)),
                            "new_share_at_end": 0.5, "old_share_at_end": 0.5}],
                "rewards": [0.5] * 4, "length_end_share": 0.0, "wall_s": 10.0, "seed": 0}

    parts = [{"seed": seed, "runs": {"sao": run([1.0, 1.0]), "running_mean": run([0.2, 0.2, 0.2]),
                                     "grpo_dis": run([1.0, 0.2])}} for seed in (0, 1)]
    record = merge(parts, samples=200)
    assert record["methods"] == ["sao", "running_mean", "grpo_dis"] and record["seeds"] == [0, 1]
    versus_mean = record["comparisons"]["sao-running_mean"]["pooled"]
    assert versus_mean["mean"] == pytest.approx(0.8) and versus_mean["low"] == pytest.approx(0.8)
    versus_group = record["comparisons"]["sao-grpo_dis"]
    assert versus_group["pooled"]["mean"] == pytest.approx(0.4) and versus_group["by_shift"][0]["per_seed"] == [
        pytest.approx(0.4)] * 2
    assert versus_group["pooled"]["low"] < 0.4 < versus_group["pooled"]["high"] <= 0.8  # the group's rows vary


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_compares_the_three_methods(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    argv = ["--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            "--results-md", str(results_md), "--entropy-coef", "0.01", "--lr-critic", "1e-3"]
    assert main(argv) == 0
    part = json.loads((tmp_path / "out" / "online-seed0.json").read_text())
    steps, batch = part["design"]["steps"], part["design"]["batch"]
    assert set(part["runs"]) == set(METHODS)
    for run in part["runs"].values():
        assert run["steps"] == steps == len(run["rewards"])
        assert all(0.0 <= r <= 1.0 for r in run["rewards"])
        assert all(e is not None and e > 0 for e in run["entropy"])  # the bonus is on for every method
        assert [(e["persona"], e["shift"]) for e in run["events"]] == [("Ada", 6), ("Basil", 11)]
        for event in run["events"]:
            rewards = [float(x) for x in event["after_rewards"].split()]
            assert len(rewards) == event["trajectories_after"] > 0 and event["after"] == pytest.approx(
                sum(rewards) / len(rewards))
        assert set(run["persona_rewards"]) == {"Ada", "Basil"}
        assert run["trajectories_generated"] >= steps * batch
    # SAO's critic trains at the rate given (its warm-up of 10 steps is over by the last of 16); no
    # baseline has a critic
    assert part["runs"]["sao"]["critic_lr"] == pytest.approx(1e-3)
    assert part["runs"]["running_mean"]["critic_lr"] is None and part["runs"]["grpo_dis"]["critic_lr"] is None
    assert part["design"]["lr_critic"] == 1e-3
    groups = part["runs"]["grpo_dis"]["groups"]
    assert groups["rows"] == steps * batch and groups["batches"] == steps
    merged = json.loads((tmp_path / "out" / "online.json").read_text())
    assert set(merged["comparisons"]) == {"sao-running_mean", "sao-grpo_dis"}
    assert (tmp_path / "out" / "online.png").stat().st_size > 10_000
    text = results_md.read_text()
    assert "<!-- online:begin -->" in text and "1 seed(s) of the 5" in text
