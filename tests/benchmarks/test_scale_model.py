"""The scaling model: hand-worked limits it must reproduce, and ``sao bench scale --quick`` end to end.

Each limit case makes one stage the only slow one, so the steady-state throughput is known in closed
form: the trainer (batch / step time), the rollouts (Little's law: in flight / trajectory duration),
the lake writer (rows per commit / commit time), shared cores (two busy replicas on one core run at
half speed).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.scale_model import (
    Scenario,
    datacentre_scenario,
    decode_curve,
    main,
    replica_gpus,
    simulate,
)

FAST = dict(
    replicas=2, max_in_flight=8, rate_curve=((1.0, 1e9),), turn_overhead_s=1e-6, tokens_per_turn=1.0,
    context_tokens=100.0, turns=1, tool_median_s=1e-6, tool_sigma=0.0, flush_rows=1, flush_seconds=1e-3,
    commit_s=1e-6, commit_s_per_token=0.0, batch=8, max_staleness=1000, read_s=0.0, step_s=1e-6,
    step_s_per_token=0.0, params=1.0, publish_put_s_per_param=0.0, broadcast_s=0.0, steps=30, warmup_steps=5,
)


def scenario(**changes) -> Scenario:
    return Scenario(name="limit", **(FAST | changes))


def test_trainer_bound_throughput_is_batch_over_step_time():
    p = simulate(scenario(step_s=2.0))
    assert p.trajectories_per_s == pytest.approx(8 / 2.0, rel=0.01)
    assert p.step_s == pytest.approx(2.0, rel=0.01)
    assert p.bottleneck == "trainer"


def test_rollout_bound_throughput_follows_littles_law():
    # 8 in flight, each trajectory 2 instant turns with a 1.0 s tool call between: 8 / 1.0 s = 8 per second.
    p = simulate(scenario(turns=2, tool_median_s=1.0, steps=60))
    assert p.trajectories_per_s == pytest.approx(8.0, rel=0.05)
    assert p.bottleneck == "rollout"


def test_per_turn_cost_is_work_each_replica_shares():
    # A turn costs 0.5 s of its replica's time; 2 turns per trajectory: each of the 2 replicas finishes
    # one trajectory per second whatever the number in flight, so 2 per second.
    for in_flight in (2, 8):
        p = simulate(scenario(turn_overhead_s=0.5, turns=2, max_in_flight=in_flight, steps=60))
        assert p.trajectories_per_s == pytest.approx(2.0, rel=0.05)


def test_lake_bound_throughput_is_rows_per_commit_over_commit_time():
    p = simulate(scenario(flush_rows=4, flush_seconds=100.0, commit_s=1.0, max_in_flight=64, steps=40))
    assert p.trajectories_per_s == pytest.approx(4 / 1.0, rel=0.05)
    assert p.rows_per_commit == pytest.approx(4, rel=0.01)
    assert p.bottleneck == "lake"


def test_two_busy_replicas_on_one_shared_core_run_at_half_speed():
    # Decode-bound: 100 tokens per trajectory at 100 tokens/s per replica (one request each).
    decode = dict(rate_curve=((1.0, 100.0),), tokens_per_turn=100.0, max_in_flight=2, batch=2, steps=40)
    dedicated = simulate(scenario(**decode))
    shared = simulate(scenario(**decode, shared_cores=1.0))
    assert shared.trajectories_per_s / dedicated.trajectories_per_s == pytest.approx(0.5, rel=0.1)


def test_the_staleness_gate_bounds_work_in_flight():
    # Room for 64 in flight, but (0 + 1) * batch 4 may start per version: a synchronous pipeline of
    # 1.0 s rollouts (a tool call between two instant turns) and a 0.5 s step: 4 per 1.5 s.
    p = simulate(scenario(turns=2, tool_median_s=1.0, max_in_flight=64, batch=4, max_staleness=0, step_s=0.5))
    assert p.trajectories_per_s == pytest.approx(4 / 1.5, rel=0.05)
    assert p.mean_staleness == 0.0


def test_weights_that_arrive_later_than_the_staleness_bound_make_each_step_wait_for_the_broadcast():
    # Rollouts of the old weights are stale (skipped; their gate places given back) until the replicas
    # run the new version 10 s after its publication: a step every ~10 s.
    p = simulate(scenario(turns=2, tool_median_s=0.1, step_s=0.1, max_staleness=0, broadcast_s=10.0))
    assert p.bottleneck == "publish" and p.skipped_stale_frac > 0.5
    assert 10.0 <= p.step_s < 11.0


def test_scenarios_reject_impossible_settings():
    with pytest.raises(ValueError, match="steps"):
        scenario(steps=5, warmup_steps=5)
    with pytest.raises(ValueError, match="rate_curve"):
        scenario(rate_curve=((0.0, 10.0),))
    with pytest.raises(ValueError, match="broadcast"):
        datacentre_scenario("x", params=7e9, replicas=4, trainer_gpus=8, trajectory_tokens=8000, broadcast="gossip")


def test_decode_curve_respects_kv_memory_and_grows_with_concurrency():
    assert replica_gpus(7e9, dataclasses.replace(_hw())) == 1 and replica_gpus(30e9, _hw()) == 2
    short = decode_curve(30e9, 8_000, _hw())
    long = decode_curve(30e9, 100_000, _hw())
    assert long[-1][0] < short[-1][0]  # 100k-token contexts fit fewer requests
    rates = [rate for _, rate in short]
    assert rates == sorted(rates)


def _hw():
    from benchmarks.scale_model import Hardware

    return Hardware()


@pytest.mark.slow
def test_quick_run_writes_json_and_markdown(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Someone else's section\n\nkept\n")
    scaling = tmp_path / "SCALING.md"
    scaling.write_text("# Scaling\n\n<!-- scaling-predictions:begin -->\n<!-- scaling-predictions:end -->\n")
    assert main(["--quick", "--results-dir", str(tmp_path), "--results-md", str(results),
                 "--scaling-md", str(scaling)]) == 0
    data = json.loads((tmp_path / "scale.json").read_text())
    assert len(data["datacentre"]) == 2
    for row in data["datacentre"]:
        assert row["trajectories_per_s"] >= 0 and row["bottleneck"] in {"rollout", "gate", "trainer", "lake", "publish"}
    text = results.read_text()
    assert "Someone else's section" in text and text.count("<!-- scale:begin -->") == 1
    assert "first bottleneck" in text
    assert "what to do next" in scaling.read_text() and data["datacentre"][0]["scenario"] in scaling.read_text()


def _committed_scale_data() -> dict:
    from benchmarks.scale_model.paths import RESULTS_DIR

    return json.loads((RESULTS_DIR / "scale.json").read_text())


def _reading(markdown: str) -> str:
    return markdown.split("Reading the table", 1)[1]


def test_scaling_doc_section_is_what_the_committed_data_renders_to():
    from benchmarks.scale_model.paths import ROOT
    from benchmarks.scale_model.report import scaling_markdown

    doc = (ROOT / "docs" / "SCALING.md").read_text()
    section = doc.split("<!-- scaling-predictions:begin -->", 1)[1].split("<!-- scaling-predictions:end -->", 1)[0]
    assert section.strip() == scaling_markdown(_committed_scale_data()).strip()


def test_reading_the_table_takes_its_figures_from_the_rows():
    from benchmarks.scale_model.report import GRID_ROWS, scaling_markdown

    data = _committed_scale_data()
    assert [row["scenario"] for row in data["datacentre"]] == list(GRID_ROWS.values())
    before = _reading(scaling_markdown(data))
    assert "at about 26 per second" in before and "a step (28 s)" in before and "(18 s)" in before
    assert "28% go stale" in before and "(0.3 s) cuts the stale share to 11%" in before
    assert "(256 against 249 per second)" in before and "a step of 28 minutes" in before
    assert "still on 2048 (12 minutes, 2.3x faster); about 30% of rollouts" in before
    assert "caps a 512-replica deployment" in before and "{" not in before  # every figure filled in

    changed = json.loads(json.dumps(data))
    base, faster, sharded, _, batched, widest, long, long_faster = changed["datacentre"]
    base["trajectories_per_s"] = 31.4
    faster.update(step_s=30.2, broadcast_s=20.4, skipped_stale_frac=0.35)
    sharded.update(broadcast_s=0.52, skipped_stale_frac=0.07)
    batched["trajectories_per_s"], widest["trajectories_per_s"] = 300.4, 310.0
    long["step_s"], long_faster["step_s"], long_faster["skipped_stale_frac"] = 1800.0, 600.0, 0.41
    long_faster["trajectories_per_s"] = long["trajectories_per_s"] * 3.04
    after = _reading(scaling_markdown(changed))
    assert "at about 31 per second" in after and "at about 26" not in after
    assert "a step (30 s)" in after and "(20 s)" in after and "35% go stale" in after
    assert "(0.5 s) cuts the stale share to 7%" in after
    assert "(310 against 300 per second)" in after and "multiplies it by 2.6" in after
    assert "a step of 30 minutes" in after and "still on 2048 (10 minutes, 3.0x faster); about 41% of" in after


def test_reading_the_table_refuses_another_grid_or_a_claim_the_rows_no_longer_bear_out():
    from benchmarks.scale_model.datacentre import datacentre_grid
    from benchmarks.scale_model.report import GRID_ROWS, scaling_markdown

    assert [sc.name for sc in datacentre_grid()] == list(GRID_ROWS.values())
    data = _committed_scale_data()
    quick = data | {"datacentre": data["datacentre"][:2]}
    assert "first 2 rows only" in _reading(scaling_markdown(quick))
    for rows in (data["datacentre"][:3] + data["datacentre"][4:], data["datacentre"][1:],
                 [row | {"scenario": row["scenario"].replace("512", "256")} for row in data["datacentre"]]):
        with pytest.raises(ValueError, match="GRID_ROWS"):
            scaling_markdown(data | {"datacentre": rows})
    lake_first = [data["datacentre"][0] | {"bottleneck": "lake"}, *data["datacentre"][1:]]
    with pytest.raises(ValueError, match="the base row is trainer-bound"):
        scaling_markdown(data | {"datacentre": lake_first})
