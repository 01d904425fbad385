"""Three SAO steps with vLLM rollout replicas: Serve replicas running vLLM in their own Python environment
(``make vllm-env``), the lake, Ray Train; weights published by the trainer reach vLLM during generation.
Every row passes ``sao lake check``, and every action segment's recorded log-probabilities agree with the
trainer's recomputation under the version that sampled it (``make test-vllm``)."""

import json

import pytest
import yaml

from benchmarks.gpu_check import action_logprob_gap
from sao.config import resolve
from sao.models.policy import build_policy, save_policy
from tests._runs import train_and_audit

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

PROMPTS = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(3, 7)]


@pytest.fixture(scope="module")
def vllm_environment():
    from sao.rollout.vllm_engine import VLLMEnvironmentError, vllm_python

    try:
        return vllm_python()
    except VLLMEnvironmentError as error:
        pytest.skip(f"no vLLM environment ({error})")


def test_three_sao_steps_with_vllm_replicas(tmp_path, tokenizer, ray_session, vllm_environment):
    from sao import runs
    from sao.models.policy import load_policy
    from sao.train.checkpoint import policy_dir

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in PROMPTS))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "run_id": "vllm-replicas", "workdir": str(tmp_path / "runs"),
        "model": {"path": str(save_policy(build_policy(seed=0), tmp_path / "model", tokenizer, policy_version=0))},
        "data": {"train": str(tmp_path / "data.jsonl")}, "env": {"max_tool_calls": 0},
        "train": {"steps": 3, "batch_size": 4},
        # Long replies, more rollouts in flight than a batch and the default staleness: generation goes on
        # while the trainer publishes, so weights change in the middle of replies.
        "rollout": {"engine": "vllm", "num_replicas": 1, "max_tokens": 160, "max_in_flight": 12,
                    "vllm": {"kv_cache_memory_bytes": 256 << 20}},
        "value_pretraining": {"samples": 0}, "lake": {"root": str(tmp_path / "lake")}}))
    config, _ = resolve(tmp_path / "run.yaml")
    assert runs.pipeline_config(config, config.model.path).rollout_python == vllm_environment
    config, version_zero, rows = train_and_audit(tmp_path / "run.yaml")
    assert rows and all(row["error"] is None for row in rows)
    assert all(row["engine_name"] == "vllm" and row["engine_version"].startswith("vllm-0.") for row in rows)
    spanning = [row for row in rows if row["min_policy_version"] < row["max_policy_version"]]
    assert spanning, "no reply was sampled by two versions: no weight update landed during generation"

    # Every action segment against the trainer's forward pass of the version that sampled it.
    gap = action_logprob_gap(rows, lambda v: load_policy(version_zero if v == 0 else policy_dir(config.checkpoint_root, v)))
    print(f"\nvLLM replicas: {len(rows)} rows, {len(spanning)} sampled by two versions or more, "
          f"{gap['action_tokens']} action tokens, versions {gap['versions']}, "
          f"max |recorded - trainer| = {gap['max_abs_gap']:.2e} nats")
    assert gap["rows"] == len(rows) and gap["versions"] == [0, 1, 2, 3] and gap["max_abs_gap"] < 1e-5, gap
