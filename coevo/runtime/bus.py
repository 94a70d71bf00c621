"""The typed event bus on NATS JetStream.

Invariants:
- every event is published on ``subject_for(run, kind)`` with ``Nats-Msg-Id = event_id``, so a
  retried or repeated publish of the same event is stored once (within the duplicate window);
- at most ``bus.max_inflight_publishes`` publishes await their acknowledgement; one unanswered for
  ``bus.publish_ack_timeout_s`` is sent again (same id) by the next publish, and ``flush()``
  returns only when every publish was acknowledged (failed ones are retried with the same id, a
  failure leaving the rest queued);
- a consumed message is acked only after its handler returned and everything it published was
  stored (``coevo.runtime.outbox``); a payload that is not a valid event is terminated *after* a
  ``DeadLettered`` event holding its bytes and the reason was stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from coevo.config import BusConfig, NatsConfig, StreamConfig
from coevo.errors import BusError, ClaimError, NoResponders, PayloadUnavailable, PublishError
from coevo.runtime import claims, outbox
from coevo.runtime.aio import drain
from coevo.runtime.credentials import (
    ADMIN,
    KV_BUCKETS,
    inbox_prefix,
    payload_bucket,
    payload_buckets,
    read_credential,
)
from coevo.runtime.kv import Bucket
from coevo.runtime.pull import Puller, delivered_seq, read_all
from coevo.schemas import (
    ControlReply,
    ControlRequest,
    Event,
    Frozen,
    control_subject,
    decode,
    encode,
    events_prefix,
    kind_from_subject,
    kind_of,
    new_id,
    subject_for,
)

log = structlog.get_logger("coevo.bus")

MSG_ID = "Nats-Msg-Id"


def stored_id(msg: Msg) -> str | None:
    """The event id a stored message was published under (its deduplication id), read without
    decoding the payload or following its claim."""
    return (msg.headers or {}).get(MSG_ID)
CLAIM_READS = 4
"""tries at a claimed object within one decode (0.1, 0.2, 0.4 s apart) before PayloadUnavailable"""
TRANSIENT = (BusError, nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
             nats.js.errors.ServiceUnavailableError)
"""what the bus raises while a node is down, a partition lasts or a leader is elected: try again later"""
UNANSWERED_S = 3.0
"""publishes unacknowledged this long, none acknowledged meanwhile: the server does not answer"""
M = TypeVar("M", bound=Frozen)


def stream_name(run_id: str) -> str:
    return f"COEVO_{run_id}"


async def connect_nats(cfg: NatsConfig, url: str, name: str = "coevo") -> NATS:
    """Connect with credentials and TLS from config; secrets are read from the environment."""
    opts: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",") if u.strip()],  # a cluster: every node's URL
        "name": name,
        "connect_timeout": cfg.connect_timeout_s,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
    }
    if cfg.user:
        opts["user"] = cfg.user
    if cfg.password_env:
        opts["password"] = _secret(cfg.password_env)
    if cfg.token_env:
        opts["token"] = _secret(cfg.token_env)
    if cfg.creds_file:
        opts["user_credentials"] = str(cfg.creds_file)
    if cfg.credentials_file:
        cred = read_credential(cfg.credentials_file)
        opts.update(user=cred.user, password=cred.password, inbox_prefix=inbox_prefix(cred.user))
    if cfg.tls_ca or cfg.tls_cert:
        ctx = ssl.create_default_context(cafile=str(cfg.tls_ca) if cfg.tls_ca else None)
        if cfg.tls_cert:
            ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key) if cfg.tls_key else None)
        opts["tls"] = ctx

    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)
        del errors[:-1]
        log.warning("nats.error", error=repr(exc))

    async def on_disconnect() -> None:
        log.debug("nats.disconnected", url=url)

    async def on_reconnect() -> None:
        log.info("nats.reconnected", url=url)

    # the first connection is bounded: nats-py would otherwise retry a refused one (wrong token) for ever
    first = max(30.0, 6 * cfg.connect_timeout_s)
    try:
        return await asyncio.wait_for(nats.connect(
            error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, **opts
        ), first)
    except TimeoutError:
        last = f" (last error: {errors[-1]!r})" if errors else ""
        raise BusError(f"cannot connect to NATS at {url} within {first:.0f} s{last}") from None
    except Exception as exc:
        raise BusError(f"cannot connect to NATS at {url}: {exc!r}") from exc


def _secret(env: str) -> str:
    value = os.environ.get(env)
    if not value:
        raise BusError(f"environment variable {env} (named by the config) is not set")
    return value


@dataclass(slots=True)
class _UnackedPublish:
    subject: str
    payload: bytes
    event_id: str
    t0: float
    headers: dict[str, str] = field(default_factory=dict)
    future: asyncio.Future[bool] | None = None
    """Resolves True once JetStream stored the message (``duplicate`` or not); fails when the stream
    refused it or nobody answered. Set by ``publish_raw``, resolved by the ack subscription."""


@dataclass
class BusStats:
    published: int = 0
    duplicates: int = 0
    publish_retries: int = 0
    dead_lettered: int = 0
    forged_requests: int = 0
    """messages on a served subject that were not requests (``is_request``): dropped"""
    latencies_ms: list[float] = field(default_factory=list)
    track_latency: bool = False


class NatsBus:
    """A run's view of JetStream: one stream ``COEVO_<run>`` with subjects ``coevo.<run>.ev.>``."""

    def __init__(
        self, nc: NATS, run_id: str, bus: BusConfig, stream: StreamConfig | None = None
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=bus.publish_ack_timeout_s)
        self.run_id = run_id
        self.cfg = bus
        self.stream_cfg = stream or StreamConfig()
        self.stream = stream_name(run_id)
        self.stats = BusStats()
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
        self._closed = False
        self.manages = True
        """whether this connection may create and change the run's stream and buckets (not a role's)"""
        self.user = ADMIN
        """whose large events this bus stores (its object store): a role's, or the run's admin"""
        self._stores: dict[str, Any] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str,
        run_id: str,
        *,
        nats_cfg: NatsConfig | None = None,
        bus: BusConfig | None = None,
        stream: StreamConfig | None = None,
        name: str = "coevo",
    ) -> NatsBus:
        nats_cfg = nats_cfg or NatsConfig()
        nc = await connect_nats(nats_cfg, url, name=name)
        self = cls(nc, run_id, bus or BusConfig(), stream)
        if nats_cfg.credentials_file is not None:  # a role's connection may not create or change the stream
            self.user = nc.options["user"]  # as connect_nats read it from the file
            self.manages = self.user == ADMIN
        try:
            await self.ensure_stream()
        except BaseException:
            await nc.close()
            raise
        return self

    async def ensure_stream(self) -> api.StreamInfo:
        """Create the run's stream, or update it to the configured limits."""
        s = self.stream_cfg
        config = api.StreamConfig(
            name=self.stream,
            subjects=[f"{events_prefix(self.run_id)}.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE if s.storage == "file" else api.StorageType.MEMORY,
            max_age=s.max_age_s,
            max_bytes=s.max_bytes,
            max_msg_size=s.max_msg_size,
            duplicate_window=s.duplicate_window_s,
            num_replicas=s.replicas,
        )
        try:
            info = await self.js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            if not self.manages:
                raise BusError(f"run {self.run_id} has no stream yet, and a role may not create one: start the run "
                               f"first (coevo run, or coevo server --run-id {self.run_id})") from None
            return await self.js.add_stream(config)
        if info.config.subjects != config.subjects or info.config.max_age != config.max_age or \
                info.config.max_bytes != config.max_bytes or info.config.duplicate_window != \
                config.duplicate_window or info.config.max_msg_size != config.max_msg_size:
            if not self.manages:  # the admin's limits hold, the message size included (claims start below it)
                log.warning("bus.stream_config_differs", stream=self.stream,
                            detail="the run's admin set other stream limits; a role keeps them")
                self.stream_cfg = self.stream_cfg.model_copy(update={"max_msg_size": info.config.max_msg_size})
                return info
            return await self.js.update_stream(config)
        return info

    def connected(self) -> bool:
        """Connected to a server that answers: a connection to a node cut off from its cluster (a
        partition) stays up while nothing it is sent is acknowledged; once publishes have waited
        ``UNANSWERED_S`` with no acknowledgement, it counts as gone (stops then drain as when
        disconnected)."""
        if not self.nc.is_connected:
            return False
        since = self._unanswered_since
        return since is None or time.perf_counter() - since < UNANSWERED_S

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush pending publishes, then drain the connection, within ``timeout_s`` in all (a second
        when the server is gone or does not answer, and a second more to close the socket: what is
        not acknowledged then was guarded by its input, which is redelivered, or is a status).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self.flush_while_connected(timeout_s), timeout_s)
        except TimeoutError:
            log.warning("bus.closed_unflushed", unacked=len(self._unacked), failed=len(self._failed))
        finally:
            drained = False
            if self.nc.is_connected and self.connected():  # drained only into a server that answers
                try:
                    await asyncio.wait_for(self.nc.drain(), min(timeout_s, 5.0))
                    drained = True
                except (TimeoutError, nats.errors.ConnectionClosedError):
                    pass
            if not drained and not self.nc.is_closed:
                # bounded: across a cut the socket is silently dead, and nats-py's close waits for
                # its writes to go out (12 to 18 s in chaos); what they held is redelivered
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.nc.close(), 1.0)

    async def flush_while_connected(self, timeout_s: float | None = None, grace_s: float = 1.0) -> None:
        """``flush``, given up (``TimeoutError``) once the connection has been down for ``grace_s``."""
        flush = asyncio.ensure_future(self.flush(timeout_s))
        try:
            if await drain([flush], float("inf"), self.connected, grace_s):
                raise TimeoutError("the connection is down: publishes left unacknowledged")
            await flush
        finally:
            flush.cancel()

    async def __aenter__(self) -> NatsBus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- publish -----------------------------------------------------------------------------

    async def publish(self, event: Event) -> asyncio.Future[bool]:
        """Publish without waiting for the ack (bounded in-flight). Returns the ack future."""
        if event.run_id != self.run_id:
            raise BusError(f"event {event.event_id} belongs to run {event.run_id}, not {self.run_id}")
        return await self.publish_raw(subject_for(self.run_id, kind_of(event)), encode(event),
                                      event.event_id)

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
        while len(self._unacked) >= self.cfg.max_inflight_publishes:
            await self._wait_for_room()
        if len(payload) > self.inline_limit:
            pending = await self._unacked_publish(subject, payload, msg_id)
        else:
            pending = _UnackedPublish(subject, payload, msg_id, time.perf_counter(), {MSG_ID: msg_id})
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
            await self.nc.publish(subject, pending.payload, reply=self._acks_prefix + token, headers=pending.headers)
        except BaseException:
            self._forget(token)
            fut.cancel()
            raise
        box = outbox.current()
        if box is not None:
            box.staged.append((fut, pending))
        return fut

    async def _start_acks(self) -> None:
        """Subscribe to this bus's ack subjects (``<inbox>.<token>``), once."""
        async with self._acks_lock:
            if not self._acks_prefix:
                prefix = f"{self.nc.new_inbox()}."
                await self.nc.subscribe(f"{prefix}*", cb=self._on_ack)
                self._acks_start, self._acks_prefix = len(prefix), prefix

    async def _on_ack(self, msg: Msg) -> None:
        """JetStream's answer to one publish: a ``PubAck``, an error, or a no-responders status."""
        pending = self._forget(msg.subject[self._acks_start:])
        if pending is None or pending.future is None:
            return  # answered after it expired: it was published again under its id (stored once)
        data = msg.data
        error = "no stream answered (status reply)" if not data else _ack_error(data)
        if error is not None:
            self._failed.append(pending)
            pending.future.set_exception(PublishError(pending.subject, pending.event_id, error))
            pending.future.exception()  # retrieved: nobody need await a publish that is retried anyway
            return
        # an acknowledgement: the server answers (a refusal does not count: it is retried)
        self._unanswered_since = None if not self._unacked and not self._failed else time.perf_counter()
        self.stats.published += 1
        if b'"duplicate"' in data and json.loads(data).get("duplicate"):
            self.stats.duplicates += 1
        if self.stats.track_latency:
            self.stats.latencies_ms.append((time.perf_counter() - pending.t0) * 1e3)
        pending.future.set_result(True)

    def _forget(self, token: str) -> _UnackedPublish | None:
        pending = self._unacked.pop(token, None)
        if not self._unacked:
            self._idle.set()
        if len(self._unacked) < self.cfg.max_inflight_publishes:
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
            await self._unacked_publish(subject_for(self.run_id, kind_of(event)), encode(event), event.event_id))

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
                self._stores[name] = await self.js.create_object_store(name, api.ObjectStoreConfig(
                    ttl=self.stream_cfg.max_age_s, replicas=self.stream_cfg.replicas,
                    storage=api.StorageType.FILE if self.stream_cfg.storage == "file" else api.StorageType.MEMORY))
        return self._stores[name]

    async def decode_msg(self, msg: Msg) -> Event:
        """The event a stored message holds, following a claim to the object store it names.

        ``ValueError`` subclasses for anything that is not a valid event of the message's subject (an
        event whose kind is not its subject's is not valid: a role may publish only its own
        subjects); ``PayloadUnavailable`` when a claimed object cannot be read now, after a few tries
        (a leader change, a timeout): the message is intact, try again later."""
        if claims.is_claim(msg.headers):
            claim = claims.Claim.parse(msg.data)
            if claim.bucket not in payload_buckets(self.run_id):
                raise ClaimError(f"claim on {claim.bucket}, not an object store of run {self.run_id}")
            for attempt in range(CLAIM_READS):
                try:
                    event = decode(await claims.fetch(self.js, claim))
                    break
                except PayloadUnavailable:
                    if attempt == CLAIM_READS - 1:
                        raise
                    await asyncio.sleep(0.1 * 2**attempt)
        else:
            event = decode(msg.data)
        kind = kind_from_subject(msg.subject or "")
        if kind is not None and kind != kind_of(event):
            raise ValueError(f"a {kind_of(event)} event on the subject of {kind}")
        return event

    async def _expire(self, sent_before: float) -> None:
        """Give up waiting for the acks of publishes sent before ``sent_before`` and publish them again."""
        for token, pending in list(self._unacked.items()):
            if pending.t0 < sent_before:
                self._forget(token)
                self._failed.append(pending)
                if pending.future is not None:
                    pending.future.cancel()
        await self._retry_failed()

    async def _retry_failed(self) -> None:
        """Publish the failed ones again, in order; when one cannot be stored (``PublishError``, to the
        caller) those after it stay queued for the next try, never dropped."""
        failed, self._failed = self._failed, []
        for i, pending in enumerate(failed):
            self.stats.publish_retries += 1
            try:
                await self.republish(pending)
            except BaseException:
                self._failed[:0] = failed[i + 1:]
                raise

    async def republish(self, p: _UnackedPublish) -> api.PubAck:
        """Publish ``p`` again under its id and wait for the ack (stored once whatever came before)."""
        last: BaseException | None = None
        for attempt in range(self.cfg.publish_retries + 1):
            try:
                ack = await self.js.publish(p.subject, p.payload, headers=p.headers or {MSG_ID: p.event_id},
                                            timeout=self.cfg.publish_ack_timeout_s)
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError,
                    nats.errors.ConnectionReconnectingError, nats.js.errors.APIError) as exc:
                last = exc  # APIError: refused by the stream (full, message too large): try again, then fail
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            self.stats.published += 1
            self.stats.duplicates += int(ack.duplicate or False)
            return ack
        raise PublishError(p.subject, p.event_id, repr(last))

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every publish so far is acknowledged (retrying failures)."""
        timeout_s = timeout_s or self.cfg.publish_ack_timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            await self._expire(float("inf"))
        await self._retry_failed()

    @property
    def inflight(self) -> int:
        return len(self._unacked)

    # ---- consume -----------------------------------------------------------------------------

    def consumer_config(self, durable: str, kinds: Iterable[str], *, deliver: str = "all",
                        ephemeral: bool = False) -> api.ConsumerConfig:
        subjects = sorted(subject_for(self.run_id, k) for k in kinds)
        return api.ConsumerConfig(
            durable_name=None if ephemeral else durable,
            name=durable,
            inactive_threshold=60.0 if ephemeral else None,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.LAST if deliver == "last" else api.DeliverPolicy.ALL,
            ack_wait=self.cfg.ack_wait_s,
            # one more than ours: our last attempt dead-letters before the server gives up
            max_deliver=self.cfg.max_deliver + 1,
            max_ack_pending=self.cfg.max_ack_pending,
            filter_subjects=subjects if len(subjects) > 1 else None,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
        )

    async def pull_subscription(self, durable: str, kinds: Iterable[str], *, deliver: str = "all",
                                ephemeral: bool = False) -> Any:
        """Create or update the durable consumer, then bind nats-py's pull subscription to it (tools
        and tests; agents consume through ``puller``)."""
        await self._ensure_consumer(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        return await self.js.pull_subscribe_bind(durable=durable, stream=self.stream)

    async def puller(self, durable: str, kinds: Iterable[str], *, deliver: str = "all",
                     ephemeral: bool = False) -> Puller:
        """Create or update the durable consumer, then a ``Puller`` that fetches its batches."""
        await self._ensure_consumer(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        return await Puller(self.nc, self.stream, durable).start()

    async def _ensure_consumer(self, durable: str, kinds: Iterable[str], *, deliver: str, ephemeral: bool) -> None:
        config = self.consumer_config(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        try:
            await self.js.add_consumer(self.stream, config)
        except nats.js.errors.BadRequestError as exc:
            raise BusError(f"consumer {durable} exists with an incompatible config: {exc}") from exc

    async def dead_letter(self, msg: Msg, consumer: str, reason: str, source: Any) -> None:
        delivered = msg.metadata.num_delivered if msg.reply else 0
        await self._store_dead_letter(source, msg.subject, msg.data, msg.headers, consumer, reason, delivered)

    async def _store_dead_letter(self, source: Any, subject: str, data: bytes | None, headers: Any, consumer: str,
                                 reason: str, delivered: int, event_id: str | None = None) -> None:
        """A ``DeadLettered`` event holding the message's bytes and the reason, stored before returning."""
        from coevo.schemas import DeadLettered

        event = DeadLettered(
            event_id=event_id or new_id(), run_id=self.run_id, source=source, original_subject=subject, consumer=consumer,
            reason=reason[:4000], raw=bytes(data or b""), delivery_count=delivered,
            headers={k: str(v) for k, v in (headers or {}).items()},
        )
        await self.publish_sync(event)
        self.stats.dead_lettered += 1
        log.warning("bus.dead_lettered", subject=subject, consumer=consumer, reason=reason[:200])

    async def watch_lost_deliveries(self, source: Any) -> Any:
        """Dead-letter what the server stopped redelivering without an outcome.

        A consumer dead-letters a message itself on its last crash (``bus.max_deliver``); the server
        allows one delivery more, so a message is lost silently only when that last delivery ended
        with no ack, nak or term at all: its consumer process died (or was stopped) while holding
        it, every time. JetStream then publishes a max-deliveries advisory (when it finds the message
        out of deliveries, at the consumer's next pull: a restarted replica's); every agent of the run
        listens in one queue group, so one of those alive stores the message as ``DeadLettered``
        (its id derives from consumer and sequence: stored once whoever sends it).
        """

        async def on_advisory(msg: Msg) -> None:
            try:
                advisory = json.loads(msg.data)
                seq, consumer, n = int(advisory["stream_seq"]), str(advisory["consumer"]), int(advisory["deliveries"])
                stored = await self.js.get_msg(self.stream, seq)
            except Exception as exc:  # a malformed advisory, or the message is gone (retention)
                log.warning("bus.lost_delivery_unrecoverable", error=repr(exc)[:300])
                return
            await self._store_dead_letter(
                source, stored.subject or "", stored.data, stored.headers, consumer,
                f"delivered {n} times without an outcome: its consumer died or stopped while handling it", n,
                event_id=f"lost-{consumer}-{seq}")

        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream}.*"
        return await self.nc.subscribe(subject, queue=f"coevo-lost-{self.run_id}", cb=on_advisory)

    # ---- key-value state ---------------------------------------------------------------------

    async def provision(self) -> None:
        """Create the run's buckets and object stores where missing (the admin does, before any role's
        agent needs them: roles may not create them, ``coevo.runtime.credentials``)."""
        for name in KV_BUCKETS:
            await self.kv(name)
        for bucket in payload_buckets(self.run_id):
            await self.payload_store(bucket)

    async def kv(self, name: str) -> Bucket:
        """The run's KV bucket ``name`` (one of ``KV_BUCKETS``, file-backed), created on first use."""
        if name not in KV_BUCKETS:
            raise ValueError(f"unknown bucket {name!r}: add it to coevo.runtime.credentials.KV_BUCKETS")
        bucket = f"coevo_{self.run_id}_{name}"
        try:
            return Bucket(await self.js.key_value(bucket), bucket)
        except nats.js.errors.BucketNotFoundError:
            return Bucket(await self.js.create_key_value(bucket=bucket, storage=api.StorageType.FILE, history=1,
                                                         replicas=self.stream_cfg.replicas), bucket)

    # ---- reading history ---------------------------------------------------------------------

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

    # ---- request-reply on core NATS (control, weight transfers) --------------------------------

    async def serve(self, subject: str, request_type: type[M], handler: Callable[[M], Awaitable[Frozen]]) -> Any:
        """Answer requests on ``subject``, each in its own task (a slow answer holds up no other); a
        malformed request or a failing handler is answered with ``{"error": reason}`` (the requester
        raises it), never left to time out. Only requests (``is_request``) are answered."""
        tasks: set[asyncio.Task[None]] = set()

        async def on_request(msg: Msg) -> None:
            if not is_request(msg, subject):
                self.stats.forged_requests += 1
                log.warning("bus.not_a_request", subject=subject, delivered_as=msg.subject, reply=msg.reply[:80])
                return
            task = asyncio.create_task(answer(msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def answer(msg: Msg) -> None:
            try:
                request = request_type.model_validate_json(msg.data)
            except ValueError as exc:
                await msg.respond(_error_reply(f"malformed {request_type.__name__}: {exc}"))
                return
            try:
                reply = await handler(request)
            except Exception as exc:
                log.warning("bus.request_failed", subject=subject, error=repr(exc)[:500])
                await msg.respond(_error_reply(str(exc) or repr(exc)))
                return
            await msg.respond(reply.model_dump_json().encode())

        return await self.nc.subscribe(subject, cb=on_request)

    async def request(self, subject: str, request: Frozen, reply_type: type[M], timeout_s: float = 5.0) -> M:
        """The typed reply; ``BusError`` for an error reply or a timeout, ``NoResponders`` for nobody."""
        try:
            msg = await self.nc.request(subject, request.model_dump_json().encode(), timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"nobody serves {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise BusError(f"no reply on {subject} within {timeout_s}s") from exc
        if msg.data.startswith(b'{"error"'):
            raise BusError(f"{subject}: {json.loads(msg.data)['error']}")
        return reply_type.model_validate_json(msg.data)

    async def serve_control(
        self, agent_id: str, handler: Callable[[ControlRequest], Awaitable[ControlReply]]
    ) -> Any:
        return await self.serve(control_subject(self.run_id, agent_id), ControlRequest, handler)

    async def control(self, agent_id: str, command: str, timeout_s: float = 5.0) -> ControlReply:
        request = ControlRequest(command=command)  # type: ignore[arg-type]
        try:
            return await self.request(control_subject(self.run_id, agent_id), request, ControlReply, timeout_s)
        except NoResponders as exc:
            raise NoResponders(f"no agent {agent_id} in run {self.run_id}") from exc


def is_request(msg: Msg, subject: str) -> bool:
    """Whether ``msg`` is a request a client sent to ``subject``: on that very subject, with a reply
    inbox. A JetStream push consumer can deliver stored messages to any subject, the role's
    permissions notwithstanding (the server delivers them); those keep their stored subject and
    reply with ``$JS.ACK...``, and are not requests (a forged ``stop`` would be one)."""
    return msg.subject == subject and bool(msg.reply) and not msg.reply.startswith("$JS.")


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


def _error_reply(reason: str) -> bytes:
    return json.dumps({"error": reason[:2000]}).encode()
