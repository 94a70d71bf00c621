"""Waiting on a condition, never on a fixed sleep: ``until`` polls an async predicate until it holds or
its timeout fails the test."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, every_s: float = 0.05) -> None:
    """Return once ``await predicate()`` is true; ``TimeoutError`` after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not await predicate():
            await asyncio.sleep(every_s)
