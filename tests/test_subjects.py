"""A role is its subjects (issue 36, items 6 and 9): what a role may publish is decided by subject,
and a reader knows who produced an event from the subject it came on.

On a run's real embedded server, each agent under its own role's credentials: the policy cannot
schedule a candidate group (the server refuses it, or every reader dead-letters it: never scored,
never decided), and a follower that starts after the judge's announcement came last still gets its
own lane's latest weights."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import torch

from coevo.config import CoevoConfig, LearnerConfig, NatsConfig, load_config
from coevo.runtime.app import credentials_dir, open_bus
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Consumer, Delivery
from coevo.runtime.credentials import inbox_prefix, read_credential, role_permissions
from coevo.schemas import (
    SCOPES,
    DeadLettered,
    Event,
    GroupScored,
    LearnerStepped,
    Source,
    TaskScheduled,
    TaskSpec,
    TrajectoryCompleted,
    WeightsApplied,
    WeightsPublished,
    encode,
    subject_for,
)
from tests.waiting import until

# ---- the subjects, as pure decisions ---------------------------------------------------------------


def test_each_event_goes_on_its_producers_subject_and_a_subject_refuses_what_it_may_not_carry() -> None:
    from coevo.schemas import kind_of, parse_subject, refusal, scope_of, subject_of
    from tests.samples import sample_events

    samples = {kind_of(e): e for e in sample_events("r")}
    assert {k: subject_of("r", e) for k, e in samples.items() if k in SCOPES} == {
        "task.scheduled": "coevo.r.ev.task.scheduled.tasks",
        "learner.stepped": f"coevo.r.ev.learner.stepped.{samples['learner.stepped'].role}",  # type: ignore[attr-defined]
        "weights.published": f"coevo.r.ev.weights.published.{samples['weights.published'].role}",  # type: ignore[attr-defined]
        "weights.applied": f"coevo.r.ev.weights.applied.{samples['weights.applied'].role}",  # type: ignore[attr-defined]
        "agent.status": "coevo.r.ev.agent.status.policy",  # the sample's source role
        "dead.lettered": "coevo.r.ev.dead.lettered.policy",
    }
    for e in samples.values():
        assert refusal(scope_of(e), e) is None and refusal(None, e) is None  # the bare subject: old streams
        assert parse_subject(subject_of("r", e)) == (kind_of(e), scope_of(e))
    group: Any = samples["task.scheduled"]
    opened = group.model_copy(update={"group_id": "ext-1", "slot_id": None})  # what the endpoint opens
    assert scope_of(opened) == "endpoint" and refusal("endpoint", opened) is None
    for purpose in ("candidate", "eval"):
        why = refusal("endpoint", opened.model_copy(update={"purpose": purpose}))
        assert why is not None and purpose in why and "endpoint" in why
    assert "slot slot-0" in str(refusal("endpoint", opened.model_copy(update={"slot_id": "slot-0"})))
    assert refusal("endpoint", group) == (
        "a task.scheduled of 'tasks' on the subject of 'endpoint', which only the 'policy' role publishes on"
    )
    assert refusal("tasks", opened) == (
        "a task.scheduled of 'endpoint' on the subject of 'tasks', which only the 'tasks' role publishes on"
    )
    judge: Any = samples["weights.published"].model_copy(update={"role": "judge"})
    assert refusal("policy", judge) == (
        "a weights.published of 'judge' on the subject of 'policy', which only the 'learner' role publishes on"
    )
    assert refusal("nobody", judge) == "weights.published has no subject of scope 'nobody'"
    # every role reports on its own subject: a status or dead letter in another role's name is refused
    status: Any = samples["agent.status"]
    assert subject_of("r", status) == "coevo.r.ev.agent.status.policy"  # its source's role
    learners = status.model_copy(update={"source": Source(agent_id="learner-1", role="learner")})
    assert refusal("policy", learners) == (
        "a agent.status of 'learner' on the subject of 'policy', which only the 'policy' role publishes on"
    )
    bench = status.model_copy(update={"source": Source(agent_id="b", role="bench")})  # no run role: the admin's
    assert subject_of("r", bench) == "coevo.r.ev.agent.status.admin" and refusal("admin", bench) is None
    from coevo.agents import ROLES
    from coevo.schemas.registry import RUN_ROLES

    assert set(RUN_ROLES) == set(ROLES)
    assert parse_subject("coevo.r.ev.step.taken.x") == ("step.taken.x", None)  # not step.taken's: refused
    assert parse_subject("coevo.r.ctl.x") is None
    with pytest.raises(KeyError):
        subject_for("r", "step.taken", "policy")


async def test_an_old_stream_and_an_old_export_still_read(bus: NatsBus, nats_url: str, cfg: CoevoConfig) -> None:
    """Events stored on the subjects of before scopes (``coevo.<run>.ev.<kind>``, by the admin) are read
    by every reader of their kind; an export of them imports onto today's subjects."""
    from coevo.schemas import readable, subject_of
    from coevo.tools.events import import_events
    from tests.samples import sample_events

    old = sample_events(bus.run_id)
    for e in old:
        await bus.publish_raw(subject_for(bus.run_id, type(e)), encode(e), e.event_id)
    await bus.flush()
    assert await bus.events() == old
    assert await bus.events(["weights.published", "task.scheduled"]) == [
        e for e in old if isinstance(e, WeightsPublished | TaskScheduled)
    ]
    rows = [
        {"seq": i + 1, "subject": subject_for(bus.run_id, type(e)), "event": readable(e)} for i, e in enumerate(old)
    ]
    moved = await NatsBus.connect(nats_url, f"{bus.run_id}m", nats_cfg=cfg.nats, bus=cfg.bus, stream=cfg.stream)
    try:
        assert await import_events(moved, rows) == len(old)
        again = [(m.subject, e) async for _, e, m in moved.history()]
        assert [e for _, e in again] == [e.model_copy(update={"run_id": moved.run_id}) for e in old]
        assert [s for s, _ in again] == [subject_of(moved.run_id, e) for _, e in again if e is not None]
    finally:
        await moved.close()


