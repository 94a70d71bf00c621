"""Published weights: the model's tensors only, in the serving dtype, for every server of a lane.

What ``WeightsPublished`` points at, what vLLM reloads from disk, what the weight server pushes and
what a local engine in the learner's process swaps in (from memory, ``HELD``). No optimizer state,
no fp32 master copy: ``learner.publish_dtype`` (bf16 on CUDA, fp32 on CPU by default).

Invariants:
- every publication gets a directory of its own (``v<version>-<nonce>``: a learner restarted from
  an older checkpoint publishes the redone versions beside, never over, the lost ones), written
  whole (config, tokenizer files, safetensors, manifest last) then renamed into place; no fsync:
  published weights are a cache a restarted learner rewrites;
- the tensors handed to ``HELD`` and the files are the same immutable CPU copy, taken between two
  optimiser steps, so a push or an in-memory swap never races the next step;
- the newest ``KEEP_PUBLISHED`` directories are kept, and an older one while anyone reads it (a
  follower loading it, the weight server reading it to push: ``lease``); it goes at a later prune.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from coevo.weights import lease, tensorfiles

KEEP_PUBLISHED = 4


def serving_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """``learner.publish_dtype`` as a torch dtype (auto: the lane's compute dtype, ``learner.dtype``)."""
    if name == "auto":
        return compute
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def serving_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Immutable CPU copies of ``state`` with floating tensors in ``dtype`` (tied names share one copy)."""
    seen: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key not in seen:
            target = dtype if t.is_floating_point() else t.dtype
            t = t.detach()
            seen[key] = t.to(target).to("cpu") if t.is_cuda else t.to(dtype=target, copy=True)  # cast on the GPU
        out[name] = seen[key]
    return out


def write_published(
    root: Path, version: int, tensors: dict[str, torch.Tensor], config_json: str, base_model: Path
) -> tuple[Path, str, int]:
    """One publication directory of a whole model; (path, manifest digest, bytes written)."""

    def write(tmp: Path) -> dict[str, tensorfiles.FileInfo]:
        files = tensorfiles.write_weights(tmp, tensors)
        files["config.json"] = tensorfiles.write_text(tmp / "config.json", config_json)
        files.update(tensorfiles.copy_files(base_model, tmp, tensorfiles.TOKENIZER_FILES))
        return files

    return _publish(root, version, write)


def write_published_adapter(
    root: Path, version: int, tensors: dict[str, torch.Tensor], adapter_config_json: str
) -> tuple[Path, str, int]:
    """One publication directory of a LoRA adapter (its tensors and config, no base); as ``write_published``."""
    return _publish(root, version, lambda tmp: tensorfiles.write_adapter(tmp, tensors, adapter_config_json))


def _publish(
    root: Path, version: int, write: Callable[[Path], dict[str, tensorfiles.FileInfo]]
) -> tuple[Path, str, int]:
    name = f"v{version:06d}-{secrets.token_hex(3)}"
    tmp = root / f".tmp-{name}"
    tmp.mkdir(parents=True)
    files = write(tmp)
    digest = tensorfiles.seal(tmp, root / name, files, durable=False, version=version)
    prune_published(root)
    return root / name, digest, sum(int(f["bytes"]) for f in files.values())


def prune_published(root: Path, keep: int = KEEP_PUBLISHED) -> list[Path]:
    """Remove all but the newest ``keep`` publications, except those being read; returns those kept
    back because they were being read."""
    done = sorted((p for p in root.glob("v*") if p.is_dir()), key=lambda p: p.stat().st_mtime_ns)
    return [old for old in done[:-keep] if not lease.remove_unless_read(old)]


def clear_partial(root: Path) -> None:
    """Remove directories a killed learner left half written."""
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
