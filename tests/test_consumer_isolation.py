"""A role touches only its own consumers of the run's events (docs/security.md, "The bus").

Every role used to be granted ``$JS.API.CONSUMER.MSG.NEXT.<stream>.*``, ``...DURABLE.CREATE.<stream>.*``
and ``$JS.ACK.<stream>.>``: with the judge's credentials a process pulled and acked the learner's
``group.scored`` deliveries (settled, never trained), then changed the learner durable's filter.
Here, on a run's real server under the real permissions, every role against every other: none may
create, update, read, pull, ack or delete another's consumer (its shared durable or a numbered one);
each may do all of that with its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js import api

from coevo.config import CoevoConfig, NatsConfig
from coevo.runtime.app import credentials_dir, open_bus
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Consumer, Subscription
from coevo.runtime.credentials import EMITS, consumer_names, inbox_prefix, read_credential, slot_name
from coevo.runtime.pull import Puller
from coevo.schemas import Source, TaskDecided, TaskScheduled, TaskSpec, subject_for
from tests.waiting import until

ROLES = tuple(EMITS)


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[NatsBus]:
    async with open_bus("iso1", store=tmp_path / "nats") as bus:  # as coevo run: embedded, as admin
        yield bus


def _url(bus: NatsBus) -> str:
    return f"nats://{bus.nc.connected_url.hostname}:{bus.nc.connected_url.port}"


async def _connect(bus: NatsBus, tmp_path: Path, role: str, errors: list[Exception]) -> nats.NATS:
    c = read_credential(credentials_dir(tmp_path / "nats") / f"{role}.json")

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    return await nats.connect(
        _url(bus), user=c.user, password=c.password, inbox_prefix=inbox_prefix(c.user), error_cb=on_error
    )


def _touches(stream: str, name: str, filter_subject: str) -> list[str]:
    """Every API subject that creates, updates, reads, pulls, acks or deletes consumer ``name``."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter_subject}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.INFO.{stream}.{name}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
        f"$JS.API.CONSUMER.DELETE.{stream}.{name}",
        f"$JS.ACK.{stream}.{name}.1.1.1.1700000000000000000.0",
    ]


def test_each_roles_consumer_names_are_its_own() -> None:
    names = {r: set(consumer_names(r)) for r in ROLES}
    for a in ROLES:
        assert a in names[a] and slot_name(a, 0) in names[a]
        for b in ROLES:
            if a != b:
                assert not names[a] & names[b], (a, b)


async def test_no_role_touches_anothers_consumers(admin: NatsBus, tmp_path: Path) -> None:
    """Each role sends every consumer operation at every other role's durable and a numbered name of
    it, and the unnamed create (which takes any name in its body): the server refuses each one."""
    stream, run = admin.stream, admin.run_id
    scored = subject_for(run, "group.scored")
    await admin.js.add_consumer(stream, api.ConsumerConfig(durable_name="learner", filter_subject=scored))
    for role in ROLES:
        errors: list[Exception] = []
        nc = await _connect(admin, tmp_path, role, errors)
        tried = [f"$JS.API.CONSUMER.CREATE.{stream}"]
        for victim in ROLES:
            if victim != role:
                tried += _touches(stream, victim, scored) + _touches(stream, slot_name(victim, 3), scored)
        body = json.dumps({"stream_name": stream, "config": {"name": "learner", "filter_subject": ">"}}).encode()
        for subject in tried:
            await nc.publish(subject, body, reply=nc.new_inbox())
        await nc.flush()
        refused: set[str] = set()
        async with asyncio.timeout(10):
            while not {s.lower() for s in tried} <= refused:
                await asyncio.sleep(0.02)
                refused = {
                    str(e).lower().split('publish to "')[1].rstrip('"')
                    for e in errors
                    if "permissions violation for publish to" in str(e).lower()
                }
        await nc.close()
    info = await admin.js.consumer_info(stream, "learner")  # untouched by all of them
    assert info.config.filter_subject == scored and info.delivered.stream_seq == 0


