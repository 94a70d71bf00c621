"""The live status line of a long-running process (``coevo run``, ``coevo agent``): on a terminal a
line redrawn every second, with log lines printed above it; elsewhere a ``progress`` log line every
``every_s`` seconds.

Invariant: while the line is drawn, the console log handlers write through the same console, so a
log line always ends with its newline above the status line and never runs into it; the handlers get
their own streams back when the line ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import structlog

from coevo.runtime.aio import wait_event

log = structlog.get_logger("coevo.progress")


class _Above:
    """A stream for logging handlers that prints each record through a rich console (its colours kept)."""

    def __init__(self, console: Any) -> None:
        self.console = console

    def write(self, text: str) -> int:
        from rich.text import Text

        if text.strip():
            self.console.print(Text.from_ansi(text.rstrip("\n")), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        return None


@contextmanager
def logs_above(console: Any) -> Iterator[None]:
    """The console log handlers (plain ``StreamHandler``s of the root logger) print through ``console``;
    a handler whose stream is already closed (left behind by whoever set it up) is left alone."""
    handlers = [
        h
        for h in logging.getLogger().handlers
        if type(h) is logging.StreamHandler and not getattr(h.stream, "closed", False)
    ]
    streams = [h.stream for h in handlers]
    for h in handlers:
        h.setStream(_Above(console))
    try:
        yield
    finally:
        for h, stream in zip(handlers, streams, strict=True):
            h.setStream(stream)


async def show_status(
    line: Callable[[], str], stop: asyncio.Event, *, every_s: float = 30.0, console: Any = None
) -> None:
    """Show ``line()`` until ``stop`` is set (see the module's invariant)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    if console.is_terminal:
        with console.status(line()) as status, logs_above(console):
            while not stop.is_set():
                await wait_event(stop, 1.0)
                status.update(line())
    else:
        while not stop.is_set():
            await wait_event(stop, every_s)
            log.info("progress", status=line())


def agent_line(agent: Any) -> str:
    """One agent's counters, the non-zero ones: what a ``coevo agent`` process has done so far."""
    done = ", ".join(f"{k.split('.', 1)[-1]} {v}" for k, v in sorted(agent.counters.items()) if v)
    return f"{agent.agent_id}: {done or 'waiting for work'}"
