"""The typed event bus on NATS JetStream.

Invariants:
- publishing: see ``coevo.runtime.publishing`` (stored once per event id, bounded in flight, flushed);
- a consumed message is acked only after its handler returned and everything it published was
  stored (``coevo.runtime.outbox``); a payload that is not a valid event is terminated *after* a
  ``DeadLettered`` event holding its bytes and the reason was stored;
- a connection joins a run only when the run's recorded event schema major is this code's (reading
  history: not older), checked before it changes anything (``coevo.schemas.versions``); the stream
  records the schema of the process that created it, kept across later updates of its limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from coevo.config import BusConfig, NatsConfig, StreamConfig
from coevo.errors import BusError, ClaimError, PayloadUnavailable, PublishError, SchemaMismatch
from coevo.runtime import claims, slots
from coevo.runtime.aio import drain
from coevo.runtime.credentials import ADMIN, KV_BUCKETS, inbox_prefix, payload_buckets, read_credential
from coevo.runtime.history import History
from coevo.runtime.kv import Bucket
from coevo.runtime.placement import placed
from coevo.runtime.publishing import MSG_ID, Publisher
from coevo.runtime.pull import Puller
from coevo.runtime.rpc import Rpc
from coevo.runtime.stats import BusStats
from coevo.schemas import (
    RUN_SCHEMA_KEY,
    SCHEMA_VERSION,
    Event,
    SchemaVersion,
    decode,
    events_prefix,
    join_refusal,
    kind_of,
    new_id,
    parse_subject,
    refusal,
    run_version,
    subject_filters,
)

log = structlog.get_logger("coevo.bus")


def stored_id(msg: Msg) -> str | None:
    """The event id a stored message was published under (its deduplication id), read without
    decoding the payload or following its claim."""
    return (msg.headers or {}).get(MSG_ID)


CLAIM_READS = 4
"""tries at a claimed object within one decode (0.1, 0.2, 0.4 s apart) before PayloadUnavailable"""
TRANSIENT = (
    BusError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.js.errors.ServiceUnavailableError,
)
"""what the bus raises while a node is down, a partition lasts or a leader is elected: try again later"""
_CANNOT_UPDATE = 10012
"""JetStream's error code for a consumer created again with a config it cannot take (its start)"""
UNANSWERED_S = 3.0
"""publishes unacknowledged this long, none acknowledged meanwhile: the server does not answer"""


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
        return await asyncio.wait_for(
            nats.connect(error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, **opts), first
        )
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


