"""The demo's arms side by side: every figure read from the records, each arm paired with the base seed
by seed, the ranges min to max over an arm's seeds; nothing written under docs/."""

from __future__ import annotations

import json

import pytest

from benchmarks.demo import EVAL_SEED, _parse, main
from benchmarks.demo_compare import arm_row, compare, markdown


def _run(seed, accuracy, *, tool_call=100, answer=30, fit=0.2, step=-0.02, oracle=-0.4, pretraining=256, minutes=3.0,
         surprise=0.04):
    return {
        "seed": seed, "wall_s": 60 * (minutes + 2.5),
        "result": {"accuracy_after": accuracy, "accuracy_before": 0.45, "eval_tasks": 1000, "steps": 150,
                   "trajectories": 4900 + seed, "train_wall_s": 60 * minutes,
                   "failures_after": {"tool_call": tool_call, "answer": answer, "structure": 2},
                   "settings": {"eval": {"seed": EVAL_SEED}}},
        "value_pretraining": None if pretraining is None else {
            "num_train": pretraining - 51, "num_heldout": 51, "explained_variance_after": fit / 4},
        "critic_fit": {"critic/explained_variance": {"first": 0.0, "last": fit}},
        "sampled_surprise": {"first": {"all": 0.09, "succeeded": 0.02}, "last": {"all": surprise, "succeeded": surprise / 8}},
        "critic_off_path": {when: {"step_off_path": step, "step_on_path": step / 4, "value_before": 0.5,
                                   "oracle_step_off_path": oracle, "oracle_value_before": -oracle}
                            for when in ("first", "last")},
    }


MACHINE = {"cpus": 2, "memory_gib": 24, "platform": "Linux", "python": "3.11", "date": "2026-12-06"}
BASE = {"tag": "seeds", "sets": ["eval.tasks=1000"],
        "runs": [_run(1, 0.75), _run(2, 0.70, tool_call=220, fit=0.1, step=0.03), _run(3, 0.72, answer=61)]}
ARM = {"tag": "floor", "sets": ["eval.tasks=1000", "algorithm.advantage_floor=0.0"],
       "runs": [_run(2, 0.80, step=-0.05, oracle=-0.5, surprise=0.032), _run(1, 0.78, minutes=2.5),
                _run(3, 0.72, step=0.01, surprise=0.024)]}
GRPO = {"tag": "grpo", "sets": ["eval.tasks=1000", "algorithm.name=grpo", "rollout.group_size=8"],
        "runs": [{**_run(s, 0.70, pretraining=None), "critic_fit": {}, "critic_off_path": None} for s in (1, 2, 3)]}


def test_an_arms_row_gathers_its_runs_figures_by_seed_and_pairs_it_with_the_base():
    row = arm_row(ARM, BASE, "arm.json", is_base=False)
    assert row["seeds"] == [1, 2, 3] and row["accuracy"] == [0.78, 0.80, 0.72]  # sorted by seed
    assert row["median"] == 0.78 and row["sets"] == ["algorithm.advantage_floor=0.0"]  # the base's sets left out
    # seed by seed: 0.78-0.75, 0.80-0.70, 0.72-0.72 = 0.03, 0.10, 0.00; mean 13/300
    assert [p["diff"] for p in row["against"]["pairs"]] == pytest.approx([0.03, 0.10, 0.0])
    assert row["against"]["mean_diff"] == pytest.approx(0.13 / 3)
    assert row["failures"]["tool_call"] == {"min": 0.1, "max": 0.1}
    assert row["off_path"]["last"]["step_off_path"] == {"min": -0.05, "max": 0.01}
    assert row["off_path"]["last"]["oracle_step_off_path"] == {"min": -0.5, "max": -0.4}
    assert row["train_min"] == {"min": 2.5, "max": 3.0} and row["pretraining_rollouts"] == [256]
    assert row["critic"] and row["algorithm"] == "sao"
    assert row["surprise_last"]["all"] == {"min": 0.024, "max": 0.04}
    assert row["surprise_last"]["succeeded"] == pytest.approx({"min": 0.003, "max": 0.005})


def test_a_figure_that_one_run_did_not_record_is_not_recorded_for_the_arm():
    older = {**ARM, "runs": [ARM["runs"][0], {**ARM["runs"][1], "critic_off_path": None}, ARM["runs"][2]]}
    row = arm_row(older, BASE, "arm.json", is_base=False)
    assert row["off_path"]["last"]["step_off_path"] is None
    assert "| not recorded | not recorded |" in markdown(
        {"machine": MACHINE, "command": "c", "against": "base.json", "arms": [row],
         "pooled_off_path": {"last": {"runs": 0}}}, "demo-x", None)


