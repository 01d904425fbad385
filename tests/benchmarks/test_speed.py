"""The speed benchmark: its in-memory queue (the lake's comparison) and a quick end-to-end run of every
arm that writes nowhere under docs/."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

import benchmarks.speed as speed
from benchmarks.speed import (
    ArmResult,
    MemoryQueue,
    _finished,
    _lake_steps,
    _round,
    _run_trajectories,
    _steady,
    _trainer_path,
    main,
    over_rounds,
)


def _record(version):
    return SimpleNamespace(min_policy_version=version)


def test_the_queue_hands_out_fresh_records_in_arrival_order_and_drops_stale_ones():
    queue = MemoryQueue()
    queue.add_many([_record(0), _record(3), _record(1), _record(4)])
    batch = queue.take(2, version=4, max_staleness=2)  # staleness 4, 1, 3, 0: the first and third are stale
    assert [r.min_policy_version for r in batch] == [3, 4]
    assert queue.dropped_stale == 2
    with pytest.raises(TimeoutError, match="0 of 1"):
        queue.take(1, version=4, max_staleness=2, timeout_s=0.05)


def test_the_queue_waits_for_a_batch_to_arrive():
    queue = MemoryQueue()
    threading.Timer(0.1, queue.add_many, args=([_record(0), _record(0)],)).start()
    started = time.monotonic()
    assert len(queue.take(2, version=0, max_staleness=0, timeout_s=5)) == 2
    assert time.monotonic() - started >= 0.09


def test_steady_rate_counts_steps_after_the_first():
    # steps end at 10, 12, 16 s; batch 8: two steps (16 trajectories) in 6 s; busy 1 + 3 of 6 s
    arm = _steady("x", 8, [10.0, 12.0, 16.0], [5.0, 1.0, 3.0], 0.0, 20.0)
    assert arm.trajectories == 16 and arm.steady_s == 6.0 and arm.per_s == pytest.approx(16 / 6)
    assert arm.trainer_busy == pytest.approx(4 / 6) and arm.startup_s == 10.0 and arm.step_s == [2.0, 4.0]


def test_target_figures_are_taken_within_a_round_and_each_arm_is_its_median_round():
    def round_(per_s, ratio):
        arms = [{"name": name, "per_s": v} for name, v in zip(("rollouts", "async", "sync"), per_s, strict=True)]
        return {"arms": arms, "rollout_capacity_per_s": per_s[0], "trainer_capacity_per_s": 9.0,
                "roofline_per_s": per_s[0], "rollout_time_s": {"p50": ratio}, "async_over_sync": ratio,
                "async_over_roofline": per_s[1] / per_s[0], "lake_cost": 0.1 * ratio}

    rounds = [round_((10.0, 6.0, 2.0), 3.0), round_((8.0, 6.0, 3.0), 2.0), round_((12.0, 3.0, 1.0), 3.0)]
    summary = over_rounds(rounds)
    assert summary["async_over_sync"] == {"median": 3.0, "min": 2.0, "max": 3.0}
    assert summary["async_over_roofline"] == {"median": 0.6, "min": 0.25, "max": 0.75}
    assert summary["roofline_per_s"] == 10.0
    assert [a["per_s"] for a in summary["arms"]] == [10.0, 6.0, 2.0]  # each arm's median round, not a mixture
    assert summary["arms"][2]["per_s_runs"] == [2.0, 3.0, 1.0]


def test_the_rollouts_finished_in_the_steady_span_are_split_into_trained_cancelled_and_not_trained(tmp_path):
    """Finished at 1..6 s; the span is (1.5, 5.5] s: rollouts 2-5 count (4 in 4 s), of which 2 and 3
    were trained, 4 cancelled, 5 stored and not trained; 1 (before) and 6 (after) are outside."""
    import dataclasses
    import datetime as dt

    from sao.lake.config import LakeConfig, WriterConfig
    from sao.lake.ledger import record_train_step, register_policy_version
    from sao.lake.records import PolicyVersionRecord, TerminationReason, TrainStepRecord
    from sao.lake.store import Lake
    from sao.lake.synthetic import make_trajectories
    from sao.lake.writer import TrajectoryWriter

    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    for version in (0, 1, 2):
        register_policy_version(lake, PolicyVersionRecord("run-0", version, f"ckpt/{version}", "sha",
                                                          parent_version=None if version == 0 else version - 1))
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    records = []
    for index, record in enumerate(make_trajectories(6, seed=3, num_tokens=8), start=1):
        timings = dataclasses.replace(record.timings, created_at=t0, started_at=t0,
                                      finished_at=t0 + dt.timedelta(seconds=index))
        reason = TerminationReason.CANCELLED if index == 4 else record.termination_reason
        records.append(dataclasses.replace(record, timings=timings, termination_reason=reason))
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)
    assert writer.stats.written == 6
    ids = [r.trajectory_id for r in records]

    record_train_step(lake, TrainStepRecord("run-0", 0, 1, 2, lake.version("trajectories"), (ids[1], ids[2], ids[0]),
                                            t0, t0, {}))
    done = _finished(_run_trajectories(tmp_path / "lake", "run-0"), _lake_steps(tmp_path / "lake", "run-0"),
                     t0 + dt.timedelta(seconds=1.5), t0 + dt.timedelta(seconds=5.5))
    assert done == {"count": 4, "per_s": 1.0, "trained": 2, "cancelled": 1, "not_trained": 1}


def test_the_lake_on_the_trainers_path_is_measured_from_the_rows_of_the_run(tmp_path):
    """Rows A-E arrive at 10.0, 10.5, 11.0, 12.0, 12.2 s and are planned into commits 0.02, 0.03, 0.01,
    0.05, 0.01 s later. Step 0 trains A, ends at 10.8; step 1 trains B and C, starts at 11.0 (0.2 s
    after), has its batch 0.04 s later (11.04: 0.03 s after C's commit at 11.01); step 2 trains D and E,
    starts at 12.5 (0.3 s after step 1's end at 12.2), has its batch at 12.6 (0.39 s after E's 12.21).
    Medians over steps 1 and 2: 0.01 and 0.01 -> 0.01; 0.03 and 0.39 -> 0.21; 0.2 and 0.3 -> 0.25."""
    import datetime as dt

    import pyarrow as pa

    from sao.lake.commit import append_blind
    from sao.lake.config import LakeConfig, WriterConfig
    from sao.lake.ledger import record_train_step, register_policy_version
    from sao.lake.records import PolicyVersionRecord, TrainStepRecord
    from sao.lake.store import Lake
    from sao.lake.synthetic import make_trajectories
    from sao.lake.writer import TrajectoryWriter
    from schemas import trajectories

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def at(seconds):
        return t0 + dt.timedelta(seconds=seconds)

    written = Lake.open(LakeConfig(root=str(tmp_path / "written")))
    register_policy_version(written, PolicyVersionRecord("run-0", 0, "ckpt/0", "sha"))
    records = make_trajectories(5, seed=4, num_tokens=8)
    with TrajectoryWriter(written, WriterConfig(background_flush=False)) as writer:
        writer.add_many(records)
    table = written.read(trajectories.NAME).sort_by("ingest_seq")
    arrived = [10.0, 10.5, 11.0, 12.0, 12.2]
    planned = [10.02, 10.53, 11.01, 12.05, 12.21]
    for name, seconds in (("arrived_at", arrived), ("ingested_at", planned)):
        column = pa.array([at(x) for x in seconds], trajectories.SCHEMA.field(name).type)
        table = table.set_column(table.schema.get_field_index(name), trajectories.SCHEMA.field(name), column)
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register_policy_version(lake, PolicyVersionRecord("run-0", 0, "ckpt/0", "sha"))
    append_blind(lake, trajectories.NAME, table)
    ids = table["trajectory_id"].to_pylist()
    steps = [((ids[0],), 9.0, 10.8, 0.1), ((ids[1], ids[2]), 11.0, 12.2, 0.04), ((ids[3], ids[4]), 12.5, 13.4, 0.1)]
    for step, (chosen, started, finished, wait) in enumerate(steps):
        record_train_step(lake, TrainStepRecord("run-0", step, step, step + 1, lake.version(trajectories.NAME), chosen,
                                                at(started), at(finished), {}, timings={"wait_read_s": wait}))
    path = _trainer_path(_run_trajectories(tmp_path / "lake", "run-0"), _lake_steps(tmp_path / "lake", "run-0"))
    assert path == pytest.approx({"arrival_to_commit_s": 0.01, "commit_to_selected_s": 0.21, "between_steps_s": 0.25},
                                 abs=1e-6)


@pytest.fixture
def mocked_arms(monkeypatch):
    """Every arm of a round replaced by a figure (no Ray, no lake): returns the names of the arms run, in
    order."""
    ran = []

    def arm(name, per_s):
        ran.append(name)
        return ArmResult(name=name, trajectories=32, steady_s=1.0, per_s=per_s, wall_s=1.0, rollout_s=[1.0],
                         step_s=[1.0], finished={"count": 4, "per_s": 2.0, "trained": 3, "cancelled": 1,
                                                 "not_trained": 0})

    monkeypatch.setattr(speed, "_config", lambda *args, **kwargs: None)
    monkeypatch.setattr(speed, "_capacity_arms", lambda *args: (arm("rollout capacity", 4.0),
                                                                 arm("trainer capacity (SAO)", 8.0)))

    def pipeline_arm(name, config, tasks, lake_figures=True):
        # only the asynchronous lake arm reads the figures its trajectories give (finished, trainer path)
        assert lake_figures == ("lake" in name), name
        return arm(name, 3.0 if "lake" in name else 1.0)

    monkeypatch.setattr(speed, "_pipeline_arm", pipeline_arm)
    monkeypatch.setattr(speed, "_queue_arm", lambda config, tasks: arm("async SAO (in-memory queue)", 3.2))
    return ran


def test_the_lake_and_queue_arms_take_turns_to_go_first(tmp_path, mocked_arms):
    ran = mocked_arms
    args = SimpleNamespace(workdir=tmp_path, batch=32, steps=1, sync_steps=1)
    orders = []
    for index in range(3):
        ran.clear()
        record = _round(args, None, [], lambda text: None, index)
        orders.append(ran[2:4])
        assert record["order"] == ["lake", "queue"] if index % 2 == 0 else ["queue", "lake"]
        # the record's arms keep the table's order whatever order they ran in
        assert [a["name"] for a in record["arms"]] == ["rollout capacity", "trainer capacity (SAO)",
                                                       "async SAO (lake)", "async SAO (in-memory queue)", "sync GRPO"]
        assert record["lake_cost"] == pytest.approx(1 - 3.0 / 3.2)
    lake, queue = "async SAO (lake)", "async SAO (in-memory queue)"
    assert orders == [[lake, queue], [queue, lake], [lake, queue]]


@pytest.mark.parametrize("tag", ["", "staleness4"])
def test_a_tag_names_the_result_files_and_the_section(tmp_path, mocked_arms, monkeypatch, tag):
    import sao.runs

    monkeypatch.setattr(speed, "policy_dir", lambda args: tmp_path / "policy")
    monkeypatch.setattr(sao.runs, "math_tasks", lambda split: [])
    out, results = tmp_path / "out", tmp_path / "RESULTS.md"
    argv = ["--workdir", str(tmp_path / "work"), "--out", str(out), "--results-md", str(results), "--runs", "2"]
    assert main([*argv, "--tag", tag] if tag else argv) == 0
    name = f"speed-{tag}" if tag else "speed"
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.json", f"{name}.png"]
    data = json.loads((out / f"{name}.json").read_text())
    assert data["tag"] == tag and [r["order"] for r in data["rounds"]] == [["lake", "queue"], ["queue", "lake"]]
    text = results.read_text()
    assert f"<!-- {name}:begin -->" in text and f"/{name}.png)" in text
    assert ("(staleness4)" in text) == bool(tag)


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_measures_every_arm(tmp_path, ray_session):
    out = tmp_path / "out"
    assert main(["--quick", "--workdir", str(tmp_path / "work"), "--out", str(out),
                 "--results-md", str(tmp_path / "RESULTS.md")]) == 0
    data = json.loads((out / "speed.json").read_text())
    assert data["runs"] == len(data["rounds"]) == 1
    assert data["async_over_sync"]["median"] == data["rounds"][0]["async_over_sync"]
    names = [a["name"] for a in data["arms"]]
    assert names == ["rollout capacity", "trainer capacity (SAO)", "async SAO (lake)", "async SAO (in-memory queue)",
                     "sync GRPO"]
    for arm in data["arms"]:
        assert arm["per_s"] > 0 and arm["trajectories"] > 0
    sync = data["arms"][-1]
    assert sync["staleness_mean"] == 0.0  # every synchronous batch was sampled by the trainer's own version
    assert data["roofline_per_s"] == min(data["rollout_capacity_per_s"], data["trainer_capacity_per_s"])
    lake_arm = data["arms"][2]["finished"]
    assert lake_arm["count"] == lake_arm["trained"] + lake_arm["cancelled"] + lake_arm["not_trained"] > 0
    assert data["trained_share"]["median"] == lake_arm["trained"] / lake_arm["count"]
    assert (out / "speed.png").stat().st_size > 0
    assert not (tmp_path / "RESULTS.md").exists()  # --quick never writes a results section
