"""The typed bus against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import pytest

from coevo.errors import Reject, Retry
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Consumer, Subscription
from coevo.schemas import DeadLettered, Source, StepTaken, TaskScheduled, TaskSpec, encode, subject_for
from tests.samples import sample_events

SRC = Source(agent_id="test", role="test")


def sched(run_id: str, i: int = 0) -> TaskScheduled:
    return TaskScheduled(
        run_id=run_id, source=SRC, task=TaskSpec(task_id=f"t{i}", family="quick"), group_id=f"g{i}", n_rollouts=4
    )


async def test_round_trip_every_event_type(bus: NatsBus, run_id: str) -> None:
    events = sample_events(run_id)
    for e in events:
        await bus.publish(e)
    await bus.flush()
    stored = await bus.events()
    assert [type(e) for e in stored] == [type(e) for e in events]
    assert stored == events  # every field survives the wire, typed


async def test_republished_event_is_stored_once(bus: NatsBus, run_id: str) -> None:
    e = sched(run_id)
    first = await bus.publish_sync(e)
    second = await bus.publish_sync(e)
    await bus.publish(e)
    await bus.flush()
    assert not first.duplicate and second.duplicate
    assert first.seq == second.seq
    assert [x.event_id for x in await bus.events()] == [e.event_id]
    assert bus.stats.duplicates == 2


async def test_async_publishes_resolve_from_the_servers_acks(bus: NatsBus, run_id: str) -> None:
    """The bus's own asynchronous publish: each future resolves from JetStream's PubAck, a repeat
    counts as a duplicate, and ``flush`` returns only when nothing awaits an ack."""
    events = [sched(run_id, i) for i in range(300)]
    futures = [await bus.publish(e) for e in events]
    again = await bus.publish(events[0])
    await bus.flush()
    assert all(f.done() and f.result() is True for f in [*futures, again])
    assert bus.inflight == 0 and bus.stats.published == 301 and bus.stats.duplicates == 1
    assert [e.event_id for e in await bus.events()] == [e.event_id for e in events]


async def test_a_publish_the_stream_refuses_fails_its_future_and_is_stored_once_room_comes(
    nats_url: str, run_id: str, cfg
) -> None:
    """A full stream (discard new) answers the publish with an error: the future fails with the
    server's reason, and the publish is sent again (same id) until the stream takes it."""
    from dataclasses import replace

    from nats.js.api import DiscardPolicy

    from coevo.errors import PublishError

    bus = await NatsBus.connect(nats_url, run_id, bus=cfg.bus.model_copy(update={"publish_retries": 8}))
    try:
        await bus.publish_sync(sched(run_id, 0))
        full = (await bus.js.stream_info(bus.stream)).config
        await bus.js.update_stream(replace(full, max_msgs=1, discard=DiscardPolicy.NEW))
        refused = await bus.publish(sched(run_id, 1))
        with pytest.raises(PublishError, match="maximum messages"):
            await asyncio.wait_for(asyncio.shield(refused), 5)
        assert bus.inflight == 0

        async def make_room() -> None:
            await asyncio.sleep(0.5)
            await bus.js.update_stream(replace(full, max_msgs=-1, discard=DiscardPolicy.OLD))

        async with asyncio.TaskGroup() as tg:
            tg.create_task(make_room())
            await bus.flush()  # retries the refused publish (backing off) until the stream has room
        assert bus.stats.publish_retries == 1
        assert [e.group_id for e in await bus.events()] == ["g0", "g1"]
    finally:
        await bus.close()


