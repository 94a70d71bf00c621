"""Following published weights: a local engine swaps them in place between batches.

Invariant: within a run a follower applies versions in increasing order only (an older or
repeated ``WeightsPublished`` is acknowledged and ignored; the first one it sees is always applied,
so a server left with another run's weights is brought to this run's), verifies the checksum before loading, and
reports every attempt as ``WeightsApplied`` (ok or not), so the learner and the trace know which
version served which tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from coevo.runtime.bus import Delivery
from coevo.runtime.consumer import Subscription
from coevo.schemas import WeightsApplied, WeightsPublished


def checkpoint_sha256(path: Path) -> str:
    """sha256 over the checkpoint's safetensors files, in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class WeightsFollower:
    """Mixin for agents that own a swappable inference client (``self.client``) of ``lane``."""

    lane: str
    _applied_version: int | None = None

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
        path = Path(event.path)
        error = None
        pause_ms = 0.0
        if not path.is_dir():
            error = f"no checkpoint at {path}"
        elif checkpoint_sha256(path) != event.sha256:
            error = f"checksum mismatch at {path}"
        else:
            try:
                pause_ms = await client.swap_weights(path, event.version)
            except Exception as exc:  # reported, the engine keeps serving the old version
                error = repr(exc)
        if error is None:
            agent.model_version = event.version
            self._applied_version = event.version
        else:
            agent.log.error("weights.apply_failed", version=event.version, error=error)
        await agent.emit(agent.event(WeightsApplied, cause=event, role=event.role, server=agent.agent_id,
                                     version=event.version if error is None else client.version,
                                     pause_ms=pause_ms, ok=error is None, error=error))
