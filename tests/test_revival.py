"""#36 item 3: a consumer deleted under a running agent comes back where it left off.

A role may delete any consumer of its run, and the server deletes an unshared one after
``bus.unshared_inactive_s`` without a pull (a partition longer than that). Before the fix the
agent's fetches met no responders for ever: nothing new was delivered and nothing said so.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import nats.errors

from coevo.config import CoevoConfig
from coevo.runtime.agent import Agent
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Subscription
from coevo.runtime.revival import SETTLED_KEPT, Ledger
from coevo.schemas import AgentStatus, Source, TaskDecided, TaskScheduled, TaskSpec

SRC = Source(agent_id="test", role="test")


def sched(run_id: str, i: int) -> TaskScheduled:
    return TaskScheduled(
        run_id=run_id, source=SRC, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
    )


def decided(run_id: str, i: int) -> TaskDecided:
    return TaskDecided(
        run_id=run_id,
        source=SRC,
        slot_id=f"s{i}",
        parent_id="p",
        candidate_id=f"c{i}",
        direction="harder",
        accepted=True,
        reason="test",
        parent_accuracy=0.5,
        candidate_accuracy=0.5,
        rewriter="builtin",
    )


def test_a_ledger_resumes_at_the_first_unsettled_sequence_and_remembers_what_it_settled() -> None:
    ledger = Ledger()
    assert ledger.resume_from() == 1
    for seq in (3, 4, 5, 6):
        ledger.fetched(seq)
    ledger.settle(3)
    ledger.settle(5)  # 4 nak'd (or in a handler): the server must hand it out again
    assert ledger.resume_from() == 4 and ledger.seen(5) and not ledger.seen(4)
    ledger.settle(4)
    ledger.settle(6)
    assert ledger.resume_from() == 7
    ledger.ack_floor = 2  # a shared durable: another replica may hold 3 and up
    assert ledger.resume_from() == 3
    for seq in range(10, 10 + 3 * SETTLED_KEPT):
        ledger.fetched(seq)
        ledger.settle(seq)
    assert len(ledger.settled) <= 2 * SETTLED_KEPT and ledger.seen(9 + 3 * SETTLED_KEPT)


class Keeper(Agent):
    """Handles scheduled tasks on a shared durable and decisions on its own (unshared) consumer,
    counting every handling by event id; the handler of ``t-hold`` waits until ``release`` is set."""

    role = "test-keeper"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.handled: Counter[str] = Counter()
        self.changed = asyncio.Event()
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription("keeper", (TaskScheduled,), self.on_task, concurrency=2),
            Subscription("keeper-own", (TaskDecided,), self.on_decided, concurrency=1, shared=False),
        ]

    async def on_task(self, event: TaskScheduled, _d: Any) -> None:
        if event.task.task_id == "t-hold":
            self.holding.set()
            await self.release.wait()
        self.handled[event.event_id] += 1
        self.changed.set()

    async def on_decided(self, event: TaskDecided, _d: Any) -> None:
        self.handled[event.event_id] += 1
        self.changed.set()

    async def until_handled(self, ids: set[str], timeout_s: float = 20.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not ids <= set(self.handled):
                self.changed.clear()
                await self.changed.wait()


async def _deleted(bus: NatsBus, name: str) -> asyncio.Future[None]:
    """A future resolved by the server's advisory that consumer ``name`` was deleted."""
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_advisory(_msg: Any) -> None:
        if not gone.done():
            gone.set_result(None)

    sub = await bus.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{bus.stream}.{name}", cb=on_advisory)
    gone.add_done_callback(lambda _f: asyncio.ensure_future(sub.unsubscribe()))
    return gone


async def _reported(bus: NatsBus, agent_id: str, counters: dict[str, int], timeout_s: float = 20.0) -> AgentStatus:
    """The first status of ``agent_id`` whose counters reach ``counters``, as stored in the stream."""
    async with asyncio.timeout(timeout_s):
        async for _, event in bus.tail(asyncio.Event()):
            if isinstance(event, AgentStatus) and event.agent_id == agent_id:
                if all(event.counters.get(k, 0) >= v for k, v in counters.items()):
                    return event
    raise AssertionError("unreachable")


