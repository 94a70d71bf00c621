"""What a benchmark ran on, recorded beside its numbers: a wall-clock result means nothing without the
machine, and a result means little without the code that made it.

Invariant: ``kind`` is the part of ``machine()`` that changes what a wall-clock budget buys (the CPU, the
cores this process may use, the GPU); ``bench merge`` joins wall-clock parts only where it is equal.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
"""the checkout coevo runs from (a git work tree when installed editable)"""


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (``platform.processor()`` where /proc/cpuinfo has none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The commit coevo runs from, ``+changes`` when its work tree differs from it; None outside a git
    checkout (an installed wheel)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """The machine and code of this process: CPU, usable cores, whether the CPU multiplies bf16 in hardware,
    the GPU (None without one), torch's version and coevo's commit."""
    import torch

    from coevo.inference.precision import cpu_has_bf16

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "cpu_bf16": cpu_has_bf16(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "commit": commit(),
    }


def kind(described: dict[str, Any]) -> tuple[Any, ...]:
    """What of ``machine()``'s answer a wall-clock budget depends on."""
    return described.get("cpu"), described.get("cores"), described.get("gpu")
