"""How a version gets into one server: what a client can do (Protocols), and the transports built on it.

A client's capabilities are structural: a client that ``Reloads`` takes a weights directory (local
engines, vLLM servers), one that ``TakesTensors`` also takes tensors held in memory (a local engine),
one that ``ReceivesPushes`` joins the learner's transfer group (a vLLM server started with a weight
transfer backend). ``transport_for`` chooses once, when the follower is built, from the client and
``learner.weight_sync``; nothing later asks a client what it can do.

Invariants:
- a transport either loads the announced version (or, pushed, the newest the learner holds, which
  it names) and returns how, or raises ``LoadFailed`` with the reason: the server then keeps
  serving what it served, and the follower reports the failure;
- a directory is loaded only from under the publication root, resolved (``..`` and links followed),
  verified against the announced digest, and under a lease (``lease``) so it is not pruned meanwhile;
- a failed push falls back to a reload from disk (which also restores a server a transfer broken
  halfway left with part of the new tensors), and the next push connects again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import structlog

from coevo.config import DiskSync, PushSync
from coevo.errors import LoadFailed
from coevo.runtime import faults
from coevo.runtime.bus import NatsBus
from coevo.schemas import (
    TransferConnect,
    TransferEndpoint,
    TransferOffer,
    TransferRequest,
    WeightsPublished,
    transfer_subject,
)
from coevo.weights import lease
from coevo.weights.manifest import HELD, HeldWeights, verify

TransportName = Literal["disk", "gloo", "nccl", "adapter"]


@runtime_checkable
class Reloads(Protocol):
    """A client that loads a weights directory between requests."""

    @property
    def version(self) -> int: ...

    async def swap_weights(self, path: Path, version: int) -> float: ...


@runtime_checkable
class TakesTensors(Reloads, Protocol):
    """... and takes tensors held in this process's memory (never modified) instead of files."""

    async def swap_tensors(self, tensors: dict[str, Any], version: int) -> float: ...


@runtime_checkable
class ReceivesPushes(Reloads, Protocol):
    """... and receives weights the learner broadcasts into its workers."""

    async def workers(self) -> int: ...

    async def init_transfer(self, init_info: dict[str, Any], timeout_s: float) -> None: ...

    async def receive_weights(self, offer: TransferOffer, timeout_s: float) -> float: ...


@runtime_checkable
class LoadsAdapters(Reloads, Protocol):
    """... and serves its base with a LoRA adapter (a directory; ``tensors``: the same, held in memory)."""

    async def load_adapter(self, path: Path, version: int, tensors: dict[str, Any] | None = None) -> float: ...


@dataclass(frozen=True)
class Loaded:
    version: int
    pause_ms: float
    transport: TransportName


class Transport(Protocol):
    name: TransportName

    async def load(self, event: WeightsPublished) -> Loaded: ...


class DiskReload:
    """Load the announced directory: from memory when this process holds it (the learner's own), else
    from disk once verified."""

    name: TransportName = "disk"

    def __init__(self, client: Reloads, root: Path, *, full_verify: bool = False, held: HeldWeights = HELD) -> None:
        self.client = client
        self.root = root
        self.full_verify = full_verify
        self.held = held

    async def load(self, event: WeightsPublished) -> Loaded:
        path = resolved_within(Path(event.path), self.root)
        if path is None:
            raise LoadFailed(
                f"refused: {event.path} is not under the publication root {self.root} (learner.publication_root)"
            )
        if event.format == "lora" and not isinstance(self.client, LoadsAdapters):
            raise LoadFailed(f"{type(self.client).__name__} cannot load LoRA adapters")
        try:
            await faults.ahit("follower.load")
            tensors = self.held.get(path, event.sha256)
            if tensors is None or event.format == "lora" or not isinstance(self.client, TakesTensors):
                async with lease.reading_async(path):
                    problem = await asyncio.to_thread(verify, path, event.sha256, full=self.full_verify)
                    if problem is not None:
                        raise LoadFailed(problem)
                    return await self._load(path, event, tensors)
            return Loaded(event.version, await self.client.swap_tensors(tensors, event.version), self.name)
        except LoadFailed:
            raise
        except Exception as exc:  # the client's own failure: reported, the server keeps its version
            raise LoadFailed(repr(exc)) from exc

    async def _load(self, path: Path, event: WeightsPublished, tensors: dict[str, Any] | None) -> Loaded:
        if event.format == "lora":
            assert isinstance(self.client, LoadsAdapters)
            return Loaded(event.version, await self.client.load_adapter(path, event.version, tensors), "adapter")
        return Loaded(event.version, await self.client.swap_weights(path, event.version), self.name)


