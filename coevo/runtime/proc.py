"""Child processes that die with the process that started them.

Invariant: a child started with ``preexec_fn=die_with_parent`` gets SIGTERM when the thread that
started it ends, which for every coevo command is its main thread (the event loop's): a bench or
run stopped by kill -9 leaves no agent behind. (The embedded NATS server needs more, a watchdog on
a pipe, because ``start()`` may run in a worker thread: ``coevo.runtime.server``.)
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn``: ask the kernel for SIGTERM when the parent (its forking thread) is gone."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
