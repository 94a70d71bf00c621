"""The envelope every coevo event carries.

Invariant: an event is immutable once built, rejects unknown fields and wrong types (strict mode),
and carries enough identity (event id, run id, source, causation and correlation ids) to be traced
back to what caused it, and the schema version it was written with (``coevo.schemas.versions``:
decoding tolerates a newer minor's unknown fields, ``coevo.schemas.registry.decode``; building one
in code never does). This module imports only pydantic and the standard library.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from coevo.schemas.versions import SchemaVersion

SCHEMA_VERSION = SchemaVersion(2, 4)
"""The event schema this code writes and reads. Bump the minor for added optional fields (or kinds),
the major for anything else, then refresh the snapshot: ``python -m coevo.schemas.snapshot --write``.
2.0: the first with a minor; 1 (an integer on the wire) was every release before, whose readers
refused any field they did not know."""

Identifier = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]
"""Ids used in subjects, durable names and stream names: no spaces, no wildcards."""

RunId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
"""A run id becomes part of stream names and subjects, so it may not contain dots."""


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> float:
    return time.time()


class Frozen(BaseModel):
    """Base of every payload model: immutable, strict, no unknown fields."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, ser_json_bytes="base64", val_json_bytes="base64"
    )


class Source(Frozen):
    """Who produced an event: the agent, its role, and the version of the model it used (if any)."""

    agent_id: Identifier
    role: Identifier
    model_version: int | None = None


class Event(Frozen):
    """Common envelope. Subclasses add a ``kind`` literal and their payload."""

    event_id: str = Field(default_factory=new_id, min_length=1, max_length=64)
    run_id: RunId
    schema_version: str = Field(
        default=str(SCHEMA_VERSION),
        pattern=SCHEMA_VERSION.wire_pattern(),
        description="MAJOR.MINOR of the schema the writer used (other majors are upcast or refused by decode)",
    )
    ts: float = Field(default_factory=now, description="Unix time (seconds) at creation.")
    source: Source
    causation_id: str | None = Field(default=None, description="event_id of the event that caused this one")
    correlation_id: str | None = Field(
        default=None, description="id shared by every event of one unit of work (e.g. a task's group)"
    )

    @property
    def writer_schema(self) -> SchemaVersion:
        """The schema version the event was written with."""
        return SchemaVersion.parse(self.schema_version)
