"""A consumer that disappears comes back: where it resumes, and its recreation.

A consumer can vanish under a running agent: the run's admin deletes it (a role may touch only its
own consumers, ``coevo.runtime.credentials``), or the server
drops an unshared one that saw no pull for ``bus.unshared_inactive_s`` (a partition longer than
that). A fetch then ends with ``ConsumerGone`` (409 "Consumer Deleted") or with no responders
(503); ``Revival.revive`` asks the server whether the consumer is there, and if it is not, creates
it again with the same filter and limits, once for all of the consumer's workers, counted
(``ConsumerStats.recreated``) and logged once. A consumer whose filter was changed under it (the
admin may) is found at the next read of its ack floor (every few seconds), deleted and created
again the same way (``restore``). A role's own consumer comes back under its numbered name, or under
another of the role's if another owner took it meanwhile (``coevo.runtime.slots``).

Invariants:
- nothing is skipped: a recreated consumer starts at ``Ledger.resume_from``, the lowest stream
  sequence this process fetched and did not settle (ack or term: a nak'd message is redelivered),
  else, for a shared durable, the one after the ack floor last read from the server (another
  replica's messages in flight lie above it; a stale floor is lower: more redelivered, never less;
  a process that fetched nothing yet resumes there, not at 1), else the one after the last it
  fetched. A ``deliver="last"`` subscription starts again at the newest
  matching event, as its policy says;
- nothing settled here is handled twice: what the new consumer delivers again that this process
  already settled (``Ledger.settled``, the most recent ``SETTLED_KEPT``) is acked without its
  handler; one still in a handler here is nak'd until that handler ends.
"""

from __future__ import annotations

import asyncio
import dataclasses

import nats.errors
import nats.js.errors
import structlog
from nats.js import api

from coevo.errors import BusError
from coevo.runtime import slots
from coevo.runtime.bus import NatsBus

log = structlog.get_logger("coevo.consumer")

SETTLED_KEPT = 8192
"""settled sequences a ledger remembers above its resume point (beyond: the oldest are forgotten,
and handled again if a recreated consumer redelivers them: at-least-once, as after a crash)"""


class Ledger:
    """What one process did with each stream sequence its consumer fetched (pure: no I/O).

    ``fetched`` when a message arrives, ``settle`` when it was acked or terminated; a nak leaves it
    open (the server redelivers it). ``resume_from`` is where a recreated consumer starts."""

    __slots__ = ("ack_floor", "last", "open", "settled")

    def __init__(self) -> None:
        self.last = 0
        """the highest stream sequence fetched"""
        self.open: set[int] = set()
        """fetched and not settled (in a handler, nak'd, or handed back)"""
        self.settled: set[int] = set()
        """acked or terminated here, above the resume point (bounded by ``SETTLED_KEPT``)"""
        self.ack_floor: int | None = None
        """a shared durable's ack floor as last read from the server (None: unshared, or not read)"""

    def fetched(self, seq: int) -> None:
        if seq > self.last:
            self.last = seq
        self.open.add(seq)

    def settle(self, seq: int) -> None:
        self.open.discard(seq)
        self.settled.add(seq)
        if len(self.settled) > 2 * SETTLED_KEPT:
            self._prune()

    def seen(self, seq: int) -> bool:
        """Whether ``seq`` was settled here already (a recreated consumer's redelivery)."""
        return seq in self.settled

    def resume_from(self) -> int:
        """The lowest sequence open here, else where the consumer stood: the server's ack floor (+1)
        when it was read (a shared durable: everything below it is acked, by this process or another
        replica), else the one after the last fetched. A process that fetched nothing yet (after a
        restart or ``--resume``) resumes at the floor it read, never at 1 (everything acked before
        would be handled again)."""
        stood = self.last + 1 if self.ack_floor is None else self.ack_floor + 1
        return max(min([*self.open, stood]), 1)

    def _prune(self) -> None:
        start = self.resume_from()
        kept = sorted(s for s in self.settled if s >= start)
        self.settled = set(kept[-SETTLED_KEPT:])


