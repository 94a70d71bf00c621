"""Weights directories written once, each file hashed while it is written (no second read).

Both artefacts of a lane go through here: published weights (serving dtype, no fsync: a cache the
learner rewrites after a crash) and resume checkpoints (fp32 weights and optimizer state, fsynced).

Invariants:
- a directory is written under a temporary name, its ``manifest.json`` (every file's size and
  sha256, from the bytes as they were written) last, then renamed into place: a reader sees a whole
  directory or none;
- safetensors files are written by ``write_safetensors`` (the format: an 8-byte little-endian
  header length, a JSON header of dtypes, shapes and offsets, then the raw bytes) straight from the
  tensors in memory; hashing runs on a second thread beside the write (both release the GIL);
- weights above ``shard_bytes`` are split into shards written in parallel, with the
  ``model.safetensors.index.json`` transformers and vLLM read.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

from coevo.inference.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from coevo.weights.manifest import write_manifest

SHARD_BYTES = 512 << 20
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
"""the model directory's files besides weights and config that every weights directory carries"""
_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
FileInfo = dict[str, Any]


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (a CPU tensor; no copy when it is contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _header(items: list[tuple[str, torch.Tensor]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_chunks(path: Path, chunks: Iterable[memoryview | bytes]) -> FileInfo:
    """Write ``chunks`` to ``path`` while a second thread hashes them; ``{"bytes", "sha256"}``."""
    h = hashlib.sha256()
    size = 0
    with ThreadPoolExecutor(1, thread_name_prefix="coevo-hash") as hasher, Path(path).open("wb") as f:
        pending = None
        for chunk in chunks:
            if pending is not None:
                pending.result()
            pending = hasher.submit(h.update, chunk)
            f.write(chunk)
            size += len(chunk)
        if pending is not None:
            pending.result()
    return {"bytes": size, "sha256": h.hexdigest()}


def write_safetensors(path: Path, items: list[tuple[str, torch.Tensor]]) -> FileInfo:
    """One safetensors file from CPU tensors (names may alias one tensor: each is written)."""
    return write_chunks(path, [_header(items), *(_raw(t) for _, t in items)])


class HashingFile:
    """A binary file object that hashes what is written through it (for ``torch.save``)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        self.h.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def info(self) -> FileInfo:
        return {"bytes": self.size, "sha256": self.h.hexdigest()}


def torch_save(path: Path, obj: Any) -> FileInfo:
    with Path(path).open("wb") as f:
        out = HashingFile(f)
        torch.save(obj, out)
    return out.info()


def shards(items: list[tuple[str, torch.Tensor]], shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most ``shard_bytes`` each (a larger tensor alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > shard_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def write_weights(
    folder: Path, tensors: dict[str, torch.Tensor], shard_bytes: int = SHARD_BYTES
) -> dict[str, FileInfo]:
    """The weights as ``model.safetensors`` or as shards written in parallel plus their index."""
    groups = shards(list(tensors.items()), shard_bytes)
    if len(groups) == 1:
        return {"model.safetensors": write_safetensors(folder / "model.safetensors", groups[0])}
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    with ThreadPoolExecutor(min(4, len(groups)), thread_name_prefix="coevo-shard") as pool:
        infos = list(pool.map(lambda nm, g: write_safetensors(folder / nm, g), names, groups))
    files = dict(zip(names, infos, strict=True))
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {name: nm for nm, g in zip(names, groups, strict=True) for name, _ in g},
    }
    files["model.safetensors.index.json"] = write_text(folder / "model.safetensors.index.json", json.dumps(index))
    return files


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config_json: str) -> dict[str, FileInfo]:
    """A LoRA adapter as PEFT saves it (``adapters``): its tensors and ``adapter_config.json``."""
    return {
        ADAPTER_WEIGHTS: write_safetensors(folder / ADAPTER_WEIGHTS, list(tensors.items())),
        ADAPTER_CONFIG: write_text(folder / ADAPTER_CONFIG, config_json),
    }


def write_text(path: Path, text: str) -> FileInfo:
    return write_chunks(path, [text.encode()])


def copy_files(src: Path, folder: Path, names: Iterable[str]) -> dict[str, FileInfo]:
    """Copy the named files of ``src`` that exist (tokenizer files), hashed as they are copied."""
    out = {}
    for name in names:
        if (src / name).is_file():
            out[name] = write_chunks(folder / name, [(src / name).read_bytes()])
    return out


def fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(tmp: Path, final: Path, files: dict[str, FileInfo], *, durable: bool, **meta: Any) -> str:
    """Write the manifest, (fsync,) rename ``tmp`` to ``final``; returns the manifest digest."""
    digest = write_manifest(tmp, files, **meta)
    if durable:
        fsync_dir(tmp)
    if final.exists() and exchange(tmp, final):  # the old one is in ``tmp`` now: never a moment without one
        shutil.rmtree(tmp)
        return digest
    if final.exists():  # a file system without RENAME_EXCHANGE
        shutil.rmtree(final)
    os.rename(tmp, final)
    return digest


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    kernel, libc or file system cannot, and nothing was changed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = int(libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE))
    except (AttributeError, OSError):
        return False
    return rc == 0