async def test_a_publish_nobody_answers_fails_instead_of_hanging(nats_url: str, run_id: str, cfg) -> None:
    """No stream takes the subject (deleted under the bus): the server's no-responders status fails
    the future at once; retries give up after ``bus.publish_retries`` with a ``PublishError``."""
    from coevo.errors import PublishError

    bus = await NatsBus.connect(nats_url, run_id, bus=cfg.bus.model_copy(update={"publish_retries": 1}))
    try:
        await bus.js.delete_stream(bus.stream)
        fut = await bus.publish(sched(run_id))
        with pytest.raises(PublishError, match="no stream answered"):
            await asyncio.wait_for(asyncio.shield(fut), 5)
        with pytest.raises(PublishError):
            await bus.flush()
    finally:
        bus._failed.clear()
        await bus.close()


async def test_wrong_run_is_refused(bus: NatsBus) -> None:
    with pytest.raises(Exception, match="belongs to run"):
        await bus.publish(sched("other-run"))


async def run_consumer(consumer: Consumer, stop: asyncio.Event, until, timeout: float = 10) -> None:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(consumer.run(stop))
        async with asyncio.timeout(timeout):
            await until()
        stop.set()


async def test_malformed_payload_is_dead_lettered_and_consumer_continues(bus: NatsBus, run_id: str) -> None:
    subject = subject_for(run_id, TaskScheduled)
    good = [sched(run_id, i) for i in range(3)]
    await bus.publish_sync(good[0])
    await bus.nc.jetstream().publish(subject, b'{"kind": "task.scheduled", "n_rollouts": "many"}')
    await bus.nc.jetstream().publish(subject, b"\x00\xffnot json")
    wrong_type = encode(good[1]).replace(b'"n_rollouts":4', b'"n_rollouts":"4"')  # strict: no coercion
    await bus.nc.jetstream().publish(subject, wrong_type)
    await bus.publish_sync(good[2])
    seen: list[str] = []

    async def handler(event: TaskScheduled, _d) -> None:
        seen.append(event.task.task_id)

    c = Consumer(bus, Subscription("sched", (TaskScheduled,), handler), SRC)
    stop = asyncio.Event()

    async def until() -> None:
        while c.stats.handled + c.stats.dead_lettered < 5:
            await asyncio.sleep(0.02)

    await run_consumer(c, stop, until)
    assert seen == ["t0", "t2"]
    dead = [e for e in await bus.events(["dead.lettered"]) if isinstance(e, DeadLettered)]
    assert len(dead) == 3
    assert dead[1].raw == b"\x00\xffnot json"
    assert all(d.original_subject == subject and d.consumer == "sched" for d in dead)
    assert "n_rollouts" in dead[0].reason and "n_rollouts" in dead[2].reason
    assert dead[2].raw == wrong_type


async def test_retry_reject_and_crash_outcomes(bus: NatsBus, run_id: str, cfg) -> None:
    events = [sched(run_id, i) for i in range(3)]
    for e in events:
        await bus.publish(e)
    await bus.flush()
    attempts: dict[str, int] = {}

    async def handler(event: TaskScheduled, d) -> None:
        tid = event.task.task_id
        attempts[tid] = attempts.get(tid, 0) + 1
        if tid == "t0" and attempts[tid] < 3:
            raise Retry("not yet", delay_s=0.01)
        if tid == "t1":
            raise Reject("bad task")
        if tid == "t2":
            raise RuntimeError("boom")

    c = Consumer(bus, Subscription("outcomes", (TaskScheduled,), handler), SRC)
    stop = asyncio.Event()

    async def until() -> None:
        while c.stats.handled + c.stats.dead_lettered < 3:
            await asyncio.sleep(0.02)

    await run_consumer(c, stop, until)
    assert attempts == {"t0": 3, "t1": 1, "t2": cfg.bus.max_deliver}
    assert c.stats.retried == 2 and c.stats.crashed == cfg.bus.max_deliver
    dead = await bus.events(["dead.lettered"])
    reasons = sorted(d.reason for d in dead)
    assert reasons[0].startswith("handler crashed 5 times") and "boom" in reasons[0]
    assert reasons[1] == "rejected: bad task"


