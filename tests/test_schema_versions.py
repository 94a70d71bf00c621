"""Schema versions in the codec (no I/O): a newer minor decodes with its unknown fields dropped and
reported, known fields stay strict, older majors are upcast, a newer major is refused, and who may
join or read a run of which version."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from coevo.schemas import (
    SCHEMA_VERSION,
    SchemaVersion,
    StepJudged,
    StepTaken,
    TaskRewritten,
    decode,
    encode,
    encode_json,
    join_refusal,
    run_version,
)
from coevo.schemas.packed import Blob, frame, unframe
from coevo.schemas.versions import LEGACY_MAJOR, RUN_SCHEMA_KEY
from tests.samples import sample_events

SAMPLES = {e.kind: e for e in sample_events("r1")}  # type: ignore[attr-defined]
NEWER_MINOR = str(SchemaVersion(SCHEMA_VERSION.major, SCHEMA_VERSION.minor + 1))
NEWER_MAJOR = str(SchemaVersion(SCHEMA_VERSION.major + 1, 0))


def _as(event: Any, version: str, **extra: Any) -> dict[str, Any]:
    return json.loads(encode_json(event)) | {"schema_version": version} | extra


def test_a_newer_minor_decodes_with_its_unknown_fields_dropped_and_named() -> None:
    """A writer one minor ahead adds fields (at the top, in a nested model, in a list of them): a
    reader keeps everything it knows and names what it dropped; it never refuses the event."""
    judged = SAMPLES["step.judged"]
    assert isinstance(judged, StepJudged)
    data = _as(judged, NEWER_MINOR, judge_temperature=0.7)
    data["source"]["host"] = "h2"
    data["votes"][0]["reasoning_tokens"] = 12
    ignored: list[tuple[str, str]] = []
    got = decode(json.dumps(data), ignored)
    assert got.model_dump(exclude={"schema_version"}) == judged.model_dump(exclude={"schema_version"})
    assert got.schema_version == NEWER_MINOR and got.writer_schema == SchemaVersion.parse(NEWER_MINOR)
    assert sorted(ignored) == [
        ("step.judged", "judge_temperature"),
        ("step.judged", "source.host"),
        ("step.judged", "votes.reasoning_tokens"),
    ]


def test_a_newer_minor_frame_keeps_its_arrays() -> None:
    """The packed wire form (token ids, log-probs as raw arrays): dropping a field of the head
    leaves the arrays read from the frame, exactly."""
    step = StepTaken.model_validate(
        {**dict(SAMPLES["step.taken"]), "prompt_token_ids": list(range(300)), "logprobs": [-0.5, -1.5]}
    )
    parts = unframe(encode(step))
    assert parts is not None
    head = json.loads(bytes(parts[0])) | {"schema_version": NEWER_MINOR, "ref_logprobs_source": "vllm"}
    arrays = Blob()
    arrays.add(bytes(parts[1]))  # the arrays as they were (8-aligned already): references unchanged
    raw = frame(json.dumps(head).encode(), arrays)
    ignored: list[tuple[str, str]] = []
    got = decode(raw, ignored)
    assert isinstance(got, StepTaken) and list(got.prompt_token_ids) == list(range(300))
    assert list(got.logprobs) == [-0.5, -1.5] and ignored == [("step.taken", "ref_logprobs_source")]


def test_known_fields_stay_strict_in_a_newer_minor() -> None:
    """Tolerance is for fields a reader does not know, never for the values of those it does."""
    bad = _as(SAMPLES["task.scheduled"], NEWER_MINOR, priority=3) | {"n_rollouts": "8"}
    with pytest.raises(ValidationError, match="n_rollouts"):
        decode(json.dumps(bad))


def test_an_unknown_field_of_this_minor_or_an_older_one_is_invalid() -> None:
    """Only a newer minor may hold fields this code does not know: at its own version (or older) an
    unknown field is a malformed event."""
    for version in (str(SCHEMA_VERSION), f"{SCHEMA_VERSION.major}.0"):
        with pytest.raises(ValidationError, match="extra"):
            decode(json.dumps(_as(SAMPLES["task.scheduled"], version, priority=3)))


def test_an_older_minor_decodes_with_the_defaults_of_what_it_lacks() -> None:
    data = _as(SAMPLES["step.taken"], f"{SCHEMA_VERSION.major}.0")
    for newer in ("grammar", "env_reward", "allowed_token_ids"):  # fields with defaults
        data.pop(newer)
    got = decode(json.dumps(data))
    assert isinstance(got, StepTaken) and got.grammar is None and got.env_reward is None


def test_a_newer_major_is_refused_naming_both_versions() -> None:
    with pytest.raises(ValueError, match=rf"schema {NEWER_MAJOR}: this code \({SCHEMA_VERSION}\).*upgrade"):
        decode(json.dumps(_as(SAMPLES["task.scheduled"], NEWER_MAJOR)))


def test_events_of_the_legacy_integer_version_are_upcast() -> None:
    """Every release before minors wrote ``schema_version: 1`` (an integer): read as 1.0 and upcast,
    including a ``TaskRewritten`` of the release that briefly wrote ``attempt``."""
    for event in sample_events("r1"):
        got = decode(json.dumps(_as(event, 1)))  # type: ignore[arg-type]
        assert got == event and got.schema_version == str(SCHEMA_VERSION)
    rewritten = SAMPLES["task.rewritten"]
    assert isinstance(rewritten, TaskRewritten)
    assert decode(json.dumps(_as(rewritten, 1, attempt=2))) == rewritten  # type: ignore[arg-type]


def test_the_wire_carries_major_dot_minor() -> None:
    assert json.loads(encode_json(SAMPLES["task.scheduled"]))["schema_version"] == str(SCHEMA_VERSION)
    assert SchemaVersion.parse(1) == (1, 0) and SchemaVersion.parse("2.13") == (2, 13)
    for bad in ("2", "2.1.0", "02.1", True, 1.5, -1, None):
        with pytest.raises(ValueError, match="schema_version"):
            SchemaVersion.parse(bad)
    with pytest.raises(ValidationError, match="schema_version"):  # an event is built at this code's major
        StepTaken.model_validate({**dict(SAMPLES["step.taken"]), "schema_version": NEWER_MAJOR})


@pytest.mark.parametrize(
    ("run", "code", "reading", "refused"),
    [
        ("2.0", "2.0", False, None),
        ("2.0", "2.5", False, None),  # a newer minor joins
        ("2.5", "2.0", False, None),  # an older minor joins
        ("3.0", "2.4", False, "upgrade this process to a release of schema 3.x"),
        ("3.0", "2.4", True, "upgrade this process"),  # nor can it read a newer major
        ("1.0", "2.0", False, "a new major cannot join a running run"),
        ("1.0", "2.0", True, None),  # history of an older major is upcast
    ],
)
def test_who_may_join_or_read_a_run(run: str, code: str, reading: bool, refused: str | None) -> None:
    why = join_refusal("r1", SchemaVersion.parse(run), SchemaVersion.parse(code), reading=reading)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why and f"records event schema {run}, this code's is {code}" in why


def test_a_stream_without_a_recorded_version_is_legacy() -> None:
    assert run_version(None) == run_version({"other": "x"}) == SchemaVersion(LEGACY_MAJOR, 0)
    assert run_version({RUN_SCHEMA_KEY: "2.3"}) == (2, 3)
    with pytest.raises(ValueError):
        run_version({RUN_SCHEMA_KEY: "two"})
