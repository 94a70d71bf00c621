"""Reading a run's stream as an observer: every stored event in order, then the new ones as they come
(``NatsBus.tail``: an ephemeral consumer that acknowledges nothing, so observing a run never changes
what its agents receive; it is not in docs/architecture.md's table), and the agents' consumers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from coevo.observe.aggregate import ConsumerInfo
from coevo.runtime.bus import NatsBus
from coevo.runtime.history import TAIL_PREFIX
from coevo.schemas import Event


def tail(
    bus: NatsBus,
    stop: asyncio.Event,
    *,
    start_seq: int = 1,
    wait_s: float = 1.0,
    on_caught_up: Callable[[], None] | None = None,
) -> AsyncIterator[tuple[int, Event | None]]:
    """``(sequence, event)`` from ``start_seq`` on, live until ``stop`` (``NatsBus.tail``)."""
    return bus.tail(stop, start_seq=start_seq, wait_s=wait_s, on_caught_up=on_caught_up)


async def consumer_infos(bus: NatsBus) -> list[ConsumerInfo]:
    """The run's durable consumers (the agents'), as JetStream reports them; ``BusError`` when it cannot."""
    out = []
    for info in await bus.consumers():
        name = info.name or ""
        if name.startswith((TAIL_PREFIX, "history_")):
            continue
        out.append(
            ConsumerInfo(
                name=name,
                pending=info.num_pending or 0,
                ack_pending=info.num_ack_pending or 0,
                redelivered=info.num_redelivered or 0,
                waiting=info.num_waiting or 0,
            )
        )
    return out