async def test_long_handler_keeps_its_message_with_in_progress(bus: NatsBus, run_id: str, cfg) -> None:
    await bus.publish_sync(sched(run_id))
    calls = 0

    async def slow(event, d) -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(cfg.bus.ack_wait_s * 2)  # longer than ack_wait: no redelivery

    c = Consumer(bus, Subscription("slow", (TaskScheduled,), slow), SRC)
    stop = asyncio.Event()

    async def until() -> None:
        while c.stats.handled < 1:
            await asyncio.sleep(0.05)

    await run_consumer(c, stop, until, timeout=20)
    assert calls == 1


async def test_unacked_message_is_redelivered_to_another_consumer(
    nats_url: str, run_id: str, cfg, bus: NatsBus
) -> None:
    """A consumer that dies holding a message (connection gone, no ack) loses nothing."""
    for i in range(4):
        await bus.publish(sched(run_id, i))
    await bus.flush()
    victim_bus = await NatsBus.connect(nats_url, run_id, bus=cfg.bus)
    got_by_victim: list[str] = []
    holding = asyncio.Event()

    async def hang(event, d) -> None:
        got_by_victim.append(event.task.task_id)
        holding.set()
        await asyncio.Event().wait()  # never acks

    victim = Consumer(victim_bus, Subscription("work", (TaskScheduled,), hang, concurrency=1), SRC)
    stop_v = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        t = tg.create_task(victim.run(stop_v))
        await asyncio.wait_for(holding.wait(), 10)
        t.cancel()  # the process "dies": the task is gone and the connection closes without a nak
        await victim_bus.nc.close()
    assert len(got_by_victim) == 1
    done: list[str] = []

    async def work(event, d) -> None:
        done.append(event.task.task_id)

    survivor = Consumer(bus, Subscription("work", (TaskScheduled,), work), SRC)
    stop = asyncio.Event()

    async def until() -> None:
        while len(done) < 4:
            await asyncio.sleep(0.05)

    await run_consumer(survivor, stop, until, timeout=cfg.bus.ack_wait_s + 10)
    assert sorted(done) == ["t0", "t1", "t2", "t3"]
    assert got_by_victim[0] in done


async def test_control_request_reply(bus: NatsBus) -> None:
    from coevo.schemas import ControlReply, ControlRequest

    async def handler(req: ControlRequest) -> ControlReply:
        return ControlReply(
            agent_id="a1", role="r", state="paused" if req.command == "pause" else "running", uptime_s=1.0
        )

    sub = await bus.serve_control("a1", handler)
    try:
        assert (await bus.control("a1", "pause")).state == "paused"
        assert (await bus.control("a1", "status")).state == "running"
        with pytest.raises(Exception, match="no agent"):
            await bus.control("nobody", "status", timeout_s=1)
    finally:
        await sub.unsubscribe()


async def test_runs_are_isolated(nats_url: str, cfg, run_id: str, bus: NatsBus) -> None:
    other = await NatsBus.connect(nats_url, run_id + "x", bus=cfg.bus)
    try:
        await other.publish_sync(sched(other.run_id))
        await bus.publish_sync(sched(run_id))
        assert len(await bus.events()) == 1 and len(await other.events()) == 1
    finally:
        await other.close()


async def test_step_event_with_token_arrays_round_trips(bus: NatsBus, run_id: str) -> None:
    step = StepTaken(
        run_id=run_id,
        source=SRC,
        trajectory_id="tr",
        task_id="t",
        group_id="g",
        step_index=0,
        observation="o",
        prompt_token_ids=list(range(2000)),
        response_token_ids=[1, 2],
        logprobs=[-0.1234567890123, -2.5],
        policy_version=3,
    )
    await bus.publish_sync(step)
    (back,) = await bus.events()
    assert back == step and back.logprobs[0] == -0.1234567890123


