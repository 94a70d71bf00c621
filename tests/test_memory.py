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


_FREED_BUT_RESIDENT = """
import asyncio, sys
from coevo.runtime.memory import rss_bytes, trim_heap, trimmed_while
blocks = [bytearray(b"x" * 50_000) for _ in range(8_000)]  # 400 MB from the main heap, pages touched
pin = bytearray(b"x" * 50_000)  # above them: the heap cannot shrink from its top
full = rss_bytes()
del blocks  # free, coalesced, and still resident
freed = rss_bytes()
if sys.argv[1] == "trim":
    print(trim_heap(), full, freed, rss_bytes(), flush=True)
else:
    async def main():
        async def low():  # the agents: done once the trimmer has handed the pages back
            while rss_bytes() > freed - 300_000_000:
                await asyncio.sleep(0.02)
        agents = [asyncio.ensure_future(low())]
        await asyncio.wait_for(trimmed_while(agents, 0.05), 30)
    asyncio.run(main())
    print(True, full, freed, rss_bytes(), flush=True)
"""


def _resident(mode: str) -> tuple[bool, int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _FREED_BUT_RESIDENT, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "1"},
        timeout=60,
    )
    released, full, freed, trimmed = out.stdout.splitlines()[-1].split()  # after any log line
    return released == "True", int(full), int(freed), int(trimmed)


def test_trim_heap_hands_freed_pages_back() -> None:
    released, full, freed, trimmed = _resident("trim")
    assert freed > full - 50_000_000, "glibc kept the freed 400 MB resident (else this test means nothing)"
    assert released and trimmed < freed - 350_000_000


def test_agents_host_trims_until_its_agents_are_done() -> None:
    """``trimmed_while`` trims on its own schedule and returns once every task it watches is done."""
    released, _, freed, trimmed = _resident("while")
    assert released and trimmed < freed - 300_000_000
