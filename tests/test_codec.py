"""The wire codec: token ids and log-probs array-backed in Python, raw arrays in a frame on the wire,
JSON (base64 or plain lists) still read."""

from __future__ import annotations

import base64
import copy
import json
import math
import pickle
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
    FloatArray,
    GroupScored,
    IntArray,
    StepJudged,
    StepTaken,
    TrainingSample,
    decode,
    encode,
    encode_json,
    envelope,
    json_schemas,
    kind_of,
)
from coevo.schemas.packed import MAGIC, Floats, PackedArray, TokenIds
from tests.samples import sample_events

SAMPLES = {kind_of(type(e)): e for e in sample_events("codec")}
PACKED_FIELDS = ("prompt_token_ids", "response_token_ids", "logprobs", "allowed_token_ids")

ints = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=50)
floats = st.lists(st.floats(allow_nan=False), max_size=50)  # NaN != NaN: equality cannot hold


@st.composite
def tokens(draw: Any) -> dict[str, Any]:
    return {
        "prompt_token_ids": draw(ints),
        "response_token_ids": draw(ints),
        "logprobs": draw(floats),
        "allowed_token_ids": draw(st.none() | ints),
    }


@st.composite
def events(draw: Any) -> Event:
    """Any event type, its number lists (top level, in votes, in training samples) drawn."""
    e = SAMPLES[draw(st.sampled_from(sorted(SAMPLES)))]
    if isinstance(e, StepTaken):
        return e.model_copy(update=draw(tokens()))
    if isinstance(e, StepJudged):
        return e.model_copy(update={"votes": [v.model_copy(update=draw(tokens())) for v in e.votes]})
    if isinstance(e, GroupScored):
        return e.model_copy(
            update={
                "policy_samples": [s.model_copy(update=draw(tokens())) for s in e.policy_samples],
                "judge_samples": [s.model_copy(update=draw(tokens())) for s in e.judge_samples],
            }
        )
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


def _frame_parts(raw: bytes) -> tuple[dict[str, Any], bytes]:
    assert raw[:4] == MAGIC
    (n,) = struct.unpack_from("<I", raw, 4)
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _array(head: dict[str, Any], blob: bytes, field: str) -> bytes:
    start, n = (int(x) for x in head[field][1:].split(":"))
    return blob[start : start + n]


def test_the_wire_is_a_frame_of_json_head_and_little_endian_arrays() -> None:
    step = SAMPLES["step.taken"].model_copy(
        update={"prompt_token_ids": IntArray([1, 258, 151_935]), "logprobs": FloatArray([-0.25, -1e-9])}
    )
    raw = encode(step)
    head, blob = _frame_parts(raw)
    assert (len(raw) - len(blob)) % 8 == 0  # the arrays start 8-aligned
    assert _array(head, blob, "prompt_token_ids") == b"\x01\0\0\0\x02\x01\0\0\x7f\x51\x02\0"
    assert _array(head, blob, "logprobs") == struct.pack("<2d", -0.25, -1e-9)
    assert all(int(head[f][1:].split(":")[0]) % 8 == 0 for f in ("prompt_token_ids", "response_token_ids", "logprobs"))
    assert head["allowed_token_ids"] is None
    assert decode(raw) == step
    bare = SAMPLES["task.scheduled"]  # nothing to pack: plain JSON, readable as it is
    assert encode(bare)[:1] == b"{" and decode(encode(bare)) == bare


def test_one_json_document_carries_arrays_as_base64_or_lists() -> None:
    step = SAMPLES["step.taken"].model_copy(
        update={"prompt_token_ids": IntArray([1, 258, 151_935]), "logprobs": FloatArray([-0.25, -1e-9])}
    )
    wire = json.loads(encode_json(step))
    assert base64.urlsafe_b64decode(wire["prompt_token_ids"]) == b"\x01\0\0\0\x02\x01\0\0\x7f\x51\x02\0"
    assert decode(encode_json(step)) == step
    assert json.loads(encode_json(step.model_copy(update={"response_token_ids": []})))["response_token_ids"] == []
    wire["prompt_token_ids"] = base64.b64encode(struct.pack("<3i", 1, 258, 151_935)).decode()  # standard alphabet
    wire["logprobs"] = [-0.25, -1e-9]  # other writers may use plain lists
    assert decode(json.dumps(wire)) == step


