"""The run's KV bucket lists exactly its live keys (coevo.runtime.kv), against a real nats-server:
across several fetches, without deleted or purged keys, while the event loop is busy, and leaving no
consumer behind."""

from __future__ import annotations

import asyncio

from coevo.runtime.bus import NatsBus


async def test_a_listing_holds_every_live_key_and_no_deleted_one(bus: NatsBus) -> None:
    kv = await bus.kv("tasks")
    assert await kv.keys() == []  # an empty bucket lists nothing, without an error
    for i in range(600):  # more than one fetch's worth
        await kv.put(f"slot.{i}", b"v")
    for i in range(0, 600, 97):
        await kv.delete(f"slot.{i}")
    await kv._kv.purge("slot.5")
    live = {f"slot.{i}" for i in range(600) if i % 97 and i != 5}
    listed = await kv.keys()
    assert len(listed) == len(live) == 592 and set(listed) == live


async def test_concurrent_listings_on_a_busy_loop_all_see_every_key(bus: NatsBus) -> None:
    """nats-py's own ``keys()`` can end its replay before messages in flight to it are counted and
    answer NoKeysError for a full bucket (nats-io/nats.py#842, seen in CI); the pull-consumer listing
    counts first and reads until that count."""
    kv = await bus.kv("tasks")
    for i in range(17):
        await kv.put(f"slot.{i}", b"x" * 2000)

    def busy() -> None:  # the loop's other work: holds it between the listing's awaits
        sum(range(20_000))

    async def list_while_busy() -> list[str]:
        keys = asyncio.ensure_future(kv.keys())
        while not keys.done():
            busy()
            await asyncio.sleep(0)
        return keys.result()

    for _ in range(10):
        listings = await asyncio.gather(*(list_while_busy() for _ in range(10)))
        assert all(sorted(keys) == sorted(f"slot.{i}" for i in range(17)) for keys in listings)
    stream = await bus.js.stream_info(f"KV_{kv.name}")
    assert stream.state.consumer_count == 0  # every listing removed its consumer
