"""The learner's side of pushed weights: it answers connect and push requests of servers' followers.

A follower (the agent that owns an inference server) asks to ``connect``: the learner opens a group
as rank 0 (in a thread: the server's workers join it when the follower calls vLLM's
``/init_weight_transfer_engine``) and answers where. Then, per new version, it asks to ``push``:
the learner takes the newest published weights (the serving-dtype copy it holds in memory,
``HELD``; read back from the files only when this process does not hold them), answers with the
plan (names, dtypes, shapes) and broadcasts the tensors while the follower has vLLM receive them
(``/update_weights``).

Invariants: one transfer at a time per server (a push waits for the previous send to end); a
failed or timed-out send closes that server's group, and its next push is refused until the
follower connects again; only published weights are sent (the newest, whatever version was
asked), and the reply names the version actually sent.

Who may ask (any process with a follower role's credentials can): a connect names a server allowed
by ``servers`` (any, when empty) that holds no link, or replaces a link with that link's token (its
own follower's, answered by its last connect) or a broken one; a push names its link's token; at
most ``max_links`` links and ``max_workers`` workers each. Every blocking step (forming a group,
reading weights, sending) runs on the server's own pool of ``2 * max_links`` threads, never on the
default executor the learner's step runs on: servers that never join hold none of the learner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from coevo.config import PushSync
from coevo.errors import TransferRefused
from coevo.runtime.bus import NatsBus
from coevo.schemas import TransferConnect, TransferEndpoint, TransferOffer, TransferRequest, transfer_subject
from coevo.weights import lease
from coevo.weights.manifest import HELD
from coevo.weights.transfer import Collective, GlooCollective, NcclCollective, Plan, load_checkpoint_tensors, send

log = structlog.get_logger("coevo.weights")

Published = Callable[[], tuple[int, Path, str]]  # the newest published (version, path, digest) of a lane


@dataclass
class _Link:
    """One server's transfer group, as rank 0 holds it."""

    ready: asyncio.Future[Collective]
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sending: asyncio.Future[None] | None = None
    broken: str | None = None

    @property
    def failed(self) -> bool:
        """Unusable: its send failed, or its group did not form (any server may take its name)."""
        formed = not self.ready.done() or (not self.ready.cancelled() and self.ready.exception() is None)
        return self.broken is not None or not formed

    def close(self) -> None:
        if self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None:
            with contextlib.suppress(Exception):
                self.ready.result().close()


