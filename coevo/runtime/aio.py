"""Small structured-concurrency helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def first_completed(*aws: Awaitable[Any]) -> None:
    """Wait until the first of ``aws`` completes; cancel and await the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