async def test_the_judge_cannot_drain_or_repoint_the_learners_durable(admin: NatsBus, tmp_path: Path) -> None:
    """The reviewer's case, end to end: the learner's ``group.scored`` delivery stays the learner's."""
    from tests.samples import sample_events

    stream, run = admin.stream, admin.run_id
    scored = subject_for(run, "group.scored")
    await admin.js.add_consumer(stream, api.ConsumerConfig(durable_name="learner", filter_subject=scored))
    event = next(e for e in sample_events(run) if e.__class__.__name__ == "GroupScored")
    await admin.publish_sync(event)
    errors: list[Exception] = []
    nc = await _connect(admin, tmp_path, "judge", errors)
    js = nc.jetstream(timeout=1.0)
    with pytest.raises(nats.errors.TimeoutError):
        await _pull(nc, stream)
    with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
        await js.add_consumer(
            stream, api.ConsumerConfig(durable_name="learner", filter_subject=subject_for(run, "step.taken"))
        )
    await nc.close()
    info = await admin.js.consumer_info(stream, "learner")
    assert info.config.filter_subject == scored and info.num_pending == 1 and info.num_ack_pending == 0


async def _pull(nc: nats.NATS, stream: str) -> None:
    puller = await Puller(nc, stream, "learner").start()
    try:
        msgs = await puller.fetch(1, 1.0)
        for m in msgs:
            await m.ack()
    finally:
        await puller.unsubscribe()


async def test_each_role_runs_its_own_consumers(admin: NatsBus, tmp_path: Path, cfg: CoevoConfig) -> None:
    """Under its credentials each role consumes on its shared durable and on unshared consumers (each
    one of its numbered names), reads the history, and deletes what it made."""
    from coevo.runtime.credentials import CONSUMER_SLOTS

    run = admin.run_id
    src = Source(agent_id="t", role="tasks")
    event = TaskScheduled(run_id=run, source=src, task=TaskSpec(task_id="t1", family="q"), group_id="g1", n_rollouts=1)
    await admin.publish_sync(event)
    for role in ROLES:
        bus = await NatsBus.connect(
            _url(admin),
            run,
            nats_cfg=NatsConfig(credentials_file=credentials_dir(tmp_path / "nats") / f"{role}.json"),
            bus=cfg.bus,
            name=role,
        )
        try:
            got: dict[str, asyncio.Event] = {"shared": asyncio.Event(), "own": asyncio.Event()}

            async def on_shared(_e: TaskScheduled, _d: object, got: dict[str, asyncio.Event] = got) -> None:
                got["shared"].set()

            async def on_own(_e: TaskScheduled, _d: object, got: dict[str, asyncio.Event] = got) -> None:
                got["own"].set()

            stop = asyncio.Event()
            shared = Consumer(bus, Subscription(role, (TaskScheduled,), on_shared), src, cfg=cfg.bus)
            own = Consumer(bus, Subscription(f"{role}-own", (TaskScheduled,), on_own, shared=False), src, cfg=cfg.bus)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(shared.run(stop))
                tg.create_task(own.run(stop))
                await asyncio.wait_for(asyncio.gather(got["shared"].wait(), got["own"].wait()), 20)
                stop.set()
            assert own.revival.name in {slot_name(role, k) for k in range(CONSUMER_SLOTS)}
            assert [e.event_id for e in await bus.events(["task.scheduled"])] == [event.event_id]
            assert (await bus.js.consumer_info(bus.stream, role)).num_ack_pending == 0
            await bus.js.delete_consumer(bus.stream, own.revival.name)
            await bus.js.delete_consumer(bus.stream, role)
        finally:
            await bus.close()


