"""A typed, bounded pull consumer.

Invariants:
- at most about ``fetch_batch`` messages are held at once (each of ``concurrency`` workers
  fetches its share only when it has handled its previous batch), under the server's
  ``max_ack_pending``; memory stays flat whatever the producer does;
- every fetched message ends in exactly one of: ack (handler returned and every event it published
  is stored: the outbox, ``coevo.runtime.outbox``), nak with delay (``Retry``, a crash below
  ``max_deliver``, outputs that could not be stored, a claimed payload that cannot be read now, or
  shutdown), or term after a stored
  ``DeadLettered`` event (invalid payload, ``Reject``, or the last allowed crash);
- a fetched message is kept with ``in_progress`` every ``in_progress_every_s`` from its fetch until its
  outcome, whether its handler runs or it waits behind its batch-mates (none passes ``ack_wait``);
- a consumer deleted under it (by the admin, or as inactive), or re-pointed (the admin), is created again
  where it left off (a role's own under one of its numbered names, ``coevo.runtime.slots``), and
  what it redelivers that was settled here is acked without its handler (``coevo.runtime.revival``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from pydantic import ValidationError

from coevo.config import BusConfig
from coevo.errors import ConsumerGone, PayloadUnavailable, PublishError, Reject, Retry
from coevo.runtime import faults
from coevo.runtime.aio import cancel_all, drain, first_completed, unless_set
from coevo.runtime.bus import NatsBus
from coevo.runtime.credentials import ADMIN
from coevo.runtime.outbox import Outbox, staging
from coevo.runtime.pull import Puller, stream_seq
from coevo.runtime.revival import Revival
from coevo.schemas import Event, Source, kind_of, new_id


class Delivery:
    """What a handler knows about the message it handles (metadata parsed on demand)."""

    __slots__ = ("msg",)

    def __init__(self, msg: Msg) -> None:
        self.msg = msg

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def stream_seq(self) -> int:
        return self.msg.metadata.sequence.stream

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    async def in_progress(self) -> None:
        """Tell the server the work goes on (resets the ack timer)."""
        await self.msg.in_progress()


log = structlog.get_logger("coevo.consumer")
ACK_FLOOR_EVERY_S = 5.0

Handler = Callable[[Any, Delivery], Awaitable[None]]


@dataclass
class ConsumerStats:
    handled: int = 0
    retried: int = 0
    crashed: int = 0
    dead_lettered: int = 0
    nak_on_shutdown: int = 0
    unconfirmed: int = 0
    max_inflight: int = 0
    recreated: int = 0
    """times its consumer was found deleted and created again"""
    settled_before: int = 0
    """deliveries of a message settled here already (a recreated consumer's, a lost ack's): acked unhandled"""
    unknown_fields: int = 0
    """fields of events of a newer schema minor ignored (handled, never dead-lettered: ``bus.unknown_field``)"""


@dataclass
class Subscription:
    """What an agent consumes: a durable name shared by its replicas, event types, a handler."""

    durable: str
    events: tuple[type[Event], ...]
    handler: Handler
    concurrency: int | None = None
    shared: bool = True
    """True: replicas share the durable (load balancing). False: each agent instance has its own."""
    deliver: Literal["all", "last"] = "all"
    """``last``: start from the newest event of each subject it reads (each lane's latest weights)."""
    scope: str | None = None
    """read only this scope's subject of the (scoped) kinds: one lane (``coevo.schemas.registry``)"""
    batch: int | None = None
    """messages a worker fetches at once (default: ``bus.fetch_batch / concurrency``). 1 for handlers
    that wait on other messages of the same subscription (the learner's wait for a checkpoint that
    needs more groups): a message fetched waits behind its batch-mates, kept in progress, and is never
    handed to another worker."""
    kinds: tuple[str, ...] = field(init=False)
    """what it reads: kinds, or ``<kind>.<scope>`` with a scope (``History.history``'s selectors)"""

    def __post_init__(self) -> None:
        self.kinds = tuple(kind_of(e) + (f".{self.scope}" if self.scope else "") for e in self.events)


def backoff(delays: list[float], attempt: int) -> float:
    """Delay before redelivery number ``attempt`` (1-based), the last delay repeated."""
    return delays[min(max(attempt, 1), len(delays)) - 1]


class Consumer:
    def __init__(
        self,
        bus: NatsBus,
        sub: Subscription,
        source: Source,
        *,
        cfg: BusConfig | None = None,
        drain_timeout_s: float = 3.0,
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
        self._held: dict[int, tuple[Msg, float]] = {}
        self._holding: dict[int, int] = {}  # stream sequence -> id() of the message a handler here holds
        self._parked: dict[int, list[Msg]] = {}  # second deliveries of held sequences (``_take``)
        self._unstarted: list[Msg] = []  # fetched, not started when the stop came: given back at the end
        self.name = sub.durable if sub.shared else f"{sub.durable}-{source.agent_id}"
        own = not sub.shared and bus.user != ADMIN  # a role's: one of its numbered names (coevo.runtime.slots)
        self.revival = Revival(bus, self.name, sub.kinds, sub.deliver, not sub.shared, owner=new_id() if own else None)
        """where the consumer resumes if it is deleted, kept across runs (a supervised restart)"""

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; then let each worker finish the message it handles within
        ``drain_timeout_s`` (cancelled and nak'd after that, or after a second without a connection) and nak what it fetched but did not start.

        ``concurrency`` workers each pull their own batches (``fetch_batch / concurrency``) through
        their own subscription to the shared durable, so a message is never handed between tasks.
        """
        per_worker = self.sub.batch or max(1, -(-self.cfg.fetch_batch // self.concurrency))
        subs: list[Puller] = []
        rv = self.revival

        async def open_pullers() -> None:
            name = await self.bus.open_consumer(
                self.name,
                self.sub.kinds,
                deliver=self.sub.deliver,
                ephemeral=not self.sub.shared,
                owner=rv.owner,
                held=rv.name if rv.owner is not None and rv.name != self.name else None,
            )
            rv.name = name
            for _ in range(self.concurrency):
                subs.append(await Puller(self.bus.nc, self.bus.stream, name).start())
            await rv.read_ack_floor()

        try:
            # a stop while the consumer is created ends it at once (the request can take its full
            # timeout across a cut: a policy stopped then took 8 s)
            if not await unless_set(stop, open_pullers()):
                return
            async with asyncio.TaskGroup() as tg:
                workers = [
                    tg.create_task(self._worker(ps, per_worker, stop), name=f"{self.sub.durable}:w{i}")
                    for i, ps in enumerate(subs)
                ]
                keepalive = tg.create_task(self._keepalive(), name=f"{self.sub.durable}:keepalive")
                await first_completed(stop.wait(), asyncio.wait(workers))
                await cancel_all([*await drain(workers, self.drain_timeout_s, self.bus.connected), keepalive])
        finally:
            # every pull of this process closed before anything is given back: a message nak'd while
            # one of them still waits would be handed straight back here, and each bounce costs one of
            # its deliveries (a clean stop used to dead-letter messages that way)
            for ps in subs:
                with contextlib.suppress(Exception):
                    await ps.unsubscribe()
            unstarted, self._unstarted = self._unstarted, []
            await self._release([*unstarted, *(m for ps in subs for m in ps.take_late())])

    async def _worker(self, psub: Puller, batch: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self.resumed.is_set():
                await first_completed(self.resumed.wait(), stop.wait())
                if self.resumed.is_set():  # back from away: the name may be another owner's now (or gone)
                    await self.revival.read_ack_floor()
                    self.stats.recreated = self.revival.recreated
                continue
            if psub.durable != self.revival.name:  # recreated under another of the role's names
                psub.retarget(self.revival.name)
            try:
                msgs = await psub.fetch(batch, self.cfg.fetch_timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except (ConsumerGone, nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
                if not self.resumed.is_set():
                    continue  # paused (away) meanwhile: it touches nothing now, and fetches again once resumed
                if await self.revival.revive(exc):  # deleted: created again where this process left off
                    self.stats.recreated = self.revival.recreated
                    continue
                await asyncio.sleep(self.cfg.fetch_timeout_s)  # a node failing over: the stream comes back
                continue
            await self._handle_batch(await self._take(msgs), stop)

    async def _take(self, msgs: list[Msg]) -> list[tuple[Msg, int]]:
        """Hold a fetched batch (kept in progress from now, batch-mates waiting included), with each
        message's stream sequence. A message settled here already is acked unhandled; a second
        delivery of one a handler here holds (a recreated consumer's) is parked beside it until
        that handler's outcome (``_unhold``)."""
        ledger = self.revival.ledger
        settled, holding, held = ledger.settled, self._holding, self._held
        fetched = time.monotonic()
        batch = []
        for msg in msgs:
            seq = stream_seq(msg)
            if seq in settled and await self._settled_here(msg, seq):  # a recreated consumer's redelivery
                continue
            held[id(msg)] = (msg, fetched)
            if seq in holding:
                self._parked.setdefault(seq, []).append(msg)
                continue
            ledger.fetched(seq)
            holding[seq] = id(msg)
            batch.append((msg, seq))
        if len(self._held) > self.stats.max_inflight:
            self.stats.max_inflight = len(self._held)
        return batch

    async def _handle_batch(self, batch: list[tuple[Msg, int]], stop: asyncio.Event) -> None:
        done = 0  # the batch's messages with an outcome (unheld)
        try:
            for i, (msg, seq) in enumerate(batch):
                if stop.is_set():
                    self._unstarted.extend(m for m, _ in batch[i:])  # given back once every pull is closed
                    break
                if not self.resumed.is_set():
                    await self._release([m for m, _ in batch[i:]])
                    break
                try:
                    if await self._handle(msg):
                        self.revival.ledger.settle(seq)
                except asyncio.CancelledError:  # the drain ran out: given back once every pull is closed
                    self._unstarted.extend(m for m, _ in batch[i + 1 :])
                    raise
                finally:
                    done = i + 1
                    await self._unhold(msg, seq)
        finally:
            for msg, seq in batch[done:]:
                await self._unhold(msg, seq)

    async def _settled_here(self, msg: Msg, seq: int) -> bool:
        """Whether ``seq`` was settled here already: then ``msg`` is acked, unhandled."""
        if not self.revival.ledger.seen(seq):
            return False
        self.stats.settled_before += 1
        with contextlib.suppress(Exception):
            await msg.ack()
        return True

    async def _unhold(self, msg: Msg, seq: int) -> None:
        """``msg`` has its outcome: deliveries of it parked meanwhile are acked (settled) or nak'd
        (to be handled: the outcome went to a consumer since deleted)."""
        self._held.pop(id(msg), None)
        if self._holding.get(seq) != id(msg):
            return
        del self._holding[seq]
        if not self._parked:
            return
        for twin in self._parked.pop(seq, ()):
            self._held.pop(id(twin), None)
            if not await self._settled_here(twin, seq):
                with contextlib.suppress(Exception):
                    await twin.nak()

    async def _release(self, msgs: list[Msg]) -> None:
        """Give fetched-but-unstarted messages back at once (nak without delay)."""
        for msg in msgs:
            self.stats.nak_on_shutdown += 1
            with contextlib.suppress(Exception):
                await msg.nak()

    async def _keepalive(self) -> None:
        """Send ``in_progress`` for messages held longer than ``in_progress_every_s``; read a shared
        durable's ack floor every ``ACK_FLOOR_EVERY_S`` (where a recreation would start at the latest)."""
        every = self.cfg.in_progress_every_s
        floor_read = time.monotonic()
        while True:
            await asyncio.sleep(every / 2)
            if time.monotonic() - floor_read > ACK_FLOOR_EVERY_S:
                floor_read = time.monotonic()
                await self.revival.read_ack_floor()
                self.stats.recreated = self.revival.recreated
            limit = time.monotonic() - every / 2
            for msg, since in list(self._held.values()):
                if since < limit:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()

    async def _decode(self, msg: Msg) -> Event | None:
        """The message's event; None when a claim could not be read now and the message was nak'd (it
        is intact: read again on a later delivery). On its last delivery it is held (in progress)
        and read again until ``bus.payload_wait_s``, so an outage of the object store (a partition,
        a leader change) longer than the redeliveries loses nothing; only then dead-lettered."""
        try:  # the common case first, without parsing the message's metadata (its reply subject into a
            return await self._read(msg)  # dataclass and a datetime: ~15 % of a small event's time)
        except PayloadUnavailable as first:
            exc = first
        delivered = msg.metadata.num_delivered
        deadline = time.monotonic() + self.cfg.payload_wait_s
        pause = 1.0
        while True:
            self.stats.retried += 1
            log.warning(
                "consumer.payload_unavailable", error=str(exc)[:300], consumer=self.sub.durable, delivered=delivered
            )
            if delivered < self.cfg.max_deliver:
                await msg.nak(delay=backoff(self.cfg.nak_backoff_s, delivered))
                return None
            if time.monotonic() + pause > deadline:
                await self._dead_letter(
                    msg,
                    f"claimed payload unreadable on {delivered} deliveries and for "
                    f"{self.cfg.payload_wait_s:.0f} s more: {exc}",
                )
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 10.0)
            try:
                return await self._read(msg)
            except PayloadUnavailable as again:
                exc = again

    async def _read(self, msg: Msg) -> Event:
        ignored: list[tuple[str, str]] = []
        event = await self.bus.decode_msg(msg, ignored)
        self.stats.unknown_fields += len(ignored)
        return event

    async def _admitted(self, msg: Msg) -> Event | None:
        """The message's event, or None when it is not one of this run's (dead-lettered with the
        reason) or its payload cannot be had now (left to redelivery)."""
        try:
            event = await self._decode(msg)
        except ValidationError as exc:
            await self._dead_letter(msg, f"invalid payload: {_short(exc)}")
            return None
        except ValueError as exc:
            await self._dead_letter(msg, f"undecodable payload: {exc}")
            return None
        if event is not None and event.run_id != self.bus.run_id:
            await self._dead_letter(msg, f"event of run {event.run_id} on run {self.bus.run_id}")
            return None
        return event

    async def _handle(self, msg: Msg) -> bool:
        """Handle one message to its outcome; True when it was acked (a dead letter settles itself)."""
        if (event := await self._admitted(msg)) is None:
            return False
        box = Outbox(event.event_id, self.sub.durable)
        try:
            with staging(box):
                if faults.armed("handler"):
                    await faults.ahit("handler")
                await self.sub.handler(event, Delivery(msg))
            if box.staged:  # nothing staged (most deliveries of a pure consumer): nothing to wait for
                await box.confirm(self.bus)
        except asyncio.CancelledError:  # the drain ran out: given back once every pull is closed (``run``)
            self._unstarted.append(msg)
            raise
        except Retry as r:
            self.stats.retried += 1
            delivered = msg.metadata.num_delivered
            await msg.nak(delay=r.delay_s if r.delay_s is not None else backoff(self.cfg.nak_backoff_s, delivered))
            log.info(
                "handler.retry", reason=str(r), event_id=event.event_id, consumer=self.sub.durable, delivered=delivered
            )
        except Reject as r:
            await self._dead_letter(msg, f"rejected: {r}")
        except PublishError as exc:  # outputs not stored: redeliver (reruns dedupe by derived ids)
            self.stats.unconfirmed += 1
            log.warning(
                "handler.outputs_not_stored", error=str(exc), event_id=event.event_id, consumer=self.sub.durable
            )
            await msg.nak(delay=backoff(self.cfg.nak_backoff_s, msg.metadata.num_delivered))
        except Exception as exc:
            self.stats.crashed += 1
            delivered = msg.metadata.num_delivered
            if delivered >= self.cfg.max_deliver:
                await self._dead_letter(msg, f"handler crashed {delivered} times: {exc!r}")
            else:
                log.warning(
                    "handler.crashed",
                    error=repr(exc),
                    event_id=event.event_id,
                    consumer=self.sub.durable,
                    delivered=delivered,
                )
                await msg.nak(delay=backoff(self.cfg.nak_backoff_s, delivered))
        else:
            await msg.ack()
            self.stats.handled += 1
            return True
        return False

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        await self.bus.dead_letter(msg, self.sub.durable, reason, self.source)
        await msg.term()
        self.stats.dead_lettered += 1
        self.revival.ledger.settle(stream_seq(msg))


def _short(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