# ---- a run's real server, each role under its own credentials -----------------------------------


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[NatsBus]:
    async with open_bus("subj1", store=tmp_path / "nats") as bus:  # as coevo run: embedded, as admin
        yield bus


def _url(bus: NatsBus) -> str:
    return f"nats://{bus.nc.connected_url.hostname}:{bus.nc.connected_url.port}"


async def _role_bus(admin: NatsBus, tmp_path: Path, role: str, cfg: CoevoConfig) -> NatsBus:
    creds = credentials_dir(tmp_path / "nats") / f"{role}.json"
    return await NatsBus.connect(
        _url(admin), admin.run_id, nats_cfg=NatsConfig(credentials_file=creds), bus=cfg.bus, name=role
    )


async def _settled(bus: NatsBus, consumer: str) -> bool:
    """Everything stored so far was handed to ``consumer`` and has an outcome."""
    try:
        info = await bus.js.consumer_info(bus.stream, consumer)
    except nats.js.errors.NotFoundError:
        return False
    return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq > 0


async def test_a_policy_cannot_schedule_a_candidate_group(admin: NatsBus, tmp_path: Path, cfg: CoevoConfig) -> None:
    """A policy-credentialed process tries to schedule a ``candidate`` group with outcomes of its
    choosing (two won rollouts) on every subject a ``task.scheduled`` can have: the server refuses
    the tasks agent's subject; what it may store (the endpoint's subject) is dead-lettered by the
    scorer with the reason, so the group is never scored and the tasks agent never decides on it."""
    from coevo.agents.scorer import ScorerAgent

    run = admin.run_id
    forged = TaskScheduled(
        run_id=run,
        source=Source(agent_id="policy-x", role="policy"),
        task=TaskSpec(task_id="quick-1", family="quickgame"),
        slot_id="slot-0",
        group_id="ext-forged",  # the endpoint's own group ids, so that it goes on the endpoint's subject
        n_rollouts=2,
        purpose="candidate",
    )
    scheduled = subject_for(run, "task.scheduled")
    subjects = sorted({scheduled} | {s for s in role_permissions(run, "policy").publish if s.startswith(scheduled)})
    c = read_credential(credentials_dir(tmp_path / "nats") / "policy.json")
    nc = await nats.connect(_url(admin), user=c.user, password=c.password, inbox_prefix=inbox_prefix(c.user))
    js = nc.jetstream(timeout=2.0)
    stored, refused = [], []
    for s in subjects:
        try:
            await js.publish(s, encode(forged), headers={"Nats-Msg-Id": f"forged-{s}"})
            stored.append(s)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            refused.append(s)
    for i in range(2):
        done = TrajectoryCompleted(
            run_id=run,
            source=forged.source,
            trajectory_id=f"ext-forged-r{i}",
            task_id="quick-1",
            group_id="ext-forged",
            rollout_index=i,
            outcome="won",
            num_steps=0,
        )
        await js.publish(subject_for(run, "trajectory.completed"), encode(done))
    await nc.close()
    assert scheduled in refused  # the tasks agent's own subject (today: its only one) is not the policy's
    scorer_bus = await _role_bus(admin, tmp_path, "scorer", cfg)
    scorer = ScorerAgent(scorer_bus, cfg)
    stop = asyncio.Event()
    run_task = asyncio.create_task(scorer.run())
    try:
        await until(lambda: _settled(admin, "scorer"), timeout_s=60.0)
    finally:
        stop.set()
        scorer.stop()
        await run_task
        await scorer_bus.close()
    events = await admin.events()
    assert [e for e in events if isinstance(e, GroupScored) and e.group_id == "ext-forged"] == []
    letters = {e.original_subject: e.reason for e in events if isinstance(e, DeadLettered)}
    assert set(letters) == set(stored)  # every forged group the server stored was refused by its reader
    for reason in letters.values():
        assert "candidate" in reason and "endpoint" in reason, reason