@pytest.mark.parametrize("pulling", [False, True], ids=["idle", "pulling"])
async def test_an_unshared_consumer_taken_by_another_owner_comes_back_under_another_name(
    admin: NatsBus, tmp_path: Path, cfg: CoevoConfig, pulling: bool
) -> None:
    """A role's own consumer is dropped (as inactive) and another instance of the role takes its name
    meanwhile: the first comes back under another of the role's names and misses nothing. A pull of
    its still waiting at the drop (``pulling``) ends with it; paused, the consumer does not recreate
    the name then (it would race the other owner for it)."""
    run = admin.run_id
    bus = await NatsBus.connect(
        _url(admin),
        run,
        nats_cfg=NatsConfig(credentials_file=credentials_dir(tmp_path / "nats") / "learner.json"),
        bus=cfg.bus,
        name="learner",
    )
    src = Source(agent_id="l", role="learner")
    seen: list[str] = []
    changed = asyncio.Event()

    async def on_decided(e: TaskDecided, _d: object) -> None:
        seen.append(e.slot_id)
        changed.set()

    def decided(i: int) -> TaskDecided:
        return TaskDecided(
            run_id=run,
            source=src,
            slot_id=f"s{i}",
            parent_id="p",
            candidate_id=f"c{i}",
            direction="harder",
            accepted=True,
            reason="test",
            parent_accuracy=0.5,
            candidate_accuracy=0.5,
            rewriter="builtin",
        )

    async def seen_at_least(n: int) -> None:
        async with asyncio.timeout(20):
            while len(seen) < n:
                changed.clear()
                await changed.wait()

    stop = asyncio.Event()
    # pulling: a pull waits long enough to be there at the drop
    bus_cfg = cfg.bus.model_copy(update={"fetch_timeout_s": 10.0}) if pulling else cfg.bus
    own = Consumer(bus, Subscription("learner-decisions", (TaskDecided,), on_decided, shared=False), src, cfg=bus_cfg)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(own.run(stop))
            await admin.publish_sync(decided(0))
            await seen_at_least(1)
            first = own.revival.name

            async def pulls_waiting() -> bool:
                return (await admin.js.consumer_info(admin.stream, first)).num_waiting > 0

            async def idle() -> bool:
                return not await pulls_waiting()

            if pulling:
                await until(pulls_waiting)
            own.resumed.clear()  # away (as across a partition)
            if not pulling:
                await until(idle)
            await admin.js.delete_consumer(admin.stream, first)
            # another owner takes the name at once (the admin, as another instance of the role would)
            await admin.js.add_consumer(
                admin.stream,
                api.ConsumerConfig(
                    name=first, filter_subject=subject_for(run, "task.decided"), metadata={"coevo_owner": "other"}
                ),
            )
            own.resumed.set()
            await admin.publish_sync(decided(1))
            await seen_at_least(2)

            async def moved() -> bool:
                return own.revival.recreated == 1

            await until(moved)
            stop.set()
        assert seen == ["s0", "s1"]
        assert own.revival.name != first and own.revival.name.startswith("learner_")
        assert own.stats.recreated == 1
        # back, it moved before pulling: the other owner's consumer delivered it nothing
        assert (await admin.js.consumer_info(admin.stream, first)).delivered.consumer_seq == 0
    finally:
        await bus.close()


async def test_a_durable_repointed_under_its_consumer_is_restored(admin: NatsBus, cfg: CoevoConfig) -> None:
    """Only the admin may still change a durable's filter: the consumer finds it at its next read of the
    ack floor, creates it again with its own filter from where it stood, and misses nothing."""
    import dataclasses

    run = admin.run_id
    src = Source(agent_id="t", role="tasks")
    seen: list[str] = []
    changed = asyncio.Event()

    async def on_task(e: TaskScheduled, _d: object) -> None:
        seen.append(e.group_id)
        changed.set()

    def sched(i: int) -> TaskScheduled:
        return TaskScheduled(
            run_id=run, source=src, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
        )

    stop = asyncio.Event()
    c = Consumer(admin, Subscription("rp", (TaskScheduled,), on_task, concurrency=1), src, cfg=cfg.bus)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(c.run(stop))
        await admin.publish_sync(sched(0))
        async with asyncio.timeout(20):
            while seen != ["g0"]:
                changed.clear()
                await changed.wait()
        info = await admin.js.consumer_info(admin.stream, "rp")
        await admin.js.add_consumer(
            admin.stream,
            dataclasses.replace(info.config, filter_subject=subject_for(run, "task.decided"), filter_subjects=None),
        )
        await admin.publish_sync(sched(1))  # not delivered while the durable reads another subject

        async def restored() -> bool:
            return c.revival.recreated == 1 and seen == ["g0", "g1"]

        await until(restored)
        stop.set()
    assert seen == ["g0", "g1"] and c.stats.recreated == 1
    restored_config = (await admin.js.consumer_info(admin.stream, "rp")).config
    bare = subject_for(run, "task.scheduled")
    assert sorted(restored_config.filter_subjects or []) == [bare, f"{bare}.*"]
