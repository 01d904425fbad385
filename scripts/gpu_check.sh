#!/usr/bin/env bash
# The GPU check, unattended, on a machine with an NVIDIA GPU (docs/VLLM.md, "The GPU check"):
#   scripts/gpu_check.sh [OUT.json]      (default gpu_check.json)
# 1. the project's environment (.venv) with the CUDA torch vLLM 0.33 needs, and the vLLM environment
#    (.venv-vllm) beside it: created when missing, their time reported apart from the check's;
# 2. `sao bench gpu-check` (benchmarks/gpu_check.py): the `gpu` tests, vLLM's tokens/s through the engine
#    against its own offline LLM.generate on the same prompts, and 3 SAO steps with vLLM replicas and the
#    trainer on the GPU, with the lake check and the trainer-engine log-probability gap. Under 8 minutes
#    once the environments exist; every figure goes to the one JSON file.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check.json}
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed); on a CPU run: .venv/bin/sao bench gpu-check --device cpu" >&2
  exit 2
fi
nvidia-smi -L
started=$(date +%s)
make install-dev TORCH_SPEC='torch==2.14.0'
make vllm-env TORCH_SPEC='torch==2.14.0' VLLM_SPEC='vllm==0.33.*'
echo "gpu_check: environments ready in $(( $(date +%s) - started )) s" >&2
export RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
timeout 480 .venv/bin/sao bench gpu-check --device cuda --out "$out"