async def test_backpressure_keeps_memory_flat(bus: NatsBus, run_id: str, cfg) -> None:
    """A producer far faster than its consumer: the backlog stays on the server, not in memory."""
    import tracemalloc

    from coevo.bench.bus import make_event

    n = 6000
    handled = 0

    async def slow(event, d) -> None:
        nonlocal handled
        handled += 1
        await asyncio.sleep(0.01)  # ~200 events/s with 2 workers: far slower than any producer

    c = Consumer(bus, Subscription("slowpoke", (StepTaken,), slow, concurrency=2), SRC)
    stop = asyncio.Event()
    samples: list[tuple[int, int, int]] = []  # (published, traced bytes, publishes in flight)
    tracemalloc.start()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(c.run(stop))
            for i in range(n):
                await bus.publish(make_event(run_id, 2000, i))
                if i % 500 == 499:
                    samples.append((i, tracemalloc.get_traced_memory()[0], bus.inflight))
            await bus.flush(30)
            info = await bus.js.consumer_info(bus.stream, "slowpoke")
            stop.set()
    finally:
        tracemalloc.stop()
    assert handled < n / 2, "the consumer must be the bottleneck for this test to mean anything"
    assert info.num_pending > n / 3  # the backlog is on the server...
    assert info.num_ack_pending <= cfg.bus.max_ack_pending
    assert c.stats.max_inflight <= cfg.bus.fetch_batch  # ...not in this process
    assert max(s[2] for s in samples) <= cfg.bus.max_inflight_publishes
    growth = samples[-1][1] - samples[1][1]
    assert growth < 3 * 1024 * 1024, f"memory grew by {growth} bytes while the backlog grew"


async def test_message_whose_consumer_dies_on_every_delivery_is_dead_lettered(
    nats_url: str, run_id: str, cfg, bus: NatsBus
) -> None:
    """The gap a consumer cannot close itself: its process dies holding the message on every delivery,
    so it never sees its last one fail. The server's max-deliveries advisory reaches a live agent."""
    from coevo.runtime.agent import run_agents
    from coevo.schemas import DeadLettered
    from tests.agents_for_tests import Echo

    poison = sched(run_id, 7)
    await bus.publish_sync(poison)
    dying = await NatsBus.connect(nats_url, run_id, bus=cfg.bus.model_copy(update={"max_deliver": 1}))
    stop = asyncio.Event()

    async def die_twice() -> None:
        try:
            sub = await dying.pull_subscription("fragile", ["task.scheduled"])
            for n in (1, 2):  # our max_deliver 1: the server delivers twice, then gives up
                msgs = await sub.fetch(1, timeout=cfg.bus.ack_wait_s + 5)
                assert msgs[0].metadata.num_delivered == n  # held, never acked: "the process died"
            async with asyncio.timeout(cfg.bus.ack_wait_s + 20):
                while not [e for e in await bus.events(["dead.lettered"]) if e.consumer == "fragile"]:
                    # the restarted consumer pulls again: the server finds the message out of deliveries
                    with contextlib.suppress(nats.errors.TimeoutError):
                        assert not await sub.fetch(1, timeout=0.5)
        finally:
            stop.set()

    try:
        await asyncio.gather(run_agents([Echo(bus, cfg)], handle_signals=False, until=stop), die_twice())
    finally:
        await dying.close()
    lost = [e for e in await bus.events(["dead.lettered"]) if isinstance(e, DeadLettered)]
    assert len(lost) == 1 and lost[0].consumer == "fragile" and lost[0].delivery_count == 2
    assert lost[0].raw == encode(poison) and lost[0].original_subject.endswith(".task.scheduled.tasks")
    assert "died or stopped" in lost[0].reason


