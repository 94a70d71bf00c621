"""One registry: event kind <-> model <-> subject, and the wire codec.

Invariant: ``decode(encode(e)) == e`` for every registered event; every kind has exactly one
subject ``coevo.<run>.ev.<kind>``; raw bytes that are not a valid event raise ``ValidationError``
(never a half-built event). Old schema versions pass through an upcaster before validation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter

from coevo.schemas.base import SCHEMA_VERSION, Event
from coevo.schemas.events import (
    AgentStatus,
    BudgetExceeded,
    DeadLettered,
    GroupScored,
    LearnerStepped,
    RunFinished,
    StepJudged,
    StepTaken,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
    TrajectoryCompleted,
    WeightsApplied,
    WeightsPublished,
)
from coevo.schemas.packed import Arrays, Blob, frame, unframe

EVENT_TYPES: tuple[type[Event], ...] = (
    TaskScheduled,
    TaskRewritten,
    TaskDecided,
    StepTaken,
    TrajectoryCompleted,
    StepJudged,
    GroupScored,
    LearnerStepped,
    WeightsPublished,
    WeightsApplied,
    AgentStatus,
    DeadLettered,
    BudgetExceeded,
    RunFinished,
)

AnyEvent: Any = Annotated[Union[EVENT_TYPES], Field(discriminator="kind")]  # noqa: UP007  (built at run time)
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(AnyEvent)

KIND_TO_MODEL: dict[str, type[Event]] = {m.model_fields["kind"].default: m for m in EVENT_TYPES}
MODEL_TO_KIND: dict[type[Event], str] = {m: k for k, m in KIND_TO_MODEL.items()}

SUBJECT_ROOT = "coevo"
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}
"""(kind, old schema_version) -> function that rewrites the payload to the next version."""


def kind_of(model: type[Event] | Event) -> str:
    cls = model if isinstance(model, type) else type(model)
    return MODEL_TO_KIND[cls]


def events_prefix(run_id: str) -> str:
    return f"{SUBJECT_ROOT}.{run_id}.ev"


def subject_for(run_id: str, kind: str | type[Event]) -> str:
    k = kind if isinstance(kind, str) else kind_of(kind)
    if k not in KIND_TO_MODEL:
        raise KeyError(f"unknown event kind {k!r}")
    return f"{events_prefix(run_id)}.{k}"


def kind_from_subject(subject: str) -> str | None:
    parts = subject.split(".", 3)
    if len(parts) < 4 or parts[0] != SUBJECT_ROOT or parts[2] != "ev":
        return None
    return parts[3]


def control_subject(run_id: str, agent_id: str) -> str:
    return f"{SUBJECT_ROOT}.{run_id}.ctl.{agent_id}"


def transfer_subject(run_id: str, role: str, op: str) -> str:
    """Request-reply subject where the learner serves weight transfers of ``role`` (op: connect, push)."""
    return f"{SUBJECT_ROOT}.{run_id}.weights.{role}.{op}"


def encode(event: Event) -> bytes:
    """The event on the wire: a frame (JSON head + raw arrays, ``coevo.schemas.packed``) when it
    holds token ids or log-probs, plain JSON otherwise."""
    blob = Blob()
    head = event.__pydantic_serializer__.to_json(event, context={"blob": blob})
    return frame(head, blob) if blob.parts else head


def encode_json(event: Event) -> bytes:
    """The event as one JSON document (arrays as base64): for files, not the bus."""
    return event.__pydantic_serializer__.to_json(event)


def readable(event: Event) -> dict[str, Any]:
    """The event as JSON-ready data with token ids and log-probs as plain lists (exports, diffs);
    ``decode(json.dumps(readable(e))) == e``."""
    return event.model_dump(mode="json", context={"lists": True})


def decode(raw: bytes | str | memoryview) -> Event:
    """Validate raw bytes (a frame or JSON) into the registered event they encode.

    Fast path: current-version payloads go straight through the Rust JSON validator; a frame's
    arrays are views of ``raw``. Older versions are parsed, upcast step by step, then validated.
    Anything that is not a valid event raises ``ValueError`` (pydantic's ``ValidationError`` is one).
    """
    parts = unframe(raw) if not isinstance(raw, str) else None
    head = bytes(parts[0]) if parts else bytes(raw) if isinstance(raw, memoryview) else raw
    try:
        return EVENT_ADAPTER.validate_json(head, context=_frame_context(parts))
    except Exception:
        data = _json(head)
        version = data.get("schema_version") if isinstance(data, dict) else None
        if type(version) is not int or version >= SCHEMA_VERSION:
            raise
        try:
            upcasted = upcast(data)
        except (TypeError, KeyError, AttributeError) as exc:  # an upcaster met a shape it does not know
            raise ValueError(f"cannot upcast {data.get('kind')!r} from schema_version {version}: {exc!r}") from exc
        # back through the JSON validator: arrays in the head (references, base64) read as on the fast path
        return EVENT_ADAPTER.validate_json(_json_bytes(upcasted), context=_frame_context(parts), strict=False)


def _frame_context(parts: tuple[memoryview, memoryview] | None) -> dict[str, Any] | None:
    return {"frame": Arrays(parts[1])} if parts else None


def _json(raw: bytes | str) -> Any:
    """``json.loads``, a ``ValueError`` for anything it cannot read (too deep included)."""
    try:
        return json.loads(raw)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data).encode()


def envelope(raw: bytes | memoryview) -> dict[str, Any] | None:
    """The JSON object a payload's head holds (a frame's arrays left as references), or None when
    it is not one: for reading what a message says without validating it (dead letters)."""
    try:
        parts = unframe(raw)
        body = _json(bytes(parts[0]) if parts else bytes(raw))
    except (ValueError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def upcast(data: dict[str, Any]) -> dict[str, Any]:
    kind = data.get("kind")
    version = int(data.get("schema_version", SCHEMA_VERSION))
    while version < SCHEMA_VERSION:
        step = UPCASTERS.get((str(kind), version))
        if step is None:
            raise ValueError(f"no upcaster for {kind} schema_version {version}")
        data = step(data)
        version += 1
        data["schema_version"] = version
    return data


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of every event, keyed by kind."""
    return {kind: model.model_json_schema() for kind, model in KIND_TO_MODEL.items()}
