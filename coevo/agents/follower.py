"""Following published weights: every local engine or vLLM server takes each new version.

Invariant: within a run a follower applies versions in increasing order only (an older or
repeated ``WeightsPublished`` is acknowledged and ignored; the first one it sees is always applied,
so a server left with another run's weights is brought to this run's), verifies the checksum before loading, and
reports every attempt as ``WeightsApplied`` (ok or not, and how the weights travelled), so the
learner and the trace know which version served which tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coevo.inference.checkpoints import checkpoint_sha256
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
    _endpoint: TransferEndpoint | None = None

    def weight_subscriptions(self) -> list[Subscription]:
        return [Subscription(f"{self.lane}-weights", (WeightsPublished,), self.on_weights, concurrency=1,
                             shared=False, deliver="last")]

    async def on_weights(self, event: WeightsPublished, _d: Delivery) -> None:
        agent: Any = self
        client = agent.client
        applied = getattr(self, "_applied_version", None)
        if event.role != self.lane or not hasattr(client, "swap_weights"):
            return
        if applied is not None and event.version <= applied:
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
        else:
            agent.log.error("weights.apply_failed", version=event.version, error=error)
        await agent.emit(agent.event(WeightsApplied, cause=event, role=event.role, server=agent.agent_id,
                                     version=version if error is None else client.version,
                                     pause_ms=pause_ms, ok=error is None, error=error, transport=transport))

    async def _reload(self, event: WeightsPublished) -> tuple[str | None, float]:
        """Load the published checkpoint (checksum verified first); (error or None, pause in ms)."""
        path = Path(event.path)
        if not path.is_dir():
            return f"no checkpoint at {path}", 0.0
        if checkpoint_sha256(path) != event.sha256:
            return f"checksum mismatch at {path}", 0.0
        try:
            return None, await self.client.swap_weights(path, event.version)  # type: ignore[attr-defined]
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