def test_python_side_is_array_backed_and_behaves_like_a_list() -> None:
    step = StepTaken.model_validate(
        {**dict(SAMPLES["step.taken"]), "prompt_token_ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.5]}
    )
    ids, lps = step.prompt_token_ids, step.logprobs
    assert isinstance(ids, IntArray) and isinstance(lps, FloatArray)
    assert ids == [5, 6, 7, 8] and [5, 6, 7, 8] == ids and ids != [5, 6, 7] and ids != [5, 6, 7, 9]
    assert len(ids) == 4 and ids[1] == 6 and ids[-1] == 8 and ids[1:3] == [6, 7] and list(ids) == [5, 6, 7, 8]
    assert ids + [9] == [5, 6, 7, 8, 9] and [4] + ids == [4, 5, 6, 7, 8]  # noqa: RUF005 (what "+" does)
    assert 7 in ids and ids.index(7) == 2
    assert lps.tolist() == [-0.5, -1.5] and sum(lps) == -2.0 and type(lps[0]) is float and type(ids[0]) is int
    assert step.model_dump()["prompt_token_ids"] == [5, 6, 7, 8] and type(step.model_dump()["logprobs"]) is list
    again = decode(encode(step))
    assert again == step and hash(again.prompt_token_ids) == hash(ids)
    assert pickle.loads(pickle.dumps(again)) == step and copy.deepcopy(again) == step
    assert repr(IntArray(range(10))) == "IntArray([0, 1, 2, 3, 4, 5, 6, 7], ... 2 more)"


def test_a_decoded_frame_wraps_the_message_bytes_instead_of_copying_them() -> None:
    raw = encode(SAMPLES["step.taken"].model_copy(update={"prompt_token_ids": IntArray(range(1000))}))
    ids = decode(raw).prompt_token_ids
    assert ids.wire_bytes().obj is raw  # a view of the message: no number is a Python object yet
    assert ids == list(range(1000))


def test_values_outside_int32_are_refused_not_wrapped() -> None:
    with pytest.raises(ValidationError, match="out of range"):
        StepTaken.model_validate({**dict(SAMPLES["step.taken"]), "prompt_token_ids": [2**40]})
    body = json.loads(encode_json(SAMPLES["step.taken"]))
    body["prompt_token_ids"] = [-(2**31) - 1]
    with pytest.raises(ValidationError, match="out of range"):
        decode(json.dumps(body))


def test_exports_for_people_hold_plain_lists_and_decode_back() -> None:
    step = SAMPLES["step.taken"].model_copy(
        update={"prompt_token_ids": IntArray([1, 258]), "logprobs": FloatArray([-0.5])}
    )
    readable = step.model_dump(mode="json", context={"lists": True})
    assert readable["prompt_token_ids"] == [1, 258] and readable["logprobs"] == [-0.5]
    assert decode(json.dumps(readable)) == step


def test_frames_are_smaller_than_plain_lists_for_real_token_ids() -> None:
    step = StepTaken.model_validate(
        {
            **dict(SAMPLES["step.taken"]),
            "prompt_token_ids": [(k * 2_654_435_761) % 151_936 for k in range(2000)],
            "response_token_ids": [(k * 40_503) % 151_936 for k in range(500)],
            "logprobs": [-math.log1p(k) / 7 for k in range(500)],
        }
    )
    assert len(encode(step)) < 0.8 * len(encode_json(step)) < 0.8 * len(_legacy(step))


def test_python_side_is_strict() -> None:
    sample = SAMPLES["group.scored"].policy_samples[0]  # type: ignore[attr-defined]
    dumped = sample.model_dump()
    assert dumped["prompt_token_ids"] == [1, 2] and dumped["logprobs"] == [-0.5]
    assert TrainingSample.model_validate(dumped) == sample
    for bad in ("AQAAAAIAAAA=", "@0:8", [True], ["1"], [1.5]):  # packed forms exist only on the wire
        with pytest.raises(ValidationError):
            TrainingSample.model_validate({**dumped, "prompt_token_ids": bad})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("not base64!", "valid base64"),
        ("AAA=", "whole number"),  # 2 bytes: half an int32
        ("AQAA\nAA==", "valid base64"),
        ("é", "valid base64"),
        ("@0:8", "outside a frame"),  # a reference means nothing in plain JSON
        ([1.5], "valid integer"),
        (["1"], "valid integer"),
        ({"a": 1}, "valid bytes"),
    ],
)
def test_a_malformed_packed_field_is_a_validation_error(value: Any, why: str) -> None:
    body = json.loads(encode_json(SAMPLES["step.taken"]))
    body["prompt_token_ids"] = value
    with pytest.raises(ValidationError, match=why):
        decode(json.dumps(body))


