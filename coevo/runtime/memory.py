"""Process memory: at most two glibc malloc arenas in a coevo process.

glibc gives every thread that allocates under contention an arena of its own (up to 8 per core),
64 MiB heaps that are trimmed only from the top. A coevo process runs the event loop, the
learner's and engines' worker threads, torch's threads and the checkpoint writer: in a sample of a
30-minute run's memory map, ~970 MB of its ~1.2 GB resident set sat in such arenas
(docs/benchmarks.md, "A long run"). With two, memory one thread freed is reusable by the next
instead of pinned in an arena of its own. ``MALLOC_ARENA_MAX`` in the environment, when set, wins.

Invariant: ``bound_malloc_arenas`` is called before the process starts threads (the CLI's first
step); it never raises, and it does nothing off glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2


def bound_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas at ``arenas`` (True when the cap was set here)."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))