# ---- lanes: deliver=last per lane -----------------------------------------------------------------


def _agent(role: str, cfg: CoevoConfig) -> Any:
    """An agent's declared subscriptions, read as the topology does (no models loaded)."""
    from coevo.agents import resolve_role

    agent: Any = object.__new__(resolve_role(role))
    agent.cfg = cfg
    return agent


async def test_each_last_only_subscription_gets_its_own_lanes_latest(
    admin: NatsBus, tmp_path: Path, cfg: CoevoConfig
) -> None:
    """The learner announces and steps the policy lane, then the judge lane (the judge's came last).
    Each per-instance, newest-only subscription started afterwards (a restarted agent) gets its own
    lane's latest: the policy's and the judge's weights followers, the policy's endpoint gate
    (``policy-steps``), the tasks agent's step gate; the tasks agent's versions get both lanes'."""
    learner = await _role_bus(admin, tmp_path, "learner", cfg)
    src = Source(agent_id="learner-1", role="learner")
    for role, version in (("policy", 1), ("policy", 2), ("judge", 7)):
        await learner.publish_sync(
            WeightsPublished(
                run_id=admin.run_id,
                source=src,
                role=role,
                version=version,
                path=f"/w/{role}/v{version}",
                sha256="0" * 64,
                bytes=1,
            )
        )
        await learner.publish_sync(
            LearnerStepped(
                run_id=admin.run_id,
                source=src,
                role=role,
                version=version,
                samples=1,
                tokens=1,
                loss=0.0,
                kl=0.0,
                clip_fraction=0.0,
                mismatch_kl=0.0,
                tokens_per_second=1.0,
                group_ids=[f"g-{role}-{version}"],
            )
        )
    await learner.close()
    with_endpoint = load_config(overrides={"policy.serve_port": 0, "run.runs_dir": str(tmp_path / "runs")})
    subs = {s.durable: s for s in _agent("policy", with_endpoint).subscriptions()}
    subs |= {s.durable: s for s in _agent("judge", cfg).subscriptions()}
    subs |= {s.durable: s for s in _agent("tasks", cfg).subscriptions()}
    got: dict[str, list[tuple[str, int]]] = {}
    for durable in ("policy-weights", "judge-weights", "policy-steps", "tasks-weights", "tasks-steps"):
        assert subs[durable].deliver == "last" and not subs[durable].shared

        async def record(event: Event, _d: Delivery, durable: str = durable) -> None:
            assert isinstance(event, WeightsPublished | LearnerStepped)
            got.setdefault(durable, []).append((event.role, event.version))

        sub = dataclasses.replace(subs[durable], handler=record)
        source = Source(agent_id=f"restarted-{durable}", role="policy")
        consumer = Consumer(admin, sub, source)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        try:
            await until(
                lambda durable=durable, source=source: _settled(admin, f"{durable}-{source.agent_id}"), timeout_s=60.0
            )
        finally:
            stop.set()
            await task
    assert {k: sorted(v) for k, v in got.items()} == {
        "policy-weights": [("policy", 2)],
        "judge-weights": [("judge", 7)],
        "policy-steps": [("policy", 2)],
        "tasks-steps": [("policy", 2)],
        "tasks-weights": [("judge", 7), ("policy", 2)],
    }


