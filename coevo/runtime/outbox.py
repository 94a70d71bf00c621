"""The outbox: what a handler publishes is stored before its input is acknowledged.

While a consumer runs a handler, every publish on the bus (from the handler or from tasks it
started) is staged in that delivery's ``Outbox``. The consumer acknowledges the input only after
``confirm`` saw each staged publish acknowledged by JetStream (a failed one is published again
with the same ``Nats-Msg-Id``); if that cannot be done, the input is nak'd and redelivered.

Invariant (at-least-once, stated here once for every agent): a crash at any point either leaves the
input unacknowledged (it is redelivered and the handler runs again) or happens after every output
of the handler is stored. Outputs of a rerun dedupe when they are the same facts: an event built
while handling has an id derived from the input, the consumer and its content (``derived_id``),
so the same output of the same input is stored once; a different output (sampling, clocks) is
stored beside the first, and consumers keep their own first-wins rules (see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
from dataclasses import dataclass, field
from typing import Protocol

from coevo.config import BusConfig
from coevo.schemas import Event


@dataclass(slots=True)
class UnackedPublish:
    """A publish awaiting its acknowledgement (what the bus's table holds and an outbox stages)."""

    subject: str
    payload: bytes
    event_id: str
    t0: float
    headers: dict[str, str] = field(default_factory=dict)
    future: asyncio.Future[bool] | None = None
    """Resolves True once JetStream stored the message (``duplicate`` or not); fails when the stream
    refused it or nobody answered. Set by ``publish_raw``, resolved by the ack subscription."""
    tries: int = 0
    """times it failed (refused, unanswered for an ack timeout, or lost to an injected fault)"""
    strikes: int = 0
    """failures counted against ``bus.publish_retries``: those after the stream stored another publish
    since this one first failed (the stream takes publishes; it refuses this one)"""
    acks_at_first_failure: int = -1
    """the bus's acknowledgement count when it first failed (-1: it has not)"""
    retry_at: float = 0.0
    """``time.perf_counter()`` before which it is not sent again (its backoff)"""
    error: str = ""
    """why it last failed"""


class Republisher(Protocol):
    """What ``confirm`` needs of the bus (``coevo.runtime.publishing.Publisher``): the outbox sits
    below the bus and never imports it."""

    cfg: BusConfig

    async def republish(self, p: UnackedPublish) -> object: ...


@dataclass
class Outbox:
    """The publishes staged while handling one delivery of ``cause_id`` by ``consumer``."""

    cause_id: str
    consumer: str
    staged: list[tuple[asyncio.Future[bool], UnackedPublish]] = field(default_factory=list)

    def derived_id(self, event: Event) -> str:
        """A deterministic id for an event built while handling this delivery."""
        body = event.model_dump_json(exclude={"event_id", "ts"})
        digest = hashlib.sha256(f"{self.cause_id}\0{self.consumer}\0{body}".encode()).hexdigest()
        return f"o-{digest[:40]}"

    async def confirm(self, bus: Republisher) -> None:
        """Return once every staged publish is stored; raise ``PublishError`` if one cannot be."""
        for fut, unacked in self.staged:
            try:
                await asyncio.wait_for(asyncio.shield(fut), bus.cfg.publish_ack_timeout_s)
                continue
            except asyncio.CancelledError:
                if not fut.cancelled():
                    raise  # we are cancelled, not the publish
            except Exception:  # timed out or failed: publish again, same id (stored once)
                pass
            await bus.republish(unacked)


_CURRENT: contextvars.ContextVar[Outbox | None] = contextvars.ContextVar("coevo_outbox", default=None)


def current() -> Outbox | None:
    """The outbox of the delivery being handled in this task (or a task it started), if any."""
    return _CURRENT.get()


class staging:
    """Make ``box`` the current outbox inside the ``with`` block (and tasks started in it)."""

    __slots__ = ("box", "token")

    def __init__(self, box: Outbox) -> None:
        self.box = box

    def __enter__(self) -> Outbox:
        self.token = _CURRENT.set(self.box)
        return self.box

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self.token)
