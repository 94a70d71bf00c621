"""``coevo bench chaos``: the closed loop as separate processes on a 3-node NATS cluster, under faults.

Every role (tasks, policy, judge, scorer, learner, an env worker) runs as its own ``coevo agent``
process. A fault injector kill -9s a random agent every ``kill_every_s`` (and starts it again),
kills a NATS node and restarts it, and publishes garbage and schema-violating messages on every
subject. Then faults stop, the tasks agent stops scheduling, the others drain, and the verdict is
read from the stream itself (``judge_stream``, pure): every scheduled group is scored or
dead-lettered, no group is trained twice into the surviving weights, learner versions only go up.
The same loop without faults gives the throughput to compare with.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevo.config import NatsConfig
from coevo.runtime.bus import connect_nats
from coevo.runtime.credentials import ADMIN, credential_path, credentials_dir, role_users
from coevo.runtime.proc import die_with_parent
from coevo.schemas import (
    DeadLettered,
    Event,
    GroupScored,
    LearnerStepped,
    TaskScheduled,
    TrajectoryCompleted,
    envelope,
)

ROLES = ("tasks", "policy", "judge", "scorer", "learner", "env")
KILLABLE = ("policy", "judge", "scorer", "learner", "env", "tasks")


@dataclass(frozen=True)
class ChaosPlan:
    minutes: float = 10.0
    kill_every_s: float = 5.0
    node_every_s: float = 60.0
    node_down_s: float = 5.0
    garbage_every_s: float = 5.0
    drain_s: float = 120.0
    seed: int = 0


# ---- the verdict, from the stream (pure) ------------------------------------------------------------


def _dead_group(letter: DeadLettered) -> str | None:
    """The group a dead-lettered message belonged to, if it was one of this run's group events."""
    body = envelope(letter.raw) or {}
    return body.get("group_id") if body.get("kind") in ("task.scheduled", "group.scored") else None


def _trained_twice(steps: list[LearnerStepped]) -> int:
    """Groups trained again while their first training is still in the surviving weights.

    A learner process that restarts resumes from its newest checkpoint (version ``v0``): steps an
    earlier process made after ``v0`` are rolled back with it, so retraining their groups is not a
    double count."""
    twice = 0
    for role in {s.role for s in steps}:
        live: dict[str, int] = {}  # group -> version of the step that trained it
        incarnation = None
        for s in (s for s in steps if s.role == role):
            if s.source.agent_id != incarnation:
                incarnation, restored = s.source.agent_id, s.version - 1
                live = {g: v for g, v in live.items() if v <= restored}
            for g in s.group_ids:
                twice += g in live
                live[g] = s.version
    return twice


def _monotonic(steps: list[LearnerStepped]) -> bool:
    """Within each learner process and role, versions only go up."""
    last: dict[tuple[str, str], int] = {}
    for s in steps:
        key = (s.source.agent_id, s.role)
        if key in last and s.version <= last[key]:
            return False
        last[key] = s.version
    return True


def _trail(events: list[Event], group_id: str) -> dict[str, int]:
    """What the stream holds of one group, by kind (to see where a lost group stopped)."""
    return dict(Counter(e.kind for e in events if getattr(e, "group_id", None) == group_id  # type: ignore[attr-defined]
                        or getattr(e, "correlation_id", None) == group_id))


def judge_stream(events: list[Event], seconds: float) -> dict[str, Any]:
    scheduled = {e.group_id for e in events if isinstance(e, TaskScheduled)}
    scored = {e.group_id for e in events if isinstance(e, GroupScored)}
    letters = [e for e in events if isinstance(e, DeadLettered)]
    dead = {g for g in map(_dead_group, letters) if g}
    steps = [e for e in events if isinstance(e, LearnerStepped)]
    reasons = Counter(e.reason.split(":")[0][:60] for e in letters)
    lost = sorted(scheduled - scored - dead)
    return {
        "lost_examples": {g: _trail(events, g) for g in lost[:5]},
        "groups_scheduled": len(scheduled),
        "groups_scored": len(scored & scheduled),
        "groups_lost": len(scheduled - scored - dead),
        "groups_dead_lettered": len(dead & scheduled),
        "groups_trained_twice": _trained_twice(steps),
        "learner_steps": len(steps),
        "learner_versions_monotonic": _monotonic(steps),
        "dead_lettered": dict(reasons.most_common()),
        "trajectories": sum(isinstance(e, TrajectoryCompleted) for e in events),
        "trajectories_per_second": round(sum(isinstance(e, TrajectoryCompleted) for e in events) / seconds, 3),
    }