def _reframe(head: dict[str, Any], blob: bytes) -> bytes:
    text = json.dumps(head).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + blob


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda h, b: (h | {"prompt_token_ids": "@0:100000"}, b), "past the frame"),
        (lambda h, b: (h | {"prompt_token_ids": "@0:6"}, b), "whole number"),
        (lambda h, b: (h | {"logprobs": "@0:12"}, b), "8-byte"),
        (lambda h, b: (h | {"logprobs": "@4:8"}, b), "not 8-aligned"),
        (lambda h, b: (h | {"prompt_token_ids": "@٠:١٢"}, b), "valid base64"),  # digits are ASCII digits
        (lambda h, b: (h | {"prompt_token_ids": "@-1:4"}, b), "valid base64"),  # not a reference: read as base64
    ],
)
def test_a_malformed_frame_reference_is_a_validation_error(edit: Any, why: str) -> None:
    raw = encode(SAMPLES["step.taken"])
    with pytest.raises(ValidationError, match=why):
        decode(_reframe(*edit(*_frame_parts(raw))))


def test_a_frame_cannot_decode_into_more_numbers_than_it_holds() -> None:
    """Many references to the same bytes would turn a small message into a huge event (and a huge
    re-encoding downstream): together a frame's references may name at most its arrays' bytes."""
    judged = SAMPLES["step.judged"]
    vote = judged.votes[0].model_copy(update={"prompt_token_ids": IntArray(range(256))})  # type: ignore[attr-defined]
    raw = encode(judged.model_copy(update={"votes": [vote] * 3}))
    head, blob = _frame_parts(raw)
    assert decode(raw) == judged.model_copy(update={"votes": [vote] * 3})  # distinct copies: fine
    first = head["votes"][0]["prompt_token_ids"]
    assert first == "@0:1024"
    for v in head["votes"]:
        v["prompt_token_ids"] = first  # every vote points at the first vote's 1 KB, all the frame holds
    with pytest.raises(ValidationError, match="more bytes than"):
        decode(_reframe(head, blob[:1024]))


def test_a_truncated_frame_is_a_value_error() -> None:
    raw = encode(SAMPLES["step.taken"])
    for cut in (MAGIC, raw[:6], raw[:12], raw[:-4]):
        with pytest.raises(ValueError):
            decode(cut)
    with pytest.raises(ValueError, match="head"):
        decode(MAGIC + struct.pack("<I", 10**6) + raw[8:])


def test_packed_float_lists_must_be_whole_float64s() -> None:
    body = json.loads(encode_json(SAMPLES["step.taken"]))
    body["logprobs"] = base64.b64encode(b"\0" * 12).decode()
    with pytest.raises(ValidationError, match="8-byte"):
        decode(json.dumps(body))


