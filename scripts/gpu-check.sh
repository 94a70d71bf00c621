#!/usr/bin/env bash
# The checks that need CUDA: `coevo bench learner` at the 0.5B and 1.5B shapes (JSON into $BENCH_DIR,
# else $OUT, else runs/gpu-check), then the tests marked gpu: bf16 learner steps on one GPU; weights
# pushed over vLLM's own NCCL transfer on two GPUs with vLLM's GPU build importable by this python
# (the learner's NCCL end is vLLM's communicator). Run in an environment with coevo installed:
# pip install -e '.[dev]' (or coevo's dependencies as wheels on PYTHONPATH, ../shared/notes/STACK.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPUs:', torch.cuda.device_count())"
# the learner at real sizes: step, publish and checkpoint costs, peak memory, MFU (docs/benchmarks.md)
BENCH=${BENCH_DIR:-${OUT:-runs/gpu-check}}
mkdir -p "$BENCH"
for size in 0.5B 1.5B; do
  "$PY" -m coevo bench learner --size "$size" --device cuda --json "$BENCH/learner-$size.json"
done
exec "$PY" -m pytest -q -m gpu tests/test_gpu.py -rs "$@"
