"""Child processes that die with the process that started them.

Invariant: a child started with ``preexec_fn=die_with_parent`` gets SIGTERM when the thread that
started it ends, which for every coevo command is its main thread (the event loop's): a bench or
run stopped by kill -9 leaves no agent behind. (The embedded NATS server needs more, a watchdog on
a pipe, because ``start()`` may run in a worker thread: ``coevo.runtime.server``.) A command's own
SIGINT/SIGTERM is honoured in every state, its first connect included (``StopSignals``); its SIGUSR1
prints where each of its asyncio tasks waits (``dump_tasks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn``: ask the kernel for ``sig`` when the parent (its forking thread) is gone."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def die_with_launcher() -> None:
    """For a process whose launcher coevo does not control (a torchrun rank): SIGKILL when the
    launcher is gone, so a launcher killed with -9 leaves no rank behind to hold the group's work.
    A launcher gone already ends this process now: it died before the request took effect, or, for
    a rank torchrun started (``TORCHELASTIC_RUN_ID``), before this process got here (its parent is
    then init, which is not a torchrun). ``coevo``'s entry point asks first thing, before torch is
    imported, so that window is the interpreter's start, not seconds."""
    import os

    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent or (parent == 1 and "TORCHELASTIC_RUN_ID" in os.environ and not _torchrun(1)):
        os._exit(1)


def _torchrun(pid: int) -> bool:
    """Whether process ``pid`` is a torchrun (a container may start one as its first process)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True  # cannot tell: assume it is
    return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline


def exit_now(code: int) -> NoReturn:
    """End the process at once, without waiting for its worker threads (a forward pass, a weight load
    that a lagging follower started: Python's exit joins them, which held a stopped agent for 20 s).
    For a process that has stopped: what it had to hand back is acknowledged or left to be
    redelivered, so nothing a worker still computes is read. Logs and streams are flushed first."""
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_stoppable(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` for a command that owns processes and hosts (a bench): SIGTERM, like SIGINT,
    cancels it, so its clean-up runs (agents stopped, namespaces and servers removed) instead of
    the default action ending it with them left behind; SIGUSR1 prints every task's stack
    (``dump_tasks``) instead of ending it. Stopped: ``KeyboardInterrupt``."""

    async def main() -> T:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        dump_tasks_on_usr1()  # a bench that seems stuck says where it waits, and goes on
        try:
            return await coro
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None


class StopSignals:
    """SIGINT and SIGTERM set ``stop``; until ``started()`` they also cancel the task that installed
    them, so a process still connecting (to a server that is not there: the first connect may wait
    30 s) ends at once instead of after the connect gives up. ``cancelled`` tells that cancellation
    apart from any other. Use from the task that runs the command, inside its event loop."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.cancelled = False
        self._task = asyncio.current_task()
        self._started = False
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        self.stop.set()
        if not self._started and self._task is not None and not self.cancelled:
            self.cancelled = True
            self._task.cancel()

    def started(self) -> None:
        """From here on a signal only sets ``stop``: what runs drains by its own rules."""
        self._started = True


def dump_tasks(file: Any = None) -> None:
    """Every asyncio task of the running loop and where it waits, to ``file`` (stderr): what
    ``kill -USR1`` on a coevo process prints (a stop that does not end says what it waits on)."""
    import io
    import sys

    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    out.write(f"coevo: {len(tasks)} asyncio tasks\n")
    for task in tasks:
        out.write(f"--- {task.get_name()}\n")
        waiting: Any = task.get_coro()
        while waiting is not None:  # the chain of awaits down to what it waits on
            frame = getattr(waiting, "cr_frame", None) or getattr(waiting, "gi_frame", None)
            if frame is None:
                out.write(f"    waits on {waiting!r:.200}\n")
                break
            out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
            waiting = getattr(waiting, "cr_await", None) or getattr(waiting, "gi_yieldfrom", None)
    print(out.getvalue(), file=file or sys.stderr, flush=True)


def dump_tasks_on_usr1() -> None:
    """``kill -USR1 <pid>`` prints every task's stack (``dump_tasks``); needs a running loop."""
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: none
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