async def test_a_puller_hands_out_batches_at_once_and_waits_only_for_the_first_message(
    bus: NatsBus, run_id: str
) -> None:
    """The consumer's fetch on core NATS: what is there comes at once in batches of at most
    ``batch``; with nothing there it returns when the first message arrives, not at the expiry; with
    nothing at all it times out at the expiry."""
    import time

    puller = await bus.puller("pull-test", ["task.scheduled"])
    try:
        for i in range(10):
            await bus.publish(sched(run_id, i))
        await bus.flush()
        batches = [await puller.fetch(4, 5.0) for _ in range(3)]
        assert [len(b) for b in batches] == [4, 4, 2]
        for b in batches:
            for m in b:
                await m.ack()
        got_ids = [(await bus.decode_msg(m)).group_id for b in batches for m in b]
        assert sorted(got_ids) == sorted(f"g{i}" for i in range(10))

        async def later() -> None:
            await asyncio.sleep(0.3)
            await bus.publish_sync(sched(run_id, 10))

        t0 = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(later())
            got = await puller.fetch(8, 20.0)
        waited = time.monotonic() - t0
        assert [(await bus.decode_msg(m)).group_id for m in got] == ["g10"]
        assert 0.25 < waited < 10.0  # the message's arrival ended the wait, not the 20 s expiry
        await got[0].ack()

        t0 = time.monotonic()
        with pytest.raises(nats.errors.TimeoutError):
            await puller.fetch(8, 0.5)
        assert time.monotonic() - t0 >= 0.45
        assert puller.take_late() == []
    finally:
        await puller.unsubscribe()


async def test_a_puller_whose_stream_is_gone_says_so(bus: NatsBus, run_id: str) -> None:
    import nats.js.errors

    puller = await bus.puller("pull-gone", ["task.scheduled"])
    try:
        await bus.js.delete_stream(bus.stream)
        with pytest.raises((nats.js.errors.Error, nats.errors.Error)):
            await puller.fetch(4, 2.0)
    finally:
        await puller.unsubscribe()
        await bus.ensure_stream()


async def test_a_pull_refused_for_a_conflict_is_not_retried_at_once(bus: NatsBus, run_id: str) -> None:
    """A 409 (here: more waiting pulls than the consumer's max_waiting) ends the request empty-handed;
    the fetch times out after a short pause instead of at once (a worker would spin) or at the expiry."""
    import time

    from nats.js import api

    from coevo.runtime.pull import Puller

    await bus.js.add_consumer(
        bus.stream, api.ConsumerConfig(durable_name="narrow", ack_policy=api.AckPolicy.EXPLICIT, max_waiting=1)
    )
    first = await Puller(bus.nc, bus.stream, "narrow").start()
    second = await Puller(bus.nc, bus.stream, "narrow").start()
    try:
        async with asyncio.TaskGroup() as tg:
            waiting = tg.create_task(first.fetch(1, 3.0))
            await asyncio.sleep(0.3)  # the first pull waits on the server
            t0 = time.monotonic()
            with pytest.raises(nats.errors.TimeoutError):
                await second.fetch(1, 3.0)
            refused_after = time.monotonic() - t0
            await bus.publish_sync(sched(run_id))
            got = await waiting
        assert 0.09 <= refused_after < 1.5
        assert len(got) == 1 and (await bus.decode_msg(got[0])).group_id == "g0"
    finally:
        await first.unsubscribe()
        await second.unsubscribe()


async def test_bench_bus_moves_both_sizes_through_both_clients() -> None:
    """``coevo bench bus`` end to end on a small count: every field it reports is there and sane
    (the speed itself is the benchmark's business, not a test's)."""
    from coevo.bench.bus import SIZES, bench_bus

    out = await bench_bus(count=300, repeats=2)
    assert set(out["sizes"]) == set(SIZES)
    for label, res in out["sizes"].items():
        assert abs(res["event_bytes"] - SIZES[label]) < 0.1 * SIZES[label] + 500
        assert len(res["paired_ratios"]) == 2
        for client in ("coevo", "nats_py"):
            assert res[client]["publish_per_s"] > 0 and res[client]["consume_per_s"] > 0
            assert res[client]["end_to_end_per_s"] < min(res[client]["publish_per_s"], res[client]["consume_per_s"])
        assert res["publish_ratio"] > 0 and res["consume_ratio"] > 0
    assert out["ratio"] == min(res["ratio"] for res in out["sizes"].values())


