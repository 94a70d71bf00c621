#!/usr/bin/env bash
# The checks that need CUDA (tests marked gpu): bf16 learner steps on one GPU; weights pushed over
# vLLM's own NCCL transfer on two GPUs with vLLM's GPU build importable by this python (the learner's
# NCCL end is vLLM's communicator). Run in an environment with coevo installed: pip install -e '.[dev]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPUs:', torch.cuda.device_count())"
exec "$PY" -m pytest -q -m gpu tests/test_gpu.py -rs "$@"
