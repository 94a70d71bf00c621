"""Creating replicated JetStream assets on a cluster that is still forming.

Invariant: a stream, bucket or object store of R replicas is created once the metadata leader knows R
peers that can hold it. A cluster whose leader was just elected may not have heard from every peer
yet and answers "no suitable peers for placement" (JetStream error 10005); that answer is retried
until ``timeout_s``, any other error is raised at once, and the last refusal is raised past the
deadline (a cluster that really has too few nodes still fails, with the server's own words).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.js.errors

T = TypeVar("T")

NO_SUITABLE_PEERS = 10005
"""JetStream's err_code for a placement it cannot make (yet)"""


async def placed(create: Callable[[], Awaitable[T]], timeout_s: float = 30.0, poll_s: float = 0.1) -> T:
    """``await create()``, retried while JetStream cannot place it yet (see the module's invariant)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await create()
        except nats.js.errors.BadRequestError as e:
            if e.err_code != NO_SUITABLE_PEERS or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(poll_s)
