"""LoRA lanes (``learner.lora``): the lane's model wrapped by PEFT, so that only the adapter trains.

What a LoRA lane trains, checkpoints and publishes is the adapter: its optimiser holds the adapter's
parameters only, its resume checkpoints and published weights are PEFT adapter directories
(``coevo.inference.adapters``) of a few MB, and the base stays the model directory it started from.

Invariants:
- a fresh adapter computes exactly the base model (PEFT initialises ``lora_B`` to zero), so version 0
  of a LoRA lane serves what the base serves;
- the adapter's tensors are named as PEFT saves them (``base_model.model.<module>.lora_A.weight``),
  the names vLLM loads and a local engine applies (``adapters.Beside``).
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from coevo.config import LoraConfig
from coevo.errors import ConfigError
from coevo.inference import adapters


def _peft_config(cfg: LoraConfig) -> Any:
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError as exc:
        raise ConfigError(f"learner.lora needs peft: pip install 'coevo[lora]' ({exc})", field="learner.lora") from exc
    # peft annotates lora_alpha int; it only divides by it (alpha / r), a float alpha is meant
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, cfg: LoraConfig, adapter: str = "default") -> Any:
    """``model`` with a fresh adapter named ``adapter`` on ``cfg.target_modules``; the base's
    parameters frozen."""
    config = _peft_config(cfg)
    missing = [m for m in cfg.target_modules if not any(n.split(".")[-1] == m for n, _ in model.named_modules())]
    if missing:
        raise ConfigError(
            f"learner.lora.target_modules: the model has no layer named {missing}", field="learner.lora.target_modules"
        )
    from peft import get_peft_model

    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config, adapter_name=adapter)


def adapter_state(model: Any, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (live references: copy before the next step)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=adapter))


def adapter_config_json(model: Any, base_model: Path, adapter: str = "default") -> str:
    """``adapter_config.json`` of the adapter (what PEFT writes and vLLM reads)."""
    config = model.peft_config[adapter].to_dict()
    config["base_model_name_or_path"] = str(base_model)
    return json.dumps(config, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v))


def load_adapter(model: Any, path: Path, adapter: str = "default") -> None:
    """Load the adapter saved in ``path`` (a LoRA lane's checkpoint) into the wrapped ``model``."""
    from peft import set_peft_model_state_dict

    tensors, _ = adapters.read(path)
    result = set_peft_model_state_dict(model, tensors, adapter_name=adapter)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"adapter at {path} has tensors this lane's adapter lacks: {unexpected[:3]}")


def trainable(model: torch.nn.Module, adapter: str | None = None) -> list[torch.nn.Parameter]:
    """Every parameter that trains: of the whole model, or (``adapter``) of that adapter only."""
    if adapter is None:
        return [p for p in model.parameters() if p.requires_grad]
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in f"{n}."]


class SharedBase:
    """One base model under several LoRA lanes (policy and judge as two adapters of one base): the
    base is held once, each lane adds its adapter. The lanes share ``lock``, so one lane's step,
    publication or checkpoint never runs while another lane's adapter is the active one."""

    def __init__(self, base_model: Path, cfg: LoraConfig, dtype: torch.dtype = torch.float32) -> None:
        self.base_model = Path(base_model)
        self.cfg = cfg
        self.dtype = dtype
        """the frozen base's dtype (the adapters stay float32: PEFT upcasts them)"""
        self.lock = threading.RLock()
        self.model: Any = None

    def attach(self, adapter: str, resume: Path | None, device: str) -> Any:
        """The shared model on ``device`` with a new adapter ``adapter`` (the one saved at ``resume``, or fresh)."""
        from transformers import AutoModelForCausalLM

        with self.lock:
            if self.model is None:
                base = AutoModelForCausalLM.from_pretrained(self.base_model, dtype=self.dtype)
                self.model = wrap(base, self.cfg, adapter)
            else:
                self.model.add_adapter(adapter, _peft_config(self.cfg))
            self.model.to(device)
            if resume is not None:
                load_adapter(self.model, resume, adapter)
            return self.model
