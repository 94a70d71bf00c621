"""One registry: event kind <-> model <-> subject, and the wire codec.

Invariant: ``decode(encode(e)) == e`` for every registered event; raw bytes that are not a valid
event raise ``ValidationError`` (never a half-built event). Versions (``coevo.schemas.versions``):
an event of this code's major decodes whatever its minor (a newer minor's fields this code does not
know are dropped and reported, its known fields as strict as ever; an unknown field in an event of
this minor or an older one is invalid); an older major passes through its upcasters
(``UPCASTERS``: one per kind and major) before validation; a newer major is refused.

Subjects (a role is its subjects). An event of a kind one role produces is published on
``coevo.<run>.ev.<kind>``. A kind that two producers share, or that is read per lane, has one more
token, its scope: ``coevo.<run>.ev.<kind>.<scope>`` (``SCOPES``: the scopes of each such kind and
the one role that publishes each; ``scope_of`` reads an event's scope from what it is, not from who
says it sent it). Invariant: each subject has exactly one producer role (``producer_of``), which
the run's server lets publish there and no other role (``coevo.runtime.credentials``); so a reader
knows who produced an event from the subject it came on, and an event its subject may not carry
(``refusal``: another scope's, or what the scope's producer never sends, such as a ``candidate``
group on the endpoint's subject) is not a valid event of that subject (the bus raises, a consumer
dead-letters it with the reason). Newest-only readers read one lane's subject, so each is handed
its own lane's last event. A scoped kind on its bare subject is an event stored before scopes
(old streams) or by the run's ``admin``: read as it is (no role may publish there).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from coevo.schemas.base import SCHEMA_VERSION, Event
from coevo.schemas.events import (
    AgentStatus,
    BudgetExceeded,
    DeadLettered,
    GroupScored,
    LearnerStepped,
    RunFinished,
    StepAgreementMeasured,
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
from coevo.schemas.versions import LEGACY_MAJOR, SchemaVersion

EVENT_TYPES: tuple[type[Event], ...] = (
    TaskScheduled,
    TaskRewritten,
    TaskDecided,
    StepTaken,
    TrajectoryCompleted,
    StepAgreementMeasured,
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


def _from_legacy(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 -> 2.0: every field added while the version stayed 1 has a default, and a
    ``LearnerStepped`` of 0 samples was a disposal report from the release that wrote one; only a
    ``TaskRewritten.attempt`` (written for an hour, then reverted) is gone."""
    if data.get("kind") == "task.rewritten":
        data.pop("attempt", None)
    return data


UPCASTERS: dict[tuple[str, int], Upcaster] = {(kind, LEGACY_MAJOR): _from_legacy for kind in KIND_TO_MODEL}
"""(kind, old major) -> function that rewrites a payload of that major to the next one (a minor
needs none: it only adds fields with defaults)."""


def kind_of(model: type[Event] | Event) -> str:
    cls = model if isinstance(model, type) else type(model)
    return MODEL_TO_KIND[cls]


ENDPOINT_GROUPS = "ext-"
"""The id prefix of the groups the policy's endpoint opens (an outside agent's own task); no other
producer's group id starts with it."""
LANES = ("policy", "judge")
RUN_ROLES = ("policy", "judge", "scorer", "tasks", "learner", "env", "metrics", "retention")
"""The roles of a run (``coevo.agents.ROLES``, kept equal by a test); ``admin`` is the run's own process."""
BY_ROLE = ("agent.status", "dead.lettered")
"""Kinds every role publishes, each on its own role's subject."""

SCOPES: dict[str, dict[str, str]] = {
    "task.scheduled": {"tasks": "tasks", "endpoint": "policy"},
    "learner.stepped": {lane: "learner" for lane in LANES},
    "weights.published": {lane: "learner" for lane in LANES},
    "weights.applied": {lane: lane for lane in LANES},
    **{kind: {role: role for role in (*RUN_ROLES, "admin")} for kind in BY_ROLE},
}
"""kind -> scope -> the one role that publishes ``coevo.<run>.ev.<kind>.<scope>``: a group the tasks
agent schedules, or one the policy's endpoint opens; each lane's steps, weights, and servers; each
role's own statuses and dead letters (``admin``: the run's process, and agents of no run role)."""