async def test_a_restarted_policy_follower_applies_its_lanes_weights_announced_before_the_judges(
    admin: NatsBus, tmp_path: Path, loop_cfg: CoevoConfig
) -> None:
    """A policy agent (its real engine, under the policy's credentials) starts after the learner
    announced the policy's weights and then the judge's: it loads the policy's and reports it.
    (Its newest-only subscription used to be handed the judge's announcement alone: base weights for good.)"""
    from coevo.agents.policy import PolicyAgent
    from coevo.inference.models import ensure_default_model
    from coevo.training.lane import Lane

    root = tmp_path / "published"
    cfg = loop_cfg.model_copy(update={"learner": loop_cfg.learner.model_copy(update={"publication_root": root})})
    lane = Lane("policy", ensure_default_model("policy", Path(cfg.env.cache_dir)), root, LearnerConfig(), device="cpu")
    lane.version = 1
    with torch.no_grad():
        next(lane.model.parameters()).add_(1.0)  # weights the base does not have
    path, digest, size = lane.publish_alone()
    learner = await _role_bus(admin, tmp_path, "learner", cfg)
    src = Source(agent_id="learner-1", role="learner")
    await learner.publish_sync(
        WeightsPublished(
            run_id=admin.run_id, source=src, role="policy", version=1, path=str(path), sha256=digest, bytes=size
        )
    )
    await learner.publish_sync(  # the judge's announcement comes last
        WeightsPublished(
            run_id=admin.run_id, source=src, role="judge", version=4, path=str(root / "judge"), sha256="0" * 64, bytes=1
        )
    )
    await learner.close()
    policy_bus = await _role_bus(admin, tmp_path, "policy", cfg)
    policy = PolicyAgent(policy_bus, cfg, agent_id="policy-restarted")

    async def applied() -> bool:
        return any(
            isinstance(e, WeightsApplied) and e.server == "policy-restarted" and e.ok and e.version == 1
            for e in await admin.events(["weights.applied"])
        )

    task = asyncio.create_task(policy.run())
    try:
        await until(applied, 90.0)
    finally:
        policy.stop()
        await task
        await policy_bus.close()
    assert policy.client.version == 1 and policy.model_version == 1
