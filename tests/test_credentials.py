"""Who may connect to a run's NATS and what each role may do there (docs/security.md, "The bus").

Pure decisions first (the permission table against the agents' declarations), then a run's real
embedded server: a connection without credentials, a role publishing outside its kinds, a role
touching the stream or another role's subjects are refused by the server itself."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest

from coevo.agents import ROLES, resolve_role
from coevo.errors import ConfigError
from coevo.runtime.app import credentials_dir, open_bus
from coevo.runtime.bus import NatsBus
from coevo.runtime.credentials import (
    ADMIN,
    EMITS,
    EVERY_ROLE_EMITS,
    inbox_prefix,
    read_credential,
    role_permissions,
    run_streams,
)
from coevo.schemas import (
    KIND_TO_MODEL,
    SCOPES,
    control_subject,
    kind_from_subject,
    kind_of,
    producer_of,
    selector_keys,
    subject_for,
)

# ---- the table -----------------------------------------------------------------------------------


def _subjects(run_id: str) -> list[str]:
    """Every event subject of a run: each kind's, each scope's, and a scoped kind's bare one."""
    return sorted(
        {subject_for(run_id, k) for k in KIND_TO_MODEL}
        | {f"coevo.{run_id}.ev.{key}" for k in KIND_TO_MODEL for key in selector_keys(k)}
    )


def _owners(subject: str) -> list[str]:
    return sorted(r for r in ROLES if subject in role_permissions("r1", r).publish)


def test_each_role_may_publish_exactly_what_its_agent_declares() -> None:
    assert set(EMITS) == set(ROLES)
    for role in ROLES:
        assert set(EMITS[role]) == {kind_of(e) for e in resolve_role(role).emits}, role
        allowed = {s for s in role_permissions("r1", role).publish if s.startswith("coevo.r1.ev.")}
        kinds = {kind_from_subject(s) for s in allowed}
        assert kinds == {*EMITS[role], *EVERY_ROLE_EMITS}, role
    # a role is its subjects: each has one producer, the one its registry scope names
    for subject in _subjects("r1"):
        assert _owners(subject) == ([p] if (p := producer_of(subject, EMITS)) in ROLES else []), subject
    assert _owners(subject_for("r1", "task.scheduled", "tasks")) == ["tasks"]  # train, candidate, eval groups
    assert _owners(subject_for("r1", "task.scheduled", "endpoint")) == ["policy"]  # its endpoint's
    assert _owners(subject_for("r1", "task.scheduled")) == []  # old streams' and the admin's
    for lane in ("policy", "judge"):
        assert _owners(subject_for("r1", "weights.published", lane)) == ["learner"]
        assert _owners(subject_for("r1", "weights.applied", lane)) == [lane]
    for kind in EVERY_ROLE_EMITS:  # each role reports on its own subject
        assert all(_owners(subject_for("r1", kind, role)) == [role] for role in ROLES)
        assert _owners(subject_for("r1", kind)) == _owners(subject_for("r1", kind, "admin")) == []


def test_no_role_changes_the_stream_or_reads_another_roles_inbox() -> None:
    for role in ROLES:
        p = role_permissions("r1", role)
        assert not any(
            s == ">"
            or s.startswith(
                (
                    "coevo.>",
                    "coevo.r1.>",
                    "$JS.API.>",
                    "$JS.API.STREAM.CREATE",
                    "$JS.API.STREAM.UPDATE",
                    "$JS.API.STREAM.DELETE",
                    "$JS.API.STREAM.MSG.DELETE",
                    "$KV.>",
                    "_INBOX",
                )
            )
            for s in p.publish
        ), role
        purges = [s for s in p.publish if s.startswith("$JS.API.STREAM.PURGE.")]
        assert purges == (["$JS.API.STREAM.PURGE.COEVO_r1"] if role == "retention" else []), role
        assert [s for s in p.publish if s.startswith("$O.")] == [f"$O.COEVO_r1_payloads_{role}.>"]
        assert [s for s in p.publish if s.startswith("$KV.")] == [
            f"$KV.coevo_r1_{b}.>"
            for b in {"tasks": ("tasks", "llmcache_tasks"), "judge": ("judgetests", "llmcache_judge")}.get(role, ())
        ]
        consumers = [s for s in p.publish if s.startswith("$JS.API.CONSUMER.")]  # on this run's streams only
        assert consumers and all(set(s.split(".")) & set(run_streams("r1")) for s in consumers), consumers
        assert [s for s in p.subscribe if s.startswith("_INBOX")] == [f"{inbox_prefix(role)}.>"]
        assert not any(s.startswith("coevo.r1.ctl") for s in p.publish)  # commands come from admin only
        assert "coevo.r1.ev.>" not in p.subscribe and ">" not in p.subscribe
    with pytest.raises(ConfigError, match="no NATS permissions for role 'intruder'"):
        role_permissions("r1", "intruder")


