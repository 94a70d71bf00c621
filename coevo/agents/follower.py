"""Following published weights: every local engine or vLLM server takes each new version.

Invariants: within a run a follower applies weights in stream order, skipping to the newest
announcement it holds when it falls behind (one load at a time, never an older one after a newer):
an older or repeated
``WeightsPublished`` (a redelivery behind one already applied, or the same directory again) is
acknowledged and ignored, while a lower version published *later* in the stream with other weights (a learner
restarted from an older checkpoint re-announcing its restored weights) is applied, so servers
follow the surviving lineage; the first one it sees is always applied, so a server left with
another run's weights is brought to this run's. Weights are verified before loading (the
manifest against the announced digest and every file's size; ``learner.verify = "full"`` also
re-hashes the files) and loaded only from under the publication root (``learner.publication_root``,
by default the run's checkpoints under this process's ``run.runs_dir``; a ``WeightsPublished``
naming another path is refused); a local engine in the learner's own process takes the published tensors
from memory (``HELD``), without reading files. Every attempt is reported as ``WeightsApplied``
(ok or not, and how the weights travelled), so the learner and the trace know which version
served which tokens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from coevo.config import checkpoint_root
from coevo.inference.checkpoints import HELD, verify
from coevo.runtime import faults
from coevo.runtime.bus import Delivery
from coevo.runtime.consumer import Subscription
from coevo.schemas import (
    TransferConnect,
    TransferEndpoint,
    TransferOffer,
    TransferRequest,
    WeightsApplied,
    WeightsPublished,
    transfer_subject,
)


class WeightsFollower:
    """Mixin for agents that own a swappable inference client (``self.client``) of ``lane``.

    With ``learner.weight_sync`` gloo or nccl and a client that can receive pushed weights (vLLM),
    the follower asks the learner to push the new version into its server; if that fails, it falls
    back to loading the published checkpoint (which also restores a consistent server after a
    transfer broken halfway), and connects again on the next version.
    """

    lane: str
    _applied_version: int | None = None
    _applied_at: tuple[int, str, str] = (-1, "", "")
    """stream sequence, path and digest of the event applied last"""
    _endpoint: TransferEndpoint | None = None

    _newest: tuple[int, WeightsPublished | None] = (0, None)
    """the latest-stored announcement handed to this follower: (stream sequence, event)"""
    _attempted_seq: int = 0
    """stream sequence of the announcement attempted last"""
    _applying: asyncio.Lock | None = None

    def weight_subscriptions(self) -> list[Subscription]:
        # several in flight: announcements that arrive while a load runs are seen, and only the newest
        # of them is loaded next (``on_weights``)
        return [Subscription(f"{self.lane}-weights", (WeightsPublished,), self.on_weights, concurrency=8,
                             shared=False, deliver="last")]

    async def on_weights(self, event: WeightsPublished, delivery: Delivery) -> None:
        """Newest wins: a follower slower than the learner loads the latest announcement it was handed,
        not each one in turn (versions it would load only to replace, and which publication pruning
        may remove meanwhile). One load at a time; an announcement is acknowledged once one at least
        as late in the stream was attempted (applied, or reported as failed)."""
        agent: Any = self
        if event.role != self.lane or not hasattr(agent.client, "swap_weights"):
            return
        seq = _stream_seq(delivery)
        if seq == 0:  # no stream position (a replay, a hand-built delivery): in the order given
            await self._apply(event, seq)
            return
        if seq > self._newest[0]:
            self._newest = (seq, event)
        if self._applying is None:
            self._applying = asyncio.Lock()
        async with self._applying:
            if self._attempted_seq >= seq:
                return  # a later announcement was attempted while this one waited
            newest_seq, newest = self._newest
            assert newest is not None
            if newest_seq > seq:
                agent.counters["weights.skipped_to_newest"] += 1
            await self._apply(newest, newest_seq)
            self._attempted_seq = newest_seq

    async def _apply(self, event: WeightsPublished, seq: int) -> None:
        agent: Any = self
        client = agent.client
        applied = getattr(self, "_applied_version", None)
        last_seq, last_path, last_digest = self._applied_at
        if applied is not None and event.version <= applied and (
                seq <= last_seq or event.path == last_path or event.sha256 == last_digest):
            return  # older or repeated: this run already serves something newer
        transport = agent.cfg.learner.weight_sync if hasattr(client, "receive_weights") else "disk"
        version, pause_ms, error = event.version, 0.0, None
        if transport != "disk":
            try:
                version, pause_ms = await self._pull(event)
            except Exception as exc:
                self._endpoint = None
                error = f"{transport} transfer failed: {exc!r}"[:1000]
                agent.log.warning("weights.transfer_failed", version=event.version, error=error)
                transport = "disk"
        if transport == "disk":
            reload_error, pause_ms = await self._reload(event)
            error = None if reload_error is None else "; ".join(e for e in (error, reload_error) if e)
        if error is None:
            agent.model_version = version
            self._applied_version = version
            self._applied_at = (seq, event.path, event.sha256)
        else:
            agent.log.error("weights.apply_failed", version=event.version, error=error)
        await agent.emit(agent.event(WeightsApplied, cause=event, role=event.role, server=agent.agent_id,
                                     version=version if error is None else client.version,
                                     pause_ms=pause_ms, ok=error is None, error=error, transport=transport))

    async def _reload(self, event: WeightsPublished) -> tuple[str | None, float]:
        """Load the published weights (from memory in the learner's process, else from disk once
        verified); (error or None, pause in ms)."""
        agent: Any = self
        root = agent.cfg.learner.publication_root or checkpoint_root(agent.cfg, agent.bus.run_id)
        path = resolved_within(Path(event.path), root)
        if path is None:
            return f"refused: {event.path} is not under the publication root {root} (learner.publication_root)", 0.0
        try:
            await faults.ahit("follower.load")
            held = HELD.get(path, event.sha256)
            if held is not None and hasattr(agent.client, "swap_tensors"):
                return None, await agent.client.swap_tensors(held, event.version)
            problem = await asyncio.to_thread(verify, path, event.sha256, full=agent.cfg.learner.verify == "full")
            if problem is not None:
                return problem, 0.0
            return None, await agent.client.swap_weights(path, event.version)
        except Exception as exc:  # reported, the engine keeps serving the old version
            return repr(exc), 0.0

    async def _pull(self, event: WeightsPublished) -> tuple[int, float]:
        """Have the learner push its newest weights into this agent's server; (version, pause in ms)."""
        agent: Any = self
        bus, lc = agent.bus, agent.cfg.learner
        if self._endpoint is None:
            workers = await agent.client.workers()
            endpoint = await bus.request(transfer_subject(bus.run_id, self.lane, "connect"),
                                         TransferConnect(server=agent.agent_id, workers=workers), TransferEndpoint,
                                         timeout_s=30.0)
            await agent.client.init_transfer(endpoint.init_info(), lc.transfer_timeout_s)
            self._endpoint = endpoint
        offer = await bus.request(transfer_subject(bus.run_id, self.lane, "push"),
                                  TransferRequest(server=agent.agent_id, version=event.version), TransferOffer,
                                  timeout_s=lc.transfer_timeout_s)
        return offer.version, await agent.client.receive_weights(offer, lc.transfer_timeout_s)


def resolved_within(path: Path, root: Path) -> Path | None:
    """``path`` resolved (``..`` and links followed), when it lies under ``root`` resolved; else None.
    What is loaded is the resolved path, so a link changed after the check leads nowhere new."""
    try:
        real = Path(path).resolve()
        return real if real.is_relative_to(Path(root).resolve()) else None
    except (OSError, RuntimeError):
        return None


def _stream_seq(delivery: Delivery | None) -> int:
    try:
        return int(delivery.stream_seq) if delivery is not None else 0
    except Exception:  # a delivery without JetStream metadata (replayed or built by hand)
        return 0
