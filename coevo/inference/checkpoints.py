"""Checkpoint integrity: the digest the learner announces and every follower verifies before loading.

Invariant: the digest depends only on the safetensors files' names and bytes (name order), so the
same weights written twice have the same digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def checkpoint_sha256(path: Path) -> str:
    """sha256 over the checkpoint's safetensors files, in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
