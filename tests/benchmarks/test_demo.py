"""The demo benchmark: a quick variant of the demo run as a newcomer runs it, in an empty folder, its
recorded result read back and reported; nothing written under docs/."""

from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace

import pytest

from benchmarks.demo import (
    EVAL_SEED,
    PRETRAINING_KEYS,
    _algorithm,
    _failures,
    _fit,
    _off_path,
    _parse,
    _pretraining,
    _reward_curve_text,
    _step_cost_text,
    _surprise,
    critic_fit,
    main,
    paired,
    reread,
    reward_curve,
    run_demo,
    run_sets,
    sampled_surprise,
    step_cost,
    summarise,
    value_pretraining,
)


def test_a_folder_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(RuntimeError, match="is not empty"):
        run_demo(tmp_path, [])


def test_the_targets_figures_are_medians_over_the_runs():
    runs = [{"wall_s": w, "result": {"accuracy_before": b, "accuracy_after": a}}
            for w, b, a in ((300.0, 0.4, 0.7), (360.0, 0.5, 0.7), (330.0, 0.45, 0.75))]
    summary = summarise(runs)
    assert summary["accuracy_after"] == {"median": 0.7, "min": 0.7, "max": 0.75}
    assert summary["rise"] == pytest.approx({"median": 0.3, "min": 0.2, "max": 0.3})
    assert summary["wall_s"] == {"median": 330.0, "min": 300.0, "max": 360.0}


def test_failures_are_shown_as_shares_of_the_tasks_and_their_absence_said():
    result = {"eval_tasks": 200, "failures_after": {"tool_call": 30, "answer": 5, "structure": 1}}
    assert _failures(result) == "15.0% / 2.5% / 0.5%"
    assert _failures({"eval_tasks": 200}) == "not recorded"


def test_each_seeded_run_sets_its_own_seeds_and_the_shared_evaluation_seed():
    args = _parse(["--seeds", "3,7", "--set", "algorithm.alpha=2"])
    assert args.seeds == [3, 7]
    assert run_sets(args.sets, 7) == ["algorithm.alpha=2", "seed=7", "sft.seed=7", f"eval.seed={EVAL_SEED}"]
    assert run_sets(args.sets, None) == ["algorithm.alpha=2"]  # repeats (--runs) keep the config's seed


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "1,1"], "must differ"),
    (["--seeds", "1,x"], "integers separated by commas"),
    (["--seeds", ","], "names no seed"),
    (["--seeds", "1,2", "--set", "sft.seed=4"], "drop ['sft.seed=4']"),
])
def test_seeds_that_cannot_be_run_as_asked_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_the_demo_runs_recorded_result(tmp_path):
    out, md = tmp_path / "demo.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--quick", "--workdir", str(tmp_path / "work"), "--out-json", str(out), "--results-md", str(md)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    result = run["result"]
    assert result["steps"] == 2 and result["eval_tasks"] == 8 and result["settings"]["train"]["steps"] == 2
    assert 0.0 <= result["accuracy_after"] <= 1.0 and run["wall_s"] > result["train_wall_s"] > 0
    assert run["value_pretraining"]["num_train"] + run["value_pretraining"]["num_heldout"] == 8
    assert isinstance(run["critic_fit"], dict)  # empty when every return was alike (no variance to explain)
    assert set(run["critic_off_path"]) == {"first", "last"} and run["critic_off_path"]["last"]["version"] == 2
    surprise = run["sampled_surprise"]  # both steps are the first 25 and the last 25: the same 16 rollouts
    assert surprise["first"] == surprise["last"] and surprise["last"]["rollouts"] == 16 and surprise["last"]["all"] > 0
    assert [part["steps"] for part in run["reward_curve"]] == [[0, 1], [1, 2]]  # two steps: two parts
    assert all(0.0 <= part["reward"] <= 1.0 for part in run["reward_curve"])
    cost = run["step_cost"]  # two steps: one period, in both windows
    assert cost["first"] == cost["last"] and cost["last"]["period_s"] > cost["last"]["update_s"] > 0
    assert data["summary"]["accuracy_after"]["median"] == result["accuracy_after"]
    assert data["demo_command"].startswith("sao train --config configs/demo.yaml --set train.steps=2")
    assert "| held-out accuracy after training > 0.8 |" in md.read_text()


