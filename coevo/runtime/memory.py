"""Process memory: at most two glibc malloc arenas in a coevo process.

glibc gives every thread that allocates under contention an arena of its own (up to 8 per core),
64 MiB heaps that are trimmed only from the top. A coevo process runs the event loop, the
learner's and engines' worker threads, torch's threads and the checkpoint writer: in a sample of a
30-minute run's memory map, ~970 MB of its ~1.2 GB resident set sat in such arenas
(docs/benchmarks.md, "A long run"). With two, memory one thread freed is reusable by the next
instead of pinned in an arena of its own. ``MALLOC_ARENA_MAX`` in the environment, when set, wins.

Freed memory stays resident too: glibc returns a heap's pages to the OS only from its top, so
what a learner step's activations held (GBs on a pretrained model) stays in the process after the
step, and fragmentation lets the span grow. ``trimmed_while`` hands the free pages back every
``agent.heap_trim_s`` in every process that runs agents: a 12-minute SmolLM2 coin-collector run
peaked at 8.0 GB with it and 14.9 GB without (docs/benchmarks.md, "Freed memory handed back, on a
real model").

Invariant: ``bound_malloc_arenas`` is called before the process starts threads (the CLI's first
step); neither it nor ``trim_heap`` raises, and both do nothing off glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import sys
import time
from collections.abc import Collection
from typing import Any

import structlog

M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2

log = structlog.get_logger(__name__)


@functools.cache
def _glibc(name: str) -> Any:
    """glibc's function ``name``, or None off Linux or off glibc (musl has no mallopt nor malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def bound_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas at ``arenas`` (True when the cap was set here)."""
    mallopt = _glibc("mallopt")
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


def rss_bytes(pid: int | None = None) -> int | None:
    """The resident set of process ``pid`` (this one when None; Linux), or None."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_heap() -> bool:
    """Hand the pages of every arena's free chunks back to the OS (glibc's ``malloc_trim(0)``): the
    chunks stay free for the next allocation, which faults in fresh pages. True when it released any."""
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


async def trimmed_while(tasks: Collection[asyncio.Future[Any]], every_s: float) -> None:
    """``trim_heap`` every ``every_s`` seconds (in a worker thread: it takes the arenas' locks, not the
    event loop) until every one of ``tasks`` is done; ``every_s`` 0: never."""
    if every_s <= 0 or not tasks:
        return
    while True:
        _, pending = await asyncio.wait(tasks, timeout=every_s)
        if not pending:
            return
        before, t0 = rss_bytes(), time.perf_counter()
        released = await asyncio.to_thread(trim_heap)
        after = rss_bytes()
        log.debug(
            "memory.trimmed",
            released=released,
            rss_mb=None if after is None else round(after / 2**20),
            freed_mb=None if before is None or after is None else round((before - after) / 2**20),
            seconds=round(time.perf_counter() - t0, 3),
        )
