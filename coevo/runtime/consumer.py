"""A typed, bounded pull consumer.

Invariants:
- at most ``concurrency`` messages are held at once (fetches ask only for free slots), on top of
  the server's ``max_ack_pending``; memory stays flat whatever the producer does;
- every fetched message ends in exactly one of: ack (handler returned), nak with delay
  (``Retry``, a crash below ``max_deliver``, or shutdown), or term after a stored ``DeadLettered``
  event (invalid payload, ``Reject``, or the last allowed crash);
- handlers that run longer than ``in_progress_every_s`` keep their message with ``in_progress``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg
from pydantic import ValidationError

from coevo.config import BusConfig
from coevo.runtime.aio import first_completed
from coevo.runtime.bus import Delivery, NatsBus
from coevo.runtime.errors import Reject, Retry
from coevo.schemas import Event, Source, decode, kind_of

log = structlog.get_logger("coevo.consumer")

Handler = Callable[[Any, Delivery], Awaitable[None]]


@dataclass
class ConsumerStats:
    handled: int = 0
    retried: int = 0
    crashed: int = 0
    dead_lettered: int = 0
    nak_on_shutdown: int = 0
    max_inflight: int = 0


@dataclass
class Subscription:
    """What an agent consumes: a durable name shared by its replicas, event types, a handler."""

    durable: str
    events: tuple[type[Event], ...]
    handler: Handler
    concurrency: int | None = None
    kinds: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.kinds = tuple(kind_of(e) for e in self.events)


def backoff(delays: list[float], attempt: int) -> float:
    """Delay before redelivery number ``attempt`` (1-based), the last delay repeated."""
    return delays[min(max(attempt, 1), len(delays)) - 1]


class Consumer:
    def __init__(
        self, bus: NatsBus, sub: Subscription, source: Source, *, cfg: BusConfig | None = None,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.bus = bus
        self.drain_timeout_s = drain_timeout_s
        self.sub = sub
        self.source = source
        self.cfg = cfg or bus.cfg
        self.concurrency = sub.concurrency or self.cfg.handler_concurrency
        self.stats = ConsumerStats()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self._inflight: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain in-flight handlers (nak what is unfinished)."""
        psub = await self.bus.pull_subscription(self.sub.durable, self.sub.kinds)
        try:
            async with asyncio.TaskGroup() as tg:
                while not stop.is_set():
                    if not self.resumed.is_set():
                        await first_completed(self.resumed.wait(), stop.wait())
                        continue
                    free = self.concurrency - len(self._inflight)
                    if free <= 0:
                        self._slot_freed.clear()
                        await first_completed(self._slot_freed.wait(), stop.wait())
                        continue
                    try:
                        msgs = await psub.fetch(min(free, self.cfg.fetch_batch),
                                                timeout=self.cfg.fetch_timeout_s)
                    except nats.errors.TimeoutError:
                        continue
                    for msg in msgs:
                        task = tg.create_task(self._handle(msg), name=f"{self.sub.durable}:{msg.subject}")
                        self._inflight.add(task)
                        task.add_done_callback(self._done)
                    self.stats.max_inflight = max(self.stats.max_inflight, len(self._inflight))
                await self._drain()
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._slot_freed.set()

    async def _drain(self) -> None:
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.drain_timeout_s)
        for task in pending:
            task.cancel()

    async def _handle(self, msg: Msg) -> None:
        md = msg.metadata
        try:
            event = decode(msg.data)
        except ValidationError as exc:
            await self._dead_letter(msg, f"invalid payload: {_short(exc)}")
            return
        except ValueError as exc:
            await self._dead_letter(msg, f"undecodable payload: {exc}")
            return
        if event.run_id != self.bus.run_id:
            await self._dead_letter(msg, f"event of run {event.run_id} on run {self.bus.run_id}")
            return
        delivery = Delivery(msg, msg.subject, md.sequence.stream, md.num_delivered)
        bound = log.bind(event_id=event.event_id, subject=msg.subject, consumer=self.sub.durable,
                         delivered=md.num_delivered)
        try:
            await self._run_with_keepalive(self.sub.handler(event, delivery), msg)
        except asyncio.CancelledError:
            self.stats.nak_on_shutdown += 1
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Retry as r:
            self.stats.retried += 1
            await msg.nak(delay=r.delay_s if r.delay_s is not None else
                          backoff(self.cfg.nak_backoff_s, md.num_delivered))
            bound.info("handler.retry", reason=str(r))
        except Reject as r:
            await self._dead_letter(msg, f"rejected: {r}")
        except Exception as exc:
            self.stats.crashed += 1
            if md.num_delivered >= self.cfg.max_deliver:
                await self._dead_letter(msg, f"handler crashed {md.num_delivered} times: {exc!r}")
            else:
                bound.warning("handler.crashed", error=repr(exc))
                await msg.nak(delay=backoff(self.cfg.nak_backoff_s, md.num_delivered))
        else:
            await msg.ack()
            self.stats.handled += 1

    async def _run_with_keepalive(self, work: Awaitable[None], msg: Msg) -> None:
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.cfg.in_progress_every_s)
                if done:
                    return task.result()
                await msg.in_progress()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        await self.bus.dead_letter(msg, self.sub.durable, reason, self.source)
        await msg.term()
        self.stats.dead_lettered += 1



def _short(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])

