"""The quality benchmark: its merge of seeds' parts (areas, equal-time accuracy and paired intervals,
worked by hand on a made-up record), which parts it merges, and a quick run end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks.quality import _parse, design, load_parts, main, merge


def _run(arm, seed, *, offset_s, offset_traj, elapsed, rewards):
    """A run of batch 10 evaluated at versions 0 and 2 (``rewards``: per-task strings at each)."""
    curve = [{"version": v, "elapsed_s": e, "accuracy": r.count("1") / len(r), "stderr": 0.0,
              "num_tasks": len(r), "failures": {"tool_copy": r.count("0")}, "rewards": r}
             for v, e, r in zip((0, 2), (0.0, elapsed), rewards, strict=True)]
    steps = [{"step": 0, "version": 1, "elapsed_s": elapsed / 2, "metrics": {"batch/reward_mean": 0.2}},
             {"step": 1, "version": 2, "elapsed_s": elapsed, "metrics": {"batch/reward_mean": 0.4}}]
    return {"arm": arm, "seed": seed, "label": arm, "lr_policy": 2e-4, "lr_source": "test", "steps": 2,
            "offset_s": offset_s, "offset_trajectories": offset_traj, "wall_s": elapsed, "startup_s": 1.0,
            "step_rows": steps, "curve": curve, "settings": {"train": {"batch_size": 10}}}


def _parts():
    return [{"seed": seed, "runs": [
        _run("sao", seed, offset_s=10.0, offset_traj=20, elapsed=10.0, rewards=("00", "11")),
        _run("grpo", seed, offset_s=0.0, offset_traj=0, elapsed=30.0, rewards=("00", "01"))]} for seed in (0, 1)]


def test_the_merge_counts_value_pretraining_first_and_pairs_tasks_by_seed():
    record = merge(_parts(), samples=200)
    # horizons: the longest run's end on each axis; T: the shortest run's end, pretraining counted
    assert record["horizon_time_s"] == 30.0 and record["horizon_trajectories"] == 40.0
    assert record["t_equal"] == 20.0
    sao, grpo = (next(r for r in record["runs"] if r["arm"] == a and r["seed"] == 0)["measures"]
                 for a in ("sao", "grpo"))
    # SAO over time: 0 while pretraining (0-10 s), 0 -> 1 over 10-20 s, 1 held to 30 s: (0 + 5 + 10) / 30
    # GRPO: 0 -> 0.5 over 0-30 s: 0.25
    assert sao["auc_time"] == pytest.approx(0.5) and grpo["auc_time"] == pytest.approx(0.25)
    # over trajectories: SAO 0 for its 20 pretraining rollouts, 0 -> 1 over 20-40: 10 / 40;
    # GRPO 0 -> 0.5 over 0-20, 0.5 held to 40: (5 + 10) / 40
    assert sao["auc_trajectories"] == pytest.approx(0.25) and grpo["auc_trajectories"] == pytest.approx(0.375)
    assert sao["final"] == 1.0 and grpo["final"] == 0.5
    assert sao["at_t"] == 1.0 and grpo["at_t"] == pytest.approx(0.5 * 20 / 30)
    pair = record["comparisons"]["sao-grpo"]
    # two identical seeds, per-task differences [0.5, 0] on the time axis: no spread to draw
    assert pair["auc_time"]["mean"] == pytest.approx(0.25) and pair["auc_time"]["per_seed"] == [0.25, 0.25]
    assert pair["auc_trajectories"]["mean"] == pytest.approx(-0.125)
    assert pair["final"]["mean"] == pytest.approx(0.5)
    summary = record["summary"]["sao"]
    assert summary["wall_s"]["mean"] == 20.0 and summary["offset_s"]["mean"] == 10.0
    assert summary["final_failures"] == {"tool_copy": 0.0} and record["summary"]["grpo"]["final_failures"] == {
        "tool_copy": 0.5}
    assert summary["reward_first10"] == pytest.approx(0.3) and summary["flat_group_frac"] is None


def test_parts_that_train_an_arm_at_two_rates_are_refused():
    parts = _parts()
    parts[1]["runs"][0]["lr_policy"] = 1e-4
    with pytest.raises(SystemExit, match=r"different learning rates \{'sao': \[0.0001, 0.0002\]\}"):
        merge(parts, samples=10)


def test_only_parts_of_the_same_design_are_merged(tmp_path):
    args = _parse(["--out", str(tmp_path), "--steps", "20"])
    for seed, steps in ((0, 20), (1, 20), (2, 30)):
        other = _parse(["--out", str(tmp_path), "--steps", str(steps)])
        (tmp_path / f"quality-heavy-seed{seed}.json").write_text(json.dumps({"seed": seed, "design": design(other)}))
    (tmp_path / "quality-fast-seed0.json").write_text(json.dumps({"seed": 0, "design": {}}))  # another setting
    parts, notes = load_parts(args)
    assert [p["seed"] for p in parts] == [0, 1]
    assert notes == ["quality-heavy-seed2.json left out: its design differs in steps"]
    with pytest.raises(SystemExit, match=r"no part of quality-heavy with this design(.|\n)*seed2.json left out"):
        load_parts(_parse(["--out", str(tmp_path), "--steps", "40"]))


def test_the_arguments_are_checked():
    with pytest.raises(SystemExit):
        _parse(["--arms", "sao,ppo"])
    with pytest.raises(SystemExit):
        _parse(["--lr", "sao"])
    assert _parse(["--lr", "sao=1e-4,grpo=3e-4"]).lr_given == {"sao": 1e-4, "grpo": 3e-4}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)  # four arms and value pretraining: about 3 min alone here, more on a loaded machine
def test_a_quick_run_writes_a_part_and_merges_it(tmp_path):
    arms = "sao,grpo,grpo_dis,ppo_async"
    assert main(["--quick", "--workdir", str(tmp_path), "--arms", arms]) == 0
    part = json.loads((tmp_path / "quality-quick-heavy-seed0.json").read_text())
    assert part["seed"] == 0 and part["design"]["latency"]["kind"] == "lognormal"
    pretraining = part["value_pretraining"]
    assert pretraining["trajectories"] == 8 and pretraining["seconds"] > 0
    runs = {r["arm"]: r for r in part["runs"]}
    assert set(runs) == set(arms.split(","))
    for arm, run in runs.items():
        assert run["steps"] == 2 and [s["step"] for s in run["step_rows"]] == [0, 1]
        elapsed = [s["elapsed_s"] for s in run["step_rows"]]
        assert 0 < elapsed[0] <= elapsed[1] == run["wall_s"]
        assert [e["version"] for e in run["curve"]] == [0, 1, 2]
        assert all(len(e["rewards"]) == e["num_tasks"] == 8 for e in run["curve"])
        assert run["settings"]["algorithm"]["name"] == arm
        # value pretraining's cost lands on the critic arms only
        critic = arm in ("sao", "ppo_async")
        assert run["offset_s"] == (pretraining["seconds"] if critic else 0.0)
        assert run["offset_trajectories"] == (8 if critic else 0)
        assert run["critic_path"] == (pretraining["path"] if critic else None)
    assert runs["grpo"]["settings"]["train"]["synchronous"] is True
    assert all(s["metrics"]["batch/staleness_max"] == 0 for s in runs["grpo"]["step_rows"])
    assert all("batch/flat_group_frac" in s["metrics"] for s in runs["grpo"]["step_rows"])
    # version 0 is the same SFT policy for every arm of a seed: one evaluation, the same figure
    assert len({json.dumps(r["curve"][0], sort_keys=True) for r in part["runs"]}) == 1
    ratios = runs["ppo_async"]["ratios"]
    assert [r["step"] for r in ratios] == [0, 1] and ratios[0]["by_staleness"].keys() == {"0"}
    assert ratios[0]["outside_clip"] == 0.0 and ratios[0]["abs_log_rho"] < 1e-4
    merged = json.loads((tmp_path / "quality-quick-heavy.json").read_text())
    assert set(merged["comparisons"]) == {"sao-grpo", "sao-grpo_dis", "sao-ppo_async"}
    assert merged["seeds"] == [0] and merged["comparisons"]["sao-grpo"]["auc_time"]["seeds"] == 1
    assert (tmp_path / "quality-quick-heavy.png").stat().st_size > 0
    section = (tmp_path / "RESULTS.md").read_text()
    assert "<!-- quality-quick-heavy:begin -->" in section and "Only 1 seed(s)" in section


def test_each_arms_rate_comes_from_the_command_line_then_the_tuning_record_then_the_config(tmp_path):
    from benchmarks.quality import _base_settings, learning_rates

    args = _parse(["--out", str(tmp_path), "--workdir", str(tmp_path), "--lr", "sao=1e-4", "--arms", "sao,grpo"])
    base = _base_settings(args)
    assert learning_rates(args, base) == {
        "sao": {"lr": 1e-4, "source": "--lr"},
        "grpo": {"lr": base.algorithm.lr_policy, "source": "the demo config's algorithm.lr_policy"}}
    (tmp_path / "quality-heavy-lr.json").write_text(json.dumps({"picked": {"sao": 3e-4, "grpo": 4e-4}}))
    rates = learning_rates(args, base)
    assert rates["sao"]["lr"] == 1e-4 and rates["grpo"] == {
        "lr": 4e-4, "source": "tuned on the validation tasks (quality-heavy-lr.json)"}


@pytest.mark.slow
@pytest.mark.ray
def test_tuning_judges_each_rate_on_the_validation_tasks(tmp_path):
    assert main(["--quick", "--workdir", str(tmp_path), "--arms", "grpo", "--tune-lrs", "1e-4,3e-4"]) == 0
    record = json.loads((tmp_path / "quality-quick-heavy-lr.json").read_text())
    accuracy = record["validation_accuracy"]["grpo"]
    assert set(accuracy) == {"0.0001", "0.0003"} and all(0.0 <= a <= 1.0 for a in accuracy.values())
    assert record["picked"]["grpo"] == float(max(accuracy, key=accuracy.get))
    assert record["design"]["validation_tasks"] == 8 and record["tune_steps"] == 1


def test_the_section_says_whether_each_arm_ran_at_its_tuned_rate():
    from benchmarks.quality import tuning_lines

    record = merge(_parts(), samples=10)  # both arms at 2e-4
    assert tuning_lines(record)[0].startswith("No learning-rate tuning record")
    record["tuning"] = {"command": "c", "file": "f.json", "machine": {"commit": "abc"}, "tune_steps": 60, "seed": 0,
                        "design": {"validation_tasks": 500}, "picked": {"sao": 2e-4, "grpo": 4e-4},
                        "validation_accuracy": {"sao": {"0.0002": 0.7}, "grpo": {"0.0004": 0.6}}}
    assert "grpo ran at another rate than its pick" in tuning_lines(record)[0]
    record["tuning"]["picked"]["grpo"] = 2e-4
    assert tuning_lines(record)[0].endswith("every arm ran at its pick.")