async def test_consumers_deleted_under_a_running_agent_come_back_and_lose_and_repeat_nothing(
    bus: NatsBus, run_id: str, cfg: CoevoConfig
) -> None:
    """The admin deletes the agent's shared durable while a handler holds one of its messages, and
    its unshared consumer: events published before, during and after are each handled exactly once,
    and the agent's status reports each recreation."""
    agent = Keeper(bus, cfg)
    own = f"keeper-own-{agent.agent_id}"
    before = [sched(run_id, i) for i in range(5)] + [decided(run_id, i) for i in range(3)]
    held = sched(run_id, 99).model_copy(update={"task": TaskSpec(task_id="t-hold", family="q")})
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(agent_run(agent, stop))
        for e in before:
            await bus.publish(e)
        await bus.publish(held)
        await bus.flush()
        await agent.until_handled({e.event_id for e in before})
        await asyncio.wait_for(agent.holding.wait(), 10)

        gone = [await _deleted(bus, "keeper"), await _deleted(bus, own)]
        await bus.js.delete_consumer(bus.stream, "keeper")  # a handler holds t-hold meanwhile
        await bus.js.delete_consumer(bus.stream, own)
        await asyncio.wait_for(asyncio.gather(*gone), 10)
        after = [sched(run_id, i) for i in range(10, 20)] + [decided(run_id, i) for i in range(10, 14)]
        for e in after:
            await bus.publish(e)
        await bus.flush()
        await agent.until_handled({e.event_id for e in after})
        agent.release.set()
        await agent.until_handled({held.event_id})
        status = await _reported(bus, agent.agent_id, {"keeper.recreated": 1, "keeper-own.recreated": 1})
        # the recreated durable redelivers from the ack floor it was read at: those handled already
        # are acked unhandled, and a stop while they are still on their way would leave them pending
        async with asyncio.timeout(20):
            while (info := await bus.js.consumer_info(bus.stream, "keeper")).num_ack_pending or info.num_pending:
                await asyncio.sleep(0.1)
        stop.set()
    assert set(agent.handled) == {e.event_id for e in [*before, held, *after]}
    assert set(agent.handled.values()) == {1}, "an event was handled twice"
    assert status.counters["keeper.recreated"] == 1 and status.counters["keeper-own.recreated"] == 1
    info = await bus.js.consumer_info(bus.stream, "keeper")
    assert info.num_ack_pending == 0 and info.num_pending == 0  # the redelivered t-hold was acked, not left
    assert status.counters["keeper.settled_before"] >= 1  # t-hold's second delivery waited for its handler


async def test_an_unshared_consumer_the_server_dropped_as_inactive_comes_back(
    bus: NatsBus, run_id: str, cfg: CoevoConfig
) -> None:
    """A paused agent pulls nothing (as across a partition): past ``bus.unshared_inactive_s`` the
    server deletes its own consumer; resumed, it creates it again and misses nothing published
    while it was away."""
    cfg = cfg.model_copy(update={"bus": cfg.bus.model_copy(update={"unshared_inactive_s": 1.0})})
    quick = NatsBus(bus.nc, run_id, cfg.bus, cfg.stream)
    agent = Keeper(quick, cfg)
    own = f"keeper-own-{agent.agent_id}"
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(agent_run(agent, stop))
        first = decided(run_id, 0)
        await bus.publish_sync(first)
        await agent.until_handled({first.event_id})
        gone = await _deleted(bus, own)
        agent.pause()
        await asyncio.wait_for(gone, 15)  # dropped by the server, not by us
        away = [decided(run_id, i) for i in range(1, 6)]
        for e in away:
            await bus.publish(e)
        await bus.flush()
        agent.resume()
        await agent.until_handled({e.event_id for e in away})
        stop.set()
    assert set(agent.handled.values()) == {1}
    assert agent.snapshot_counters()["keeper-own.recreated"] == 1


async def agent_run(agent: Agent, stop: asyncio.Event) -> None:
    from coevo.runtime.agent import run_agents

    try:
        await run_agents([agent], handle_signals=False, until=stop)
    except* nats.errors.ConnectionClosedError:
        pass
