"""Control messages (request-reply on core NATS, not stored in the event stream)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coevo.schemas.base import Frozen, Identifier
from coevo.schemas.events import AgentState

Command = Literal["status", "pause", "resume", "stop"]


class ControlRequest(Frozen):
    command: Command


class ControlReply(Frozen):
    agent_id: Identifier
    role: Identifier
    state: AgentState
    uptime_s: float = Field(ge=0.0)
    counters: dict[str, int] = Field(default_factory=dict)
    accepted: bool = True
    detail: str | None = None


# ---- weight transfer (learner <-> the follower of an inference server) ------------------------

TransferBackend = Literal["gloo", "nccl"]


class TransferConnect(Frozen):
    """A server's follower asks the learner to open a transfer group with the server's workers."""

    server: Identifier
    workers: int = Field(default=1, ge=1, description="the server's worker count (vLLM /get_world_size)")
    token: str | None = Field(
        default=None, max_length=128, description="the token of the link it replaces (its own, from its last connect)"
    )


class TransferEndpoint(Frozen):
    """Where the learner (rank 0) waits for the server's workers (ranks 1..workers)."""

    backend: TransferBackend
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=2)
    token: str = Field(default="", description="this link's secret: its pushes and a reconnect replacing it name it")

    def init_info(self) -> dict[str, object]:
        """vLLM's ``/init_weight_transfer_engine`` body (one tensor per broadcast: not packed)."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "packed": False,
        }


class TransferRequest(Frozen):
    """Send ``version`` (or the newest the learner has, if that one is gone) to ``server``."""

    server: Identifier
    version: int = Field(ge=0)
    token: str = Field(default="", max_length=128, description="the token the server's connect was answered with")


class TransferOffer(Frozen):
    """The learner holds these tensors in memory and is broadcasting them, in this order, now."""

    version: int = Field(ge=0)
    sha256: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def update_info(self) -> dict[str, object]:
        """vLLM's ``/update_weights`` body."""
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
