"""Request-reply on core NATS, typed: control commands and environment and weight-transfer services.

Invariants: only requests (``is_request``: on the very subject, with a reply inbox) are answered,
each in its own task; a malformed request or a failing handler gets ``{"error": reason}``, never a
timeout; the requester raises ``BusError`` for it and ``NoResponders`` when nobody serves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from coevo.errors import BusError, NoResponders
from coevo.runtime.stats import BusStats
from coevo.schemas import ControlReply, ControlRequest, Frozen, control_subject

log = structlog.get_logger("coevo.bus")
M = TypeVar("M", bound=Frozen)


class Rpc:
    """The request-reply half of the bus (``NatsBus`` is an ``Rpc``)."""

    nc: NATS
    run_id: str
    stats: BusStats

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

    async def serve_control(self, agent_id: str, handler: Callable[[ControlRequest], Awaitable[ControlReply]]) -> Any:
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


def _error_reply(reason: str) -> bytes:
    return json.dumps({"error": reason[:2000]}).encode()
