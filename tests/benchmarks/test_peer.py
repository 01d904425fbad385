"""The TRL side-by-side benchmark runs end to end (``--quick``): every arm through its real trainer (TRL's
GRPOTrainer, our pipeline synchronous and asynchronous, single- and multi-turn), its figures and a figure
written under the test's folder, nothing under docs/. Its summaries are checked on hand-made records."""

from __future__ import annotations

import json

import pytest

from benchmarks.peer import _split_ours, summarize
from benchmarks.peer_report import ARMS, SPLIT_PARTS, THREAD_GROUPS


def _record(ends: list[float], rewards: list[float], trained: int = 8) -> dict:
    steps = [{"step": k, "begin": (ends[k - 1] if k else 0.0), "end": end, "reward": r, "trained": trained,
              "split": {"generation": 0.5, "training": 0.25, "lake": 0.0, "other": 0.25}}
             for k, (end, r) in enumerate(zip(ends, rewards, strict=True))]
    events = [[end, 100, trained] for end in ends]
    return {"steps": steps, "events": events, "peak_rss_gib": 1.0, "peak_pss_gib": 0.5,
            "cpu_window_s": {"rollout replicas": 2.4, "driver + trainer process": 1.2}}


def test_summary_counts_only_the_steady_state_window():
    record = _record([2.0, 3.0, 4.0, 5.0, 6.0], [0.1, 0.2, 0.6, 0.7, 0.8])
    s = summarize(record, warmup=2, target_reward=0.5)
    assert s["window_s"] == 3.0  # from the end of step 1 to the end of step 4
    assert s["trained_per_s"] == pytest.approx(3 * 8 / 3.0)
    assert s["tokens_per_s"] == pytest.approx(3 * 100 / 3.0)
    assert s["split_frac"]["generation"] == pytest.approx(0.5)
    assert s["cpu_ms_per_completion"] == pytest.approx({"rollout replicas": 100.0, "driver + trainer process": 50.0})
    # rolling 3-step means 0.1, 0.15, 0.3, 0.5, 0.7: the target is reached at step 3, 5 s after step 0 began
    assert s["target_step"] == 3 and s["time_to_target_s"] == pytest.approx(5.0)
    assert summarize(record, warmup=2, target_reward=0.9)["time_to_target_s"] is None


def test_synchronous_split_separates_generation_training_and_the_lake():
    steps = [
        {"begin": 0.0, "end": 10.0, "batch_created_first": 0.5, "batch_finished_last": 6.0,
         "timings": {"wait_read_s": 6.5, "update_s": 2.0, "commit_s": 0.5}},
        {"begin": 10.2, "end": 20.0, "batch_created_first": 10.4, "batch_finished_last": 16.0,
         "timings": {"wait_read_s": 6.0, "update_s": 2.5, "commit_s": 0.3}},
    ]
    second = _split_ours(steps, synchronous=True)[1]["split"]
    assert second["generation"] == pytest.approx(5.6)  # first launch to last finish
    assert second["training"] == 2.5
    assert second["lake"] == pytest.approx(0.3 + 0.2)  # commit + last finish (16.0) -> batch selected (16.2)
    assert sum(second.values()) == pytest.approx(10.0)  # the whole cycle, end of step 0 -> end of step 1
    asynchronous = _split_ours(steps, synchronous=False)[1]["split"]
    assert asynchronous["generation"] == 6.0 and asynchronous["lake"] == 0.3
    assert sum(asynchronous.values()) == pytest.approx(10.0)


def _arms(tmp_path):
    import argparse

    from benchmarks.peer import arms

    args = argparse.Namespace(quick=False, steps=30, multi_steps=20, workdir=tmp_path, lr=2e-4, latency_median=0.5,
                              latency_sigma=1.0, latency_max=10.0, value_samples=None, arms=list(ARMS))
    return {arm.name: arm for arm in arms(args, tmp_path / "random", tmp_path / "sft")}


