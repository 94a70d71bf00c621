"""Large events by reference (claim check): the stream holds a claim, the bytes an object store.

An encoded event larger than the bus's inline limit (``bus.inline_max_bytes``, and always below the
stream's ``max_msg_size``) is written to the run's JetStream object store under its event id, and
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


async def put(store: Any, bucket: str, key: str, payload: bytes) -> Claim:
    """Store ``payload`` under ``key`` (idempotent: the same key holds the same bytes)."""
    await store.put(key, payload)
    return Claim(bucket, key, hashlib.sha256(payload).hexdigest(), len(payload))


async def fetch(store: Any, claim: Claim) -> bytes:
    """The claimed bytes, verified against the claim's size and digest."""
    buf = io.BytesIO()
    try:
        await store.get(claim.key, writeinto=buf)  # writeinto: linear in the object's size
    except Exception as exc:
        raise ClaimError(f"claimed object {claim.bucket}/{claim.key} unreadable: {exc!r}") from exc
    data = buf.getvalue()
    if len(data) != claim.bytes or hashlib.sha256(data).hexdigest() != claim.sha256:
        raise ClaimError(f"claimed object {claim.bucket}/{claim.key} does not match its digest")
    return data