def test_schema_export_documents_every_wire_form() -> None:
    prop = json_schemas()["step.taken"]["properties"]
    forms = prop["prompt_token_ids"]["anyOf"]
    assert {"type": "array", "items": {"type": "integer"}} in forms
    assert any("frame" in f.get("description", "") for f in forms)
    assert any(f.get("contentEncoding") == "base64" and "int32" in f["description"] for f in forms)
    assert any(f.get("items") == {"type": "number"} for f in prop["logprobs"]["anyOf"])
    assert {"type": "null"} in prop["allowed_token_ids"]["anyOf"]


def test_the_annotations_are_the_public_types() -> None:
    for alias in (TokenIds, Floats):
        assert any(isinstance(m, PackedArray) for m in alias.__metadata__)  # type: ignore[attr-defined]
    assert set(PACKED_FIELDS) <= set(StepTaken.model_fields)


def test_bench_codec_measures_every_form_of_a_real_shaped_step() -> None:
    from coevo.bench.bus import SIZES, bench_codec, make_event

    out = bench_codec(n=25)
    assert set(out) == set(SIZES)
    large = out["large"]
    assert large["wire_bytes"] < large["json_base64_bytes"] < large["json_lists_bytes"]
    assert all(v > 0 for v in large.values())
    step = make_event("r", SIZES["large"], 1)
    assert isinstance(step.prompt_token_ids, IntArray) and len(step.prompt_token_ids) > 2000  # as a producer builds it
    assert abs(len(encode(step)) - SIZES["large"]) < 0.1 * SIZES["large"]


def test_an_old_version_frame_goes_through_its_upcaster_with_its_arrays(monkeypatch) -> None:
    """The durable log will hold frames of today's version once it is an old one: the upcaster sees
    the head (references as they are) and the arrays are read from the frame as on the fast path."""
    from coevo.schemas.registry import UPCASTERS

    step = StepTaken.model_validate(
        {**dict(SAMPLES["step.taken"]), "prompt_token_ids": list(range(300)), "logprobs": [-0.5, -1.5]}
    )
    head, blob = _frame_parts(encode(step))
    head["schema_version"] = 0
    head["text"] = head.pop("response_text")  # the field's old name

    def v0_to_v1(d: dict[str, Any]) -> dict[str, Any]:
        d["response_text"] = d.pop("text")
        return d

    monkeypatch.setitem(UPCASTERS, ("step.taken", 0), v0_to_v1)
    b64 = json.loads(encode_json(step)) | {"schema_version": 0}
    b64["text"] = b64.pop("response_text")
    assert decode(_reframe(head, blob)) == step
    assert decode(json.dumps(b64)) == step


def test_odd_inputs_give_value_errors_or_events() -> None:
    raw = encode(SAMPLES["step.taken"])
    assert decode(memoryview(raw)) == SAMPLES["step.taken"]
    assert decode(memoryview(encode(SAMPLES["task.scheduled"]))) == SAMPLES["task.scheduled"]
    for deep in (b"[" * 5000 + b"]" * 5000, MAGIC + struct.pack("<I", 10_000) + b"[" * 5000 + b"]" * 5000):
        with pytest.raises(ValueError):
            decode(deep)
    assert envelope(b"[" * 5000) is None and envelope(raw)["kind"] == "step.taken"


def test_equal_arrays_hash_alike_and_fields_keep_their_kind() -> None:
    assert hash(FloatArray([0.0])) == hash(FloatArray([-0.0])) and FloatArray([0.0]) == FloatArray([-0.0])
    assert IntArray([1, 2]) != (1, 2) and IntArray([1]) != FloatArray([1.0])
    step = SAMPLES["step.taken"]
    swapped = step.model_copy(update={"logprobs": IntArray([1, 2])})  # an id array put where floats go
    assert decode(encode(swapped)).logprobs == [1.0, 2.0]  # written as the field's kind, not reinterpreted
