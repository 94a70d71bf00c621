"""Small structured-concurrency helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` has passed; True when it was set. A cancellation
    always propagates (``asyncio.timeout`` tells its own from the caller's; 3.11's ``wait_for`` drops
    one that arrives as the event is set, and the loops that sleep on this would go on)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_all(tasks: Iterable[asyncio.Future[Any]], again_every_s: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again any still running after
    ``again_every_s``. Once is not enough: Python 3.11's ``asyncio.wait_for`` (under every nats-py
    request) swallows a cancellation that arrives in the same tick as its result, and a task that
    loops then never ends (a consumer's keepalive held a stop for good that way)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_every_s)


async def first_completed(*aws: Awaitable[Any]) -> None:
    """Wait until the first of ``aws`` completes; cancel and await the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all(tasks)


async def unless_set(event: asyncio.Event, aw: Awaitable[Any]) -> bool:
    """Await ``aw`` unless ``event`` is set first, which cancels it (and waits for it to end): True
    when ``aw`` completed, False when it was cancelled; its exception, if any, is raised."""
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        await cancel_all([task])
    if task.cancelled():
        return False
    try:
        task.result()
    except asyncio.CancelledError:  # a cancelled gather() holds it as its exception: it is not cancelled()
        return False
    return True


async def drain(
    tasks: Iterable[asyncio.Task[Any]],
    timeout_s: float,
    connected: Callable[[], bool],
    grace_s: float = 1.0,
    poll_s: float = 0.1,
) -> set[asyncio.Task[Any]]:
    """Give ``tasks`` up to ``timeout_s`` to finish, but only ``grace_s`` while ``connected()`` says the
    bus is gone (nothing they wait for can arrive then: their work is redelivered instead); returns
    those still running (the caller cancels them). A stop is honoured within about ``grace_s`` when
    disconnected, whatever the tasks are waiting on."""
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    start = loop.time()
    disconnected_since: float | None = None
    while pending:
        now = loop.time()
        if now - start >= timeout_s:
            break
        if connected():
            disconnected_since = None
        else:
            disconnected_since = now if disconnected_since is None else disconnected_since
            if now - disconnected_since >= grace_s:
                break
        _, pending = await asyncio.wait(pending, timeout=min(poll_s, timeout_s - (now - start)))
    return pending


async def outlast(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, whatever cancellation arrives meanwhile: for work that cannot be
    stopped (a worker thread) whose outcome must be known before the caller goes. A cancellation
    that arrived is the caller's to raise again once it has settled that outcome."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except Exception:  # its outcome, read by the caller from ``fut``
            return


async def off_the_loop(build: Callable[[], T], beat: Callable[[float], None], every_s: float = 10.0) -> T:
    """``build()`` on a worker thread (agents whose constructors load models: a real model takes a
    minute on 2 cores), so the event loop keeps answering the bus (heartbeats, acks, a Ctrl-C)
    meanwhile; ``beat(seconds so far)`` every ``every_s`` while it runs. Cancelled, the thread finishes
    on its own and its result is dropped."""
    started = time.monotonic()
    task = asyncio.ensure_future(asyncio.to_thread(build))
    while True:
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            return task.result()
        beat(time.monotonic() - started)
