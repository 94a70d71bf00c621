"""``coevo bench bus`` and ``coevo bench codec``: numbers, written as JSON.

The bus benchmark runs coevo's typed bus and plain nats-py against the same server in the same
process, alternating, best of ``repeats``: publish (bounded async, acks awaited) then consume
(pull, ack) ``count`` events of ~300 bytes and ~20 KB.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from coevo.config import BusConfig, StreamConfig
from coevo.observe.progress import tracked
from coevo.schemas import Event, Source, StepTaken, decode, encode, new_id

SIZES = {"small": 300, "large": 20_000}


def make_event(run_id: str, target_bytes: int, i: int) -> StepTaken:
    base = StepTaken(run_id=run_id, source=Source(agent_id="bench", role="bench"), trajectory_id=f"tr{i}",
                     task_id="t", group_id="g", step_index=i % 6, observation="", policy_version=0)
    pad = max(0, target_bytes - len(encode(base)))
    n_tokens = pad // 12
    return base.model_copy(update={
        "event_id": new_id(),
        "prompt_token_ids": [((i + k) * 7919) % 50_000 for k in range(n_tokens // 2)],
        "logprobs": [-(k % 97) / 13.0 for k in range(n_tokens // 4)],
        "observation": "x" * max(0, pad - 6 * (n_tokens // 2) - 8 * (n_tokens // 4)),
    })


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

        consumer = Consumer(bus, Subscription("bench", (type(events[0]),), handler),
                            Source(agent_id="bench", role="bench"))
        stop = asyncio.Event()
        t1 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(consumer.run(stop))
            await asyncio.wait_for(done.wait(), 120)
            t_con = time.perf_counter() - t1
            stop.set()
        lat = bus.stats.latencies_ms
        return {"publish_per_s": len(events) / t_pub, "consume_per_s": len(events) / t_con,
                "end_to_end_per_s": len(events) / (t_pub + t_con),
                "p50_ms": statistics.median(lat), "p99_ms": _pct(lat, 0.99)}
    finally:
        await bus.js.delete_stream(bus.stream)
        await bus.close()


async def _plain_once(url: str, run_id: str, payloads: list[bytes], max_pending: int,
                      batch: int) -> dict[str, float]:
    import nats
    from nats.js import api

    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=max_pending)
    stream = f"PLAIN_{run_id}"
    subject = f"plain.{run_id}.x"
    await js.add_stream(api.StreamConfig(name=stream, subjects=[subject], storage=api.StorageType.FILE,
                                         duplicate_window=120.0))
    try:
        lat: list[float] = []
        t0 = time.perf_counter()
        for p in payloads:
            start = time.perf_counter()
            fut = await js.publish_async(subject, p, headers={"Nats-Msg-Id": new_id()})
            fut.add_done_callback(lambda _f, s=start: lat.append((time.perf_counter() - s) * 1e3))
        await js.publish_async_completed()
        t_pub = time.perf_counter() - t0
        sub = await js.pull_subscribe(subject, durable="plain", stream=stream,
                                      config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT,
                                                                max_ack_pending=1000))
        t1 = time.perf_counter()
        got = 0
        while got < len(payloads):
            for m in await sub.fetch(batch, timeout=5):
                await m.ack()
                got += 1
        t_con = time.perf_counter() - t1
        return {"publish_per_s": len(payloads) / t_pub, "consume_per_s": len(payloads) / t_con,
                "end_to_end_per_s": len(payloads) / (t_pub + t_con),
                "p50_ms": statistics.median(lat), "p99_ms": _pct(lat, 0.99)}
    finally:
        await js.delete_stream(stream)
        await nc.close()


def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    best = max(runs, key=lambda r: r["end_to_end_per_s"])
    return {k: round(v, 3) for k, v in best.items()}


async def bench_bus(count: int = 20_000, repeats: int = 3, url: str | None = None) -> dict[str, Any]:
    from coevo.runtime.app import nats_endpoint

    cfg = BusConfig()
    with tempfile.TemporaryDirectory() as tmp:
        async with nats_endpoint(url, Path(tmp) / "nats") as endpoint:
            out: dict[str, Any] = {"count": count, "repeats": repeats, "sizes": {}}
            ratios = []
            for label, size in tracked(list(SIZES.items()), f"bench bus: {count} events x {repeats}", unit="sizes"):
                coevo_runs, plain_runs = [], []
                for _ in range(repeats):
                    run_id = f"bench{new_id()[:8]}"
                    events: list[Event] = [make_event(run_id, size, i) for i in range(count)]
                    payloads = [encode(e) for e in events]
                    plain_runs.append(await _plain_once(endpoint, run_id, payloads, cfg.max_inflight_publishes,
                                                        cfg.fetch_batch))
                    coevo_runs.append(await _coevo_once(endpoint, events, cfg))
                c, p = _best(coevo_runs), _best(plain_runs)
                ratio = c["end_to_end_per_s"] / p["end_to_end_per_s"]
                ratios.append(ratio)
                out["sizes"][label] = {"event_bytes": len(payloads[0]), "coevo": c, "nats_py": p,
                                       "ratio": round(ratio, 3)}
            out["ratio"] = round(min(ratios), 3)
            out["target_ratio"] = 0.7
            return out


def bench_codec(n: int = 5000) -> dict[str, Any]:
    """pydantic-core JSON (the wire format) vs msgpack of the dumped dict, per event size."""
    import msgspec

    from coevo.schemas.registry import EVENT_ADAPTER

    out: dict[str, Any] = {}
    for label, size in SIZES.items():
        e = make_event("bench", size, 1)
        res: dict[str, Any] = {}
        t = time.perf_counter()
        for _ in range(n):
            raw = encode(e)
        res["json_encode_us"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        for _ in range(n):
            decode(raw)
        res["json_decode_us"] = (time.perf_counter() - t) / n * 1e6
        res["json_bytes"] = len(raw)
        t = time.perf_counter()
        for _ in range(n):
            packed = msgspec.msgpack.encode(e.model_dump())
        res["msgpack_encode_us"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        for _ in range(n):
            EVENT_ADAPTER.validate_python(msgspec.msgpack.decode(packed))
        res["msgpack_decode_us"] = (time.perf_counter() - t) / n * 1e6
        res["msgpack_bytes"] = len(packed)
        out[label] = {k: round(v, 2) for k, v in res.items()}
    return out