class WeightServer:
    def __init__(self, bus: NatsBus, sync: PushSync) -> None:
        self.bus = bus
        self.backend = sync.transport
        self.host = sync.host
        self.timeout_s = sync.timeout_s
        self.allowed = frozenset(sync.servers)
        self.max_links = sync.max_links
        self.max_workers = sync.max_workers
        self.links: dict[tuple[str, str], _Link] = {}
        self.sent: dict[str, int] = {}
        self._subs: list[Any] = []
        # forming groups, reading weights and sending: never on the default executor (the learner's step)
        self._pool = ThreadPoolExecutor(max_workers=2 * sync.max_links, thread_name_prefix="coevo-weights")

    async def serve(self, role: str, published: Published) -> None:
        run = self.bus.run_id

        async def on_connect(req: TransferConnect) -> TransferEndpoint:
            return await self.connect(role, req)

        async def on_push(req: TransferRequest) -> TransferOffer:
            return await self.push(role, req, published)

        self._subs.append(await self.bus.serve(transfer_subject(run, role, "connect"), TransferConnect, on_connect))
        self._subs.append(await self.bus.serve(transfer_subject(run, role, "push"), TransferRequest, on_push))

    async def aclose(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for link in self.links.values():
            if link.sending is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(link.sending), self.timeout_s)
            link.close()
        self.links.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def admit(self, role: str, req: TransferConnect) -> tuple[str, str] | None:
        """The link a connect replaces (None: a new one), or ``TransferRefused`` with the reason."""
        key = (role, req.server)
        if self.allowed and req.server not in self.allowed:
            raise TransferRefused(f"{req.server} is not one of learner.weight_sync.servers")
        if req.workers > self.max_workers:
            raise TransferRefused(f"{req.workers} workers: over learner.weight_sync.max_workers {self.max_workers}")
        old = self.links.get(key)
        if old is not None:
            if old.failed or hmac.compare_digest((req.token or "").encode(), old.token.encode()):
                return key
            raise TransferRefused(f"{req.server} is connected: a reconnect names its link's token")
        if len(self.links) < self.max_links:
            return None
        stale = next((k for k, link in self.links.items() if link.failed), None)
        if stale is None:
            raise TransferRefused(
                f"{len(self.links)} servers are connected: learner.weight_sync.max_links is {self.max_links}"
            )
        return stale

    async def connect(self, role: str, req: TransferConnect) -> TransferEndpoint:
        replaced = self.admit(role, req)
        if replaced is not None and (old := self.links.pop(replaced, None)) is not None:
            old.close()
        key = (role, req.server)
        world = 1 + req.workers
        opening: Awaitable[Collective]
        if self.backend == "gloo":
            store = GlooCollective.host_store(self.host, world, self.timeout_s)
            port = int(store.port)
            opening = self._run(GlooCollective, store, 0, world, self.timeout_s)
        else:
            port = _free_port(self.host)
            opening = self._run(NcclCollective, self.host, port, world)
        link = _Link(asyncio.ensure_future(opening))
        link.ready.add_done_callback(lambda f: None if f.cancelled() else f.exception())  # retrieved in push
        self.links[key] = link
        log.info(
            "weights.transfer_connect", role=role, server=req.server, backend=self.backend, port=port, world_size=world
        )
        return TransferEndpoint(
            backend=self.backend, master_address=self.host, master_port=port, world_size=world, token=link.token
        )

    async def push(self, role: str, req: TransferRequest, published: Published) -> TransferOffer:
        link = self.links.get((role, req.server))
        if link is None:
            raise TransferRefused(f"{req.server} has no transfer group for {role}: connect first")
        if not hmac.compare_digest(req.token.encode(), link.token.encode()):
            raise TransferRefused(f"not {req.server}'s token: a push names the token of its server's link")
        async with link.lock:
            if link.sending is not None:
                with contextlib.suppress(BaseException):
                    await link.sending
            if link.broken:
                raise TransferRefused(f"transfer group of {req.server} is closed ({link.broken}): connect again")
            try:
                group = await asyncio.wait_for(asyncio.shield(link.ready), self.timeout_s)
            except BaseException as exc:
                link.broken = f"group did not form: {exc!r}"
                raise TransferRefused(link.broken) from exc
            version, tensors, sha = await self._run(self._load, published)
            plan = Plan.of(tensors)
            link.sending = asyncio.ensure_future(self._send(role, req.server, link, group, tensors, plan, version))
            return TransferOffer(
                version=version,
                sha256=sha,
                names=list(plan.names),
                dtype_names=list(plan.dtype_names),
                shapes=[list(s) for s in plan.shapes],
            )

    def _load(self, published: Published) -> tuple[int, dict[str, Any], str]:
        """The newest published weights: from memory, else read whole (retried if pruned meanwhile)."""
        device = "cpu"
        if self.backend == "nccl":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        for attempt in range(3):
            version, path, sha = published()
            held = HELD.get(path, sha)
            if held is not None:
                return version, held if device == "cpu" else {k: v.to(device) for k, v in held.items()}, sha
            try:
                with lease.reading(path):  # never pruned while it is read
                    return version, load_checkpoint_tensors(path, device), sha
            except FileNotFoundError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _send(
        self, role: str, server: str, link: _Link, group: Collective, tensors: dict[str, Any], plan: Plan, version: int
    ) -> None:
        try:
            await self._run(send, group, tensors, plan)
        except Exception as exc:  # the receiver vanished or timed out: this group is unusable now
            link.broken = repr(exc)[:300]
            link.close()
            log.warning("weights.transfer_failed", role=role, server=server, version=version, error=link.broken)
            return
        self.sent[server] = version
        log.info("weights.transferred", role=role, server=server, version=version, bytes=plan.bytes)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
