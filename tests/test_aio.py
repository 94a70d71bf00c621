"""Structured-concurrency helpers under the cancellations Python 3.11 really delivers."""

from __future__ import annotations

import asyncio
import sys

from coevo.runtime.aio import cancel_all, unless_set, wait_event


async def _swallowing_task() -> tuple[asyncio.Task[None], list[int]]:
    """A task whose ``wait_for`` meets its result and a cancellation in the same tick, then loops."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[None] = loop.create_future()
    turns: list[int] = []

    async def body() -> None:
        await asyncio.wait_for(answer, 5)
        while True:
            turns.append(1)
            await asyncio.sleep(0.01)

    task = asyncio.create_task(body())
    await asyncio.sleep(0)  # it waits inside wait_for now
    answer.set_result(None)
    task.cancel()
    return task, turns


async def test_one_cancel_can_be_swallowed_by_wait_for_and_cancel_all_still_ends_the_task() -> None:
    task, turns = await _swallowing_task()
    await asyncio.sleep(0.1)
    if sys.version_info < (3, 12):  # the race this helper exists for (asyncio's wait_for, rewritten in 3.12)
        assert not task.done() and turns, "the cancellation was not swallowed: the race is not reproduced"
    await asyncio.wait_for(cancel_all([task], again_every_s=0.05), 5)
    assert task.cancelled()


async def test_cancel_all_waits_for_every_task_and_leaves_finished_ones_alone() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    cleanup: list[str] = []

    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # cleanup that takes a while: cancel_all waits for it
            cleanup.append("ended")

    slow = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    await cancel_all([done, slow])
    assert slow.cancelled() and cleanup == ["ended"] and not done.cancelled()


async def test_wait_event_never_drops_a_cancellation_that_arrives_as_the_event_is_set() -> None:
    """Agents sleep on ``wait_event`` in loops (``Agent.sleep``, the observer's poll): the cancel that
    arrives in the tick the event is set must still end the loop, where 3.11's ``wait_for`` dropped it."""
    event = asyncio.Event()
    turns: list[int] = []

    async def sleeper() -> None:
        while True:
            await wait_event(event, 5)
            event.clear()
            turns.append(1)

    task = asyncio.create_task(sleeper())
    await asyncio.sleep(0)  # it waits on the event now
    event.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    assert task.cancelled() and not turns


async def test_unless_set_cancels_a_gather_and_says_so() -> None:
    """A cancelled ``gather`` ends holding ``CancelledError`` as its exception, not ``cancelled()``:
    ``unless_set`` still answers False for it, and the gathered work is cancelled."""
    event = asyncio.Event()
    children = [asyncio.ensure_future(asyncio.sleep(60, result=1)) for _ in range(3)]
    ballot = asyncio.gather(*children)
    asyncio.get_running_loop().call_soon(event.set)
    assert await asyncio.wait_for(unless_set(event, ballot), 10) is False
    assert all(c.cancelled() for c in children)
    done = asyncio.gather(asyncio.sleep(0, result=2))
    assert await unless_set(asyncio.Event(), done) is True and done.result() == [2]
