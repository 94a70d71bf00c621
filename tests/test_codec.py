"""The wire codec: token ids and log-probs packed on the wire, plain lists in Python, old events still read."""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from pydantic_core import to_json

from coevo.schemas import (
    EVENT_TYPES,
    Event,
    GroupScored,
    StepJudged,
    StepTaken,
    TrainingSample,
    decode,
    encode,
    json_schemas,
    kind_of,
)
from coevo.schemas.packed import Floats, PackedArray, TokenIds
from tests.samples import sample_events

SAMPLES = {kind_of(type(e)): e for e in sample_events("codec")}
PACKED_FIELDS = ("prompt_token_ids", "response_token_ids", "logprobs", "allowed_token_ids")

ints = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=50)
any_ints = ints | st.lists(st.integers(), max_size=5)  # outside int32: written as a plain list
floats = st.lists(st.floats(allow_nan=False), max_size=50)  # NaN != NaN: equality cannot hold


@st.composite
def tokens(draw: Any) -> dict[str, Any]:
    return {"prompt_token_ids": draw(any_ints), "response_token_ids": draw(ints), "logprobs": draw(floats),
            "allowed_token_ids": draw(st.none() | ints)}


@st.composite
def events(draw: Any) -> Event:
    """Any event type, its number lists (top level, in votes, in training samples) drawn."""
    e = SAMPLES[draw(st.sampled_from(sorted(SAMPLES)))]
    if isinstance(e, StepTaken):
        return e.model_copy(update=draw(tokens()))
    if isinstance(e, StepJudged):
        return e.model_copy(update={"votes": [v.model_copy(update=draw(tokens())) for v in e.votes]})
    if isinstance(e, GroupScored):
        return e.model_copy(update={
            "policy_samples": [s.model_copy(update=draw(tokens())) for s in e.policy_samples],
            "judge_samples": [s.model_copy(update=draw(tokens())) for s in e.judge_samples]})
    return e


@settings(max_examples=300, deadline=None)
@given(events())
def test_every_event_type_round_trips_with_any_number_lists(event: Event) -> None:
    assert decode(encode(event)) == event


def test_the_strategy_covers_every_event_type() -> None:
    assert set(SAMPLES) == {kind_of(t) for t in EVENT_TYPES}


def _legacy(event: Event) -> bytes:
    """The event as written before the packed codec: every list a plain JSON list."""
    return to_json(event.model_dump(), bytes_mode="base64")


@settings(max_examples=100, deadline=None)
@given(events())
def test_events_written_with_plain_lists_still_decode(event: Event) -> None:
    """The durable log holds events written before the packed codec: they read back the same."""
    assert decode(_legacy(event)) == event


def test_the_wire_holds_packed_little_endian_arrays() -> None:
    step = SAMPLES["step.taken"].model_copy(update={"prompt_token_ids": [1, 258, 151_935],
                                                   "logprobs": [-0.25, -1e-9]})
    wire = json.loads(encode(step))
    assert base64.urlsafe_b64decode(wire["prompt_token_ids"]) == b"\x01\0\0\0\x02\x01\0\0\x7f\x51\x02\0"
    assert base64.urlsafe_b64decode(wire["logprobs"]) == struct.pack("<2d", -0.25, -1e-9)
    assert wire["allowed_token_ids"] is None
    assert json.loads(encode(step.model_copy(update={"response_token_ids": []})))["response_token_ids"] == []
    body = json.loads(encode(step))  # other writers may use the standard alphabet, or plain lists
    body["prompt_token_ids"] = base64.b64encode(struct.pack("<3i", 1, 258, 151_935)).decode()
    body["logprobs"] = [-0.25, -1e-9]
    assert decode(json.dumps(body)) == step
    # beyond int32: a plain list, read back exactly
    wide = step.model_copy(update={"prompt_token_ids": [2**40, -(2**63)]})
    assert json.loads(encode(wide))["prompt_token_ids"] == [2**40, -(2**63)]
    assert decode(encode(wide)) == wide


def test_exports_for_people_hold_plain_lists_and_decode_back() -> None:
    step = SAMPLES["step.taken"].model_copy(update={"prompt_token_ids": [1, 258], "logprobs": [-0.5]})
    readable = step.model_dump(mode="json", context={"lists": True})
    assert readable["prompt_token_ids"] == [1, 258] and readable["logprobs"] == [-0.5]
    assert decode(json.dumps(readable)) == step
    assert isinstance(json.loads(encode(step))["prompt_token_ids"], str), "the wire itself stays packed"


def test_packed_is_smaller_than_plain_lists_for_real_token_ids() -> None:
    step = SAMPLES["step.taken"].model_copy(update={
        "prompt_token_ids": [(k * 2_654_435_761) % 151_936 for k in range(2000)],
        "response_token_ids": [(k * 40_503) % 151_936 for k in range(500)],
        "logprobs": [-math.log1p(k) / 7 for k in range(500)]})
    assert len(encode(step)) < 0.8 * len(_legacy(step))


def test_python_side_stays_plain_lists_and_strict() -> None:
    """In Python (the learner's broadcast, model_dump/model_validate) the fields are plain lists."""
    sample = SAMPLES["group.scored"].policy_samples[0]  # type: ignore[attr-defined]
    dumped = sample.model_dump()
    assert dumped["prompt_token_ids"] == [1, 2] and dumped["logprobs"] == [-0.5]
    assert TrainingSample.model_validate(dumped) == sample
    with pytest.raises(ValidationError):
        TrainingSample.model_validate({**dumped, "prompt_token_ids": "AQAAAAIAAAA="})  # packed only in JSON
    with pytest.raises(ValidationError):
        TrainingSample.model_validate({**dumped, "prompt_token_ids": [True]})
    with pytest.raises(ValidationError):
        TrainingSample.model_validate({**dumped, "prompt_token_ids": ["1"]})


@pytest.mark.parametrize(("value", "why"), [
    ("not base64!", "valid base64"),
    ("AAA=", "whole number"),  # 2 bytes: half an int32
    ("AQAA\nAA==", "valid base64"),
    ("é", "valid base64"),
    ([1.5], "valid integer"),
    (["1"], "valid integer"),
    ({"a": 1}, "valid bytes"),
])
def test_a_malformed_packed_field_is_a_validation_error(value: Any, why: str) -> None:
    body = json.loads(encode(SAMPLES["step.taken"]))
    body["prompt_token_ids"] = value
    with pytest.raises(ValidationError, match=why):
        decode(json.dumps(body))


def test_packed_float_lists_must_be_whole_float64s() -> None:
    body = json.loads(encode(SAMPLES["step.taken"]))
    body["logprobs"] = base64.b64encode(b"\0" * 12).decode()
    with pytest.raises(ValidationError, match="8-byte"):
        decode(json.dumps(body))


def test_schema_export_documents_both_wire_forms() -> None:
    prop = json_schemas()["step.taken"]["properties"]
    forms = prop["prompt_token_ids"]["anyOf"]
    assert {"type": "array", "items": {"type": "integer"}} in forms
    assert any(f.get("contentEncoding") == "base64" and "int32" in f["description"] for f in forms)
    assert any(f.get("items") == {"type": "number"} for f in prop["logprobs"]["anyOf"])
    assert {"type": "null"} in prop["allowed_token_ids"]["anyOf"]


def test_the_annotations_are_the_public_types() -> None:
    for alias in (TokenIds, Floats):
        assert any(isinstance(m, PackedArray) for m in alias.__metadata__)  # type: ignore[attr-defined]
    assert set(PACKED_FIELDS) <= set(StepTaken.model_fields)