async def test_reading_ends_only_once_everything_delivered_was_read(bus: NatsBus, run_id: str) -> None:
    """The rule ``history`` and the observer's ``tail`` end by after a fetch timeout, on the real
    consumer's info: a message the server delivered but the reader has not read yet (still on its
    way, or held for the next fetch) means "not done", as does one not delivered yet."""
    from nats.js import api

    from coevo.runtime.pull import Puller, read_all

    seqs = [(await bus.publish_sync(sched(run_id, i))).seq for i in range(4)]
    await bus.js.add_consumer(
        bus.stream,
        api.ConsumerConfig(name="reader", ack_policy=api.AckPolicy.NONE, max_ack_pending=-1, inactive_threshold=30.0),
    )
    puller = await Puller(bus.nc, bus.stream, "reader").start()
    try:
        got = await puller.fetch(3, 2.0)
        assert [m.metadata.sequence.stream for m in got] == seqs[:3]
        info = await bus.js.consumer_info(bus.stream, "reader")
        assert not read_all(info, seqs[2])  # the fourth is not delivered yet
        assert read_all(info, seqs[1], end=seqs[1])  # a history that ends there is done
        rest = await puller.fetch(3, 2.0)
        info = await bus.js.consumer_info(bus.stream, "reader")
        assert [m.metadata.sequence.stream for m in rest] == seqs[3:] and info.num_pending == 0
        assert not read_all(info, seqs[2])  # delivered, not read: its reader would have ended too early
        assert not read_all(info, seqs[2], end=seqs[3])
        assert read_all(info, seqs[3]) and read_all(info, seqs[3], end=seqs[3])
    finally:
        await puller.unsubscribe()


@pytest.mark.parametrize("fate", ["late", "lost"])
async def test_the_observer_tail_waits_for_a_late_delivery_and_not_forever_for_a_lost_one(
    bus: NatsBus, run_id: str, monkeypatch: pytest.MonkeyPatch, fate: str
) -> None:
    """``tail`` after ``stop``: the last event's delivery is held back 0.8 s (late: the fetch that
    should have had it times out first, at 0.5 s; a tail that ended on that timeout missed it) or never
    comes (lost in a reconnect: an observer acknowledges nothing, so nothing is redelivered; the
    tail still ends, after ``LOST_AFTER`` empty fetches)."""
    import time

    from coevo.runtime.history import LOST_AFTER
    from coevo.runtime.pull import STATUS, Puller

    seqs = [(await bus.publish_sync(sched(run_id, i))).seq for i in range(3)]
    deliver = Puller._on_msg

    async def holding_back_the_last(self: Puller, msg) -> None:  # type: ignore[no-untyped-def]
        if (msg.headers or {}).get(STATUS) is None and msg.metadata.sequence.stream == seqs[-1]:
            if fate == "late":
                asyncio.get_running_loop().call_later(0.8, lambda: asyncio.ensure_future(deliver(self, msg)))
            return
        await deliver(self, msg)

    monkeypatch.setattr(Puller, "_on_msg", holding_back_the_last)
    stop = asyncio.Event()
    stop.set()  # the run has ended: everything stored up to now, then return
    t0 = time.monotonic()

    async def read() -> list[int]:
        return [seq async for seq, _ in bus.tail(stop, wait_s=0.5)]

    got = await asyncio.wait_for(read(), 20)
    if fate == "late":
        assert got == seqs and time.monotonic() - t0 >= 0.75
    else:
        assert got == seqs[:2]
        assert time.monotonic() - t0 >= LOST_AFTER * 0.5


