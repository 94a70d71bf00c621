"""One process of a mixed-version run, for tests/test_upgrade.py: this file, run with ``PYTHONPATH``
naming a source tree (today's, or the previous release's), writes or reads events with that tree's
``coevo`` (and its ``tests.samples``). It uses only the bus's public API as of the previous release.

    python tests/upgrade_actor.py write URL RUN KINDS COPIES   -> {"wrote": [...]}
    python tests/upgrade_actor.py read URL RUN KINDS N          -> {"read": [...], "stats": {...}, ...}
    python tests/upgrade_actor.py role URL RUN KINDS OUT        -> a role: handles until SIGTERM, appends
                                                                   each handled event id to OUT

KINDS is a comma-separated list of event kinds. Every output is one JSON line on stdout; a role
also prints ``handled N`` as it goes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

import coevo
from coevo.config import BusConfig
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Consumer, Subscription
from coevo.schemas import KIND_TO_MODEL, SCHEMA_VERSION, Event, Source, new_id, readable

CFG = BusConfig(ack_wait_s=2.0, in_progress_every_s=0.5, nak_backoff_s=[0.05, 0.1], fetch_timeout_s=0.2)
SRC = Source(agent_id="upgrade-actor", role="test")


def _meta() -> dict[str, Any]:
    return {"schema": str(SCHEMA_VERSION), "coevo": coevo.__file__}


async def write(url: str, run: str, kinds: list[str], copies: int) -> dict[str, Any]:
    from tests.samples import sample_events

    wrote = []
    bus = await NatsBus.connect(url, run, bus=CFG)
    try:
        for _ in range(copies):
            for event in sample_events(run):
                if event.kind in kinds:  # type: ignore[attr-defined]
                    e = event.model_copy(update={"event_id": new_id()})
                    await bus.publish(e)
                    wrote.append(readable(e))
        await bus.flush()
    finally:
        await bus.close()
    return {"wrote": wrote, **_meta()}


def _consumer(bus: NatsBus, durable: str, kinds: list[str], handler: Any) -> Consumer:
    events = tuple(KIND_TO_MODEL[k] for k in kinds)
    return Consumer(bus, Subscription(durable, events, handler, concurrency=1), SRC, cfg=CFG)


async def read(url: str, run: str, kinds: list[str], n: int) -> dict[str, Any]:
    got: list[dict[str, Any]] = []
    done = asyncio.Event()
    bus = await NatsBus.connect(url, run, bus=CFG)

    async def handler(event: Event, _delivery: Any) -> None:
        got.append(readable(event))

    consumer = _consumer(bus, f"reader-{new_id()[:8]}", kinds, handler)

    async def until() -> None:
        while consumer.stats.handled + consumer.stats.dead_lettered < n:
            await asyncio.sleep(0.02)
        done.set()

    try:
        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
            tg.create_task(consumer.run(done))
            tg.create_task(until())
        dead = [readable(e) for e in await bus.events(["dead.lettered"])]
    finally:
        await bus.close()
    unknown = dict(getattr(bus, "unknown_fields", {}))
    return {"read": got, "stats": vars(consumer.stats), "unknown": unknown, "dead": dead, **_meta()}


async def role(url: str, run: str, kinds: list[str], out: str) -> dict[str, Any]:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await NatsBus.connect(url, run, bus=CFG)
    handled = 0

    async def handler(event: Event, _delivery: Any) -> None:
        nonlocal handled
        await asyncio.sleep(0.01)  # the role's work: a stop lands between events, not after them all
        await asyncio.to_thread(_append, out, event.event_id)
        handled += 1
        print(f"handled {handled}", flush=True)

    consumer = _consumer(bus, "upgraded-role", kinds, handler)
    print("started", flush=True)
    try:
        await consumer.run(stop)
    finally:
        await bus.close()
    return {"stats": vars(consumer.stats), "unknown": dict(getattr(bus, "unknown_fields", {})), **_meta()}


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def main(argv: list[str]) -> None:
    what, url, run, kinds = argv[0], argv[1], argv[2], argv[3].split(",")
    if what == "write":
        result = asyncio.run(write(url, run, kinds, int(argv[4])))
    elif what == "read":
        result = asyncio.run(read(url, run, kinds, int(argv[4])))
    else:
        result = asyncio.run(role(url, run, kinds, argv[4]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