def test_the_arms_of_each_comparison_share_their_settings(tmp_path, monkeypatch):
    # What is compared must differ only in who trains: model, batch, tokens, sampling, optimiser, threads.
    import os

    from benchmarks.peer import our_config, trl_settings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    every = _arms(tmp_path)
    trl = trl_settings(every["trl-single"])
    for name in ("grpo-single", "sao-single", "sao-single-raytrain"):
        arm = every[name]
        assert (arm.policy_dir, arm.steps, arm.seed, arm.batch) == (every["trl-single"].policy_dir, trl["max_steps"],
                                                                    trl["seed"], trl["per_device_train_batch_size"])
        _, config = our_config(arm)
        train, agent, update = config.train, config.agent, config.train.update
        assert train.batch_size == trl["per_device_train_batch_size"] and train.total_steps == trl["max_steps"]
        assert agent.max_tokens == trl["max_completion_length"] and agent.max_turns == 1
        assert (agent.temperature, agent.top_k or 0, agent.top_p) == (trl["temperature"], trl["top_k"], trl["top_p"])
        assert update.lr_policy == trl["learning_rate"] and update.max_grad_norm == trl["max_grad_norm"]
        assert update.weight_decay == trl["weight_decay"] and update.warmup_steps_policy == trl["warmup_steps"] == 0
        assert config.env_options["math_tool"]["max_tool_calls"] == 0 and not config.env_options["math_tool"]["latency"]
        if arm.synchronous:  # the same algorithm: groups of TRL's size, on TRL's threads (one per core)
            assert update.algorithm.value == "grpo" and config.group_size == trl["num_generations"]
            assert train.torch_threads == 2
        else:  # asynchronous: one thread, the replicas generate on the other core while it updates
            assert train.torch_threads == 1 and train.max_staleness == 2
    grpo, sao = (our_config(every[name])[1] for name in ("grpo-multi", "sao-multi"))
    assert grpo.env_options == sao.env_options and grpo.env_options["math_tool"]["latency"]["kind"] == "lognormal"
    assert (grpo.agent, grpo.train.batch_size, grpo.train.total_steps, grpo.train.update.lr_policy) == (
        sao.agent, sao.train.batch_size, sao.train.total_steps, sao.train.update.lr_policy)
    assert every["grpo-multi"].policy_dir == every["sao-multi"].policy_dir


def test_ratios_over_rounds_pair_the_arms_of_each_round():
    from benchmarks.peer import over_runs

    def summary(rate, cpu):
        return {"trained_per_s": rate, "cpu_ms_per_completion": {"a": cpu, "b": 1.0}}

    rounds = [{"trl-single": summary(100.0, 9.0), "grpo-single": summary(50.0, 19.0)},
              {"trl-single": summary(80.0, 9.0), "grpo-single": summary(60.0, 29.0)},
              {"trl-single": summary(120.0, 9.0), "grpo-single": summary(30.0, 14.0)}]
    over = over_runs(rounds)
    ratio = over["ratios"]["grpo-single / trl-single"]
    assert ratio["runs"] == [0.5, 0.75, 0.25] and ratio["median"] == 0.5 and ratio["target"] == 1.0
    assert (ratio["min"], ratio["max"]) == (0.25, 0.75)
    assert over["trained_per_s"]["grpo-single"]["median"] == 50.0  # not the ratio of the medians
    cpu = over["ratios"]["CPU per completion: grpo-single / trl-single"]
    assert cpu["runs"] == [2.0, 3.0, 1.5] and cpu["at_most"]
    assert "sao-single / trl-single" not in over["ratios"]  # an arm that did not run is not reported
    rounds[1]["trl-single"]["cpu_ms_per_completion"] = {}  # a window the CPU sampler did not see
    assert over_runs(rounds)["ratios"]["CPU per completion: grpo-single / trl-single"]["runs"] == [2.0, 1.5]


