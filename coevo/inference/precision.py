"""The compute dtype of the local models (``learner.dtype``): what the engines serve in, what a LoRA
lane's frozen base is held in, what every learner pass autocasts to.

Invariant: ``auto`` is bfloat16 exactly where the hardware multiplies in it (CUDA GPUs of compute
capability 8 and up, and CPUs with AMX or AVX512-BF16) and the model is wide enough for its matmuls to be the work (hidden size at least
``BF16_MIN_HIDDEN``), float32 elsewhere: the tiny built-in models are bound by latency, not by
multiplication, and keep float32's exactness. Trained parameters (an adapter, full fine-tuning's master
weights), optimiser state and every log-softmax stay float32 whatever it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from coevo.config import ComputeDtype

if TYPE_CHECKING:
    import torch

BF16_MIN_HIDDEN = 512
"""the narrowest model ``auto`` runs in bf16 (SmolLM2-135M: 576; the built-in tiny models: 128)"""


def cpu_has_bf16() -> bool:
    """This CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), as torch's kernels see it."""
    import torch

    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, p, lambda: False)()) for p in probes)


def gpu_has_bf16(device: str) -> bool:
    """The GPU multiplies bf16 in hardware (Ampere, compute capability 8, and later)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def default_device() -> str:
    """Where a local model runs when no device is named: the GPU when there is one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(name: ComputeDtype, device: str | None = None, hidden_size: int | None = None) -> torch.dtype:
    """``learner.dtype`` on ``device`` (default: ``default_device()``) for a model of ``hidden_size``
    (None: wide enough); see the module's invariant."""
    import torch

    device = device or default_device()
    if name == "auto":
        fast = gpu_has_bf16(device) if device.startswith("cuda") else device.startswith("cpu") and cpu_has_bf16()
        wide = hidden_size is None or hidden_size >= BF16_MIN_HIDDEN
        return torch.bfloat16 if fast and wide else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def model_dtype(name: ComputeDtype, device: str | None, model_dir: Path) -> torch.dtype:
    """``compute_dtype`` for the model saved in ``model_dir`` (a transformers directory; read for ``auto`` only)."""
    if name != "auto":
        return compute_dtype(name, device)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    width = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    return compute_dtype(name, device, int(width) if width else None)
