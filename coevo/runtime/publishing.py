"""Publishing with acknowledgements: the bus's half that stores events (``NatsBus`` is a ``Publisher``).

Invariants:
- every event is published on ``subject_of(run, event)`` with ``Nats-Msg-Id = event_id``, so a
  retried or repeated publish of the same event is stored once (within the duplicate window);
- at most ``bus.max_inflight_publishes`` publishes await their acknowledgement; one unanswered for
  ``bus.publish_ack_timeout_s`` is sent again (same id) by the next publish, and ``flush()``
  returns only when every publish was acknowledged (failed ones are retried with the same id);
- a failed publish is never dropped silently: it stays queued (``_failed``) and is sent again under
  its id, backing off, without waiting (no other publish waits on it: each is answered on its own),
  until it is acknowledged, or until it failed ``bus.publish_retries`` + 1 times after the stream
  stored another publish since its first failure (a subject no stream stores, one this connection may
  not publish to: it can never succeed): then it is dead-lettered (a ``DeadLettered`` event with its
  bytes and the reason) and dropped from the queue; what is left when the bus closes is reported
  (``BusStats.unstored``). An outage strikes nothing (no publish is stored meanwhile), nor does an
  injected fault;
- the in-flight bound counts the failed ones too: an outage holds publishers back, it does not grow
  the queue;
- a payload above ``inline_limit`` goes to the run's object store first; the stream holds its claim;
- a publish made while a handler runs is staged in that delivery's outbox (``coevo.runtime.outbox``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from coevo.config import BusConfig, StreamConfig
from coevo.errors import BusError, InjectedFault, PublishError
from coevo.runtime import claims, faults, outbox
from coevo.runtime.credentials import payload_bucket
from coevo.runtime.outbox import UnackedPublish as _UnackedPublish
from coevo.runtime.placement import placed
from coevo.runtime.stats import BusStats
from coevo.schemas import Event, encode, subject_of

MSG_ID = "Nats-Msg-Id"
UNSTORED_PREFIX = "unstored-"
"""the event id of a publish's dead letter: ``unstored-<its id>`` (stored once, however often it fails)"""
log = structlog.get_logger("coevo.bus")