# ---- processes --------------------------------------------------------------------------------------


@dataclass
class Fleet:
    """The agent processes of one run; each role can be killed and started again."""

    url: str
    run_id: str
    overrides: dict[str, Any]
    logs: Path
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    starts: Counter[str] = field(default_factory=Counter)
    exits: Counter[str] = field(default_factory=Counter)
    """processes that exited on their own (an agent that failed) and were started again"""
    credentials: Path | None = None
    """the server's credentials directory: each agent connects with its role's file only"""

    def agent_args(self, role: str) -> list[str]:
        args = [sys.executable, "-m", "coevo", "agent", role, "--nats", self.url, "--run-id", self.run_id]
        if self.credentials is not None:
            args += ["--nats.credentials_file", str(credential_path(self.credentials, role))]
        for key, value in self.overrides.items():
            args += ["--set", f"{key}={json.dumps(value) if isinstance(value, list) else value}"]
        return args

    def admin(self) -> NatsConfig:
        """How the bench itself connects (as the run's admin)."""
        return NatsConfig(credentials_file=credential_path(self.credentials, ADMIN) if self.credentials else None)

    async def provision(self) -> None:
        """The run's stream, buckets and object store, made by the admin with the agents' stream settings
        (replicas included) before any agent starts: a role may not create them."""
        from coevo.config import load_config
        from coevo.runtime.bus import NatsBus

        stream = load_config(overrides={k: v for k, v in self.overrides.items() if k.startswith("stream.")}).stream
        async with await NatsBus.connect(self.url, self.run_id, nats_cfg=self.admin(), stream=stream) as bus:
            await bus.provision()

    async def start(self, role: str) -> None:
        args = self.agent_args(role)
        self.starts[role] += 1
        log = (self.logs / f"{role}-{self.starts[role]}.log").open("wb")
        self.procs[role] = await asyncio.create_subprocess_exec(*args, stdout=log, stderr=log,
                                                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                                                preexec_fn=die_with_parent)
        log.close()

    async def revive(self) -> list[str]:
        """Start again every agent whose process exited on its own (what a process manager does)."""
        gone = [r for r, p in self.procs.items() if p.returncode is not None]
        for role in gone:
            await self.start(role)
        return gone

    async def kill(self, role: str) -> None:
        proc = self.procs[role]
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def stop(self, roles: tuple[str, ...] = ROLES, grace_s: float = 30.0) -> None:
        procs = [self.procs[r] for r in roles if r in self.procs and self.procs[r].returncode is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), grace_s)
            except TimeoutError:
                p.kill()
                await p.wait()


def chaos_overrides(runs_dir: Path, cache: Path | None, replicas: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "run.runs_dir": str(runs_dir), "stream.replicas": replicas, "env.remote": "true",
        "log.console": "off", "agent.heartbeat_s": 2.0, "bus.ack_wait_s": 10.0, "bus.in_progress_every_s": 2.0,
        "scorer.vote_timeout_s": 20.0, "scorer.group_timeout_s": 45.0, "tasks.inflight_timeout_s": 120.0,
        "learner.verdict_wait_s": 10.0, "agent.max_restarts": 50,
    }
    if cache is not None:
        out["env.cache_dir"] = str(cache)
    return out


# ---- faults -----------------------------------------------------------------------------------------


async def _garbage(nc: Any, run_id: str, rng: random.Random) -> int:
    """Random bytes and schema-violating events on every event subject of the run."""
    from coevo.schemas import KIND_TO_MODEL, events_prefix

    n = 0
    for kind in KIND_TO_MODEL:
        subject = f"{events_prefix(run_id)}.{kind}"
        for payload in (rng.randbytes(rng.randint(0, 64)),
                        json.dumps({"kind": kind, "run_id": run_id, "event_id": f"x{rng.random()}"}).encode()):
            try:
                await nc.jetstream().publish(subject, payload, timeout=2.0)
                n += 1
            except Exception:  # a node is down right now: that garbage is simply not stored
                pass
    return n


