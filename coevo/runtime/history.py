"""Reading a run's stored events: consumer positions, the stream's history in order, events.

Invariant: ``history`` ends only when the server says nothing is left up to its end sequence and
everything it delivered was read, never on a timeout alone; a payload that does not decode is
yielded as None (with its message), never skipped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from coevo.errors import BusError
from coevo.runtime.pull import Puller, delivered_seq, read_all
from coevo.schemas import Event, events_prefix, new_id, subject_for


class History:
    """The reading half of the bus (``NatsBus`` is a ``History``)."""

    nc: NATS
    js: JetStreamContext
    run_id: str
    stream: str

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
        self, kinds: Iterable[str] | None = None, start_seq: int = 1, end_seq: int | None = None, *,
        undecoded: Iterable[str] = (),
    ) -> AsyncIterator[tuple[int, Event | None, Msg]]:
        """Every stored event (or those of ``kinds``) in order, up to ``end_seq`` (default: now).

        Yields ``(sequence, event, msg)``; ``event`` is None for a payload that does not decode, and
        for the kinds in ``undecoded``, yielded as stored (a reader of their ids, ``stored_id(msg)``,
        never waits for an object store nor reads their bulk)."""
        raw = {subject_for(self.run_id, k) for k in undecoded}
        end = end_seq if end_seq is not None else await self.last_sequence()
        if end < start_seq:
            return
        subjects = [subject_for(self.run_id, k) for k in kinds] if kinds else [f"{events_prefix(self.run_id)}.>"]
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            filter_subjects=subjects if len(subjects) > 1 else None,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            inactive_threshold=30.0,
            max_ack_pending=-1,
        )
        name = config.name = f"history_{new_id()[:16]}"
        await self.js.add_consumer(self.stream, config)
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
                        event: Event | None = None if msg.subject in raw else await self.decode_msg(msg)
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

    async def _history_done(self, consumer: str, stalled_since: float, end: int, read: int,
                            stall_s: float = 60.0) -> bool:
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