def test_a_credentials_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"user": "policy", "password": "s3cret-pw"}))
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=r"readable by others.*chmod 600") as err:
        read_credential(path)
    assert err.value.field == "nats.credentials_file"
    os.chmod(path, 0o600)
    assert read_credential(path).user == "policy" and "s3cret-pw" not in repr(read_credential(path))
    path.write_text("not json")
    with pytest.raises(ConfigError, match="not a coevo credentials file"):
        read_credential(path)


# ---- a run's real server -------------------------------------------------------------------------


@pytest.fixture
async def run_bus(tmp_path: Path) -> AsyncIterator[NatsBus]:
    async with open_bus("sec1", store=tmp_path / "nats") as bus:  # as coevo run: embedded, as admin
        yield bus


async def _connect(url: str, creds: Path | None, errors: list[Exception] | None = None, **kw: object) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(exc)

    opts: dict[str, object] = {"allow_reconnect": False, "connect_timeout": 5, "error_cb": on_error, **kw}
    if creds is not None:
        c = read_credential(creds)
        opts.update(user=c.user, password=c.password, inbox_prefix=inbox_prefix(c.user))
    return await nats.connect(url, **opts)


def _url(bus: NatsBus) -> str:
    return f"nats://{bus.nc.connected_url.hostname}:{bus.nc.connected_url.port}"


async def test_a_connection_without_the_runs_credentials_is_refused(run_bus: NatsBus, tmp_path: Path) -> None:
    directory = credentials_dir(tmp_path / "nats")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = sorted(p.name for p in directory.iterdir())
    assert files == sorted(f"{u}.json" for u in (ADMIN, *ROLES))
    assert all(stat.S_IMODE((directory / f).stat().st_mode) == 0o600 for f in files)
    for kw in ({}, {"user": "policy", "password": "guess"}, {"token": "anything"}):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await _connect(_url(run_bus), None, **kw)
    nc = await _connect(_url(run_bus), directory / "policy.json")
    assert nc.is_connected
    await nc.close()


async def test_each_role_publishes_only_its_own_kinds(run_bus: NatsBus, tmp_path: Path) -> None:
    """Every role publishes one event of every kind; the stream holds exactly the allowed ones and the
    server reported every other one as a permissions violation."""
    directory = credentials_dir(tmp_path / "nats")
    refused: dict[str, list[str]] = {}
    subjects = _subjects(run_bus.run_id)
    for role in ROLES:
        errors: list[Exception] = []
        nc = await _connect(_url(run_bus), directory / f"{role}.json", errors)
        allowed = set(role_permissions(run_bus.run_id, role).publish)
        for subject in subjects:
            await nc.publish(
                subject,
                json.dumps({"by": role, "subject": subject}).encode(),
                headers={"Nats-Msg-Id": f"{role}-{subject}"},
            )
        await nc.flush()
        async with asyncio.timeout(10):  # the server's -ERR for each refusal arrives after the flush
            while len(errors) < len(set(subjects) - allowed):
                await asyncio.sleep(0.05)
        refused[role] = sorted(str(e).split('"')[1] for e in errors if "permissions violation" in str(e))
        await nc.close()
    stored = {
        (d["by"], d["subject"]) for _, _, msg in [x async for x in run_bus.history()] for d in [json.loads(msg.data)]
    }
    expected = {(r, s) for r in ROLES for s in role_permissions(run_bus.run_id, r).publish if s in subjects}
    assert stored == expected
    assert not {s for _, s in stored} & {subject_for(run_bus.run_id, k) for k in SCOPES}  # bare: no role's
    for role in ROLES:
        allowed = set(role_permissions(run_bus.run_id, role).publish)
        assert refused[role] == sorted(s.lower() for s in subjects if s not in allowed), role


