"""Large events by reference under faults (issue #24's first finding), on the real server: a claimed
object that cannot be read *now* is read again later instead of being dead-lettered, and a rerun of
an event id with other bytes never replaces the object a stored claim points to."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coevo.config import CoevoConfig
from coevo.runtime import faults
from coevo.runtime.agent import Agent
from coevo.runtime.bus import CLAIM_READS, NatsBus
from coevo.runtime.claims import Claim, is_claim
from coevo.runtime.consumer import Subscription
from coevo.schemas import Source, TaskScheduled, TaskSpec
from tests.conftest import run_until

SRC = Source(agent_id="test", role="tasks")


@pytest.fixture
async def small_bus(nats_url: str, run_id: str, cfg: CoevoConfig) -> Any:
    """A bus whose inline limit is 1 KiB: the events below travel by reference."""
    b = await NatsBus.connect(
        nats_url,
        run_id,
        nats_cfg=cfg.nats,
        bus=cfg.bus.model_copy(update={"inline_max_bytes": 1024}),
        stream=cfg.stream,
    )
    yield b
    await b.close()


def big_task(run_id: str, fill: str, event_id: str | None = None) -> TaskScheduled:
    fields: dict[str, Any] = {"event_id": event_id} if event_id else {}
    return TaskScheduled(
        run_id=run_id,
        source=SRC,
        task=TaskSpec(task_id="big", family="quick", params={"blob": fill * 5000}),
        group_id="g-big",
        n_rollouts=1,
        **fields,
    )


async def test_a_rerun_with_other_bytes_under_the_same_id_keeps_the_stored_claims_object(small_bus: NatsBus) -> None:
    first = big_task(small_bus.run_id, "x", event_id="fixed-id")
    rerun = big_task(small_bus.run_id, "y", event_id="fixed-id")  # the same fact id, sampled again
    await small_bus.publish_sync(first)
    await small_bus.publish_sync(rerun)  # the stream drops its claim as a duplicate
    stored = [m async for _, _, m in small_bus.history(["task.scheduled"])]
    assert len(stored) == 1 and is_claim(stored[0].headers)
    assert await small_bus.events(["task.scheduled"]) == [first]  # its object is still the first one's
    keys = {o.name for o in await (await small_bus.payload_store()).list()}
    assert Claim.parse(stored[0].data).key in keys and len(keys) == 2  # the rerun's bytes lie beside it


class Reader(Agent):
    role = "test-reader"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.got: list[TaskScheduled] = []
        self.seen = asyncio.Event()

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("test-reader", (TaskScheduled,), self.on_task)]

    async def on_task(self, event: TaskScheduled, _d: Any) -> None:
        self.got.append(event)
        self.seen.set()


async def test_an_object_store_that_cannot_be_read_now_delays_the_event_instead_of_losing_it(
    small_bus: NatsBus, cfg: CoevoConfig, inject: Any
) -> None:
    event = big_task(small_bus.run_id, "z")
    await small_bus.publish_sync(event)
    failures = CLAIM_READS + 2  # the whole first delivery fails, the second recovers
    inject({"claims.fetch": {"times": failures}})
    reader = Reader(small_bus, cfg)
    await run_until([reader], reader.seen)
    assert reader.got == [event] and faults.fired("claims.fetch") == failures
    (consumer,) = reader._consumers
    assert consumer.stats.retried >= 1 and consumer.stats.dead_lettered == 0
    assert await small_bus.events(["dead.lettered"]) == []


async def test_an_outage_longer_than_the_redeliveries_holds_the_last_delivery_until_the_store_answers(
    nats_url: str, run_id: str, cfg: CoevoConfig, inject: Any
) -> None:
    """A partition outlasts the redeliveries (here 2, a fraction of a second apart): the last one is held
    and its claim read again (chaos lost four groups' events this way); dead-lettered only after
    ``bus.payload_wait_s``."""
    bus_cfg = cfg.bus.model_copy(update={"inline_max_bytes": 1024, "max_deliver": 2, "nak_backoff_s": [0.1]})
    async with await NatsBus.connect(nats_url, run_id, nats_cfg=cfg.nats, bus=bus_cfg, stream=cfg.stream) as bus:
        event = big_task(run_id, "o")
        await bus.publish_sync(event)
        failures = CLAIM_READS * 4  # both deliveries and two more reads of the last
        inject({"claims.fetch": {"times": failures}})
        reader = Reader(bus, cfg.model_copy(update={"bus": bus_cfg}))
        await run_until([reader], reader.seen)
        assert reader.got == [event] and faults.fired("claims.fetch") == failures
        assert await bus.events(["dead.lettered"]) == []


async def test_a_scorer_restarted_while_its_store_is_unreadable_rebuilds_from_the_scores_ids(
    small_bus: NatsBus, cfg: CoevoConfig, inject: Any
) -> None:
    """Chaos (three hosts): the scorer's rebuild read every ``GroupScored``, the largest events and
    claims, and one unreadable object held the restarted scorer in its rebuild for the rest of the
    run (20 groups unscored). It needs only which groups are scored, and their ids say it."""
    from coevo.agents.scorer import ScorerAgent, scored_id
    from coevo.schemas import GroupScored
    from tests.samples import sample_events

    proto = {type(e): e for e in sample_events(small_bus.run_id)}
    done, open_ = (
        proto[TaskScheduled].model_copy(update={"event_id": f"sched-{g}", "group_id": g}) for g in ("g-done", "g-open")
    )
    score = proto[GroupScored].model_copy(
        update={
            "event_id": scored_id("g-done"),
            "group_id": "g-done",
            "trajectory_ids": [f"t{i:05d}" for i in range(200)],
        }
    )
    for e in (done, score, open_):
        await small_bus.publish_sync(e)
    (stored,) = [m async for _, _, m in small_bus.history(["group.scored"], undecoded=["group.scored"])]
    assert is_claim(stored.headers)
    (sub,) = ScorerAgent(small_bus, cfg).subscriptions()
    puller = await small_bus.puller(sub.durable, sub.kinds)
    try:
        assert len(await puller.fetch(2, 2.0)) == 2  # both schedules delivered before the restart
    finally:
        await puller.unsubscribe()
    inject({"claims.fetch": {}})  # every read of a claim fails
    scorer = ScorerAgent(small_bus, cfg)
    await asyncio.wait_for(scorer.rebuild(), 20)
    assert list(scorer.scored) == ["g-done"] and list(scorer.groups) == ["g-open"]
    assert faults.fired("claims.fetch") == 0  # nothing it needed was claimed
