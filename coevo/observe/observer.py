"""The live observer: a run's stream -> the aggregator -> sinks, Prometheus and dashboard subscribers.

Invariants:
- one task tails the stream and is the only writer of the aggregator and the sinks: each event is
  folded once, in stream order (``source.tail``);
- sinks get only the points of events after ``sink_after_seq`` (read from the marker file when
  given): a resumed run or a restarted metrics agent does not write its history twice; the marker
  is rewritten when the observer ends;
- every subscriber (a dashboard's live stream) has a bounded queue; one that falls behind is dropped
  (its page reconnects and reloads) instead of holding memory;
- ``run`` returns after ``stop`` only once everything stored up to then was folded and the sinks are
  closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from coevo.errors import BusError
from coevo.observe.aggregate import Aggregator
from coevo.observe.series import Point
from coevo.observe.sinks import Sink
from coevo.observe.source import consumer_infos, tail
from coevo.runtime.aio import wait_event
from coevo.runtime.bus import NatsBus

log = structlog.get_logger("coevo.observe")


@dataclass(eq=False)  # compared (and hashed) by identity: held in a set
class Subscriber:
    """A live consumer of points (a dashboard page's event stream)."""

    queue: asyncio.Queue[list[Point]] = field(default_factory=lambda: asyncio.Queue(maxsize=512))
    dropped: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


def read_marker(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    text = path.read_text().strip()
    return int(text) if text.isdigit() else 0


class Observer:
    """Folds a run's events into ``aggregator`` as they are stored and fans the points out."""

    def __init__(
        self,
        bus: NatsBus,
        *,
        aggregator: Aggregator | None = None,
        sinks: Iterable[Sink] = (),
        poll_s: float = 5.0,
        marker: Path | None = None,
    ) -> None:
        self.bus = bus
        self.aggregator = aggregator or Aggregator()
        self.sinks = list(sinks)
        self.poll_s = poll_s
        self.marker = marker
        self.sink_after_seq = read_marker(marker)
        self.subscribers: set[Subscriber] = set()
        self.caught_up = asyncio.Event()
        self.error: BaseException | None = None
        self.running = False

    @property
    def healthy(self) -> bool:
        return self.running and self.error is None

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    async def run(self, stop: asyncio.Event) -> None:
        """Tail until ``stop``, then fold what is left, flush and close the sinks."""
        self.running = True
        polled = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._poll(polled), name="observer:consumers")
                try:
                    await self._tail(stop)
                finally:
                    polled.set()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.running = False
            self._publish(self.aggregator.finish(), sink=True)
            self._close()

    async def _tail(self, stop: asyncio.Event) -> None:
        agg = self.aggregator
        async for seq, event in tail(self.bus, stop, start_seq=agg.last_seq + 1, on_caught_up=self.caught_up.set):
            self._publish(agg.add(event, seq), sink=seq > self.sink_after_seq)
        self.caught_up.set()

    async def _poll(self, done: asyncio.Event) -> None:
        while not done.is_set():
            try:
                infos = await consumer_infos(self.bus)
            except BusError as exc:  # busy or gone: next poll
                log.info("observer.consumer_info_failed", error=repr(exc))
            else:
                self._publish(
                    self.aggregator.add_consumers(infos, time.time()),
                    sink=self.aggregator.last_seq > self.sink_after_seq,
                )
            await wait_event(done, self.poll_s)

    def _publish(self, points: list[Point], *, sink: bool) -> None:
        if not points:
            return
        if sink:
            for s in self.sinks:
                s.write(points)
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(points)
            except asyncio.QueueFull:
                sub.dropped = True
                self.subscribers.discard(sub)
            sub.wake.set()

    def _close(self) -> None:
        for s in self.sinks:
            s.close()
        self.sinks = []
        if self.marker is not None:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"{max(self.aggregator.last_seq, self.sink_after_seq)}\n")
        for sub in list(self.subscribers):
            sub.wake.set()
        log.debug("observer.closed", last_seq=self.aggregator.last_seq)