class Publisher:
    """JetStream's asynchronous publish run by the bus itself: one reply subscription, one table of
    unacknowledged publishes."""

    nc: NATS
    js: JetStreamContext
    run_id: str
    cfg: BusConfig
    stream_cfg: StreamConfig
    stats: BusStats
    user: str
    manages: bool

    def _init_publisher(self) -> None:
        self._unacked: dict[str, _UnackedPublish] = {}  # by reply token
        self._failed: list[_UnackedPublish] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._unanswered_since: float | None = None
        """since when a publish has waited with no acknowledgement of any (None: all answered)"""
        self._room = asyncio.Event()
        self._room.set()
        self._acks_prefix = ""
        self._acks_start = 0
        self._acks_lock = asyncio.Lock()
        self._tokens = 0
        self._stores: dict[str, Any] = {}
        self._acks = 0
        """publishes acknowledged so far (a failure after another was stored counts against its retries)"""

    async def publish(self, event: Event) -> asyncio.Future[bool]:
        """Publish without waiting for the ack (bounded in-flight). Returns the ack future."""
        if event.run_id != self.run_id:
            raise BusError(f"event {event.event_id} belongs to run {event.run_id}, not {self.run_id}")
        return await self.publish_raw(subject_of(self.run_id, event), encode(event), event.event_id)

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str) -> asyncio.Future[bool]:
        """Send ``payload`` with ``Nats-Msg-Id = msg_id`` and return at once; the returned future
        resolves when JetStream acknowledged it.

        The bus runs JetStream's asynchronous publish itself (one reply subscription, one table of
        unacknowledged publishes) rather than through nats-py's ``publish_async``, which keeps a
        second table, semaphore and done callback per message beside ours.
        """
        if self._unacked:  # the oldest unanswered for a whole ack timeout: its ack was lost, send it again
            oldest = next(iter(self._unacked.values()))
            if time.perf_counter() - oldest.t0 > self.cfg.publish_ack_timeout_s:
                await self._expire(time.perf_counter() - self.cfg.publish_ack_timeout_s)
        if self._failed:
            await self._retry_failed()
        while not self._has_room():
            await self._wait_for_room()
        if len(payload) > self.inline_limit:
            pending = await self._unacked_publish(subject, payload, msg_id)
        else:
            pending = _UnackedPublish(subject, payload, msg_id, time.perf_counter(), {MSG_ID: msg_id})
        fut = await self._send(pending)
        box = outbox.current()
        if box is not None:
            box.staged.append((fut, pending))
        return fut

    async def _send(self, pending: _UnackedPublish) -> asyncio.Future[bool]:
        """Send ``pending`` with a fresh reply token and return its ack future at once."""
        subject = pending.subject
        if not self._acks_prefix:
            await self._start_acks()
        self._tokens += 1
        token = str(self._tokens)
        pending.future = fut = asyncio.get_running_loop().create_future()
        if self._unanswered_since is None:
            self._unanswered_since = time.perf_counter()
        self._unacked[token] = pending  # before sending: the ack may be read while we wait to write
        self._idle.clear()
        try:
            faults.hit("publish")  # chaos: a publish lost on its way (answered as no stream would)
        except InjectedFault as exc:
            self._refused(token, str(exc))
        else:
            try:
                await self.nc.publish(
                    subject, pending.payload, reply=self._acks_prefix + token, headers=pending.headers
                )
            except BaseException:
                self._forget(token)
                fut.cancel()
                raise
        return fut

    def _has_room(self) -> bool:
        return len(self._unacked) + len(self._failed) < self.cfg.max_inflight_publishes

    async def _start_acks(self) -> None:
        """Subscribe to this bus's ack subjects (``<inbox>.<token>``), once."""
        async with self._acks_lock:
            if not self._acks_prefix:
                prefix = f"{self.nc.new_inbox()}."
                await self.nc.subscribe(f"{prefix}*", cb=self._on_ack)
                self._acks_start, self._acks_prefix = len(prefix), prefix

    async def _on_ack(self, msg: Msg) -> None:
        """JetStream's answer to one publish: a ``PubAck``, an error, or a no-responders status."""
        pending = self._forget(msg.subject[self._acks_start :])
        if pending is None or pending.future is None:
            return  # answered after it expired: it was published again under its id (stored once)
        data = msg.data
        error = "no stream answered (status reply)" if not data else _ack_error(data)
        if error is not None:
            self._fail(pending, error)
            return
        # an acknowledgement: the server answers (a refusal does not count: it is retried)
        self._unanswered_since = None if not self._unacked and not self._failed else time.perf_counter()
        self._acks += 1
        self.stats.published += 1
        if b'"duplicate"' in data and json.loads(data).get("duplicate"):
            self.stats.duplicates += 1
        if self.stats.track_latency:
            self.stats.latencies_ms.append((time.perf_counter() - pending.t0) * 1e3)
        pending.future.set_result(True)

    def _fail(self, pending: _UnackedPublish, error: str, *, strikes: bool = True) -> None:
        """Queue a refused publish to be sent again after its backoff and fail its future (retrieved:
        nobody need await a publish that is retried anyway). ``strikes``: False for a fault injected
        on purpose (transient by definition)."""
        self._note_failure(pending, error, strikes=strikes)
        self._failed.append(pending)
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(PublishError(pending.subject, pending.event_id, error))
            pending.future.exception()

    def _note_failure(self, pending: _UnackedPublish, error: str, *, strikes: bool = True) -> None:
        pending.error = error
        if strikes and pending.acks_at_first_failure >= 0 and self._acks > pending.acks_at_first_failure:
            pending.strikes += 1  # the stream stored another publish since this one first failed
        if pending.acks_at_first_failure < 0:
            pending.acks_at_first_failure = self._acks
        pending.retry_at = time.perf_counter() + retry_delay(pending.tries)
        pending.tries += 1

    def _refused(self, token: str, error: str) -> None:
        pending = self._forget(token)
        if pending is not None:
            self._fail(pending, error, strikes=False)

    def _forget(self, token: str) -> _UnackedPublish | None:
        pending = self._unacked.pop(token, None)
        if not self._unacked:
            self._idle.set()
        if self._has_room():
            self._room.set()
        return pending

    async def _wait_for_room(self) -> None:
        """Wait until fewer than ``bus.max_inflight_publishes`` publishes await their ack; those
        unanswered for ``bus.publish_ack_timeout_s`` are published again meanwhile."""
        self._room.clear()
        try:
            await asyncio.wait_for(self._room.wait(), self.cfg.publish_ack_timeout_s)
        except TimeoutError:
            await self._expire(time.perf_counter() - self.cfg.publish_ack_timeout_s)

    async def publish_sync(self, event: Event) -> api.PubAck:
        """Publish and wait for the ack (retried with the same message id)."""
        return await self.republish(
            await self._unacked_publish(subject_of(self.run_id, event), encode(event), event.event_id)
        )

    async def _unacked_publish(self, subject: str, payload: bytes, msg_id: str) -> _UnackedPublish:
        """What goes on the wire: the payload, or a claim on it once it is in the object store."""
        headers = {MSG_ID: msg_id}
        if len(payload) > self.inline_limit:
            await self.payload_store()  # created on first use by a bus that manages the run's streams
            claim = await claims.put(self.js, self.payload_bucket, msg_id, payload)
            payload, headers[claims.CLAIM_HEADER] = claim.body(), "1"
        return _UnackedPublish(subject, payload, msg_id, time.perf_counter(), headers)

    @property
    def inline_limit(self) -> int:
        return min(self.cfg.inline_max_bytes, self.stream_cfg.max_msg_size - 4096)

    @property
    def payload_bucket(self) -> str:
        return payload_bucket(self.run_id, self.user)

    async def payload_store(self, bucket: str | None = None) -> Any:
        """An object store of the run for large events: this bus's own (where it writes), or the one a
        claim names (``bucket``); the admin creates them (same retention as the stream)."""
        name = bucket or self.payload_bucket
        if name not in self._stores:
            try:
                self._stores[name] = await self.js.object_store(name)
            except nats.js.errors.BucketNotFoundError:
                if not self.manages:
                    raise
                config = api.ObjectStoreConfig(
                    ttl=self.stream_cfg.max_age_s,
                    replicas=self.stream_cfg.replicas,
                    storage=api.StorageType.FILE if self.stream_cfg.storage == "file" else api.StorageType.MEMORY,
                )
                self._stores[name] = await placed(lambda: self.js.create_object_store(name, config))
        return self._stores[name]

    async def _expire(self, sent_before: float) -> None:
        """Give up waiting for the acks of publishes sent before ``sent_before`` and publish them again."""
        for token, pending in list(self._unacked.items()):
            if pending.t0 < sent_before:
                self._forget(token)
                self._note_failure(pending, f"not acknowledged within {self.cfg.publish_ack_timeout_s:g} s")
                pending.retry_at = 0.0  # it waited a whole ack timeout already: sent again at once
                self._failed.append(pending)
                if pending.future is not None:
                    pending.future.cancel()
        await self._retry_failed()

    async def _retry_failed(self) -> None:
        """Send again, under their ids, the failed publishes whose backoff is over, without waiting for
        their answers (each comes on its own: none waits on another); dead-letter those that failed
        ``bus.publish_retries`` + 1 times while the stream stored others (``_note_failure``)."""
        now = time.perf_counter()
        if not any(p.retry_at <= now for p in self._failed):
            return
        due = [p for p in self._failed if p.retry_at <= now]
        self._failed = [p for p in self._failed if p.retry_at > now]
        for i, pending in enumerate(due):
            try:
                if pending.strikes > self.cfg.publish_retries:
                    await self._dead_letter_unstorable(pending)
                    continue
                if pending.tries == 1:
                    self.stats.publish_retries += 1  # publishes sent again (each counted once)
                pending.t0 = time.perf_counter()
                await self._send(pending)
            except BaseException:
                self._failed[:0] = due[i:]
                raise
        if self._has_room():
            self._room.set()

    async def _dead_letter_unstorable(self, pending: _UnackedPublish) -> None:
        """``pending`` can never be stored: a ``DeadLettered`` event says so, with its bytes and why
        (sent as any publish: retried, and struck, in turn; a dead letter that cannot be stored either
        is reported and dropped, ``BusStats.unstored``)."""
        from coevo.schemas import DeadLettered, Source

        reason = (
            f"publish never stored: failed {pending.tries} times, {pending.strikes} of them while the "
            f"stream stored others (a subject no stream stores, or one this connection may not publish "
            f"to); last: {pending.error}"
        )
        log.error("bus.publish_dead_lettered", subject=pending.subject, event_id=pending.event_id, reason=reason)
        if pending.event_id.startswith(UNSTORED_PREFIX):
            self.stats.unstored += 1
            return
        role = self.user
        event = DeadLettered(
            event_id=f"{UNSTORED_PREFIX}{pending.event_id}"[:64],
            run_id=self.run_id,
            source=Source(agent_id=f"{role}-bus", role=role),
            original_subject=pending.subject,
            consumer="publish",
            reason=reason[:4000],
            raw=pending.payload,
            delivery_count=pending.tries,
            headers=dict(pending.headers),
        )
        self.stats.dead_lettered += 1
        await self._send(
            _UnackedPublish(
                subject_of(self.run_id, event),
                encode(event),
                event.event_id,
                time.perf_counter(),
                {MSG_ID: event.event_id},
            )
        )

    async def republish(self, p: _UnackedPublish) -> api.PubAck:
        """Publish ``p`` again under its id and wait for the ack (stored once whatever came before)."""
        last: BaseException | None = None
        for attempt in range(self.cfg.publish_retries + 1):
            try:
                faults.hit("publish")
                ack = await self.js.publish(
                    p.subject,
                    p.payload,
                    headers=p.headers or {MSG_ID: p.event_id},
                    timeout=self.cfg.publish_ack_timeout_s,
                )
            except (
                nats.errors.TimeoutError,
                nats.js.errors.NoStreamResponseError,
                nats.errors.ConnectionReconnectingError,
                nats.js.errors.APIError,
                InjectedFault,
            ) as exc:
                last = exc  # APIError: refused by the stream (full, message too large): try again, then fail
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            self.stats.published += 1
            self.stats.duplicates += int(ack.duplicate or False)
            return ack
        raise PublishError(p.subject, p.event_id, repr(last))

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every publish so far is acknowledged or dead-lettered (retrying failures after
        their backoff); ``PublishError`` (the first left, and why) when that did not happen within
        ``timeout_s`` (default: ``bus.publish_ack_timeout_s``)."""
        timeout_s = timeout_s or self.cfg.publish_ack_timeout_s
        end = time.perf_counter() + timeout_s
        ack_timeout = self.cfg.publish_ack_timeout_s
        while self._unacked or self._failed:
            now = time.perf_counter()
            if now >= end:
                left = [*self._failed, *self._unacked.values()][0]
                raise PublishError(
                    left.subject, left.event_id, left.error or f"not acknowledged within {timeout_s:g} s"
                )
            wake = end
            if self._failed:
                wake = min(wake, min(p.retry_at for p in self._failed))
            if self._unacked:
                wake = min(wake, min(p.t0 for p in self._unacked.values()) + ack_timeout)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), max(0.0, wake - now))
            else:
                await asyncio.sleep(max(0.0, wake - now))  # a retry's backoff: nothing else to wait for
            await self._expire(time.perf_counter() - ack_timeout)

    @property
    def inflight(self) -> int:
        return len(self._unacked)


def retry_delay(tries: int) -> float:
    """The backoff before a failed publish is sent again, after its ``tries``-th failure (0-based)."""
    return min(0.1 * 2.0**tries, 2.0)


def _ack_error(data: bytes) -> str | None:
    """The reason JetStream refused a publish, from its reply; None for a ``PubAck``."""
    if b'"error"' not in data:
        return None
    try:
        reply = json.loads(data)
    except ValueError:
        return f"unreadable publish reply: {data[:200]!r}"
    error = reply.get("error") if isinstance(reply, dict) else None
    if error is None:
        return None
    return str(error.get("description", error) if isinstance(error, dict) else error)
