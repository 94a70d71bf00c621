"""A run's key-value bucket, typed: bytes by key, with nats-py's answers-as-exceptions turned into
answers (a missing key is None, an empty bucket lists no keys) so that no agent catches nats-py
errors itself.

Invariant: an empty listing means an empty bucket. The listing is coevo's own, not nats-py's
``keys()``: that one watches the bucket with a push consumer and can call the replay done before
messages already in flight to it were counted (nats-io/nats.py#842), answering ``NoKeysError`` for a
bucket that holds keys. Here a pull consumer is created first, its pending count (the stream
leader's, taken before anything is delivered) says how many subjects to read, and they are fetched
until that count is read or the last one read says nothing is left (a fetch that times out asks the
consumer again: entries may have expired since). The consumer is deleted however the listing ends.
A bucket that lists no live key but holds entries (every key deleted, whose markers stay) is a
``BusError``, never an empty answer (a caller seeding an empty bucket would write over what it
holds). Every other failure (a closed connection, a bucket deleted under the handle) propagates as
nats-py raised it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from coevo.errors import BusError

_REMOVED = frozenset({KV_DEL, KV_PURGE})
_MARKER_REASON = "Nats-Marker-Reason"  # nats-server 2.11+: markers the server places itself
_FETCH = 256
_FETCH_TIMEOUT_S = 5.0  # one fetch of messages the server holds; longer means the server is gone


class Bucket:
    """One KV bucket of the run (``NatsBus.kv``)."""

    __slots__ = ("_js", "_kv", "name")

    def __init__(self, kv: Any, name: str, js: Any) -> None:
        self._kv, self.name, self._js = kv, name, js

    async def get(self, key: str) -> bytes | None:
        """The value under ``key``; None when there is none (never written, or deleted)."""
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return bytes(entry.value) if entry.value is not None else None

    async def put(self, key: str, value: bytes) -> int:
        """Store ``value`` under ``key``; the bucket's revision of it."""
        revision: int = await self._kv.put(key, value)
        return revision

    async def create(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` unless the key holds a value: whether this call stored it
        (False: another writer was first; its value stays)."""
        try:
            await self._kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def delete(self, key: str) -> None:
        await self._kv.delete(key)

    async def keys(self) -> list[str]:
        """Every key that holds a value; [] for an empty bucket (see the module's invariant)."""
        keys = await self._live_keys()
        if not keys:
            status = await self._kv.status()
            if status.values:
                raise BusError(
                    f"KV bucket {status.bucket} lists no keys but holds {status.values} entries (deleted "
                    "keys' markers, or a replica catching up): not an empty bucket; delete the bucket to "
                    "start afresh"
                )
        return keys

    async def _live_keys(self) -> list[str]:
        """The last entry of every subject, read by a pull consumer: the keys whose last entry is a
        value (deleted and purged keys' markers skipped)."""
        stream = KV_STREAM_TEMPLATE.format(bucket=self.name)
        prefix = KV_PRE_TEMPLATE.format(bucket=self.name)
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            headers_only=True,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        sub = await self._js.pull_subscribe(f"{prefix}>", stream=stream, config=config)
        name: str | None = None
        try:
            info = await sub.consumer_info()  # nothing is delivered before a fetch: the count is exact
            name, remaining, keys = info.name, info.num_pending, []
            while remaining > 0:
                try:
                    batch = await sub.fetch(min(remaining, _FETCH), timeout=_FETCH_TIMEOUT_S)
                except nats.errors.TimeoutError:
                    pending = (await sub.consumer_info()).num_pending  # counted entries may have expired since
                    if pending >= remaining:
                        raise BusError(
                            f"KV bucket {self.name}: listing its keys timed out with {pending} entries pending"
                        ) from None
                    remaining = pending
                    continue
                for msg in batch:
                    remaining = min(remaining - 1, msg.metadata.num_pending)
                    if _is_value(msg.headers):
                        keys.append(msg.subject[len(prefix) :])
            return keys
        finally:
            with contextlib.suppress(nats.errors.Error):  # a closed connection: its inactivity removes it
                await sub.unsubscribe()
                if name is not None:
                    await self._js.delete_consumer(stream, name)


def _is_value(headers: dict[str, str] | None) -> bool:
    """Whether a KV entry's headers mark a value, not a deletion (by a client or by the server)."""
    headers = headers or {}
    return headers.get(KV_OP) not in _REMOVED and _MARKER_REASON not in headers
