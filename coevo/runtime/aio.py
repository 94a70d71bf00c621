"""Small structured-concurrency helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` has passed; True when it was set."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


async def first_completed(*aws: Awaitable[Any]) -> None:
    """Wait until the first of ``aws`` completes; cancel and await the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