def test_the_table_pools_the_critics_step_over_every_run_that_recorded_it(tmp_path):
    files = []
    for name, record in (("base", BASE), ("floor", ARM), ("grpo", GRPO)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(record))
    record = compare(files[0], files)  # the base among the arms is shown once, first
    assert [row["tag"] for row in record["arms"]] == ["seeds", "floor", "grpo"]
    assert record["arms"][0]["against"] is None and not record["arms"][2]["critic"]
    last = record["pooled_off_path"]["last"]
    assert last["arms"] == ["seeds", "floor"] and last["runs"] == 6
    assert last["step_off_path"] == {"min": -0.05, "max": 0.03}
    text = markdown({"machine": MACHINE, "command": "c", **record}, "demo-x", None)
    # the base's tool-call failures 10.0%-22.0%; its critic's step -0.020 to +0.030, the oracle's -0.40
    assert "| seeds (`base.json`) | the demo config | 0.750 / 0.700 / 0.720 | 0.720 | (the base) | 10.0%-22.0% / 3.0%-6.1% |" in text
    assert "| -0.020 to +0.030 (-0.40) |" in text
    assert "| grpo (`grpo.json`) | `algorithm.name=grpo`, `rollout.group_size=8` |" in text and "| no critic |" in text
    assert "Arms whose median passes 0.8: none." in text
    assert "| 0.024 to 0.040 (0.0030 to 0.0050) |" in text  # the floor's surprise late: all (succeeded)


def test_an_arm_run_on_other_seeds_than_the_base_names_them():
    one = {**ARM, "runs": [ARM["runs"][0]]}  # seed 2 alone
    row = arm_row(one, BASE, "arm.json", is_base=False)
    base = arm_row(BASE, BASE, "base.json", is_base=True)
    text = markdown({"machine": MACHINE, "command": "c", "against": "base.json", "arms": [base, row],
                     "pooled_off_path": {"last": {"runs": 0}}}, "demo-x", None)
    assert "| 0.800 (seed 2) | 0.800 | +0.100 |" in text and "| 0.750 / 0.700 / 0.720 | 0.720 | (the base) |" in text


def test_records_without_seeds_or_that_do_not_pair_are_refused():
    with pytest.raises(ValueError, match="have no seed"):
        arm_row({**ARM, "runs": [{**ARM["runs"][0], "seed": None}]}, BASE, "arm.json", is_base=False)
    other = {**ARM, "runs": [{**run, "result": {**run["result"], "eval_tasks": 300}} for run in ARM["runs"]]}
    with pytest.raises(ValueError, match="do not pair"):
        arm_row(other, BASE, "arm.json", is_base=False)


def test_compare_writes_the_record_the_figure_and_the_section(tmp_path):
    base, arm = tmp_path / "base.json", tmp_path / "arm.json"
    base.write_text(json.dumps(BASE))
    arm.write_text(json.dumps(ARM))
    out, md = tmp_path / "out" / "demo-t.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--compare", str(arm), "--against", str(base), "--tag", "t", "--out-json", str(out),
                 "--results-md", str(md)]) == 0
    assert [row["tag"] for row in json.loads(out.read_text())["arms"]] == ["seeds", "floor"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "<!-- demo-t:begin -->" in md.read_text() and "![demo-t](results/demo-t.png)" in md.read_text()


@pytest.mark.parametrize(("extra", "message"), [
    ([], "needs --against"),
    (["--against", "BASE"], "needs --against (the base every arm pairs with) and --tag"),
    (["--against", "BASE", "--tag", "t", "--seeds", "1"], "runs nothing"),
    (["--against", "NONE", "--tag", "t"], "no such record"),
])
def test_compare_needs_a_base_and_a_name_and_runs_nothing(tmp_path, capsys, extra, message):
    base = tmp_path / "base.json"
    base.write_text(json.dumps(BASE))
    argv = ["--compare", str(base), *[{"BASE": str(base), "NONE": str(tmp_path / "none.json")}.get(a, a) for a in extra]]
    with pytest.raises(SystemExit):
        _parse(argv)
    assert message in capsys.readouterr().err
