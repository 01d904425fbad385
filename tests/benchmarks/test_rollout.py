"""The rollout-throughput benchmark runs end to end (``--quick``): the static loop, the engine in its own
process and the Serve app at each concurrency, the weight publication, and nothing written under docs/."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.rollout import main, static_kernel_loop, static_loop, summarise


def test_the_kernel_static_loop_decodes_what_the_transformers_loop_decodes():
    """The two static references run the same model: same prompts and sampler seed, same tokens (the
    kernel's attention agrees with Transformers' to rounding)."""
    from sao.models.policy import build_policy

    tokens_hf, tokens_kernel = [], []
    static_loop(build_policy(seed=0).eval(), 3, 12, seed=4, record=tokens_hf)
    static_kernel_loop(build_policy(seed=0).eval(), 3, 12, seed=4, record=tokens_kernel)
    assert len(tokens_hf) == 12 and tokens_kernel == tokens_hf


def test_ratios_are_taken_within_a_round_against_its_stronger_static_loop():
    def arm(tokens_s):
        return {"tokens_s": tokens_s, "mean_batch": 4.0, "busy_fraction": 0.9, "requests_per_prefill": 1.0}

    rounds = [{"static": {"static_hf": {4: 100.0}, "static_kernel": {4: 120.0}}, "reference": {4: 120.0},
               "engine": {4: arm(60.0)}, "serve": {4: arm(90.0)}, "vllm": None},
              {"static": {"static_hf": {4: 200.0}, "static_kernel": {4: 150.0}}, "reference": {4: 200.0},
               "engine": {4: arm(100.0)}, "serve": {4: arm(100.0)}, "vllm": None},
              {"static": {"static_hf": {4: 80.0}, "static_kernel": {4: 100.0}}, "reference": {4: 100.0},
               "engine": {4: arm(70.0)}, "serve": {4: arm(70.0)}, "vllm": None}]
    summary = summarise(rounds, [4])
    assert summary["ratios"]["4"]["serve/static"] == {"median": 0.7, "min": 0.5, "max": 0.75}
    assert summary["ratios"]["4"]["engine/static"] == {"median": 0.5, "min": 0.5, "max": 0.7}
    assert summary["reference"]["4"] == 120.0 and summary["static_hf"]["4"] == 100.0
    assert summary["serve"]["4"]["tokens_s"] == 90.0 and summary["serve"]["4"]["runs"] == [90.0, 100.0, 70.0]


@pytest.mark.slow
@pytest.mark.ray
def test_quick_run_measures_every_arm_and_the_publication(tmp_path):
    out, md = tmp_path / "rollout.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--quick", "--out-json", str(out), "--results-md", str(md)]) == 0
    data = json.loads(out.read_text())
    cpus = os.cpu_count() or 1
    assert data["engine_cpus"] == ([cpus - 1] if cpus > 1 else None)  # the default: decode loops on the last CPU
    levels = [str(c) for c in data["concurrency"]]
    assert data["runs"] == len(data["rounds"]) == 2
    for arm in ("static_hf", "static_kernel", "reference", "engine", "serve", "ratios"):
        assert set(data[arm]) == set(levels), arm
    for level in levels:
        assert data["reference"][level] >= max(data["static_hf"][level], data["static_kernel"][level])
        ratio = data["ratios"][level]["serve/static"]
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    for level in levels:
        for arm in ("engine", "serve"):
            point = data[arm][level]
            assert point["tokens_s"] > 0 and 0.0 < point["busy_fraction"] <= 1.0
            assert 1.0 <= point["mean_batch"] <= int(level) + 1e-9  # never more requests than clients
    publish = data["publish"]
    assert publish["parameters"] > 0 and publish["bytes"] == 4 * publish["parameters"]  # fp32
    assert 0 < publish["put_and_announce_s_median"] and 0 < publish["reach_all_replicas_s_median"] <= publish["reach_all_replicas_s_max"]
    assert "Rollout throughput" in md.read_text()


@pytest.mark.vllm
@pytest.mark.ray
def test_quick_run_with_the_vllm_arms(tmp_path):
    """--vllm adds the vLLM engine alone (in the vLLM environment's Python) and through Serve, at the same
    concurrency levels as the torch arms (make test-vllm)."""
    out, md = tmp_path / "rollout.json", tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    assert main(["--quick", "--vllm", "--out-json", str(out), "--results-md", str(md)]) == 0
    data = json.loads(out.read_text())
    levels = [str(c) for c in data["concurrency"]]
    assert set(data["vllm"]) == {"engine", "serve"}
    for arm in ("engine", "serve"):
        assert set(data["vllm"][arm]) == set(levels) and all(data["vllm"][arm][c]["tokens_s"] > 0 for c in levels)
    assert "| concurrency | torch engine | vLLM engine |" in md.read_text()
