"""Environment service protocol (request-reply on core NATS, not stored in the event stream).

``open`` goes to a family's queue group (any worker); ``step`` and ``close`` go to the worker
that holds the session (sticky). Replies carry either a result or an error string.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coevo.schemas.base import Frozen
from coevo.schemas.events import Outcome, TaskSpec


class EnvObservation(Frozen):
    text: str
    candidates: list[str] = Field(default_factory=list)
    objective: str = ""


class EnvOpen(Frozen):
    op: Literal["open"] = "open"
    task: TaskSpec


class EnvStep(Frozen):
    op: Literal["step"] = "step"
    session_id: str
    action: str


class EnvClose(Frozen):
    op: Literal["close"] = "close"
    session_id: str


class EnvReply(Frozen):
    ok: bool
    error: str | None = None
    worker_id: str = ""
    session_id: str = ""
    observation: EnvObservation | None = None
    done: bool = False
    outcome: Outcome | None = None
    reference_label: Literal[1, -1] | None = None
    info_json: str = "{}"


def env_subject(run_id: str, family: str, worker_id: str | None = None) -> str:
    base = f"coevo.{run_id}.env.{family}"
    return f"{base}.open" if worker_id is None else f"{base}.w.{worker_id}"