async def _inject(fleet: Fleet, cluster: Any, plan: ChaosPlan, until: float) -> Counter[str]:
    rng = random.Random(plan.seed)
    faults: Counter[str] = Counter()
    nc = await connect_nats(fleet.admin(), cluster.url, name="coevo-chaos")
    next_node = time.monotonic() + min(plan.node_every_s, (until - time.monotonic()) / 2)
    next_garbage = time.monotonic()
    try:
        while time.monotonic() < until:
            await asyncio.sleep(plan.kill_every_s)
            for gone in await fleet.revive():  # not a fault we injected: reported as agent_exits
                fleet.exits[gone] += 1
            role = rng.choice(KILLABLE)
            await fleet.kill(role)
            await fleet.start(role)
            faults[f"kill -9 {role}"] += 1
            if time.monotonic() >= next_garbage:
                faults["garbage messages"] += await _garbage(nc, fleet.run_id, rng)
                next_garbage = time.monotonic() + plan.garbage_every_s
            if time.monotonic() >= next_node:
                node = rng.randrange(len(cluster.nodes))
                cluster.kill_node(node)
                faults["nats node killed"] += 1
                await asyncio.sleep(plan.node_down_s)
                await asyncio.to_thread(cluster.restart_node, node)
                next_node = time.monotonic() + plan.node_every_s
    finally:
        await nc.close()
    return faults


async def _drain(fleet: Fleet, deadline: float) -> None:
    """Wait until every scheduled group is scored or dead-lettered (or the deadline)."""
    from coevo.runtime.bus import NatsBus

    async with await NatsBus.connect(fleet.url, fleet.run_id, nats_cfg=fleet.admin()) as bus:
        while time.monotonic() < deadline:
            # only the kinds that decide "lost": re-reading every step and vote each time was the bulk
            verdict = judge_stream(await bus.events(["task.scheduled", "group.scored", "dead.lettered"]), 1.0)
            if verdict["groups_lost"] == 0:
                return
            await asyncio.sleep(2.0)


async def run_fleet(cluster: Any, workdir: Path, run_id: str, plan: ChaosPlan, *, faults: bool,
                    cache: Path | None) -> dict[str, Any]:
    from coevo.runtime.bus import NatsBus

    logs = workdir / run_id
    logs.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(cluster.url, run_id, chaos_overrides(workdir / "runs", cache, len(cluster.nodes)), logs,
                  credentials=credentials_dir(workdir / "nats"))
    await fleet.provision()
    for role in ROLES:
        await fleet.start(role)
    t0 = time.monotonic()
    until = t0 + plan.minutes * 60
    injected: Counter[str] = Counter()
    if faults:
        injected = await _inject(fleet, cluster, plan, until)
    else:
        await asyncio.sleep(until - time.monotonic())
    seconds = time.monotonic() - t0
    await fleet.stop(("tasks",))  # no new groups; what was scheduled drains
    await _drain(fleet, time.monotonic() + plan.drain_s)
    await fleet.stop()
    async with await NatsBus.connect(cluster.url, run_id, nats_cfg=fleet.admin()) as bus:
        verdict = judge_stream(await bus.events(), seconds)
    return {**verdict, "seconds": round(seconds, 1), "faults_injected": sum(injected.values()),
            "faults": dict(injected), "agent_starts": dict(fleet.starts),
            "agent_exits": dict(fleet.exits)}


async def bench_chaos(plan: ChaosPlan, *, cache: Path | None = None, baseline: bool = True,
                      workdir: Path | None = None) -> dict[str, Any]:
    """``workdir``: keep the cluster's stores, the runs and the agents' logs there (default: a temporary
    directory, removed)."""
    from coevo.runtime.server import EmbeddedCluster

    with tempfile.TemporaryDirectory(prefix="coevo-chaos-") as tmp:
        work = workdir or Path(tmp)
        runs = (f"chaos{plan.seed}", f"calm{plan.seed}")
        users = role_users(credentials_dir(work / "nats"), runs)
        async with EmbeddedCluster(work / "nats", nodes=3, auth=users) as cluster:
            chaos = await run_fleet(cluster, work, runs[0], plan, faults=True, cache=cache)
            calm = await run_fleet(cluster, work, runs[1], plan, faults=False, cache=cache) \
                if baseline else None
    out: dict[str, Any] = {"plan": plan.__dict__, "chaos": chaos}
    if calm is not None:
        out["fault_free"] = calm
        out["throughput_vs_fault_free"] = round(chaos["trajectories_per_second"] /
                                                max(calm["trajectories_per_second"], 1e-9), 3)
    out["ok"] = (chaos["groups_lost"] == 0 and chaos["groups_trained_twice"] == 0
                 and chaos["learner_versions_monotonic"])
    return out