def test_the_committed_record_renders_to_its_section_with_every_target_judged(tmp_path):
    from pathlib import Path

    from benchmarks.peer import main

    results = tmp_path / "RESULTS.md"
    assert main(["--render", "--out", "docs/results", "--results-md", str(results)]) == 0
    section = results.read_text()
    committed = Path("docs/RESULTS.md").read_text()
    begin, end = "<!-- peer:begin -->", "<!-- peer:end -->"
    assert section[section.index(begin):section.index(end)] == committed[committed.index(begin):committed.index(end)]
    for target in ("target 1x", "target 0.75x", "target 3x"):
        assert target in section


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_reports_each_kind_of_arm(tmp_path):
    pytest.importorskip("trl", reason="TRL's GRPOTrainer is the peer: install the bench extra (pip install -e '.[bench]')")
    from benchmarks.peer import main

    # TRL, our synchronous pipeline (single-turn) and our asynchronous one (multi-turn, tool latency); the
    # other arms differ from these only in settings (algorithm, shape, Ray Train)
    arms = ["trl-single", "grpo-single", "sao-multi"]
    assert main(["--quick", "--arms", ",".join(arms), "--workdir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "peer-quick.json").read_text())
    assert set(data["arms"]) == set(arms) == set(data["summary"])  # (the JSON's keys are sorted)
    for name, record in data["arms"].items():
        steps = record["steps"]
        assert [s["step"] for s in steps] == [0, 1, 2], name
        assert all(s["trained"] == 8 and s["begin"] <= s["end"] for s in steps), name  # 2 prompts x 4
        assert all(0.0 <= s["reward"] <= 1.0 for s in steps), name
        assert all(s["split"][part] >= 0.0 for s in steps for part in SPLIT_PARTS), name
        summary = data["summary"][name]
        assert summary["trained_per_s"] > 0 and summary["tokens_per_s"] >= 0, name
        assert 0.9 < sum(summary["split_frac"].values()) < 1.1, name  # the parts make up the step
        assert 0.05 < summary["peak_rss_gib"] < 64 and summary["peak_pss_gib"] <= summary["peak_rss_gib"], name
        assert sum(record["cpu_s"].values()) > 0 and record["setup_s"] > 0, name
    trl = data["arms"]["trl-single"]
    assert trl["versions"]["trl"] and set(trl["cpu_s"]) == {"TRL process"}
    assert trl["kernel_thread_names"] and trl["thread_names"]  # the sampler saw the threads, the arm named them
    for summary in data["summary"].values():  # (a quick window may fall between two samples: no threads then)
        assert set(summary["root_threads_ms_per_completion"]) <= set(THREAD_GROUPS)
    assert all(0 < s["tokens"] <= 8 * 24 for s in trl["steps"])  # completions of at most 24 tokens
    grpo = data["arms"]["grpo-single"]
    assert grpo["trainer_threads"] == trl["torch_threads"]  # a synchronous trainer on TRL's threads
    assert data["arms"]["sao-multi"]["trainer_threads"] == 1  # asynchronous: the replicas use the other core
    assert data["runs"] == 1 and set(data["over_runs"]["trained_per_s"]) == set(arms)
    assert data["summary"]["grpo-single"]["tokens_per_s"] > 0  # synchronous: generated inside the window
    assert all(s["batch_created_first"] <= s["batch_finished_last"] <= s["end"] for s in grpo["steps"])
    assert {"rollout replicas", "Ray system", "driver + trainer process"} <= set(grpo["cpu_s"])
    sao = data["arms"]["sao-multi"]
    assert sao["arm"]["latency"]["kind"] == "lognormal" and sao["arm"]["algorithm"] == "sao"
    assert sao["driver"]["finished"] >= 3 * 8
    assert all(s["critic_s"] > 0 for s in sao["steps"])  # SAO's critic trained every step
    assert "## Side by side with TRL's GRPOTrainer" in (tmp_path / "peer-quick.md").read_text()
    assert (tmp_path / "peer-quick.png").stat().st_size > 0