def scope_of(event: Event) -> str | None:
    """The scope of ``event``'s subject (None: its kind has one subject), from what the event is: a
    group of the endpoint's ids is the endpoint's; a lane's event is its lane's; a status or dead
    letter is its source's role's (a reader sees that the subject and the source agree)."""
    kind = kind_of(event)
    if kind == "task.scheduled":
        return "endpoint" if event.group_id.startswith(ENDPOINT_GROUPS) else "tasks"  # type: ignore[attr-defined]
    if kind in BY_ROLE:
        return event.source.role if event.source.role in RUN_ROLES else "admin"
    if kind in SCOPES:
        return str(event.role)  # type: ignore[attr-defined]
    return None


def refusal(scope: str | None, event: Event) -> str | None:
    """Why ``event`` may not come on the subject of ``scope`` (None: it may). A bare subject (``scope``
    None) carries any event of its kind: stored before scopes, or by the run's admin."""
    if scope is None:
        return None
    kind = kind_of(event)
    if scope not in SCOPES.get(kind, {}):
        return f"{kind} has no subject of scope {scope!r}"
    own = scope_of(event)
    if own != scope:
        return (
            f"a {kind} of {own!r} on the subject of {scope!r}, which only the {SCOPES[kind][scope]!r} role publishes on"
        )
    if kind == "task.scheduled" and scope == "endpoint":
        e: Any = event
        if e.purpose != "train" or e.slot_id is not None:
            return (
                f"a {e.purpose} group of slot {e.slot_id} on the endpoint's subject: the endpoint opens "
                "only training groups of an outside agent's task (no slot); candidates and evals are the tasks agent's"
            )
    return None


def events_prefix(run_id: str) -> str:
    return f"{SUBJECT_ROOT}.{run_id}.ev"


def subject_for(run_id: str, kind: str | type[Event], scope: str | None = None) -> str:
    """The subject of ``kind`` (of its ``scope``). A scoped kind's bare subject is no role's (see the
    module's docstring): events are published on ``subject_of``."""
    k = kind if isinstance(kind, str) else kind_of(kind)
    if k not in KIND_TO_MODEL:
        raise KeyError(f"unknown event kind {k!r}")
    if scope is None:
        return f"{events_prefix(run_id)}.{k}"
    if scope not in SCOPES.get(k, {}):
        raise KeyError(f"{k} has no subject of scope {scope!r}")
    return f"{events_prefix(run_id)}.{k}.{scope}"


def subject_of(run_id: str, event: Event) -> str:
    """Where ``event`` is published."""
    return subject_for(run_id, kind_of(event), scope_of(event))


def parse_subject(subject: str) -> tuple[str, str | None] | None:
    """``(kind, scope)`` of an event subject (the kind as written when it is not one: a mismatch
    for the reader to refuse); None for a subject outside ``coevo.<run>.ev``."""
    parts = subject.split(".", 3)
    if len(parts) < 4 or parts[0] != SUBJECT_ROOT or parts[2] != "ev":
        return None
    rest = parts[3]
    if rest in KIND_TO_MODEL:
        return rest, None
    kind, _, scope = rest.rpartition(".")
    return (kind, scope) if kind in SCOPES else (rest, None)


def kind_from_subject(subject: str) -> str | None:
    parsed = parse_subject(subject)
    return parsed[0] if parsed else None


def producer_of(subject: str, emits: dict[str, tuple[str, ...]]) -> str | None:
    """The role that publishes on ``subject`` (``emits``: each role's kinds, as the credentials
    hold them); None for a subject no single role owns (a bare subject of a scoped kind, the kinds
    every role publishes, an unknown one)."""
    parsed = parse_subject(subject)
    if parsed is None:
        return None
    kind, scope = parsed
    if kind in SCOPES:
        return SCOPES[kind].get(scope) if scope is not None else None
    roles = [r for r, kinds in emits.items() if kind in kinds]
    return roles[0] if len(roles) == 1 else None


def selector_keys(selector: str) -> tuple[str, ...]:
    """The subjects (run-neutral: ``<kind>`` or ``<kind>.<scope>``) a reader's selector names: a
    kind names each of its subjects, ``<kind>.<scope>`` one."""
    if selector in SCOPES:
        return tuple(f"{selector}.{scope}" for scope in SCOPES[selector])
    if selector in KIND_TO_MODEL:
        return (selector,)
    kind, _, scope = selector.rpartition(".")
    subject_for("r", kind, scope)  # KeyError for what is neither
    return (selector,)


