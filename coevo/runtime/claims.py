"""Large events by reference (claim check): the stream holds a claim, the bytes an object store.

An encoded event larger than the bus's inline limit (``bus.inline_max_bytes``, and always below the
stream's ``max_msg_size``) is written to its producer's object store of the run (one per role) under
its event id and digest, and
the stream stores a small claim instead: ``{"claim": {bucket, key, sha256, bytes}}`` with the
header ``Coevo-Claim``. Readers (consumers, history, replay, trace) get the event back whole
through ``NatsBus.decode_msg``; models stay the single source of truth, nothing else changes.

Invariant: a claim is published only after its object is stored, and a claim whose object is
missing or whose bytes do not match its digest never decodes into an event (it is dead-lettered
with that reason like any other undecodable payload).
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import nats.js.errors
from nats.js import api

from coevo.errors import ClaimError, PayloadUnavailable
from coevo.runtime import faults

CLAIM_HEADER = "Coevo-Claim"


@dataclass(frozen=True)
class Claim:
    bucket: str
    key: str
    sha256: str
    bytes: int

    def body(self) -> builtins.bytes:  # ``bytes`` is the field here
        return json.dumps({"claim": asdict(self)}).encode()

    @classmethod
    def parse(cls, body: builtins.bytes) -> Claim:
        try:
            return cls(**json.loads(body)["claim"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ClaimError(f"malformed claim: {exc!r}") from exc


def is_claim(headers: dict[str, str] | None) -> bool:
    return bool(headers) and CLAIM_HEADER in headers  # type: ignore[operator]


CHUNK_BYTES = 128 * 1024
"""the object store's chunk size (as nats-py and the ``nats`` CLI write them)"""


def _stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _meta_subject(bucket: str, key: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"


def _object_digest(payload: bytes) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(payload).digest()).decode()


async def _info(js: Any, bucket: str, key: str) -> api.ObjectInfo:
    """The object's meta, from the stream's leader (``NotFoundError`` when there is none)."""
    msg = await js.get_last_msg(_stream(bucket), _meta_subject(bucket, key))
    info: api.ObjectInfo = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
    return info


async def put(js: Any, bucket: str, event_id: str, payload: bytes) -> Claim:
    """Store ``payload`` in object store ``bucket`` under a key of its event id and digest: a rerun
    that stores the same bytes finds them stored and writes nothing, one with other bytes under the
    same event id (whose claim the stream then drops as a duplicate) writes another object, so a
    stored claim's object is never replaced.

    The chunks are written (each acknowledged by the stream) before the meta that names them, and
    nothing is ever purged: a put that fails part way leaves chunks no meta names (they expire with
    the store), never a meta whose chunks are gone. (nats-py's ``ObjectStore.put`` purges its chunks
    when the meta's publish fails, and a publish whose acknowledgement a partition lost was stored:
    the object would name chunks that no longer exist.)"""
    digest = hashlib.sha256(payload).hexdigest()
    claim = Claim(bucket, f"{event_id}.{digest[:16]}", digest, len(payload))
    try:
        stored = await _info(js, bucket, claim.key)
        if not stored.deleted and stored.size == len(payload) and stored.digest == _object_digest(payload):
            return claim
    except nats.js.errors.NotFoundError:
        pass
    nuid = uuid.uuid4().hex
    chunks = [payload[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)]
    for chunk in chunks:
        await js.publish(f"$O.{bucket}.C.{nuid}", chunk)
    info = api.ObjectInfo(
        name=claim.key,
        bucket=bucket,
        nuid=nuid,
        size=len(payload),
        chunks=len(chunks),
        digest=_object_digest(payload),
        mtime=datetime.now(UTC).isoformat(),
        options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
    )
    await js.publish(
        _meta_subject(bucket, claim.key), json.dumps(info.as_dict()).encode(), headers={api.Header.ROLLUP: "sub"}
    )
    return claim


async def fetch(js: Any, claim: Claim) -> bytes:
    """The claimed bytes, verified against the claim's size and digest. ``ClaimError`` when the object
    is gone (deleted, expired) or does not match; ``PayloadUnavailable`` when the store cannot be read
    now (a timeout, a leader change, no responders, a lost connection): the claim is intact.

    Chunk by chunk from the store's stream by name (nats-py's ``ObjectStore.get`` looks its stream up
    by subject first, an API a role may not call: every role's read of a claim timed out)."""
    stream, buf = _stream(claim.bucket), bytearray()
    try:
        await faults.ahit("claims.fetch")
        info = await _info(js, claim.bucket, claim.key)
        if info.deleted:
            raise ClaimError(f"claimed object {claim.bucket}/{claim.key} is gone: deleted")
        seq = 1
        for _ in range(info.chunks or 0):
            msg = await js.get_msg(stream, seq=seq, subject=f"$O.{claim.bucket}.C.{info.nuid}", next=True)
            buf += msg.data or b""
            seq = (msg.seq or seq) + 1
    except nats.js.errors.NotFoundError as exc:
        raise ClaimError(f"claimed object {claim.bucket}/{claim.key} is gone: {exc!r}") from exc
    except ClaimError:
        raise
    except Exception as exc:
        raise PayloadUnavailable(f"claimed object {claim.bucket}/{claim.key} unreadable now: {exc!r}") from exc
    data = bytes(buf)
    if len(data) != claim.bytes or hashlib.sha256(data).hexdigest() != claim.sha256:
        raise ClaimError(f"claimed object {claim.bucket}/{claim.key} does not match its digest")
    return data
