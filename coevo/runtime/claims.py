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

import hashlib
import io
import json
from dataclasses import asdict, dataclass
from typing import Any

import nats.js.errors

from coevo.errors import PayloadUnavailable
from coevo.runtime import faults

CLAIM_HEADER = "Coevo-Claim"


class ClaimError(ValueError):
    """A claim that does not lead to its bytes (missing object, digest mismatch, malformed claim)."""


@dataclass(frozen=True)
class Claim:
    bucket: str
    key: str
    sha256: str
    bytes: int

    def body(self) -> bytes:
        return json.dumps({"claim": asdict(self)}).encode()

    @classmethod
    def parse(cls, body: bytes) -> Claim:
        try:
            return cls(**json.loads(body)["claim"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ClaimError(f"malformed claim: {exc!r}") from exc


def is_claim(headers: dict[str, str] | None) -> bool:
    return bool(headers) and CLAIM_HEADER in headers  # type: ignore[operator]


async def put(store: Any, bucket: str, event_id: str, payload: bytes) -> Claim:
    """Store ``payload`` under a key of its event id and digest: a rerun that stores the same bytes
    writes the same object, one with other bytes under the same event id (whose claim the stream
    then drops as a duplicate) writes another, so a stored claim's object is never replaced."""
    digest = hashlib.sha256(payload).hexdigest()
    key = f"{event_id}.{digest[:16]}"
    await store.put(key, payload)
    return Claim(bucket, key, digest, len(payload))


async def fetch(store: Any, claim: Claim) -> bytes:
    """The claimed bytes, verified against the claim's size and digest. ``ClaimError`` when the object
    is gone (deleted, expired) or does not match; ``PayloadUnavailable`` when the store cannot be read
    now (a timeout, a leader change, no responders, a lost connection): the claim is intact."""
    buf = io.BytesIO()
    try:
        await faults.ahit("claims.fetch")
        await store.get(claim.key, writeinto=buf)  # writeinto: linear in the object's size
    except nats.js.errors.NotFoundError as exc:
        raise ClaimError(f"claimed object {claim.bucket}/{claim.key} is gone: {exc!r}") from exc
    except Exception as exc:
        raise PayloadUnavailable(f"claimed object {claim.bucket}/{claim.key} unreadable now: {exc!r}") from exc
    data = buf.getvalue()
    if len(data) != claim.bytes or hashlib.sha256(data).hexdigest() != claim.sha256:
        raise ClaimError(f"claimed object {claim.bucket}/{claim.key} does not match its digest")
    return data
