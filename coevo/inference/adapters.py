"""LoRA adapters as published weights: PEFT's directory format; one adapter applied beside a model's
layers (a local engine in bf16), or merged into base weights (one in fp32: ``LocalEngine.adapter_apply``).

An adapter directory holds ``adapter_model.safetensors`` (per adapted linear layer
``base_model.model.<module>.lora_A.weight``, shape ``(r, in)``, and ``.lora_B.weight``, shape
``(out, r)``) and ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...): what PEFT
saves and what vLLM's ``/v1/load_lora_adapter`` loads; coevo adds its manifest.

Invariants:
- an adapted layer computes ``W x + s B A x`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)``
  with ``use_rslora``), as PEFT and vLLM compute it;
- applied beside the layers (``Beside``), the base weights are never written: each adapted layer adds
  ``s B(A x)`` to its output as PEFT's LoRA layer does (``x`` cast to the adapter's dtype, the sum cast
  back to the layer's), so an engine computes what a LoRA lane computes, in bf16 as in fp32;
- loading version n and then m serves exactly what loading m alone serves (``Beside`` replaces the
  previous version whole; a merge starts from the base weights every time);
- an adapter naming a module the base lacks, or a layer that is not linear, is refused whole: what was
  served before stays served.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

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


def layers(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's layers: ``{"<module>": (A, B)}`` (a ValueError for a layer without its ``lora_B``,
    or an adapter of no layer)."""
    out = {}
    for key, a in adapter.items():
        if not key.endswith(_A):
            continue
        module = key.removeprefix(PREFIX).removesuffix(_A)
        b = adapter.get(f"{PREFIX}{module}{_B}")
        if b is None:
            raise ValueError(f"adapter layer {module}: no lora_B")
        out[module] = (a, b)
    if not out:
        raise ValueError("the adapter adapts no layer")
    return out


def merged(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The base weights of every adapted layer with the adapter added, in the base's dtype and device
    (computed in fp32): ``{"<module>.weight": W + s B A}``."""
    import torch

    s = scale(config)
    out: dict[str, torch.Tensor] = {}
    for module, (a, b) in layers(adapter).items():
        w = base.get(f"{module}.weight")
        if w is None:
            raise ValueError(f"adapter layer {module}: not in the base model")
        delta = b.to(device=w.device, dtype=torch.float32) @ a.to(device=w.device, dtype=torch.float32)
        out[f"{module}.weight"] = (w.float() + s * delta).to(w.dtype)
    return out


class Beside:
    """One adapter at a time on ``model``'s linear layers, applied by forward hooks beside the base
    weights (never merged into them): a new version costs a copy of its small ``A`` and ``B``, not a
    rewrite of every adapted weight, and a bf16 base keeps an fp32 adapter's small update exactly."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.scale = 1.0
        self._ab: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: dict[str, RemovableHandle] = {}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter served now, by layer (``<module>.lora_A`` / ``.lora_B``); empty when none."""
        return {f"{m}.lora_{n}": t for m, ab in self._ab.items() for n, t in zip("AB", ab, strict=True)}

    def load(self, adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Serve ``adapter`` (PEFT's tensor names) in place of the one served now; checked whole first."""
        import torch

        modules = dict(self.model.named_modules())
        new: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, (a, b) in layers(adapter).items():
            layer = modules.get(module)
            if layer is None or not isinstance(layer, torch.nn.Linear):
                raise ValueError(
                    f"adapter layer {module}: " + ("not in the base model" if layer is None else "not a linear layer")
                )
            if a.shape != (b.shape[1], layer.in_features) or b.shape[0] != layer.out_features:
                raise ValueError(f"adapter layer {module}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit it")
            device = layer.weight.device
            new[module] = (a.detach().to(device).clone(), b.detach().to(device).clone())
        self.clear()
        self.scale, self._ab = scale(config), new
        for module in new:
            self._hooks[module] = modules[module].register_forward_hook(self._hook(module))

    def clear(self) -> None:
        """Serve the base weights alone."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._ab = {}

    def _hook(self, module: str) -> Any:
        import torch.nn.functional as F

        def add(_layer: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            a, b = self._ab[module]
            return (out + F.linear(F.linear(args[0].to(a.dtype), a), b) * self.scale).to(out.dtype)

        return add
