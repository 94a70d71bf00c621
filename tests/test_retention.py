"""Retention: the stream is kept under a size without losing work a consumer has not acknowledged."""

from __future__ import annotations

import pytest
from nats.js import api

from coevo.config import CoevoConfig, load_config
from coevo.errors import ConfigError
from coevo.runtime.bus import NatsBus
from coevo.runtime.retention import (
    ConsumerFloor,
    RetentionAgent,
    StreamSize,
    aged_sequence,
    consumer_floor,
    pinning,
    purge_below,
)
from coevo.schemas import AgentStatus, Source, subject_for

SRC = Source(agent_id="test", role="test")


def test_nothing_is_purged_under_the_limit_and_never_past_a_floor() -> None:
    size = StreamSize(first_seq=1, last_seq=1000, messages=1000, bytes=1_000_000)  # 1 KB each
    everyone_done = [ConsumerFloor("a", 1000)]
    assert purge_below(size, everyone_done, aged_seq=1000, retain_bytes=2_000_000, headroom=0.8) == 0
    assert purge_below(size, everyone_done, aged_seq=1000, retain_bytes=0, headroom=0.8) == 0
    # 500 KB allowed, 80 % headroom: keep the newest 400 messages, purge below 601
    assert purge_below(size, everyone_done, aged_seq=1000, retain_bytes=500_000, headroom=0.8) == 601
    # a consumer that acknowledged up to 300 holds the purge at 301, whatever the size
    floors = [*everyone_done, ConsumerFloor("slow", 300)]
    assert purge_below(size, floors, aged_seq=1000, retain_bytes=500_000, headroom=0.8) == 301
    assert pinning(floors, 601) == ["slow"]
    # nothing younger than the minimum age goes either
    assert purge_below(size, everyone_done, aged_seq=120, retain_bytes=500_000, headroom=0.8) == 121
    assert purge_below(size, everyone_done, aged_seq=0, retain_bytes=500_000, headroom=0.8) == 0
    # a floor at or below what is already gone purges nothing
    gone = StreamSize(first_seq=301, last_seq=1000, messages=700, bytes=700_000)
    assert purge_below(gone, floors, aged_seq=1000, retain_bytes=500_000, headroom=0.8) == 0


def test_ages_come_from_the_marks_the_keeper_recorded() -> None:
    marks = [(0.0, 10), (100.0, 50), (200.0, 90)]
    assert aged_sequence(marks, now=250.0, min_age_s=100.0) == 50
    assert aged_sequence(marks, now=250.0, min_age_s=300.0) == 0
    assert aged_sequence(marks, now=1000.0, min_age_s=100.0) == 90


def test_a_consumer_that_never_acknowledges_does_not_hold_the_floor() -> None:
    def info(policy: api.AckPolicy, pending: int, ack_pending: int, floor: int) -> api.ConsumerInfo:
        return api.ConsumerInfo(
            name="c",
            stream_name="s",
            created=0.0,
            config=api.ConsumerConfig(durable_name="c", ack_policy=policy),
            num_pending=pending,
            num_ack_pending=ack_pending,
            ack_floor=api.SequenceInfo(floor, floor),
        )

    assert consumer_floor(info(api.AckPolicy.NONE, 5, 0, 0), 100) is None
    assert consumer_floor(info(api.AckPolicy.EXPLICIT, 0, 0, 7), 100) == ConsumerFloor("c", 100)
    assert consumer_floor(info(api.AckPolicy.EXPLICIT, 3, 0, 7), 100) == ConsumerFloor("c", 7)
    assert consumer_floor(info(api.AckPolicy.EXPLICIT, 0, 2, 7), 100) == ConsumerFloor("c", 7)


def test_the_minimum_age_must_outlive_the_timeouts() -> None:
    with pytest.raises(ConfigError, match=r"stream\.retain_min_age_s"):
        load_config(overrides={"stream.retain_min_age_s": 60})
    assert load_config(overrides={"stream.retain_min_age_s": 60, "stream.retain_bytes": 0}).stream.retain_bytes == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def publish(bus: NatsBus, n: int, start: int) -> None:
    for i in range(start, start + n):
        await bus.publish_sync(
            AgentStatus(
                run_id=bus.run_id,
                source=SRC,
                agent_id="test",
                role="test",
                state="running",
                uptime_s=float(i),
                detail="x" * 900,
            )
        )


async def test_the_keeper_purges_only_acknowledged_old_events_on_the_real_server(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    js = bus.js
    await publish(bus, 100, 0)
    size = (await js.stream_info(bus.stream)).state.bytes
    # a worker that acknowledged 60 events, holds 10 unacknowledged and has 30 still to fetch
    sub = await bus.pull_subscription("worker", ["agent.status"])
    for m in await sub.fetch(60, timeout=5):
        await m.ack_sync()
    held = await sub.fetch(10, timeout=5)
    assert [m.metadata.sequence.stream for m in held] == list(range(61, 71))
    # a history reader (no acknowledgements) never holds anything back
    await js.add_consumer(
        bus.stream,
        api.ConsumerConfig(
            name="reader",
            ack_policy=api.AckPolicy.NONE,
            filter_subject=subject_for(bus.run_id, "agent.status"),
            inactive_threshold=60.0,
        ),
    )

    limit = size // 5
    keeper_cfg = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"retain_bytes": limit})})
    clock = Clock()
    keeper = RetentionAgent(bus, keeper_cfg, clock=clock)
    assert await keeper.keep() == 0, "nothing is old enough yet"
    assert (await js.stream_info(bus.stream)).state.first_seq == 1

    await publish(bus, 10, 100)  # 101..110, recorded as young at the next pass
    clock.now += keeper_cfg.stream.retain_min_age_s + 1
    assert await keeper.keep() == 61, "the worker's unacknowledged event 61 holds the purge"
    state = (await js.stream_info(bus.stream)).state
    assert (state.first_seq, state.last_seq, state.messages) == (61, 110, 50)

    for m in held:
        await m.ack_sync()
    for m in await sub.fetch(40, timeout=5):
        await m.ack_sync()
    clock.now += keeper_cfg.stream.retain_min_age_s + 1
    below = await keeper.keep()
    state = (await js.stream_info(bus.stream)).state
    assert below > 61 and state.first_seq == below and state.last_seq == 110
    assert state.bytes <= limit, "once everything is acknowledged and old, the stream fits the limit"
    # the newest events are the ones kept, and they still decode
    kept = [e.uptime_s for e in await bus.events(["agent.status"])]
    assert kept == [float(i) for i in range(below - 1, 110)]