def subject_filters(run_id: str, selector: str) -> list[str]:
    """The stream filters of a selector: a kind (every subject of it, the bare one of old streams
    included) or ``<kind>.<scope>`` (that one subject: a newest-only reader of one lane)."""
    if selector in SCOPES:
        bare = subject_for(run_id, selector)
        return [bare, f"{bare}.*"]
    if selector in KIND_TO_MODEL:
        return [subject_for(run_id, selector)]
    kind, _, scope = selector.rpartition(".")
    return [subject_for(run_id, kind, scope)]


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


def decode(raw: bytes | str | memoryview, ignored: list[tuple[str, str]] | None = None) -> Event:
    """Validate raw bytes (a frame or JSON) into the registered event they encode.

    Fast path: payloads of this code's major with no field it does not know go straight through the
    Rust JSON validator; a frame's arrays are views of ``raw``. A newer minor's unknown fields are
    dropped (each ``(kind, dotted field)`` appended to ``ignored``) and the rest validated as strictly;
    older majors are parsed, upcast step by step, then validated. Anything that is not a valid event
    raises ``ValueError`` (pydantic's ``ValidationError`` is one), a newer major included.
    """
    parts = unframe(raw) if not isinstance(raw, str) else None
    head = bytes(parts[0]) if parts else bytes(raw) if isinstance(raw, memoryview) else raw
    try:
        return EVENT_ADAPTER.validate_json(head, context=_frame_context(parts))
    except Exception as exc:
        first = exc
    data = _json(head)
    try:
        version = SchemaVersion.parse(data.get("schema_version") if isinstance(data, dict) else None)
    except ValueError:
        raise first from None  # the validator's own errors say what is wrong
    if version.major > SCHEMA_VERSION.major:
        raise ValueError(
            f"a {data.get('kind')!r} event of schema {version}: this code ({SCHEMA_VERSION}) reads major "
            f"{SCHEMA_VERSION.major} and older; upgrade this process"
        ) from None
    if version.major == SCHEMA_VERSION.major:
        unknown = _unknown_fields(first) if version.minor > SCHEMA_VERSION.minor else None
        if unknown is None:
            raise first
        for loc in unknown:
            _drop(data, loc)
        event = EVENT_ADAPTER.validate_json(_json_bytes(data), context=_frame_context(parts))
        if ignored is not None:
            ignored.extend((str(loc[0]), ".".join(str(p) for p in loc[1:] if isinstance(p, str))) for loc in unknown)
        return event
    try:
        upcasted = upcast(data)
    except (TypeError, KeyError, AttributeError) as exc:  # an upcaster met a shape it does not know
        raise ValueError(f"cannot upcast {data.get('kind')!r} from schema_version {version}: {exc!r}") from exc
    # back through the JSON validator: arrays in the head (references, base64) read as on the fast path
    return EVENT_ADAPTER.validate_json(_json_bytes(upcasted), context=_frame_context(parts), strict=False)


def _unknown_fields(exc: Exception) -> list[tuple[str | int, ...]] | None:
    """Where a validation failed only on fields the model does not know (None: on anything else)."""
    if not isinstance(exc, ValidationError):
        return None
    errors = exc.errors()
    if not errors or any(e["type"] != "extra_forbidden" or len(e["loc"]) < 2 for e in errors):
        return None
    return [tuple(e["loc"]) for e in errors]


def _drop(data: dict[str, Any], loc: tuple[str | int, ...]) -> None:
    """Remove the field at ``loc`` (the kind first, as a discriminated union reports it)."""
    node: Any = data
    for step in loc[1:-1]:
        node = node[step]
    del node[loc[-1]]


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
    """A payload of an older major rewritten, one major at a time, into this code's version."""
    kind = data.get("kind")
    major = SchemaVersion.parse(data.get("schema_version", str(SCHEMA_VERSION))).major
    while major < SCHEMA_VERSION.major:
        step = UPCASTERS.get((str(kind), major))
        if step is None:
            raise ValueError(f"no upcaster for {kind} schema_version {major}")
        data = step(data)
        major += 1
        data["schema_version"] = str(SchemaVersion(major, 0))
    data["schema_version"] = str(SCHEMA_VERSION)
    return data


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of every event, keyed by kind."""
    return {kind: model.model_json_schema() for kind, model in KIND_TO_MODEL.items()}
