"""Reading a run's stream as an observer: every stored event in order, then the new ones as they come.

Invariants:
- the observer's consumer is ephemeral, acknowledges nothing and is not a durable of any agent:
  observing a run never changes what its agents receive (it is not in docs/architecture.md's table);
- ``tail`` yields each stored event once, in stream order; after ``stop`` is set it still yields
  everything stored up to then (the run's last events, ``run.finished`` included) and returns.
  It is caught up when the server has nothing left to deliver and everything it delivered was
  read; a delivery that never came (lost in a reconnect: this consumer acknowledges nothing, so
  nothing is redelivered) stops counting after ``LOST_AFTER`` empty fetches in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import nats.errors
import nats.js.errors
from nats.js import api

from coevo.observe.aggregate import ConsumerInfo
from coevo.runtime.bus import NatsBus
from coevo.runtime.pull import Puller, read_all
from coevo.schemas import Event, events_prefix, new_id

FETCH = 256
LOST_AFTER = 3
OBSERVER_PREFIX = "observe_"


async def tail(bus: NatsBus, stop: asyncio.Event, *, start_seq: int = 1, wait_s: float = 1.0,
               on_caught_up: Callable[[], None] | None = None) -> AsyncIterator[tuple[int, Event | None]]:
    """``(sequence, event)`` from ``start_seq`` on (``event`` None: undecodable), live until ``stop``;
    ``on_caught_up`` is called whenever everything stored so far was yielded."""
    name = f"{OBSERVER_PREFIX}{new_id()[:16]}"
    config = api.ConsumerConfig(
        name=name, ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start_seq),
        filter_subject=f"{events_prefix(bus.run_id)}.>", inactive_threshold=60.0, max_ack_pending=-1)
    await bus.js.add_consumer(bus.stream, config)
    sub = await Puller(bus.nc, bus.stream, name).start()
    try:
        caught_up = False
        read = max(1, start_seq) - 1  # the last sequence yielded
        empty = 0  # fetches in a row that got nothing
        while not (stop.is_set() and caught_up):
            try:
                msgs = await sub.fetch(FETCH, wait_s)
            except (nats.errors.TimeoutError, TimeoutError):
                empty += 1
                caught_up = empty >= LOST_AFTER  # what is left when the server does not answer
                with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
                    info = await bus.js.consumer_info(bus.stream, name)
                    caught_up = read_all(info, read) or (info.num_pending == 0 and empty >= LOST_AFTER)
                if caught_up and on_caught_up is not None:
                    on_caught_up()
                continue
            empty = 0
            for msg in msgs:
                try:
                    event: Event | None = await bus.decode_msg(msg)  # follows claims of large events
                except ValueError:
                    event = None
                read = msg.metadata.sequence.stream
                yield read, event
            caught_up = not msgs or msgs[-1].metadata.num_pending == 0
            if caught_up and on_caught_up is not None:
                on_caught_up()
    finally:
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            await sub.unsubscribe()
            await bus.js.delete_consumer(bus.stream, name)


async def consumer_infos(bus: NatsBus) -> list[ConsumerInfo]:
    """The run's durable consumers (the agents'), as JetStream reports them."""
    out = []
    for info in await bus.js.consumers_info(bus.stream):
        name = info.name or ""
        if name.startswith((OBSERVER_PREFIX, "history_")):
            continue
        out.append(ConsumerInfo(name=name, pending=info.num_pending or 0, ack_pending=info.num_ack_pending or 0,
                                redelivered=info.num_redelivered or 0, waiting=info.num_waiting or 0))
    return out
