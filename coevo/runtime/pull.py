"""Fetching a pull consumer's messages on core NATS: one inbox subscription, one request per batch.

nats-py's ``PullSubscription.fetch`` waits for every message of a batch with a task of its own (two,
with its timeout) and a uuid; on a small event that is more than the rest of coevo's handling. A
``Puller`` sends JetStream's pull request itself and collects the replies in its subscription's
callback, which appends to a list and wakes the one fetch waiting.

Invariants:
- one request is in flight per puller (``fetch`` is not re-entrant): ``{"batch": n, "no_wait":
  true, "expires": timeout}``, which the server answers at once with what is there (ended by
  status 404 when fewer than ``n``), or, when nothing is, with the first messages to arrive
  within ``expires`` (then 404) or a 408 when none did;
- a fetch returns when its request is fulfilled (``n`` messages) or ended by a status, or at the
  timeout (a request lost in a reconnect); messages that arrive after that, or that a cancelled
  fetch held, are handed out by the next fetch first or by ``take_late``: none is dropped;
- status replies (404, 408, 409) end a request and are never handed out (a 409 that ends one
  empty-handed pauses 0.1 s before the timeout is raised: no busy loop on a leader change); a 409
  "Consumer Deleted" ends it with ``ConsumerGone`` (the consumer was deleted under the fetch); any
  other status (503: JetStream not answering, or no consumer by that name) ends it with nats-py's
  error for that status, as its fetch does.
"""

from __future__ import annotations

import asyncio
import json

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerInfo

from coevo.errors import ConsumerGone

STATUS = "Status"
DESCRIPTION = "Description"
DELETED = "Consumer Deleted"
_ENDS_REQUEST = frozenset({"404", "408", "409"})  # no messages, request expired, conflict (leader change, limits)
_GRACE_S = 0.5  # past the request's expiry, for the server's 408 to arrive
_CONFLICT_PAUSE_S = 0.1


def delivered_seq(info: ConsumerInfo) -> int:
    """The last stream sequence the consumer of ``info`` was delivered (0: nothing yet)."""
    return (info.delivered.stream_seq if info.delivered is not None else None) or 0


def read_all(info: ConsumerInfo, read: int, end: int | None = None) -> bool:
    """After a fetch timed out: True when ``info``'s consumer has nothing left to deliver (up to
    stream sequence ``end``) and every message it delivered (up to ``end``) was read, ``read`` being
    the last sequence read. A timeout alone proves neither: a delivered message can still be on its
    way (it is then handed out by the next fetch)."""
    delivered = delivered_seq(info)
    nothing_left = info.num_pending == 0 or (end is not None and delivered >= end)
    return nothing_left and read >= (delivered if end is None else min(delivered, end))


def stream_seq(msg: Msg) -> int:
    """The stream sequence of a JetStream message, read from its reply subject without building
    nats-py's ``Metadata`` (a dataclass, two sequence pairs and a datetime per message):
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...`` (9 tokens) or, with a domain and an
    account hash, ``$JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>...`` (12)."""
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


class Puller:
    """Fetch batches from the durable pull consumer ``durable`` of ``stream``."""

    def __init__(self, nc: NATS, stream: str, durable: str) -> None:
        self.nc = nc
        self.stream = stream
        self.durable = durable
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = ""
        self._sub: Subscription | None = None
        self._got: list[Msg] = []
        self._want = 0
        self._done: asyncio.Future[None] | None = None
        self._late: list[Msg] = []
        self._conflict = False

    def retarget(self, durable: str) -> None:
        """Fetch from ``durable`` from now on (a role's own consumer recreated under another of its
        names, ``coevo.runtime.slots``); between fetches only."""
        self.durable = durable
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{durable}"

    async def start(self) -> Puller:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)
        return self

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def fetch(self, batch: int, expires_s: float) -> list[Msg]:
        """Up to ``batch`` messages; ``nats.errors.TimeoutError`` when none came within ``expires_s``
        (the request's lifetime on the server)."""
        if batch < 1 or expires_s <= 0:
            raise ValueError("fetch needs batch >= 1 and expires_s > 0")
        if self._done is not None:
            raise RuntimeError(f"a fetch of {self.durable} is already waiting")
        if self._late:
            msgs, self._late = self._late[:batch], self._late[batch:]
            return msgs
        self._got, self._want, self._conflict = [], batch, False
        self._done = done = asyncio.get_running_loop().create_future()
        request = {"batch": batch, "no_wait": True, "expires": max(1, int(expires_s * 1e9) - 100_000)}
        error: BaseException | None = None
        try:
            await self.nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)
            await asyncio.wait_for(done, expires_s + _GRACE_S)
        except TimeoutError:
            pass  # the request was lost (a reconnect) or its 408 is late: return what came
        except (nats.js.errors.Error, nats.errors.Error, ConsumerGone) as exc:
            error = exc
        except BaseException:
            self._late.extend(self._got)  # cancelled: kept for ``take_late`` (the consumer gives them back)
            raise
        finally:
            msgs, self._got, self._want, self._done = self._got, [], 0, None
        if msgs:
            return msgs
        if error is not None:
            raise error
        if self._conflict:  # answered at once (a leader change, too many waiting pulls): not again at once
            await asyncio.sleep(min(_CONFLICT_PAUSE_S, expires_s))
        raise nats.errors.TimeoutError

    def take_late(self) -> list[Msg]:
        """Messages delivered that no fetch handed out (to give back when stopping)."""
        late, self._late = self._late, []
        return late

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(STATUS) if msg.headers else None
        if status is None:
            if self._done is None:
                self._late.append(msg)  # its fetch gave up waiting: the next one hands it out
                return
            self._got.append(msg)
            if len(self._got) >= self._want:
                self._end()
        elif status in _ENDS_REQUEST:
            if status == "409" and (msg.headers or {}).get(DESCRIPTION) == DELETED:
                self._end(ConsumerGone(self.durable))
                return
            self._conflict = status == "409"
            self._end()
        elif status != "100":  # 100: idle heartbeat (none asked for) or flow control (push only)
            try:
                nats.js.errors.APIError.from_msg(msg)
            except nats.js.errors.Error as exc:
                self._end(exc)

    def _end(self, error: BaseException | None = None) -> None:
        done = self._done
        if done is not None and not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
