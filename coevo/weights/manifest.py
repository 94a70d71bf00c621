"""Weights integrity without re-reading: the manifest the learner writes and every follower verifies.

A weights directory (published weights or a resume checkpoint) holds ``manifest.json``: every file
of the directory with its size and sha256, computed by the learner *while it wrote the files*. The
digest announced in ``WeightsPublished.sha256`` is the sha256 of that file list (``manifest_digest``).

Invariants:
- the digest depends only on the files' names, sizes and contents: the same weights written twice
  have the same digest;
- ``verify`` checks the manifest against the announced digest and every file's size (cheap: no
  file is read); ``full=True`` also re-hashes every file. A directory without a manifest (written
  before manifests existed) is verified by re-hashing its safetensors files (``checkpoint_sha256``);
- ``HELD`` keeps the newest published weights of this process in memory, by path and digest, so a
  local engine in the learner's process and the learner's weight server take the tensors from
  memory instead of reading the files back. It is bounded (``keep`` entries per role) and written
  only by the learner's lanes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def checkpoint_sha256(path: Path) -> str:
    """sha256 over the directory's safetensors files, in name order (directories without a manifest)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_digest(files: dict[str, dict[str, Any]]) -> str:
    """The announced digest: sha256 of the canonical JSON of ``{name: {"bytes", "sha256"}}``."""
    canonical = {name: {"bytes": int(info["bytes"]), "sha256": str(info["sha256"])} for name, info in files.items()}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: Path, files: dict[str, dict[str, Any]], **meta: Any) -> str:
    """Write ``manifest.json`` into ``path`` (the files were hashed while written); returns the digest."""
    digest = manifest_digest(files)
    (Path(path) / MANIFEST).write_text(json.dumps({"digest": digest, "files": files, **meta}, sort_keys=True))
    return digest


def manifest_of(path: Path) -> dict[str, Any] | None:
    f = Path(path) / MANIFEST
    return json.loads(f.read_text()) if f.exists() else None


def weights_bytes(path: Path) -> int:
    """Bytes of the weights (safetensors) in a directory."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def verify(path: Path, digest: str, *, full: bool = False) -> str | None:
    """None when the directory holds exactly the announced weights; otherwise why not."""
    path = Path(path)
    if not path.is_dir():
        return f"no weights at {path}"
    manifest = manifest_of(path)
    if manifest is None:  # written before manifests: the digest is the safetensors' sha256
        return None if checkpoint_sha256(path) == digest else f"checksum mismatch at {path}"
    files: dict[str, dict[str, Any]] = manifest.get("files", {})
    if manifest_digest(files) != digest:
        return f"manifest of {path} does not match the announced digest"
    for name, info in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != int(info["bytes"]):
            return f"{f} has {f.stat().st_size} bytes, the manifest says {info['bytes']}"
        if full and file_sha256(f) != info["sha256"]:
            return f"{f} does not match its sha256"
    return None


class HeldWeights:
    """Published weights held in this process's memory: ``path -> (digest, tensors)``, newest last."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[str, str, dict[str, Any]]] = OrderedDict()

    def put(self, role: str, path: Path, digest: str, tensors: dict[str, Any]) -> None:
        with self._lock:
            self._held[str(path)] = (role, digest, tensors)
            mine = [p for p, (r, _, _) in self._held.items() if r == role]
            for old in mine[: -self.keep]:
                del self._held[old]

    def get(self, path: Path | str, digest: str | None = None) -> dict[str, Any] | None:
        """The tensors published at ``path`` (None if not held here, or under another digest)."""
        with self._lock:
            held = self._held.get(str(path))
        if held is None or (digest is not None and held[1] != digest):
            return None
        return held[2]

    def clear(self) -> None:
        with self._lock:
            self._held.clear()


HELD = HeldWeights()
"""This process's published weights (one per process: the learner's lanes write, followers read)."""