def _seeded(seed, accuracy, eval_seed=EVAL_SEED, tasks=300):
    return {"seed": seed, "result": {"accuracy_after": accuracy, "eval_tasks": tasks,
                                     "settings": {"eval": {"seed": eval_seed}}}}


def test_an_arm_is_compared_with_its_base_seed_by_seed():
    base = {"runs": [_seeded(1, 0.70), _seeded(2, 0.75), _seeded(3, 0.60)]}
    result = paired(base, [_seeded(2, 0.80), _seeded(1, 0.72), _seeded(3, 0.68)])
    assert [p["seed"] for p in result["pairs"]] == [2, 1, 3]
    assert [p["diff"] for p in result["pairs"]] == pytest.approx([0.05, 0.02, 0.08])
    # mean 0.05; deviations -0.03, 0, 0.03: std 0.03, over sqrt(3)
    assert result["mean_diff"] == pytest.approx(0.05)
    assert result["stderr"] == pytest.approx(0.03 / 3 ** 0.5)


@pytest.mark.parametrize(("arm", "message"), [
    (_seeded(4, 0.7), "no run of seed 4"),
    (_seeded(1, 0.7, eval_seed=5), "do not pair"),
    (_seeded(1, 0.7, tasks=1000), "do not pair"),
])
def test_runs_that_do_not_pair_are_refused(arm, message):
    with pytest.raises(ValueError, match=message):
        paired({"runs": [_seeded(1, 0.70)]}, [arm])


