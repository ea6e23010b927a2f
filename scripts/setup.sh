#!/usr/bin/env bash
# Create .venv and install twinkle_ray from this checkout.
#   bash scripts/setup.sh        # runtime deps + the examples' extras (demo, RLHF examples)
#   bash scripts/setup.sh test   # + test and docs deps
# torch is pinned to the CPU build first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q -e ".[test,examples,docs]"
else
  .venv/bin/python -m pip install -q -e ".[examples]"
fi