@dataclasses.dataclass
class Revival:
    """Recreates the consumer ``name`` of ``bus``'s stream as it was made (``kinds``, ``deliver``,
    ``ephemeral``), from its ``ledger``'s position."""

    bus: NatsBus
    name: str
    kinds: tuple[str, ...]
    deliver: str
    ephemeral: bool
    owner: str | None = None
    """a role's own consumer: the nonce it holds its numbered name by (``coevo.runtime.slots``); None:
    the consumer is named as made (a shared durable, or the admin's)"""
    ledger: Ledger = dataclasses.field(default_factory=Ledger)
    recreated: int = 0
    _lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def config(self) -> api.ConsumerConfig:
        """The consumer's config, from where it resumes (``deliver="last"``: its own policy)."""
        config = self.bus.consumer_config(self.name, self.kinds, deliver=self.deliver, ephemeral=self.ephemeral)
        if self.owner is not None:
            config = slots.own_config(config, self.name, self.owner)
        if self.deliver == "last":
            return config
        return dataclasses.replace(
            config, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.ledger.resume_from()
        )

    async def revive(self, why: BaseException) -> bool:
        """After a fetch failed with ``why``: True when the consumer is there again (recreated here,
        or by another worker or replica meanwhile); False when it is there or the server cannot say
        (a node failing over: wait and fetch again)."""
        seen = self.recreated
        async with self._lock:
            if self.recreated != seen:
                return True  # another worker of this consumer recreated it while this one waited
            if await self._exists():
                return False
            return await self._recreate(type(why).__name__)

    async def _recreate(self, why: str) -> bool:
        """Create the consumer again from the ledger's position (under the lock)."""
        try:
            if self.owner is None:
                info = await self.bus.js.add_consumer(self.bus.stream, self.config())
            else:
                info = await self._recreate_own()
        except nats.js.errors.APIError:
            # another replica recreated it from another start (10012: "can not be updated")
            return await self._exists()
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError, BusError):
            return False
        self.recreated += 1
        log.warning(
            "consumer.recreated",
            consumer=self.name,
            why=why,
            start_seq=info.config.opt_start_seq,
            deliver=str(info.config.deliver_policy),
            recreated=self.recreated,
        )
        return True

    async def _recreate_own(self) -> api.ConsumerInfo:
        """A role's own consumer, under its name if free, else under the first free one of the role
        (another owner took it meanwhile: the workers fetch from the new name, ``Puller.retarget``)."""
        timeout_s = self.bus.cfg.publish_ack_timeout_s
        assert self.owner is not None
        try:
            return await slots.create(self.bus.nc, self.bus.stream, self.config(), timeout_s)
        except slots.NameTaken:
            info = await slots.claim(self.bus.nc, self.bus.stream, self.config(), self.bus.user, self.owner, timeout_s)
            self.name = str(info.name)
            return info

    def _wanted(self) -> list[str]:
        config = self.bus.consumer_config(self.name, self.kinds, deliver=self.deliver, ephemeral=self.ephemeral)
        return sorted(config.filter_subjects or [config.filter_subject or ""])

    async def read_ack_floor(self) -> None:
        """Remember the server's ack floor of a shared durable (where a recreation starts at the latest);
        restore a consumer re-pointed under it, or a role's own one that another owner holds now."""
        if self.ephemeral and self.owner is None:
            return
        name = self.name
        try:
            info = await self.bus.js.consumer_info(self.bus.stream, name)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return
        if self.owner is not None:  # a role's own: still held by this owner (not taken while it was gone)?
            if not slots.owned_by(info, self.owner):
                async with self._lock:
                    if self.name == name:  # not moved by another worker meanwhile
                        await self._recreate("taken")
            return
        if sorted(info.config.filter_subjects or [info.config.filter_subject or ""]) != self._wanted():
            await self.restore(info)  # re-pointed under it: its floor is another filter's, not trusted
            return
        self.ledger.ack_floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0

    async def restore(self, info: api.ConsumerInfo) -> None:
        """The consumer reads other subjects than it was made for (its filter was changed under it: only
        the run's admin may): delete it and create it again from the ledger's position (what it
        skipped meanwhile is delivered, what was settled here is acked unhandled), counted and logged."""
        async with self._lock:
            log.warning(
                "consumer.repointed",
                consumer=self.name,
                found=info.config.filter_subjects or info.config.filter_subject,
                wanted=self._wanted(),
            )
            try:
                await self.bus.js.delete_consumer(self.bus.stream, self.name)
            except nats.js.errors.NotFoundError:
                pass
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                return  # tried again at the next read
            await self._recreate("repointed")

    async def _exists(self) -> bool:
        """Whether the consumer is there (and, a role's own, still held by this owner)."""
        try:
            info = await self.bus.js.consumer_info(self.bus.stream, self.name)
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return True  # the server cannot say now: treat as there (fetch again later)
        return self.owner is None or slots.owned_by(info, self.owner)
