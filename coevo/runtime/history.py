"""Reading a run's stored events: consumer positions, the stream's history in order, a live tail.

Invariants:
- ``history`` ends only when the server says nothing is left up to its end sequence and everything
  it delivered was read, never on a timeout alone; a payload that does not decode is yielded as
  None (with its message), never skipped silently;
- ``tail``'s consumer is ephemeral and acknowledges nothing: reading never changes what any agent
  receives. It yields each stored event once, in stream order; after ``stop`` is set it still
  yields everything stored up to then and returns. It is caught up when the server has nothing
  left to deliver and everything it delivered was read; a delivery that never came (lost in a
  reconnect: nothing is redelivered to it) stops counting after ``LOST_AFTER`` empty fetches in a row;
- nats-py's errors stay here: a failed listing of consumers is a ``BusError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from coevo.errors import BusError
from coevo.runtime import slots
from coevo.runtime.credentials import ADMIN
from coevo.runtime.pull import Puller, delivered_seq, read_all
from coevo.schemas import Event, events_prefix, kind_from_subject, new_id, subject_filters

TAIL_FETCH = 256
LOST_AFTER = 3
TAIL_PREFIX = "observe_"
"""the name prefix of ``tail``'s ephemeral consumers (``history_`` is ``history``'s)"""


class History:
    """The reading half of the bus (``NatsBus`` is a ``History``)."""

    nc: NATS
    js: JetStreamContext
    run_id: str
    stream: str
    user: str

    async def decode_msg(self, msg: Msg) -> Event:
        raise NotImplementedError  # the bus's: it follows claims to the object store

    async def consumer_position(self, durable: str) -> int | None:
        """The last stream sequence the durable consumer ``durable`` was delivered (0: nothing yet);
        None when there is no such consumer."""
        try:
            info = await self.js.consumer_info(self.stream, durable)
        except nats.js.errors.NotFoundError:
            return None
        return delivered_seq(info)

    async def last_sequence(self) -> int:
        info = await self.js.stream_info(self.stream)
        return info.state.last_seq

    async def history(
        self,
        kinds: Iterable[str] | None = None,
        start_seq: int = 1,
        end_seq: int | None = None,
        *,
        undecoded: Iterable[str] = (),
    ) -> AsyncIterator[tuple[int, Event | None, Msg]]:
        """Every stored event (or those of ``kinds``: a kind, or ``<kind>.<scope>`` for one subject of a
        scoped kind, ``coevo.schemas.registry``) in order, up to ``end_seq`` (default: now).

        Yields ``(sequence, event, msg)``; ``event`` is None for a payload that does not decode, and
        for the kinds in ``undecoded``, yielded as stored (a reader of their ids, ``stored_id(msg)``,
        never waits for an object store nor reads their bulk)."""
        raw = set(undecoded)
        end = end_seq if end_seq is not None else await self.last_sequence()
        if end < start_seq:
            return
        name = await self._add_reader(self._reader_config(f"history_{new_id()[:16]}", kinds, start_seq))
        sub = await Puller(self.nc, self.stream, name).start()
        try:
            if (await self.js.consumer_info(self.stream, name)).num_pending == 0:
                return
            stalled_since = time.monotonic()
            read = start_seq - 1  # the last sequence yielded
            while True:
                try:
                    msgs = await sub.fetch(256, 2.0)
                except (nats.errors.TimeoutError, TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
                    # a slow fetch (a node failing over, a busy server) is not the end of history:
                    # stop only when the server says nothing is left, never on a timeout alone
                    if await self._history_done(name, stalled_since, end, read):
                        return
                    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
                        await asyncio.sleep(0.5)  # answered at once: wait for the stream to come back
                    continue
                stalled_since = time.monotonic()
                for msg in msgs:
                    md = msg.metadata
                    if md.sequence.stream > end:
                        return
                    try:
                        undecode = kind_from_subject(msg.subject) in raw
                        event: Event | None = None if undecode else await self.decode_msg(msg)
                    except ValueError:
                        event = None
                    read = md.sequence.stream
                    yield md.sequence.stream, event, msg
                    if md.num_pending == 0 or md.sequence.stream >= end:
                        return
        finally:
            await sub.unsubscribe()
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
                await self.js.delete_consumer(self.stream, name)

    async def _add_reader(self, config: api.ConsumerConfig) -> str:
        """Create a reader; its name. A role's takes one of its numbered names (``coevo.runtime.slots``:
        a role may touch only its own consumers)."""
        if self.user == ADMIN:
            await self.js.add_consumer(self.stream, config)
            return str(config.name)
        info = await slots.claim(self.nc, self.stream, config, self.user, new_id(), 5.0)
        return str(info.name)

    def _reader_config(self, name: str, kinds: Iterable[str] | None, start_seq: int) -> api.ConsumerConfig:
        """An ephemeral consumer that acknowledges nothing, from ``start_seq``, of ``kinds`` (default: all)."""
        every = [f"{events_prefix(self.run_id)}.>"]
        subjects = [s for k in kinds for s in subject_filters(self.run_id, k)] if kinds else every
        return api.ConsumerConfig(
            name=name,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            filter_subjects=subjects if len(subjects) > 1 else None,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            inactive_threshold=30.0,
            max_ack_pending=-1,
        )

    async def _history_done(
        self, consumer: str, stalled_since: float, end: int, read: int, stall_s: float = 60.0
    ) -> bool:
        """After a fetch timeout: True when nothing is left to read and everything the server
        delivered (up to ``delivered.stream_seq``) was read (``read``): a delivered message can
        still be on its way to the fetch. Raises if reading stalls for good."""
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            if read_all(await self.js.consumer_info(self.stream, consumer), read, end):
                return True
        if time.monotonic() - stalled_since > stall_s:
            raise BusError(f"reading the history of {self.stream} stalled for {stall_s:.0f} s before sequence {end}")
        return False

    async def events(self, kinds: Iterable[str] | None = None) -> list[Event]:
        """Convenience: the decoded events stored so far (undecodable ones skipped)."""
        return [e async for _, e, _ in self.history(kinds) if e is not None]

    async def tail(
        self,
        stop: asyncio.Event,
        *,
        start_seq: int = 1,
        wait_s: float = 1.0,
        on_caught_up: Callable[[], None] | None = None,
    ) -> AsyncIterator[tuple[int, Event | None]]:
        """``(sequence, event)`` from ``start_seq`` on (``event`` None: undecodable), live until ``stop``;
        ``on_caught_up`` is called whenever everything stored so far was yielded."""
        name = f"{TAIL_PREFIX}{new_id()[:16]}"
        config = api.ConsumerConfig(
            name=name,
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, start_seq),
            filter_subject=f"{events_prefix(self.run_id)}.>",
            inactive_threshold=60.0,
            max_ack_pending=-1,
        )
        name = await self._add_reader(config)
        sub = await Puller(self.nc, self.stream, name).start()
        try:
            caught_up = False
            read = max(1, start_seq) - 1  # the last sequence yielded
            empty = 0  # fetches in a row that got nothing
            while not (stop.is_set() and caught_up):
                try:
                    msgs = await sub.fetch(TAIL_FETCH, wait_s)
                except (nats.errors.TimeoutError, TimeoutError):
                    empty += 1
                    caught_up = await self._tail_caught_up(name, read, empty)
                    if caught_up and on_caught_up is not None:
                        on_caught_up()
                    continue
                empty = 0
                for msg in msgs:
                    try:
                        event: Event | None = await self.decode_msg(msg)  # follows claims of large events
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
                await self.js.delete_consumer(self.stream, name)

    async def _tail_caught_up(self, name: str, read: int, empty: int) -> bool:
        """After an empty fetch: whether everything delivered was read (or nothing answers for long)."""
        caught_up = empty >= LOST_AFTER  # what is left when the server does not answer
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            info = await self.js.consumer_info(self.stream, name)
            caught_up = read_all(info, read) or (info.num_pending == 0 and empty >= LOST_AFTER)
        return caught_up

    async def consumers(self) -> list[api.ConsumerInfo]:
        """Every consumer of the run's stream as JetStream reports it (agents', ``history``'s and
        ``tail``'s); ``BusError`` when the server cannot say now."""
        try:
            return list(await self.js.consumers_info(self.stream))
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise BusError(f"listing the consumers of {self.stream}: {exc!r}") from exc