async def test_a_stopped_consumer_gives_back_what_it_did_not_start_once(nats_url: str, run_id: str, cfg) -> None:
    """Stopping with fetched-but-unstarted messages while some of its own pulls still wait (at the
    server's ack-pending limit): each is given back once, not bounced through this process's own open
    pull requests until its deliveries run out (a clean Ctrl-C used to dead-letter such messages)."""
    tight = cfg.bus.model_copy(update={"max_ack_pending": 8})
    bus = await NatsBus.connect(nats_url, run_id, bus=tight)
    try:
        for i in range(40):
            await bus.publish(sched(run_id, i))
        await bus.flush()
        started: list[str] = []
        release = asyncio.Event()

        async def hold(event: TaskScheduled, d) -> None:
            started.append(event.task.task_id)
            await release.wait()

        # 24 workers: the server hands 8 messages out (its limit); the other 16 pulls wait for room, which
        # the 8 acks at the stop make, so those are answered after the stop
        first = Consumer(bus, Subscription("work", (TaskScheduled,), hold, concurrency=24, batch=1), SRC)
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(first.run(stop))
            async with asyncio.timeout(20):
                while len(started) < 8:
                    await asyncio.sleep(0.02)
            stop.set()
            release.set()  # the started ones end and are acked; what comes after is given back
        assert first.stats.handled == len(started) and first.stats.nak_on_shutdown >= 1
        deliveries: dict[str, int] = {}

        async def work(event: TaskScheduled, d) -> None:
            deliveries[event.task.task_id] = d.num_delivered

        second = Consumer(bus, Subscription("work", (TaskScheduled,), work), SRC)
        await run_consumer(second, asyncio.Event(), lambda: _until(lambda: len(deliveries) + len(started) >= 40), 30)
        assert sorted([*deliveries, *started]) == sorted(f"t{i}" for i in range(40))
        given_back = {t: n for t, n in deliveries.items() if n > 1}
        assert given_back, "nothing was given back: the test did not stop with unstarted messages"
        assert max(given_back.values()) == 2, given_back  # delivered to the first consumer once, then here
        assert not await bus.events(["dead.lettered"])
    finally:
        await bus.close()


async def _until(done) -> None:
    while not done():
        await asyncio.sleep(0.02)


async def test_a_stop_ends_a_consumer_whose_keepalive_swallowed_its_cancellation(
    nats_url: str, run_id: str, cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's ``asyncio.wait_for`` (under the keepalive's read of the ack floor) returns its
    result when a cancellation arrives in the same tick, and the keepalive loops on: a stop then
    waited for it for good (CI runs hung that way). Here the read swallows the first cancellation it
    meets, as that race does, and the stop still ends the consumer."""
    import coevo.runtime.consumer as consumer_mod
    from coevo.runtime.revival import Revival

    swallowed: list[bool] = []
    reads: list[int] = []
    reading = asyncio.Event()

    async def read_ack_floor(self: Revival) -> None:
        reads.append(1)
        if len(reads) == 1:  # the start's read
            return
        reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)  # the 3.11 race: the answer arrived with the cancellation

    monkeypatch.setattr(Revival, "read_ack_floor", read_ack_floor)
    monkeypatch.setattr(consumer_mod, "ACK_FLOOR_EVERY_S", 0.0)
    quick = cfg.bus.model_copy(update={"in_progress_every_s": 0.2})
    bus = await NatsBus.connect(nats_url, run_id, bus=quick)
    try:

        async def work(event: TaskScheduled, d) -> None:
            return None

        c = Consumer(bus, Subscription("work", (TaskScheduled,), work), SRC)
        stop = asyncio.Event()
        task = asyncio.create_task(c.run(stop))
        await asyncio.wait_for(reading.wait(), 10)  # the keepalive reads, and hangs there
        stop.set()
        await asyncio.wait_for(task, 15)
        assert swallowed == [True]
    finally:
        await bus.close()
