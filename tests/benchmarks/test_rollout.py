"""The rollout-throughput benchmark runs end to end (``--quick``): the static loop, the engine in its own
process and the Serve app at each concurrency, the weight publication, and nothing written under docs/."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.rollout import main


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
    for arm in ("static", "engine", "serve"):
        assert set(data[arm]) == set(levels), arm
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
