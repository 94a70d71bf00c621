"""``coevo bench bus`` and ``coevo bench codec``: numbers, written as JSON.

The bus benchmark runs coevo's typed bus and plain nats-py against the same server in the same
process, alternating, ``repeats`` pairs: publish (bounded async, acks awaited) then consume
(pull, ack) ``count`` events of each size in ``SIZES``. Both publish the same bytes: the plain
client gets the typed bus's encoded events up front (its encoding is not timed), the typed bus
encodes and decodes every event itself. The ratio is the median over pairs of (typed / plain)
end-to-end rates, each pair run back to back (in alternating order) so both halves see the same machine (a shared VM's
speed drifts by ±20 % between runs: a ratio of two independent bests moves with it); the rates
reported beside it are each client's best run, and ``ratio_of_best`` their quotient;
``publish_ratio`` and ``consume_ratio`` are the medians of the pairs' ratios for each half.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

from coevo.config import BusConfig, StreamConfig
from coevo.observe.progress import tracked
from coevo.schemas import Event, Source, StepTaken, decode, encode, encode_json, new_id

SIZES = {"small": 300, "large": 24_000}
"""Target wire size per event: ``small`` is a bare step (envelope and text only), ``large`` a step of
a few thousand tokens, as real ``StepTaken`` events are."""

VOCAB = 151_936  # token ids spread over a real tokenizer's vocabulary (Qwen's)
PROMPTS = 64  # distinct token lists, shared round-robin (a group's rollouts share a prompt)


def make_event(run_id: str, target_bytes: int, i: int) -> StepTaken:
    """A ``StepTaken`` shaped like a real one, ``target_bytes`` long on the wire: envelope and text,
    then token ids (prompt 4 : response 1) with one log-prob per response token."""
    base = StepTaken(
        run_id=run_id,
        source=Source(agent_id="bench", role="bench", model_version=3),
        trajectory_id=f"tr{i}",
        task_id="t",
        group_id="g",
        step_index=i % 6,
        objective="reach the treasure room",
        observation="You are in a hall. Exits: north, east.",
        candidates=["go north", "go east", "take key"],
        response_text="go north",
        action_index=0,
        action_text="go north",
        next_observation="You are in the library.",
        policy_version=3,
    )
    per_unit = len(encode(_with_tokens(base, 100, 0))) - len(encode(base))  # 100 units: 80 prompt, 20 response
    units = max(0, (target_bytes - len(encode(base))) * 100 // per_unit)
    return _with_tokens(base, units, i)


def _with_tokens(base: StepTaken, units: int, i: int) -> StepTaken:
    n_prompt, n_response = units * 4 // 5, units // 5
    seed = i % PROMPTS
    return StepTaken.model_validate(
        {  # validated, as a producer's constructor call is: arrays, not lists
            **dict(base),
            "event_id": new_id(),
            "prompt_token_ids": _tokens(n_prompt, seed),
            "response_token_ids": _tokens(n_response, seed + PROMPTS),
            "logprobs": _logprobs(n_response, seed),
        }
    )


@functools.lru_cache(maxsize=8 * PROMPTS)
def _tokens(n: int, seed: int) -> list[int]:
    return [((seed * 7919 + k) * 2_654_435_761) % VOCAB for k in range(n)]


@functools.lru_cache(maxsize=8 * PROMPTS)
def _logprobs(n: int, seed: int) -> list[float]:
    return [-(((seed * 31 + k) * 0.618_034 % 1.0) ** 3) * 6.0 for k in range(n)]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _coevo_once(url: str, events: list[Event], cfg: BusConfig) -> dict[str, float]:
    from coevo.runtime.bus import NatsBus
    from coevo.runtime.consumer import Consumer, Subscription

    run_id = events[0].run_id
    bus = await NatsBus.connect(url, run_id, bus=cfg, stream=StreamConfig(storage="file"))
    try:
        bus.stats.track_latency = True
        t0 = time.perf_counter()
        for e in events:
            await bus.publish(e)
        await bus.flush(60)
        t_pub = time.perf_counter() - t0
        done = asyncio.Event()
        count = 0

        async def handler(event: Event, _d: Any) -> None:
            nonlocal count
            count += 1
            if count == len(events):
                done.set()

        consumer = Consumer(
            bus, Subscription("bench", (type(events[0]),), handler), Source(agent_id="bench", role="bench")
        )
        stop = asyncio.Event()
        t1 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(consumer.run(stop))
            await asyncio.wait_for(done.wait(), 120)
            t_con = time.perf_counter() - t1
            stop.set()
        lat = bus.stats.latencies_ms
        return {
            "publish_per_s": len(events) / t_pub,
            "consume_per_s": len(events) / t_con,
            "end_to_end_per_s": len(events) / (t_pub + t_con),
            "p50_ms": statistics.median(lat),
            "p99_ms": _pct(lat, 0.99),
        }
    finally:
        await bus.js.delete_stream(bus.stream)
        await bus.close()


async def _plain_once(url: str, run_id: str, payloads: list[bytes], max_pending: int, batch: int) -> dict[str, float]:
    import nats
    from nats.js import api

    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=max_pending)
    stream = f"PLAIN_{run_id}"
    subject = f"plain.{run_id}.x"
    await js.add_stream(
        api.StreamConfig(name=stream, subjects=[subject], storage=api.StorageType.FILE, duplicate_window=120.0)
    )
    try:
        lat: list[float] = []
        t0 = time.perf_counter()
        for p in payloads:
            start = time.perf_counter()
            fut = await js.publish_async(subject, p, headers={"Nats-Msg-Id": new_id()})

            def acked(_f: asyncio.Future[Any], s: float = start) -> None:
                lat.append((time.perf_counter() - s) * 1e3)

            fut.add_done_callback(acked)
        await js.publish_async_completed()
        t_pub = time.perf_counter() - t0
        sub = await js.pull_subscribe(
            subject,
            durable="plain",
            stream=stream,
            config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=1000),
        )
        t1 = time.perf_counter()
        got = 0
        while got < len(payloads):
            for m in await sub.fetch(batch, timeout=5):
                await m.ack()
                got += 1
        t_con = time.perf_counter() - t1
        return {
            "publish_per_s": len(payloads) / t_pub,
            "consume_per_s": len(payloads) / t_con,
            "end_to_end_per_s": len(payloads) / (t_pub + t_con),
            "p50_ms": statistics.median(lat),
            "p99_ms": _pct(lat, 0.99),
        }
    finally:
        await js.delete_stream(stream)
        await nc.close()


def _paired(coevo_runs: list[dict[str, float]], plain_runs: list[dict[str, float]], key: str) -> list[float]:
    return [c[key] / p[key] for c, p in zip(coevo_runs, plain_runs, strict=True)]


def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    best = max(runs, key=lambda r: r["end_to_end_per_s"])
    return {k: round(v, 3) for k, v in best.items()}


async def bench_bus(count: int = 20_000, repeats: int = 5, url: str | None = None) -> dict[str, Any]:
    from coevo.runtime.app import nats_endpoint

    cfg = BusConfig()
    with tempfile.TemporaryDirectory() as tmp:
        async with nats_endpoint(url, Path(tmp) / "nats") as where:
            endpoint = where.url
            out: dict[str, Any] = {"count": count, "repeats": repeats, "sizes": {}}
            ratios = []
            for label, size in tracked(list(SIZES.items()), f"bench bus: {count} events x {repeats}", unit="sizes"):
                coevo_runs: list[dict[str, float]] = []
                plain_runs: list[dict[str, float]] = []
                for rep in range(repeats):
                    run_id = f"bench{new_id()[:8]}"
                    events: list[Event] = [make_event(run_id, size, i) for i in range(count)]
                    payloads = [encode(e) for e in events]
                    pair = [
                        (
                            plain_runs,
                            functools.partial(
                                _plain_once, endpoint, run_id, payloads, cfg.max_inflight_publishes, cfg.fetch_batch
                            ),
                        ),
                        (coevo_runs, functools.partial(_coevo_once, endpoint, events, cfg)),
                    ]
                    # alternate which goes first: the second runs while the server still deletes the first's files
                    for runs, once in pair[::-1] if rep % 2 else pair:
                        runs.append(await once())
                paired = _paired(coevo_runs, plain_runs, "end_to_end_per_s")
                ratio = statistics.median(paired)
                ratios.append(ratio)
                c, p = _best(coevo_runs), _best(plain_runs)
                probe = make_event(run_id, size, 0)
                out["sizes"][label] = {
                    "event_bytes": len(payloads[0]),
                    "token_ids": len(probe.prompt_token_ids) + len(probe.response_token_ids),
                    "logprobs": len(probe.logprobs),
                    "coevo": c,
                    "nats_py": p,
                    "ratio": round(ratio, 3),
                    "paired_ratios": [round(r, 3) for r in paired],
                    "publish_ratio": round(statistics.median(_paired(coevo_runs, plain_runs, "publish_per_s")), 3),
                    "consume_ratio": round(statistics.median(_paired(coevo_runs, plain_runs, "consume_per_s")), 3),
                    "ratio_of_best": round(c["end_to_end_per_s"] / p["end_to_end_per_s"], 3),
                }
            out["ratio"] = round(min(ratios), 3)
            out["target_ratio"] = 0.9
            return out


def bench_codec(n: int = 5000) -> dict[str, Any]:
    """Per event size: the wire format (a frame: JSON head + raw arrays), one JSON document with the
    arrays as base64 (``encode_json``: files, and the wire before frames), the same JSON with plain
    number lists (what events written before the packed codec hold), and msgpack of the dumped dict."""
    import msgspec
    from pydantic_core import to_json

    from coevo.schemas.registry import EVENT_ADAPTER

    def per_call_us(fn: Any, arg: Any) -> float:  # best of 5 rounds: what the code costs, not the machine's load
        return min(timeit.repeat(lambda: fn(arg), number=max(1, n // 5), repeat=5)) / max(1, n // 5) * 1e6

    out: dict[str, Any] = {}
    for label, size in SIZES.items():
        e = make_event("bench", size, 1)
        raw, b64, lists = encode(e), encode_json(e), to_json(e.model_dump())
        packed = msgspec.msgpack.encode(e.model_dump())
        res = {
            "wire_encode_us": per_call_us(encode, e),
            "wire_decode_us": per_call_us(decode, raw),
            "wire_bytes": len(raw),
            "json_base64_encode_us": per_call_us(encode_json, e),
            "json_base64_decode_us": per_call_us(decode, b64),
            "json_base64_bytes": len(b64),
            "json_lists_decode_us": per_call_us(decode, lists),
            "json_lists_bytes": len(lists),
            "msgpack_encode_us": per_call_us(lambda x: msgspec.msgpack.encode(x.model_dump()), e),
            "msgpack_decode_us": per_call_us(
                lambda b: EVENT_ADAPTER.validate_python(msgspec.msgpack.decode(b)), packed
            ),
            "msgpack_bytes": len(packed),
        }
        out[label] = {k: round(v, 2) for k, v in res.items()}
    return out