class PushedTransfer:
    """Have the learner push its newest published weights into the server's workers; reload from
    disk when that fails."""

    def __init__(
        self, client: ReceivesPushes, bus: NatsBus, lane: str, server: str, sync: PushSync, fallback: DiskReload
    ) -> None:
        self.client = client
        self.bus = bus
        self.lane = lane
        self.server = server
        self.sync = sync
        self.name: TransportName = sync.transport
        self.fallback = fallback
        self._endpoint: TransferEndpoint | None = None
        self._token: str | None = None  # our link's, kept across a failure: a reconnect replaces only it
        self.log = structlog.get_logger("coevo.weights").bind(server=server)

    async def load(self, event: WeightsPublished) -> Loaded:
        if event.format == "lora":  # a few MB: the server reads them (vLLM pushes full weights only)
            return await self.fallback.load(event)
        try:
            return await self._pull(event)
        except Exception as exc:
            self._endpoint = None
            pushed = f"{self.name} transfer failed: {exc!r}"[:1000]
            self.log.warning("weights.transfer_failed", version=event.version, error=pushed)
        try:
            return await self.fallback.load(event)
        except LoadFailed as exc:
            raise LoadFailed(f"{pushed}; {exc}") from exc

    async def _pull(self, event: WeightsPublished) -> Loaded:
        timeout_s = self.sync.timeout_s
        if self._endpoint is None:
            workers = await self.client.workers()
            endpoint = await self.bus.request(
                transfer_subject(self.bus.run_id, self.lane, "connect"),
                TransferConnect(server=self.server, workers=workers, token=self._token),
                TransferEndpoint,
                timeout_s=30.0,
            )
            self._token = endpoint.token
            await self.client.init_transfer(endpoint.init_info(), timeout_s)
            self._endpoint = endpoint
        offer = await self.bus.request(
            transfer_subject(self.bus.run_id, self.lane, "push"),
            TransferRequest(server=self.server, version=event.version, token=self._endpoint.token),
            TransferOffer,
            timeout_s=timeout_s,
        )
        return Loaded(offer.version, await self.client.receive_weights(offer, timeout_s), self.name)


def transport_for(
    client: object, *, root: Path, sync: DiskSync | PushSync, full_verify: bool, bus: NatsBus, lane: str, server: str
) -> Transport | None:
    """The transport of ``client`` (None: it serves fixed weights, an external API). Pushed only when
    ``learner.weight_sync`` asks for it and the client receives pushes; from disk otherwise."""
    if not isinstance(client, Reloads):
        return None
    disk = DiskReload(client, root, full_verify=full_verify)
    if isinstance(sync, PushSync) and isinstance(client, ReceivesPushes):
        return PushedTransfer(client, bus, lane, server, sync, disk)
    return disk


def resolved_within(path: Path, root: Path) -> Path | None:
    """``path`` resolved (``..`` and links followed), when it lies under ``root`` resolved; else None.
    What is loaded is the resolved path, so a link changed after the check leads nowhere new."""
    try:
        real = Path(path).resolve()
        return real if real.is_relative_to(Path(root).resolve()) else None
    except (OSError, RuntimeError):
        return None
