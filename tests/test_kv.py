"""The run's KV bucket lists exactly its live keys (coevo.runtime.kv), against a real nats-server:
across several fetches, without deleted or purged keys, leaving no consumer behind. (nats-py's own
``keys()`` could call a full bucket empty: nats-io/nats.py#842; the listing no longer goes through it.)"""

from __future__ import annotations

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
    stream = await bus.js.stream_info(f"KV_{kv.name}")
    assert stream.state.consumer_count == 0  # each listing removed its consumer
