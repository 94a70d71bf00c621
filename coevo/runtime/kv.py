"""A run's key-value bucket, typed: bytes by key, with nats-py's answers-as-exceptions turned into
answers (a missing key is None, an empty bucket lists no keys) so that no agent catches nats-py
errors itself.

Invariant: an empty listing means an empty bucket. nats-py answers ``NoKeysError`` both for an empty
bucket and for a listing served by a replica still catching up after a restart; the stream leader's
count of entries decides, and a bucket that lists no keys but holds entries is a ``BusError``, never
an empty answer (a caller seeding an empty bucket would write over what it holds). Every other
failure (a closed connection, a bucket deleted under the handle) propagates as nats-py raised it.
"""

from __future__ import annotations

from typing import Any

import nats.js.errors

from coevo.errors import BusError


class Bucket:
    """One KV bucket of the run (``NatsBus.kv``)."""

    __slots__ = ("_kv", "name")

    def __init__(self, kv: Any, name: str) -> None:
        self._kv, self.name = kv, name

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
        try:
            keys: list[str] = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            status = await self._kv.status()
            if status.values:
                raise BusError(
                    f"KV bucket {status.bucket} lists no keys but holds {status.values} entries (a "
                    "replica catching up, or deleted keys' markers): not an empty bucket; delete the "
                    "bucket to start afresh"
                ) from None
            return []
        return keys