class NatsBus(Publisher, History, Rpc):
    """A run's view of JetStream: one stream ``COEVO_<run>`` with subjects ``coevo.<run>.ev.>``.

    By concern: publishing with acknowledgements (``coevo.runtime.publishing``), reading history
    (``coevo.runtime.history``), request-reply (``coevo.runtime.rpc``), typed KV (``coevo.runtime.kv``);
    here: the connection and stream, decoding (claims), consumers and dead letters."""

    def __init__(self, nc: NATS, run_id: str, bus: BusConfig, stream: StreamConfig | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=bus.publish_ack_timeout_s)
        self.run_id = run_id
        self.cfg = bus
        self.stream_cfg = stream or StreamConfig()
        self.stream = stream_name(run_id)
        self.stats = BusStats()
        self._init_publisher()
        self._closed = False
        self.manages = True
        """whether this connection may create and change the run's stream and buckets (not a role's)"""
        self.user = ADMIN
        """whose large events this bus stores (its object store): a role's, or the run's admin"""
        self.reading = False
        """a reader of the run's history (tools): may connect to a run of an older schema major"""
        self.run_schema = SCHEMA_VERSION
        """the event schema the run's stream records (``coevo.schemas.versions``)"""
        self.unknown_fields: Counter[str] = Counter()
        """``<kind>.<field>`` -> events of a newer schema minor read with that field ignored (each logged once)"""

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
        reading: bool = False,
    ) -> NatsBus:
        """``reading``: to read the run's history only (a tool), not to join it (``SchemaMismatch``)."""
        nats_cfg = nats_cfg or NatsConfig()
        nc = await connect_nats(nats_cfg, url, name=name)
        self = cls(nc, run_id, bus or BusConfig(), stream)
        self.reading = reading
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
            metadata={RUN_SCHEMA_KEY: str(SCHEMA_VERSION)},
        )
        try:
            info = await self.js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            if not self.manages:
                raise BusError(
                    f"run {self.run_id} has no stream yet, and a role may not create one: start the run "
                    f"first (coevo run, or coevo server --run-id {self.run_id})"
                ) from None
            return await placed(lambda: self.js.add_stream(config))
        self.run_schema = self._admit_schema(info.config.metadata)
        # the version recorded at creation stays (none on a stream older than versions)
        recorded = (info.config.metadata or {}).get(RUN_SCHEMA_KEY)
        config.metadata = {RUN_SCHEMA_KEY: recorded} if recorded is not None else None
        if (
            info.config.subjects != config.subjects
            or info.config.max_age != config.max_age
            or info.config.max_bytes != config.max_bytes
            or info.config.duplicate_window != config.duplicate_window
            or info.config.max_msg_size != config.max_msg_size
        ):
            if not self.manages:  # the admin's limits hold, the message size included (claims start below it)
                log.warning(
                    "bus.stream_config_differs",
                    stream=self.stream,
                    detail="the run's admin set other stream limits; a role keeps them",
                )
                self.stream_cfg = self.stream_cfg.model_copy(update={"max_msg_size": info.config.max_msg_size})
                return info
            return await self.js.update_stream(config)
        return info

    def _admit_schema(self, metadata: dict[str, str] | None) -> SchemaVersion:
        """The run's recorded schema, or ``SchemaMismatch`` when this process may not connect to it."""
        try:
            run = run_version(metadata)
        except ValueError as exc:
            raise SchemaMismatch(
                f"run {self.run_id}'s stream records no valid event schema: {exc}", "?", str(SCHEMA_VERSION)
            ) from None
        if (why := join_refusal(self.run_id, run, SCHEMA_VERSION, reading=self.reading)) is not None:
            raise SchemaMismatch(why, str(run), str(SCHEMA_VERSION))
        return run

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
        except (TimeoutError, PublishError):
            left = [p.event_id for p in [*self._unacked.values(), *self._failed]]
            self.stats.unstored = len(left)
            log.warning("bus.closed_unflushed", unacked=len(self._unacked), failed=len(self._failed), ids=left[:100])
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

    async def decode_msg(self, msg: Msg, ignored: list[tuple[str, str]] | None = None) -> Event:
        """The event a stored message holds, following a claim to the object store it names; the
        fields of a newer schema minor it ignored are counted (``unknown_fields``, each logged once)
        and appended to ``ignored``.

        ``ValueError`` subclasses for anything that is not a valid event of the message's subject (an
        event whose kind is not its subject's is not valid: a role may publish only its own
        subjects); ``PayloadUnavailable`` when a claimed object cannot be read now, after a few tries
        (a leader change, a timeout): the message is intact, try again later."""
        dropped: list[tuple[str, str]] = []
        if claims.is_claim(msg.headers):
            claim = claims.Claim.parse(msg.data)
            if claim.bucket not in payload_buckets(self.run_id):
                raise ClaimError(f"claim on {claim.bucket}, not an object store of run {self.run_id}")
            for attempt in range(CLAIM_READS):
                try:
                    event = decode(await claims.fetch(self.js, claim), dropped)
                    break
                except PayloadUnavailable:
                    if attempt == CLAIM_READS - 1:
                        raise
                    await asyncio.sleep(0.1 * 2**attempt)
        else:
            event = decode(msg.data, dropped)
        if dropped:
            self._count_unknown(event, dropped)
            if ignored is not None:
                ignored.extend(dropped)
        parsed = parse_subject(msg.subject or "")
        if parsed is not None:
            kind, scope = parsed
            if kind != kind_of(event):
                raise ValueError(f"a {kind_of(event)} event on the subject of {kind}")
            if (why := refusal(scope, event)) is not None:  # a role is its subjects (coevo.schemas.registry)
                raise ValueError(why)
        return event

    def _count_unknown(self, event: Event, dropped: list[tuple[str, str]]) -> None:
        for kind, field in dropped:
            key = f"{kind}.{field}"
            if not self.unknown_fields[key]:
                log.warning(
                    "bus.unknown_field",
                    kind=kind,
                    field=field,
                    writer_schema=event.schema_version,
                    reader_schema=str(SCHEMA_VERSION),
                    detail="an event of a newer schema minor: the field is ignored (upgrade this process to read it)",
                )
            self.unknown_fields[key] += 1

    # ---- consume -----------------------------------------------------------------------------

    def consumer_config(
        self, durable: str, kinds: Iterable[str], *, deliver: str = "all", ephemeral: bool = False
    ) -> api.ConsumerConfig:
        subjects = sorted(s for k in kinds for s in subject_filters(self.run_id, k))
        return api.ConsumerConfig(
            durable_name=None if ephemeral else durable,
            name=durable,
            inactive_threshold=self.cfg.unshared_inactive_s if ephemeral else None,
            ack_policy=api.AckPolicy.EXPLICIT,
            # last: the newest of each subject read (each lane's, coevo.schemas.registry)
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT if deliver == "last" else api.DeliverPolicy.ALL,
            ack_wait=self.cfg.ack_wait_s,
            # one more than ours: our last attempt dead-letters before the server gives up
            max_deliver=self.cfg.max_deliver + 1,
            max_ack_pending=self.cfg.max_ack_pending,
            filter_subjects=subjects if len(subjects) > 1 else None,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
        )

    async def pull_subscription(
        self, durable: str, kinds: Iterable[str], *, deliver: str = "all", ephemeral: bool = False
    ) -> Any:
        """Create or update the durable consumer, then bind nats-py's pull subscription to it (tools
        and tests; agents consume through ``puller``)."""
        await self._ensure_consumer(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        return await self.js.pull_subscribe_bind(durable=durable, stream=self.stream)

    async def puller(
        self, durable: str, kinds: Iterable[str], *, deliver: str = "all", ephemeral: bool = False
    ) -> Puller:
        """Create or update the durable consumer, then a ``Puller`` that fetches its batches."""
        name = await self.open_consumer(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        return await Puller(self.nc, self.stream, name).start()

    async def open_consumer(
        self,
        durable: str,
        kinds: Iterable[str],
        *,
        deliver: str = "all",
        ephemeral: bool = False,
        owner: str | None = None,
        held: str | None = None,
    ) -> str:
        """Create or update the consumer; its name. A role's ephemeral one (an agent instance's own)
        takes one of the role's numbered names for ``owner`` (``coevo.runtime.slots``): ``held``
        again if it is still free or its own (a supervised restart), else the first free one."""
        if ephemeral and self.user != ADMIN:
            config = self.consumer_config(durable, kinds, deliver=deliver, ephemeral=ephemeral)
            return await slots.open_own(self, config, owner or new_id(), held)
        await self._ensure_consumer(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        return durable

    async def _ensure_consumer(self, durable: str, kinds: Iterable[str], *, deliver: str, ephemeral: bool) -> None:
        config = self.consumer_config(durable, kinds, deliver=deliver, ephemeral=ephemeral)
        try:
            await self.js.add_consumer(self.stream, config)
        except nats.js.errors.BadRequestError as exc:
            raise BusError(f"consumer {durable} exists with an incompatible config: {exc}") from exc
        except nats.js.errors.APIError as exc:
            # 10012: it exists from another start (a replica recreated it where its ledger resumed,
            # coevo.runtime.revival): the same filter is the same consumer
            if exc.err_code != _CANNOT_UPDATE:
                raise
            info = await self.js.consumer_info(self.stream, durable)
            have = info.config.filter_subjects or [info.config.filter_subject or ""]
            if sorted(have) != sorted(config.filter_subjects or [config.filter_subject or ""]):
                raise BusError(f"consumer {durable} exists with an incompatible config: {exc}") from exc

    async def dead_letter(self, msg: Msg, consumer: str, reason: str, source: Any) -> None:
        delivered = msg.metadata.num_delivered if msg.reply else 0
        await self._store_dead_letter(source, msg.subject, msg.data, msg.headers, consumer, reason, delivered)

    async def _store_dead_letter(
        self,
        source: Any,
        subject: str,
        data: bytes | None,
        headers: Any,
        consumer: str,
        reason: str,
        delivered: int,
        event_id: str | None = None,
    ) -> None:
        """A ``DeadLettered`` event holding the message's bytes and the reason, stored before returning."""
        from coevo.schemas import DeadLettered

        event = DeadLettered(
            event_id=event_id or new_id(),
            run_id=self.run_id,
            source=source,
            original_subject=subject,
            consumer=consumer,
            reason=reason[:4000],
            raw=bytes(data or b""),
            delivery_count=delivered,
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
                source,
                stored.subject or "",
                stored.data,
                stored.headers,
                consumer,
                f"delivered {n} times without an outcome: its consumer died or stopped while handling it",
                n,
                event_id=f"lost-{consumer}-{seq}",
            )

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
            return Bucket(await self.js.key_value(bucket), bucket, self.js)
        except nats.js.errors.BucketNotFoundError:
            return Bucket(
                await placed(
                    lambda: self.js.create_key_value(
                        bucket=bucket, storage=api.StorageType.FILE, history=1, replicas=self.stream_cfg.replicas
                    )
                ),
                bucket,
                self.js,
            )
