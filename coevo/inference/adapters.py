"""LoRA adapters as published weights: PEFT's directory format, and one adapter merged into base weights.

An adapter directory holds ``adapter_model.safetensors`` (per adapted linear layer
``base_model.model.<module>.lora_A.weight``, shape ``(r, in)``, and ``.lora_B.weight``, shape
``(out, r)``) and ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...): what PEFT
saves and what vLLM's ``/v1/load_lora_adapter`` loads; coevo adds its manifest.

Invariants:
- an adapted layer computes ``W x + s B A x`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)``
  with ``use_rslora``), as PEFT and vLLM compute it;
- a merge starts from the base weights every time, never from the previous merge: loading version
  n and then m serves exactly what loading m alone serves;
- an adapter naming a module the base lacks is refused whole (nothing merged).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def config_of(path: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())


def base_of(path: Path) -> Path:
    """The base model directory an adapter was trained on (``base_model_name_or_path``)."""
    base = config_of(path).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(f"adapter at {path}: its base model {base!r} is not a local directory")
    return Path(base)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter's tensors and its config."""
    from safetensors.torch import load_file

    path = Path(path)
    return load_file(path / ADAPTER_WEIGHTS), config_of(path)


def scale(config: Mapping[str, Any]) -> float:
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def adapted_weights(adapter: Mapping[str, torch.Tensor]) -> list[str]:
    """The base weights an adapter changes (``<module>.weight``)."""
    return [k.removeprefix(PREFIX).removesuffix(_A) + ".weight" for k in adapter if k.endswith(_A)]


def merged(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The base weights of every adapted layer with the adapter added, in the base's dtype and device
    (computed in fp32): ``{"<module>.weight": W + s B A}``."""
    import torch

    s = scale(config)
    out: dict[str, torch.Tensor] = {}
    for key, a in adapter.items():
        if not key.endswith(_A):
            continue
        module = key.removeprefix(PREFIX).removesuffix(_A)
        b = adapter.get(f"{PREFIX}{module}{_B}")
        w = base.get(f"{module}.weight")
        if b is None or w is None:
            raise ValueError(f"adapter layer {module}: " + ("no lora_B" if b is None else "not in the base model"))
        delta = b.to(device=w.device, dtype=torch.float32) @ a.to(device=w.device, dtype=torch.float32)
        out[f"{module}.weight"] = (w.float() + s * delta).to(w.dtype)
    if not out:
        raise ValueError("the adapter adapts no layer")
    return out