async def test_a_role_cannot_touch_the_stream_the_buckets_or_anothers_subjects(
    run_bus: NatsBus, tmp_path: Path
) -> None:
    directory = credentials_dir(tmp_path / "nats")
    errors: list[Exception] = []
    nc = await _connect(_url(run_bus), directory / "policy.json", errors)
    js = nc.jetstream(timeout=1.0)
    for attempt in (
        js.delete_stream(run_bus.stream),
        js.purge_stream(run_bus.stream),
        js.add_stream(name="COEVO_evil", subjects=["coevo.sec1.ev.weights.>"]),
        js.publish(f"$KV.coevo_{run_bus.run_id}_tasks.slot-0", b"{}"),  # the task pool: tasks only
        nc.request(control_subject(run_bus.run_id, "learner-1"), b'{"command": "stop"}', timeout=1),
    ):
        with pytest.raises((TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await attempt
    await nc.subscribe(f"{inbox_prefix('learner')}.>")  # the learner's replies and deliveries
    await nc.subscribe(f"coevo.{run_bus.run_id}.weights.>")  # serving weight transfers: the learner's
    await nc.subscribe(f"coevo.{run_bus.run_id}.ev.>")  # a core tap on every event
    await nc.flush()
    async with asyncio.timeout(10):
        while sum("permissions violation" in str(e) for e in errors) < 8:
            await asyncio.sleep(0.05)
    said = " ".join(str(e) for e in errors)
    for what in (
        'publish to "$js.api.stream.delete',
        'publish to "$js.api.stream.purge.coevo_sec1',
        'publish to "$js.api.stream.create',
        'publish to "$kv.coevo_sec1_tasks',
        'publish to "coevo.sec1.ctl',
        'subscription to "_inbox_learner',
        'subscription to "coevo.sec1.weights',
        'subscription to "coevo.sec1.ev.',
    ):
        assert what in said.lower(), (what, said)
    assert (await run_bus.js.stream_info(run_bus.stream)).config.name == run_bus.stream  # still there
    kv = await js.key_value(f"coevo_{run_bus.run_id}_tasks")  # reading is allowed
    assert kv is not None
    await nc.close()


async def test_a_push_consumer_cannot_deliver_a_forged_command(run_bus: NatsBus, tmp_path: Path) -> None:
    """JetStream delivers a push consumer's messages to any subject, past the role's permissions: the
    policy can aim one at an agent's control subject. What arrives there is not a request (its
    stored subject, a ``$JS.ACK`` reply) and is dropped; a real command from the admin is answered."""
    from nats.js import api

    from coevo.schemas import ControlReply, ControlRequest

    commands: list[str] = []

    async def handler(req: ControlRequest) -> ControlReply:
        commands.append(req.command)
        return ControlReply(agent_id="victim", role="policy", state="running", uptime_s=1.0)

    await run_bus.serve_control("victim", handler)
    nc = await _connect(_url(run_bus), credentials_dir(tmp_path / "nats") / "policy.json")
    js = nc.jetstream(timeout=5.0)
    await js.add_consumer(
        run_bus.stream,
        api.ConsumerConfig(
            name="policy_5",  # one of its own consumer names: another name is refused
            deliver_subject=control_subject(run_bus.run_id, "victim"),
            ack_policy=api.AckPolicy.NONE,
            filter_subject=subject_for(run_bus.run_id, "agent.status", "policy"),
        ),
    )
    await js.publish(
        subject_for(run_bus.run_id, "agent.status", "policy"), ControlRequest(command="stop").model_dump_json().encode()
    )
    async with asyncio.timeout(20):
        while run_bus.stats.forged_requests == 0:
            await asyncio.sleep(0.05)
    assert commands == []
    reply = await run_bus.control("victim", "status")
    assert reply.state == "running" and commands == ["status"]
    await nc.close()


async def test_an_event_on_another_kinds_subject_is_not_an_event(run_bus: NatsBus, tmp_path: Path) -> None:
    """Subjects are what permissions see; the kind is in the payload: a policy's ``step.taken`` whose
    payload is a ``GroupScored`` is refused by every reader, not trained."""
    from tests.samples import sample_events

    scored = next(e for e in sample_events(run_bus.run_id) if kind_of(e) == "group.scored")
    nc = await _connect(_url(run_bus), credentials_dir(tmp_path / "nats") / "policy.json")
    await nc.jetstream(timeout=5.0).publish(
        subject_for(run_bus.run_id, "step.taken"), scored.model_dump_json().encode()
    )
    await nc.close()
    (stored,) = [m async for _, _, m in run_bus.history(["step.taken"])]
    with pytest.raises(ValueError, match=r"a group\.scored event on the subject of step\.taken"):
        await run_bus.decode_msg(stored)
    assert await run_bus.events() == []


async def test_a_role_stores_its_large_events_in_its_own_object_store_and_every_role_reads_them(
    run_bus: NatsBus, tmp_path: Path
) -> None:
    """Through the roles' own connections: the tasks agent writes its claim, another role (the
    scorer's consumer, the learner's history) follows it (every role's read used to time out on a
    stream lookup it may not make), and nobody but the admin purges an object store."""
    from coevo.config import BusConfig, NatsConfig
    from coevo.runtime.claims import Claim, is_claim
    from coevo.schemas import Source, TaskScheduled, TaskSpec

    creds = credentials_dir(tmp_path / "nats")

    async def role_bus(role: str) -> NatsBus:
        return await NatsBus.connect(
            _url(run_bus),
            run_bus.run_id,
            bus=BusConfig(inline_max_bytes=1024),
            nats_cfg=NatsConfig(credentials_file=creds / f"{role}.json"),
        )

    tasks = await role_bus("tasks")
    big = TaskScheduled(
        run_id=run_bus.run_id,
        source=Source(agent_id="t", role="tasks"),
        group_id="g",
        n_rollouts=1,
        task=TaskSpec(task_id="t", family="quick", params={"blob": "x" * 400_000}),
    )  # 4 chunks
    await tasks.publish_sync(big)
    await tasks.publish_sync(big)  # a rerun finds its object stored
    errors: list[Exception] = []
    for role in ("tasks", "policy"):
        nc = await _connect(_url(run_bus), creds / f"{role}.json", errors)
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):  # not even the owner purges
            await nc.jetstream(timeout=1.0).purge_stream(f"OBJ_COEVO_{run_bus.run_id}_payloads_tasks")
        await nc.close()
    await tasks.close()
    (stored,) = [m async for _, _, m in run_bus.history(["task.scheduled"])]
    claim = Claim.parse(stored.data)
    assert is_claim(stored.headers) and claim.bucket == f"COEVO_{run_bus.run_id}_payloads_tasks"
    assert [o.name for o in await (await run_bus.payload_store(claim.bucket)).list()] == [claim.key]
    for role in ("scorer", "learner"):
        reader = await role_bus(role)
        assert await reader.events(["task.scheduled"]) == [big], role  # followed to the tasks store
        await reader.close()
    assert await run_bus.events(["task.scheduled"]) == [big]
    assert len([e for e in errors if "stream.purge.obj_coevo_sec1_payloads_tasks" in str(e).lower()]) == 2, errors


async def test_a_coevo_runs_nats_refuses_strangers_and_roles_outside_their_subjects(
    tmp_path: Path, model_cache: Path
) -> None:
    """The whole command, as a user starts it: its server takes no connection without credentials,
    and the policy's credentials cannot announce weights."""
    import subprocess

    from tests.conftest import PYTHON, subprocess_env

    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "coevo",
            "run",
            "--minutes",
            "2",
            "--run-id",
            "sec-run",
            "--run.runs_dir",
            str(runs),
            "--env.cache_dir",
            str(model_cache),
            "--no-dashboard",
            "--no-report",
            "--log.console",
            "off",
        ],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        log = runs / "sec-run" / "coevo.log.jsonl"
        url = None
        async with asyncio.timeout(120):
            while url is None:
                for line in log.read_text().splitlines() if log.exists() else []:
                    if '"nats.embedded_started"' in line:
                        url = json.loads(line)["url"]
                await asyncio.sleep(0.2)
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await _connect(url, None)
        errors: list[Exception] = []
        nc = await _connect(url, runs / "sec-run" / "nats" / "credentials" / "policy.json", errors)
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
            await nc.jetstream(timeout=2.0).publish(subject_for("sec-run", "weights.published", "policy"), b"{}")
        await nc.close()
        assert any("permissions violation" in str(e) for e in errors), errors
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