def test_against_needs_seeds_and_a_file_with_each_of_them(tmp_path, capsys):
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"runs": [_seeded(1, 0.7), _seeded(2, 0.7)]}))
    assert _parse(["--seeds", "1,2", "--against", str(base)]).against == base
    for argv, message in ((["--against", str(base)], "give --seeds"),
                          (["--seeds", "1,3", "--against", str(base)], "no run of seed(s) [3]"),
                          (["--seeds", "1", "--against", str(tmp_path / "none.json")], "no such file")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err


def test_a_seeded_record_is_paired_again_with_another_base(tmp_path, capsys):
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    record, base = results / "demo-oracle.json", tmp_path / "base.json"
    runs = json.loads(record.read_text())["runs"]
    base.write_text(json.dumps({"runs": [_seeded(run["seed"], 0.5) for run in runs]}))
    out, md = tmp_path / "demo-oracle.json", tmp_path / "RESULTS.md"
    assert main(["--reread", str(record), "--against", str(base), "--out-json", str(out), "--results-md", str(md)]) == 0
    again = json.loads(out.read_text())
    assert again["runs"] == runs  # the runs as recorded: only the pairing is new
    assert again["against"]["file"] == str(base)
    assert [p["diff"] for p in again["against"]["pairs"]] == pytest.approx(
        [run["result"]["accuracy_after"] - 0.5 for run in runs])
    assert f"Against `{base}`, seed by seed" in md.read_text()
    assert f"Read again with `sao bench demo --reread {record} --against {base}" in md.read_text()
    # a base must hold every seed of the record; a reread needs a folder or a base
    base.write_text(json.dumps({"runs": [_seeded(runs[0]["seed"], 0.5)]}))
    for argv, message in ((["--reread", str(record), "--against", str(base)], "no run of seed(s)"),
                          (["--reread", str(record)], "needs --workdir"),
                          (["--reread", str(tmp_path / "none.json"), "--against", str(base)], "no such record")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err


def test_value_pretraining_is_read_from_the_runs_report_and_shown_with_its_explained_variance(tmp_path):
    from sao.train.pretrain import REPORT_FILE

    assert value_pretraining(tmp_path) is None
    folder = tmp_path / "runs" / "demo" / "checkpoints" / "v000000" / "critic"
    folder.mkdir(parents=True)
    report = dict.fromkeys(PRETRAINING_KEYS, 1.0) | {"num_train": 230, "num_heldout": 26,
                                                      "explained_variance_after": 0.0412, "critic_path": "x"}
    (folder / REPORT_FILE).write_text(json.dumps(report))
    read = value_pretraining(tmp_path)
    assert set(read) == set(PRETRAINING_KEYS)  # the report's figures, not where the critic was written
    assert _pretraining({"value_pretraining": read}) == "256 / 0.041"
    assert _pretraining({"value_pretraining": read | {"explained_variance_after": None}}) == "256 / -"
    assert _pretraining({}) == "none"


class _Steps:
    """What ``Lake.read_run("train_steps", ...)`` gives, as rows: maps come back as (key, value) pairs."""

    def __init__(self, metrics):
        self.rows = [{"step": step, "metrics": list(m.items())} for step, m in enumerate(metrics)]

    def to_pylist(self):
        return list(reversed(self.rows))  # in no particular order: the fit sorts by step


def test_the_critics_fit_is_its_explained_variance_early_and_late(tmp_path, monkeypatch):
    import sao.lake.store as store

    steps = [{"critic/explained_variance": 0.0 if step < 40 else 0.5} for step in range(60)]
    steps += [{"critic/explained_variance": 0.5, "oracle/explained_variance": 0.9} for _ in range(10)]
    monkeypatch.setattr(store.Lake, "open", classmethod(lambda cls, root: SimpleNamespace(
        read_run=lambda name, run_id, columns: _Steps(steps))))
    fit = critic_fit(tmp_path)
    assert fit["critic/explained_variance"] == {"first": 0.0, "last": 0.5}
    assert fit["oracle/explained_variance"] == {"first": 0.9, "last": 0.9}  # only the steps that have it
    assert _fit({"critic_fit": fit}) == "0.00 / 0.50 (oracle's 0.90 / 0.90)"
    assert _fit({"critic_fit": {}}) == _fit({}) == "not recorded"
    assert _fit({"critic_fit": {}}, critic=False) == "no critic"


def test_the_steps_cost_is_its_period_and_its_parts_early_and_late(tmp_path, monkeypatch):
    import sao.lake.store as store

    start = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    ends, rows = [0.0], []  # step 0 ends at 10 s (start-up); then 40 steps of 1 s, 20 of 2 s
    for step in range(61):
        ends.append(ends[-1] + (10.0 if step == 0 else 1.0 if step <= 40 else 2.0))
        wait = 9.0 if step == 0 else 0.25 if step <= 40 else 1.25
        rows.append({"step": step, "finished_at": start + dt.timedelta(seconds=ends[-1]),
                     "timings": [("wait_read_s", wait), ("update_s", 0.5), ("commit_s", 0.1)]})
    asked = {}

    def read_run(name, run_id, columns):
        asked.update(name=name, run_id=run_id)
        return SimpleNamespace(to_pylist=lambda: list(reversed(rows)))  # in no order: sorted by step

    monkeypatch.setattr(store.Lake, "open", classmethod(lambda cls, root: SimpleNamespace(read_run=read_run)))
    cost = step_cost(tmp_path)
    assert asked == {"name": "train_steps", "run_id": "demo"}
    # steps 1-25 (step 0's start-up left out) against steps 36-60: 20 of 2 s and 5 of 1 s
    assert cost["first"] == {"period_s": 1.0, "wait_read_s": 0.25, "update_s": 0.5}
    assert cost["last"] == pytest.approx({"period_s": 1.8, "wait_read_s": 1.05, "update_s": 0.5})
    # sao bench longrun's windows of 61 steps: steps 3-8 (5-15%) against 55-60 (the last 10%)
    assert cost["flat"] == {"early": {"steps": [3, 9], "period_s": 1.0}, "late": {"steps": [55, 61], "period_s": 2.0},
                            "ratio": 2.0}
    text = ("The trainer's step, steps 1-25 -> the last 25 (medians over 1 run(s)): period 1.00 s -> 1.80 s "
            "(late over early 1.80 (1.80 to 1.80)); waiting for its batch (`wait_read_s`: rollouts to arrive, "
            "then the lake's commit and read) 0.25 s -> 1.05 s; update 0.50 s -> 0.50 s.")
    flat = (" Over the flat-cost target's windows (`sao bench longrun`'s: steps 3-8 against 55-60), the period late "
            "over early: 2.000 (2.000 to 2.000) (target at most 1.10).")
    assert _step_cost_text([{"step_cost": cost}, {"step_cost": None}, {}]) == text + flat
    before_flat = {label: cost[label] for label in ("first", "last")}  # a record from before the windows
    assert _step_cost_text([{"step_cost": before_flat}]) == text
    assert _step_cost_text([{}]) == ""  # a record written before it was recorded
    rows[2:] = []
    short = step_cost(tmp_path)  # two steps: one period, in every window
    assert short["first"] == short["last"] and short["first"]["period_s"] == 1.0
    assert short["flat"]["early"] == short["flat"]["late"] == {"steps": [1, 2], "period_s": 1.0}
    rows[1:] = []
    assert step_cost(tmp_path) is None  # one step has no period


def test_the_reward_curve_is_the_batches_mean_reward_over_each_tenth_of_the_steps(tmp_path, monkeypatch):
    import sao.lake.store as store

    # 25 steps: the batches solve 0.25 of their tasks at steps 0-11, 0.5 at 12-21, 1.0 at 22-24; step 5
    # recorded no reward (a record from before the metric), so 24 steps are cut into parts of 2 or 3
    rewards = [0.25] * 12 + [0.5] * 10 + [1.0] * 3
    metrics = [{"critic/explained_variance": 0.1, **({} if step == 5 else {"batch/reward_mean": reward})}
               for step, reward in enumerate(rewards)]
    rows = [{"step": step, "metrics": list(m.items())} for step, m in enumerate(metrics)]
    asked = {}

    def read_run(name, run_id, columns):
        asked.update(name=name, run_id=run_id, columns=columns)
        return SimpleNamespace(to_pylist=lambda: list(reversed(rows)))  # in no order: sorted by step

    monkeypatch.setattr(store.Lake, "open", classmethod(lambda cls, root: SimpleNamespace(read_run=read_run)))
    curve = reward_curve(tmp_path)
    assert asked == {"name": "train_steps", "run_id": "demo", "columns": ["step", "metrics"]}
    # the 24 steps with a reward (0-4, 6-24), cut at 0, 2, 5, 7, 10, 12, 14, 17, 19, 22, 24 (round(2.4 i))
    assert [part["steps"] for part in curve] == [[0, 2], [2, 5], [6, 8], [8, 11], [11, 13], [13, 15], [15, 18],
                                                 [18, 20], [20, 23], [23, 25]]
    assert [part["reward"] for part in curve] == pytest.approx(
        [0.25, 0.25, 0.25, 0.25, (0.25 + 0.5) / 2, 0.5, 0.5, 0.5, (0.5 + 0.5 + 1.0) / 3, 1.0])
    text = _reward_curve_text([{"seed": 1, "reward_curve": curve[:2]}, {}, {"seed": None, "reward_curve": curve[-1:]}])
    assert text == ("The share of its training batches' rollouts that solved their task (sampled at T=1, policies at "
                    "most `max_staleness` versions behind; the mean of `batch/reward_mean`), over each of 10 "
                    "consecutive parts of the run's steps (steps in brackets): seed 1: 0.25 (0-1), 0.25 (2-4); "
                    "run 3: 1.00 (23-24).")
    assert _reward_curve_text([{}, {"reward_curve": None}]) == ""  # records from before it was recorded
    rows[:] = [{"step": 0, "metrics": [("critic/explained_variance", 0.1)]}]
    assert reward_curve(tmp_path) is None


def test_the_critics_step_off_the_path_is_shown_early_and_late_beside_its_step_on_the_path():
    steps = {"first": {"step_off_path": -0.0296, "step_on_path": 0.0012},
             "last": {"step_off_path": -0.0363, "step_on_path": None}}
    assert _off_path({"critic_off_path": steps}) == "-0.030 (+0.001) / -0.036 (-)"
    oracle = {key: part | {"oracle_step_off_path": -0.5, "oracle_step_on_path": 0.02} for key, part in steps.items()}
    assert _off_path({"critic_off_path": oracle}) == (
        "-0.030 (+0.001) / -0.036 (-) (oracle's -0.500 (+0.020) / -0.500 (+0.020))")
    nothing = {"step_off_path": None, "step_on_path": None}
    assert _off_path({"critic_off_path": {"first": nothing, "last": nothing}}) == "- / -"
    assert _off_path({}) == _off_path({"critic_off_path": None}) == "not recorded"
    assert _off_path({"critic_off_path": steps}, critic=False) == "no critic"


def _sampled(reward, logprobs, mask, temperature=1.0, kind="sampling"):
    return {"trajectory_id": "t", "reward": reward, "logprobs": logprobs, "action_mask": mask,
            "logprob_kind": kind, "sampling": {"temperature": temperature}}


def test_the_trained_windows_are_a_runs_first_and_last_25_steps():
    import benchmarks.demo as demo

    steps = [{"step": step, "trajectory_ids": [f"t{step}"]} for step in range(60)]
    assert [(label, [s["step"] for s in chosen]) for label, chosen in demo._windows(steps)] == [
        ("first", list(range(25))), ("last", list(range(35, 60)))]
    assert [(label, len(chosen)) for label, chosen in demo._windows(steps[:10])] == [("first", 10), ("last", 10)]
    assert demo._windows([]) == ()


def test_the_sampled_tokens_surprise_is_their_mean_minus_log_p_early_and_late_by_outcome():
    from benchmarks.demo import TrainedWindows

    early = [_sampled(1.0, [-0.1, -9.0, -0.3], [True, False, True]),  # the observation token does not count
             _sampled(0.0, [-2.0, -0.5], [True, True])]
    late = [_sampled(1.0, [-0.02, -0.04], [True, True]), _sampled(0.5, [-3.0], [True])]  # under 1: failed
    windows = TrainedWindows(SimpleNamespace(run_id="demo"), 60, {"first": early, "last": late})
    figures = sampled_surprise(windows)
    # early: (0.1 + 0.3 + 2.0 + 0.5) / 4 tokens; succeeded (0.1 + 0.3) / 2; failed (2.0 + 0.5) / 2
    assert figures["first"] == pytest.approx({"all": 0.725, "succeeded": 0.2, "failed": 1.25, "rollouts": 2})
    assert figures["last"] == pytest.approx({"all": 3.06 / 3, "succeeded": 0.03, "failed": 3.0, "rollouts": 2})
    assert _surprise({"sampled_surprise": figures}) == "0.725 / 1.020 (0.030 / 3.000)"
    assert _surprise({}) == "not recorded"
    # sampled otherwise than from the policy at temperature 1: not an estimate of its entropy
    late[0] = _sampled(1.0, [-0.02], [True], temperature=0.7)
    assert sampled_surprise(windows) is None
    assert sampled_surprise(TrainedWindows(SimpleNamespace(run_id="demo"), 0, {})) is None


def test_the_report_names_the_algorithm_the_runs_trained_with():
    assert _algorithm({"sets": []}) == "sao"  # the demo config's
    assert _algorithm({"sets": ["train.steps=5", "algorithm.name=self_imitation"]}) == "self_imitation"
    assert _algorithm({"sets": ["algorithm.oracle_values=true"]}) == "sao"


def test_a_record_is_reread_from_its_runs_folders_and_nothing_recorded_is_replaced(tmp_path, monkeypatch):
    import benchmarks.demo as demo

    record = {"tag": "x", "runs": [{"seed": 1, "value_pretraining": {"num_train": 1}, "step_cost": {"first": "kept"}},
                                   {"seed": 2}]}
    path = tmp_path / "demo-x.json"
    path.write_text(json.dumps(record))
    with pytest.raises(FileNotFoundError, match="run-1 holds no run"):
        reread(path, tmp_path / "work", [])
    for index in (1, 2):
        (tmp_path / "work" / f"run-{index}" / "runs").mkdir(parents=True)
    monkeypatch.setattr(demo, "critic_fit", lambda folder: {"critic/explained_variance": {"first": 0.1, "last": 0.2}})
    monkeypatch.setattr(demo, "value_pretraining", lambda folder: {"num_train": folder.name})
    monkeypatch.setattr(demo, "trained_windows", lambda folder: folder.name)  # read once for both figures
    monkeypatch.setattr(demo, "critic_off_path", lambda windows: {"folder": windows})
    monkeypatch.setattr(demo, "sampled_surprise", lambda windows: {"surprise": windows})
    monkeypatch.setattr(demo, "step_cost", lambda folder: {"first": folder.name, "flat": folder.name})
    monkeypatch.setattr(demo, "reward_curve", lambda folder: [{"steps": [0, 1], "reward": folder.name}])
    runs = reread(path, tmp_path / "work", ["--reread", str(path)])["runs"]
    assert [run["reward_curve"][0]["reward"] for run in runs] == ["run-1", "run-2"]
    assert [run["sampled_surprise"] for run in runs] == [{"surprise": "run-1"}, {"surprise": "run-2"}]
    assert [run["value_pretraining"] for run in runs] == [{"num_train": 1}, {"num_train": "run-2"}]
    assert all(run["critic_fit"]["critic/explained_variance"]["last"] == 0.2 for run in runs)
    assert [run["critic_off_path"] for run in runs] == [{"folder": "run-1"}, {"folder": "run-2"}]
    # a step cost recorded before the flat-cost windows keeps what it has and gains them
    assert [run["step_cost"] for run in runs] == [{"first": "kept", "flat": "run-1"}, {"first": "run-2", "flat": "run-2"}]
