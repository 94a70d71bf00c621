"""A coevo process keeps glibc to two malloc arenas (checked with glibc's own per-arena report)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

_THREADS_ALLOCATE = """
import ctypes, sys, threading
from coevo.runtime.memory import bound_malloc_arenas
print(bound_malloc_arenas() if sys.argv[1] == "bound" else "free", flush=True)
keep = []
def work():
    for _ in range(2000):
        keep.append(bytearray(50_000))  # below the mmap threshold: from an arena
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


def _arenas(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _THREADS_ALLOCATE, mode], capture_output=True, text=True, check=True, env=env, timeout=60
    )
    return out.stdout.strip(), sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def test_eight_allocating_threads_share_two_arenas() -> None:
    said, bound = _arenas("bound", env={"PATH": "/usr/bin:/bin"})
    assert said == "True" and bound <= 2
    _, free = _arenas("free", env={"PATH": "/usr/bin:/bin"})
    assert free > 2, "without the cap glibc gives the threads arenas of their own (else this test means nothing)"


def test_the_environment_wins() -> None:
    said, arenas = _arenas("bound", env={"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "4"})
    assert said == "False" and 2 < arenas <= 4


def test_every_coevo_command_sets_it_first(tmp_path) -> None:
    """``coevo.cli.main`` (what ``coevo run``, ``agent`` and every tool go through) sets the cap."""
    script = _THREADS_ALLOCATE.replace(
        'print(bound_malloc_arenas() if sys.argv[1] == "bound" else "free", flush=True)',
        f'import coevo.cli; print(coevo.cli.main(["schemas", "export", {str(tmp_path)!r}]), flush=True)',
    )
    out = subprocess.run(
        [sys.executable, "-c", script, "cli"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert out.stdout.splitlines()[-1] == "0" and list(tmp_path.iterdir())
    assert sum(line.startswith("Arena ") for line in out.stderr.splitlines()) <= 2
