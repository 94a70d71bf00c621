"""Following published weights: the component a policy or judge agent owns for its server.

Invariants: within a run a follower applies weights in stream order, skipping to the newest
announcement it holds when it falls behind (one load at a time, never an older one after a newer):
an older or repeated ``WeightsPublished`` (a redelivery behind one already applied, or the same
directory again) is acknowledged and ignored, while a lower version published *later* in the stream
with other weights (a learner restarted from an older checkpoint re-announcing its restored weights)
is applied, so servers follow the surviving lineage; the first one it sees is always applied, so a
server left with another run's weights is brought to this run's. How a version gets in (and what is
checked first) is the transport's (``transports``). Every attempt is reported as a
``WeightsApplied`` (ok or not, and how the weights travelled), so the learner and the trace know
which version served which tokens.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coevo.config import CoevoConfig, checkpoint_root
from coevo.errors import LoadFailed
from coevo.runtime.agent import Agent
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Delivery, Subscription
from coevo.schemas import WeightsApplied, WeightsPublished
from coevo.schemas.events import Role
from coevo.weights.transports import Loaded, Reloads, Transport, TransportName, transport_for


def weights_subscription(lane: str, handler: Callable[[WeightsPublished, Delivery], Awaitable[None]]) -> Subscription:
    """The follower's subscription: its own (every server follows), its lane's subject only, from its
    newest announcement on (another lane's coming last is not handed to it instead), several in
    flight, so announcements that arrive while a load runs are seen and only the newest of them is
    loaded next."""
    return Subscription(
        f"{lane}-weights", (WeightsPublished,), handler, concurrency=8, shared=False, deliver="last", scope=lane
    )


@dataclass(frozen=True)
class Applied:
    """The outcome of one attempt: what the agent reports as ``WeightsApplied``."""

    cause: WeightsPublished
    version: int
    """the version now served: the loaded one, or on a failure the one served before"""
    pause_ms: float
    transport: TransportName
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def report_applied(agent: Agent, applied: Applied) -> None:
    """What the agent owning a follower does with each attempt: stamp its events with the version it
    now serves (when it loaded), log a failure, and publish ``WeightsApplied``."""
    if applied.ok:
        agent.model_version = applied.version
    else:
        agent.log.error("weights.apply_failed", version=applied.cause.version, error=applied.error)
    await agent.emit(
        agent.event(
            WeightsApplied,
            cause=applied.cause,
            role=applied.cause.role,
            server=agent.agent_id,
            version=applied.version,
            pause_ms=applied.pause_ms,
            ok=applied.ok,
            error=applied.error,
            transport=applied.transport,
        )
    )


class WeightsFollower:
    def __init__(
        self, lane: Role, transport: Transport | None, serving: Callable[[], int], counters: Counter[str]
    ) -> None:
        self.lane = lane
        self.transport = transport
        self.serving = serving
        """the version the server serves now (what a failed attempt reports)"""
        self.counters = counters
        self._applied: tuple[int, int, str, str] | None = None
        """version, stream sequence, path and digest of the announcement applied last"""
        self._newest: tuple[int, WeightsPublished | None] = (0, None)
        """the latest-stored announcement handed to this follower: (stream sequence, event)"""
        self._attempted_seq = 0
        self._lock = asyncio.Lock()

    @classmethod
    def of(
        cls, cfg: CoevoConfig, bus: NatsBus, lane: Role, client: object, *, server: str, counters: Counter[str]
    ) -> WeightsFollower:
        """The follower of ``client`` under ``cfg`` (one that follows nothing for a client with fixed weights)."""
        lc = cfg.learner
        transport = transport_for(
            client,
            root=lc.publication_root or checkpoint_root(cfg, bus.run_id),
            sync=lc.weight_sync,
            full_verify=lc.verify == "full",
            bus=bus,
            lane=lane,
            server=server,
        )

        def serving() -> int:
            return client.version if isinstance(client, Reloads) else 0

        return cls(lane, transport, serving, counters)

    @property
    def follows(self) -> bool:
        """Whether the server takes new weights at all (an external API does not)."""
        return self.transport is not None

    async def follow(self, event: WeightsPublished, delivery: Delivery | None) -> Applied | None:
        """Newest wins: a follower slower than the learner loads the latest announcement it was handed,
        not each one in turn (versions it would load only to replace). One load at a time; an
        announcement is done with once one at least as late in the stream was attempted. None when
        nothing was attempted for this one."""
        if event.role != self.lane or self.transport is None:
            return None
        seq = stream_seq(delivery)
        if seq == 0:  # no stream position (a replay, a hand-built delivery): in the order given
            async with self._lock:
                return await self._apply(event, seq)
        if seq > self._newest[0]:
            self._newest = (seq, event)
        async with self._lock:
            if self._attempted_seq >= seq:
                return None  # a later announcement was attempted while this one waited
            newest_seq, newest = self._newest
            assert newest is not None
            if newest_seq > seq:
                self.counters["weights.skipped_to_newest"] += 1
            self._attempted_seq = newest_seq
            return await self._apply(newest, newest_seq)

    async def _apply(self, event: WeightsPublished, seq: int) -> Applied | None:
        assert self.transport is not None
        if self._applied is not None:
            version, last_seq, last_path, last_digest = self._applied
            if event.version <= version and (seq <= last_seq or event.path == last_path or event.sha256 == last_digest):
                return None  # older or repeated: this run already serves something newer
        try:
            loaded: Loaded = await self.transport.load(event)
        except LoadFailed as exc:
            return Applied(event, self.serving(), 0.0, self.transport.name, error=str(exc)[:2000])
        self._applied = (loaded.version, seq, event.path, event.sha256)
        return Applied(event, loaded.version, loaded.pause_ms, loaded.transport)


def stream_seq(delivery: Delivery | None) -> int:
    try:
        return int(delivery.stream_seq) if delivery is not None else 0
    except Exception:  # a delivery without JetStream metadata (replayed or built by hand)
        return 0
