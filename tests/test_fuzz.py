"""Garbage in, a clear outcome out: fuzzing every event type's decoding (hypothesis), then the same
garbage on every subject of a real server, dead-lettered with a reason while the agent keeps running."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Consumer, Subscription
from coevo.schemas import (
    EVENT_TYPES,
    DeadLettered,
    Event,
    Source,
    decode,
    encode,
    encode_json,
    kind_of,
    new_id,
    subject_for,
)
from coevo.schemas.packed import MAGIC
from tests.samples import sample_events

VALID = {kind_of(type(e)): json.loads(encode_json(e)) for e in sample_events("fuzz")}
FRAMES = [encode(e) for e in sample_events("fuzz") if encode(e)[:4] == MAGIC]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: Any) -> bytes:
    """A valid event of some kind with one field replaced, dropped, or an unknown one added."""
    kind = draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[kind])
    field = draw(st.sampled_from(sorted(body)))
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "replace":
        body[field] = draw(json_values)
    elif action == "drop":
        body.pop(field)
    else:
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return json.dumps(body).encode()


@st.composite
def broken_frames(draw: Any) -> bytes:
    """A valid frame (JSON head + raw arrays) cut short, with bytes overwritten, its head length
    changed, or an array reference moved; or the frame magic before random bytes."""
    if draw(st.booleans()):
        return MAGIC + draw(st.binary(max_size=64))
    raw = bytearray(draw(st.sampled_from(FRAMES)))
    action = draw(st.sampled_from(["cut", "overwrite", "head_length", "reference"]))
    if action == "cut":
        return bytes(raw[: draw(st.integers(0, len(raw) - 1))])
    if action == "overwrite":
        at = draw(st.integers(0, len(raw) - 1))
        chunk = draw(st.binary(min_size=1, max_size=16))
        return bytes(raw[:at] + chunk + raw[at + len(chunk) :])
    if action == "head_length":
        return bytes(raw[:4] + draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little") + raw[8:])
    at = raw.find(b'"@') + 2  # a reference's offset, or (after its colon) its length
    if draw(st.booleans()):
        at = raw.index(b":", at) + 1
    return bytes(raw[:at] + str(draw(st.integers(0, 10**6))).encode() + raw[at + 1 :])


def _outcome(raw: bytes) -> str:
    """decode either returns a valid event or raises ValueError (ValidationError is one): nothing else."""
    try:
        event = decode(raw)
    except ValidationError:
        return "invalid"
    except ValueError:
        return "undecodable"
    assert isinstance(event, Event) and decode(encode(event)) == event
    return "valid"


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256) | mutated() | broken_frames())
def test_decoding_garbage_is_a_value_error_or_a_valid_event(raw: bytes) -> None:
    assert _outcome(raw) in ("valid", "invalid", "undecodable")


def test_every_event_type_is_fuzzed() -> None:
    assert set(VALID) == {kind_of(t) for t in EVENT_TYPES}
    assert {kind_of(decode(f)) for f in FRAMES} >= {"step.taken", "group.scored"}  # events with arrays


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.lists(st.binary(max_size=64) | mutated() | broken_frames(), min_size=len(VALID), max_size=len(VALID)))
async def test_garbage_on_every_subject_is_dead_lettered_and_the_consumer_keeps_running(
    nats_url: str, garbage: list[bytes]
) -> None:
    async with await NatsBus.connect(nats_url, f"fz{new_id()[:12]}") as bus:  # a run of its own per example
        await _garbage_then_one_event(bus, garbage)


async def _garbage_then_one_event(bus: NatsBus, garbage: list[bytes]) -> None:
    kinds = sorted(k for k in VALID if k != "dead.lettered")[: len(garbage)]
    seen: list[Event] = []

    async def handler(event: Event, _d: Any) -> None:
        seen.append(event)

    sub = Subscription(f"fuzz-{new_id()[:8]}", tuple(t for t in EVENT_TYPES if kind_of(t) in kinds), handler)
    consumer = Consumer(bus, sub, Source(agent_id="fuzz", role="fuzz"))
    start = await bus.last_sequence()
    for kind, raw in zip(kinds, garbage, strict=False):  # none of it is an event of this run
        await bus.publish_raw(subject_for(bus.run_id, kind), raw, f"fuzz-{start}-{kind}")
    good = sample_events(bus.run_id)[0]
    await bus.publish(good)  # after the garbage: still consumed
    await bus.flush()
    stop = asyncio.Event()
    async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
        tg.create_task(consumer.run(stop))
        while consumer.stats.handled + consumer.stats.dead_lettered < len(kinds) + 1:
            await asyncio.sleep(0.05)
        stop.set()
    letters = [
        e
        async for _, e, _ in bus.history(["dead.lettered"], start_seq=start + 1)
        if isinstance(e, DeadLettered) and e.consumer == sub.durable
    ]
    assert consumer.stats.dead_lettered == len(kinds) and consumer.stats.crashed == 0
    assert len(letters) == len(kinds) and all(letter.reason for letter in letters)
    assert [e.event_id for e in seen] == [good.event_id]
