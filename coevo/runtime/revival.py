"""A consumer that disappears comes back: where it resumes, and its recreation.

A consumer can vanish under a running agent: a role deletes it (every role may), or the server
drops an unshared one that saw no pull for ``bus.unshared_inactive_s`` (a partition longer than
that). A fetch then ends with ``ConsumerGone`` (409 "Consumer Deleted") or with no responders
(503); ``Revival.revive`` asks the server whether the consumer is there, and if it is not, creates
it again with the same filter and limits, once for all of the consumer's workers, counted
(``ConsumerStats.recreated``) and logged once.

Invariants:
- nothing is skipped: a recreated consumer starts at ``Ledger.resume_from``, the lowest stream
  sequence this process fetched and did not settle (ack or term: a nak'd message is redelivered),
  else the one after the last it fetched; a shared durable also starts no later than the ack floor
  last read from the server (another replica's messages in flight lie above it; a stale floor is
  lower: more redelivered, never less). A ``deliver="last"`` subscription starts again at the newest
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
        start = min(self.open) if self.open else self.last + 1
        if self.ack_floor is not None:
            start = min(start, self.ack_floor + 1)
        return max(start, 1)

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
    ledger: Ledger = dataclasses.field(default_factory=Ledger)
    recreated: int = 0
    _lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def config(self) -> api.ConsumerConfig:
        """The consumer's config, from where it resumes (``deliver="last"``: its own policy)."""
        config = self.bus.consumer_config(self.name, self.kinds, deliver=self.deliver, ephemeral=self.ephemeral)
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
            try:
                info = await self.bus.js.add_consumer(self.bus.stream, self.config())
            except nats.js.errors.APIError:
                # another replica recreated it from another start (10012: "can not be updated")
                return await self._exists()
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                return False
            self.recreated += 1
            log.warning(
                "consumer.recreated",
                consumer=self.name,
                why=type(why).__name__,
                start_seq=info.config.opt_start_seq,
                deliver=str(info.config.deliver_policy),
                recreated=self.recreated,
            )
            return True

    async def read_ack_floor(self) -> None:
        """Remember the server's ack floor of a shared durable (where a recreation starts at the latest)."""
        if self.ephemeral:
            return
        try:
            info = await self.bus.js.consumer_info(self.bus.stream, self.name)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return
        self.ledger.ack_floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0

    async def _exists(self) -> bool:
        try:
            await self.bus.js.consumer_info(self.bus.stream, self.name)
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return True  # the server cannot say now: treat as there (fetch again later)
        return True
