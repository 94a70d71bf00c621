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
