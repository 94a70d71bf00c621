#!/usr/bin/env bash
# Install torch==2.13.0 into .venv, the build this machine needs, and say which was installed.
#   - already importable at 2.13.0: nothing is installed (never a reinstall over a working one)
#   - a GPU (nvidia-smi answers): the default wheel from PyPI (CUDA build)
#   - no GPU: the CPU build from PyTorch's CPU index when it answers within a few seconds (no
#     gigabytes of CUDA libraries), else the default wheel (whatever pip's index gives: a fallback)
# --dry-run prints the pip arguments it would use and installs nothing.
# COEVO_TORCH_CPU_INDEX overrides the CPU index (default https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=2.13.0
INDEX=${COEVO_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
PY=${COEVO_TORCH_PYTHON:-.venv/bin/python}
DRY=${1:-}

if [ "$DRY" != "--dry-run" ] && "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
  echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed, kept"
  exit 0
fi

reachable() {  # the index answers an HTTP request within 5 s
  "$PY" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception:
    sys.exit(1)
PY
}

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  args=("torch==$VERSION"); why="a GPU is present: the default (CUDA) build"
elif reachable "$INDEX"; then
  args=(--index-url "$INDEX" "torch==$VERSION"); why="no GPU: the CPU build from $INDEX"
else
  args=("torch==$VERSION"); why="no GPU, and $INDEX does not answer: the default index's build (fallback)"
fi
if [ "$DRY" = "--dry-run" ]; then
  echo "${args[*]}"
  echo "setup: would install torch $VERSION ($why)" >&2
  exit 0
fi
if ! "$PY" -m pip install -q "${args[@]}"; then  # an index that answered but could not deliver: the default one
  [ "${args[0]}" = "--index-url" ] || exit 1
  why="no GPU; $INDEX failed mid-install: the default index's build (fallback)"
  "$PY" -m pip install -q "torch==$VERSION"
fi
echo "setup: installed torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA " + str(torch.version.cuda) if torch.version.cuda else "CPU only")') ($why)"
