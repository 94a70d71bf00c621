"""A shared durable recreated by a process that fetched nothing yet resumes at the ack floor it read.

A process restarted (or ``--resume``d) opens the shared durable, reads its ack floor, and waits for
work; the durable is deleted before its first fetch. It used to be recreated at sequence 1, and
every event acked before was handled again (versions 1-5 twice, on a real server)."""

from __future__ import annotations

import asyncio
from typing import Any

from coevo.config import CoevoConfig
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Consumer, Subscription
from coevo.runtime.revival import Ledger
from coevo.schemas import Source, TaskScheduled, TaskSpec
from tests.waiting import until

SRC = Source(agent_id="test", role="test")


def sched(run_id: str, version: int) -> TaskScheduled:
    return TaskScheduled(
        run_id=run_id,
        source=SRC,
        task=TaskSpec(task_id=f"v{version}", family="q"),
        group_id=f"g{version}",
        n_rollouts=1,
    )


def test_a_ledger_that_fetched_nothing_resumes_at_the_floor_it_read() -> None:
    ledger = Ledger()
    assert ledger.resume_from() == 1  # nothing known: the start
    ledger.ack_floor = 5
    assert ledger.resume_from() == 6  # a restarted process: everything up to 5 is acked
    ledger.fetched(9)
    ledger.settle(9)
    assert ledger.resume_from() == 6  # 6-8 may be another replica's, in flight: redelivered, 9 seen here
    ledger.ack_floor = 12  # the others acked past what this process fetched
    assert ledger.resume_from() == 13
    ledger.fetched(14)  # open here (in a handler, or nak'd)
    assert ledger.resume_from() == 13
    ledger.ack_floor = 20  # a floor above an open sequence cannot be (it is not acked): the open one wins
    assert ledger.resume_from() == 14


async def test_a_durable_deleted_before_the_first_fetch_is_not_replayed(
    bus: NatsBus, run_id: str, cfg: CoevoConfig
) -> None:
    versions = [sched(run_id, v) for v in range(1, 6)]
    for e in versions:
        await bus.publish(e)
    await bus.flush()

    first: list[str] = []

    async def handle_first(event: Any, _d: Any) -> None:
        first.append(event.task.task_id)

    stop = asyncio.Event()
    a = Consumer(bus, Subscription("floor", (TaskScheduled,), handle_first, concurrency=1), SRC, cfg=cfg.bus)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.run(stop))

        async def acked_all() -> bool:
            return len(first) == 5 and (await bus.js.consumer_info(bus.stream, "floor")).ack_floor.stream_seq == 5

        await until(acked_all)
        stop.set()
    assert first == ["v1", "v2", "v3", "v4", "v5"]

    # a restarted process: it opens the durable (reading its floor) and waits for work
    second: list[str] = []
    got = asyncio.Event()

    async def handle_second(event: Any, _d: Any) -> None:
        second.append(event.task.task_id)
        got.set()

    stop = asyncio.Event()
    b = Consumer(bus, Subscription("floor", (TaskScheduled,), handle_second, concurrency=1), SRC, cfg=cfg.bus)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(b.run(stop))

        async def waiting() -> bool:  # its pull is in: the floor was read before it
            return (await bus.js.consumer_info(bus.stream, "floor")).num_waiting > 0

        await until(waiting)
        assert b.revival.ledger.ack_floor == 5 and b.revival.ledger.last == 0
        await bus.js.delete_consumer(bus.stream, "floor")

        async def recreated() -> bool:
            return b.revival.recreated == 1

        await until(recreated)
        await bus.publish_sync(sched(run_id, 6))
        await asyncio.wait_for(got.wait(), 20)
        stop.set()
    # in stream order: a replay from 1 would have handed v1-v5 out before v6
    assert second == ["v6"], f"handled again after the recreation: {second}"
    info = await bus.js.consumer_info(bus.stream, "floor")
    assert info.config.opt_start_seq == 6
