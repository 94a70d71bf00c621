"""``coevo bench chaos``: the closed loop as separate processes on a 3-node NATS cluster, under faults.

Every role (tasks, policy, judge, scorer, learner, an env worker) runs as its own ``coevo agent``
process. The faults (``ChaosPlan.faults``, ``KINDS``):

- ``kill``: kill -9 of a random agent every ``kill_every_s`` (started again at once);
- ``node``: a NATS node killed every ``node_every_s`` and restarted after ``node_down_s``;
- ``garbage``: random bytes and schema-violating events on every subject;
- ``store_reads``: reads of claimed payloads fail (fault point ``claims.fetch``; events above 32 KiB,
  the groups' scores among them, go through the object store);
- ``slow_handlers``: a handler in 2,000 stalls 12 s, past ``bus.ack_wait_s`` (``handler``), with full
  fetch batches behind it;
- ``follower_lag``: followers take longer to load weights than the learner keeps versions;
- ``rank_failure``: the learner is two gloo ranks under torchrun, and a rank fails inside a step
  (``lane.optimizer_step``); the group ends and is started again, as a process manager would;
- ``disk_full``: the learner's checkpoints live on a small tmpfs, filled every ``disk_every_s``
  for ``disk_full_s``;
- ``consumer_delete``: the admin deletes a random agent consumer of the run every ``delete_every_s``
  (any role may): the agent creates it again where it left off (``coevo.runtime.revival``);
- ``long_partition``: an agent cut off for ``partition_s``, longer than ``bus.unshared_inactive_s``
  (``inactive_s`` here, so the bench stays short): its process is stopped (SIGSTOP, then SIGCONT),
  which the server sees as a partition: no pulls, no acks, its unshared consumers deleted as inactive;
- ``publish_fail``: 1 % of publishes (and retries) fail (fault point ``publish``), a handler's
  outputs mid-batch among them: each is sent again under its id, none dropped;
- with ``hosts`` (3 or more, ``coevo.bench.hosts``): each NATS node and a share of the agents on a
  host of its own (a network namespace), and ``link_cut``: a host's link cut for ``cut_s`` every
  ``cut_every_s``; ``sigterm_cut``: meanwhile one of that host's agents gets SIGTERM, and the
  seconds it takes to end are reported (the bound: 5 s).

Never two nodes out at once (a node kill and a cut wait for each other): the cluster keeps its
quorum. Then faults stop, the tasks agent stops scheduling, the others drain, and the verdict is
read from the stream itself (``judge_stream``, pure): every scheduled group is scored or
dead-lettered, no group is trained twice into the surviving weights, learner versions only go up.
The same loop without faults gives the throughput to compare with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from coevo.config import NatsConfig
from coevo.runtime.bus import connect_nats
from coevo.runtime.credentials import ADMIN, credential_path, credentials_dir, role_users
from coevo.runtime.proc import die_with_parent
from coevo.schemas import DeadLettered, Event, GroupScored, LearnerStepped, TaskScheduled, TrajectoryCompleted, envelope

log = structlog.get_logger("coevo.bench.chaos")

ROLES = ("tasks", "policy", "judge", "scorer", "learner", "env")
KILLABLE = ("policy", "judge", "scorer", "learner", "env", "tasks")
KINDS = (
    "kill",
    "node",
    "garbage",
    "store_reads",
    "slow_handlers",
    "follower_lag",
    "rank_failure",
    "disk_full",
    "link_cut",
    "sigterm_cut",
    "consumer_delete",
    "long_partition",
    "publish_fail",
)
PARTITIONED = ("policy", "tasks", "judge", "learner")
"""roles with unshared consumers (weight followers, learner-decisions, tasks-steps, policy-steps)"""
BASIC = ("kill", "node", "garbage")


@dataclass(frozen=True)
class ChaosPlan:
    minutes: float = 10.0
    kill_every_s: float = 5.0
    node_every_s: float = 60.0
    node_down_s: float = 5.0
    garbage_every_s: float = 5.0
    drain_s: float = 120.0
    seed: int = 0
    faults: tuple[str, ...] = BASIC
    """which of ``KINDS`` to inject (``link_cut`` and ``sigterm_cut`` need ``hosts``)"""
    hosts: int = 0
    """0: everything on loopback; 3 or more: one host (network namespace) per NATS node"""
    cut_every_s: float = 90.0
    cut_s: float = 30.0
    disk_every_s: float = 120.0
    disk_full_s: float = 20.0
    disk_mb: int = 256
    delete_every_s: float = 20.0
    partition_every_s: float = 60.0
    partition_s: float = 25.0
    inactive_s: float = 10.0
    """``bus.unshared_inactive_s`` of the agents under ``long_partition`` (shorter than ``partition_s``)"""

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
        if self.hosts and self.hosts < 3:
            raise ValueError(f"--hosts needs at least 3 (one per NATS node), got {self.hosts}")
        if not self.hosts and {"link_cut", "sigterm_cut"} & set(self.faults):
            raise ValueError("link_cut and sigterm_cut need hosts (--hosts 3)")
        if "long_partition" in self.faults and self.partition_s <= self.inactive_s:
            raise ValueError(f"a long partition outlasts inactive_s ({self.inactive_s}), got {self.partition_s}")


def fault_rules(plan: ChaosPlan, role: str) -> dict[str, dict[str, Any]]:
    """The ``COEVO_FAULTS`` rules of one role's processes under ``plan`` (pure)."""
    on = set(plan.faults)
    rules: dict[str, dict[str, Any]] = {}
    if "store_reads" in on:
        rules["claims.fetch"] = {"p": 0.05, "seed": plan.seed}
    if "slow_handlers" in on and role != "learner":  # the learner's handlers wait for checkpoints anyway
        # rare but past bus.ack_wait_s (10 s): a sequential consumer (the scorer) handles every step and
        # vote, so 2 % of 4 s stalls (the first plan) kept it stalled most of the time
        rules["handler"] = {"p": 0.0005, "delay_s": 12.0, "error": False, "seed": plan.seed}
    if "follower_lag" in on and role in ("policy", "judge"):
        rules["follower.load"] = {"p": 0.3, "delay_s": 20.0, "error": False, "seed": plan.seed}
    if "rank_failure" in on and role == "learner":
        rules["lane.optimizer_step"] = {"p": 0.01, "seed": plan.seed}
    if "publish_fail" in on:
        rules["publish"] = {"p": 0.01, "seed": plan.seed}
    return rules


# ---- the verdict, from the stream (pure) ------------------------------------------------------------


def _dead_group(letter: DeadLettered) -> str | None:
    """The group a dead-lettered message belonged to, if it was one of this run's group events."""
    body = envelope(letter.raw) or {}
    return body.get("group_id") if body.get("kind") in ("task.scheduled", "group.scored") else None


def twice_trained(steps: list[LearnerStepped]) -> list[dict[str, Any]]:
    """Each group trained again while its first training is still in the surviving weights, with
    the two steps (process, version, event id): a failure that explains itself.

    A learner process that restarts resumes from its newest checkpoint (version ``v0``): steps an
    earlier process made after ``v0`` are rolled back with it, so retraining their groups is not a
    double count. A step event stored twice (one event id) is one step."""
    twice: list[dict[str, Any]] = []
    seen: set[str] = set()
    for role in sorted({s.role for s in steps}):
        live: dict[str, LearnerStepped] = {}  # group -> the step that trained it
        incarnation = None
        for s in (s for s in steps if s.role == role):
            if s.event_id in seen:
                continue
            seen.add(s.event_id)
            if s.source.agent_id != incarnation:
                incarnation, restored = s.source.agent_id, s.version - 1
                live = {g: first for g, first in live.items() if first.version <= restored}
            for g in s.group_ids:
                if g in live:
                    twice.append({"group_id": g, "role": role, "first": _step_of(live[g]), "again": _step_of(s)})
                live[g] = s
    return twice


def _step_of(s: LearnerStepped) -> dict[str, Any]:
    return {"agent_id": s.source.agent_id, "version": s.version, "event_id": s.event_id, "groups": len(s.group_ids)}


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
    return dict(
        Counter(
            e.kind  # type: ignore[attr-defined]
            for e in events
            if getattr(e, "group_id", None) == group_id or getattr(e, "correlation_id", None) == group_id
        )
    )


def judge_stream(events: list[Event], seconds: float) -> dict[str, Any]:
    scheduled = {e.group_id for e in events if isinstance(e, TaskScheduled)}
    scored = {e.group_id for e in events if isinstance(e, GroupScored)}
    letters = [e for e in events if isinstance(e, DeadLettered)]
    dead = {g for g in map(_dead_group, letters) if g}
    steps = [e for e in events if isinstance(e, LearnerStepped) and e.is_step]
    reasons = Counter(e.reason.split(":")[0][:60] for e in letters)
    lost = sorted(scheduled - scored - dead)
    return {
        "lost_examples": {g: _trail(events, g) for g in lost[:5]},
        "groups_scheduled": len(scheduled),
        "groups_scored": len(scored & scheduled),
        "groups_lost": len(scheduled - scored - dead),
        "groups_dead_lettered": len(dead & scheduled),
        "groups_trained_twice": len(twice := twice_trained(steps)),
        "trained_twice_examples": twice[:5],
        "learner_steps": len(steps),
        "learner_versions_monotonic": _monotonic(steps),
        "dead_lettered": dict(reasons.most_common()),
        "trajectories": sum(isinstance(e, TrajectoryCompleted) for e in events),
        "trajectories_per_second": round(sum(isinstance(e, TrajectoryCompleted) for e in events) / seconds, 3),
    }


# ---- processes --------------------------------------------------------------------------------------


@dataclass
class Fleet:
    """The agent processes of one run; each role can be killed and started again.

    Each process runs in a session of its own (the learner under torchrun is a process group), is
    killed as a group, and dies with the bench (``die_with_parent``)."""

    url: str
    run_id: str
    overrides: dict[str, Any]
    logs: Path
    plan: ChaosPlan = field(default_factory=ChaosPlan)
    hosts: Any = None
    """``coevo.bench.hosts.Hosts`` when agents run on hosts of their own (role ``k`` on host ``k % n``)"""
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    starts: Counter[str] = field(default_factory=Counter)
    exits: Counter[str] = field(default_factory=Counter)
    """processes that exited on their own (an agent that failed, a learner group a rank ended) and were
    started again"""
    credentials: Path | None = None
    """the server's credentials directory: each agent connects with its role's file only"""
    stopped: set[str] = field(default_factory=set)
    """roles stopped on purpose (a SIGTERM fault): started again by ``revive``, not counted as exits"""

    def host_of(self, role: str) -> int | None:
        return ROLES.index(role) % self.hosts.n if self.hosts is not None else None

    def agent_args(self, role: str) -> list[str]:
        coevo = ["-m", "coevo", "agent", role, "--nats", self.url, "--run-id", self.run_id]
        if role == "learner" and "rank_failure" in self.plan.faults:  # two gloo ranks; a failed group is restarted
            args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *coevo]
        else:
            args = [sys.executable, *coevo]
        if self.credentials is not None:
            args += ["--nats.credentials_file", str(credential_path(self.credentials, role))]
        for key, value in self.overrides.items():
            args += ["--set", f"{key}={json.dumps(value) if isinstance(value, list) else value}"]
        host = self.host_of(role)
        return [*self.hosts.prefix(host), *args] if host is not None else args

    def env(self, role: str) -> dict[str, str]:
        from coevo.runtime.faults import ENV

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        rules = fault_rules(self.plan, role)
        if rules:
            env[ENV] = json.dumps(rules)
        return env

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
        if role in self.procs:  # never two of a role: the one before is gone first
            await self.kill(role)
        args = self.agent_args(role)
        self.starts[role] += 1
        log = (self.logs / f"{role}-{self.starts[role]}.log").open("wb")
        self.procs[role] = await asyncio.create_subprocess_exec(
            *args, stdout=log, stderr=log, env=self.env(role), preexec_fn=die_with_parent, start_new_session=True
        )
        log.close()

    async def revive(self) -> list[str]:
        """Start again every agent whose process exited (what a process manager does); the roles that
        exited on their own."""
        gone = [r for r, p in self.procs.items() if p.returncode is not None]
        for role in gone:
            await self.start(role)
        own = [r for r in gone if r not in self.stopped]
        self.stopped -= set(gone)
        return own

    async def kill(self, role: str) -> None:
        proc = self.procs[role]
        if proc.returncode is None:
            _signal(proc, signal.SIGKILL)
            await proc.wait()

    async def terminate(self, role: str, grace_s: float = 30.0) -> float:
        """SIGTERM one agent; the seconds until it ended (killed after ``grace_s``)."""
        proc = self.procs[role]
        t0 = time.monotonic()
        if proc.returncode is None:
            _signal(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                await self.kill(role)
        return time.monotonic() - t0

    async def stop(self, roles: tuple[str, ...] = ROLES, grace_s: float = 30.0) -> None:
        await asyncio.gather(*(self.terminate(r, grace_s) for r in roles if r in self.procs))


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    """``sig`` to the process's group when it leads one (a torchrun and its ranks), else to it alone
    (a subclass may start its processes in the bench's own group)."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def chaos_overrides(runs_dir: Path, cache: Path | None, replicas: int, plan: ChaosPlan | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "run.runs_dir": str(runs_dir),
        "stream.replicas": replicas,
        "env.remote": "true",
        "log.console": "off",
        "agent.heartbeat_s": 2.0,
        "bus.ack_wait_s": 10.0,
        "bus.in_progress_every_s": 2.0,
        "scorer.vote_timeout_s": 20.0,
        "scorer.group_timeout_s": 45.0,
        "tasks.inflight_timeout_s": 120.0,
        "learner.verdict_wait_s": 10.0,
        "agent.max_restarts": 50,
    }
    if cache is not None:
        out["env.cache_dir"] = str(cache)
    if plan is not None and "store_reads" in plan.faults:
        out["bus.inline_max_bytes"] = 32768  # the groups' scores (and the longest trajectories) by claim
    if plan is not None and "long_partition" in plan.faults:
        out["bus.unshared_inactive_s"] = plan.inactive_s
    return out


# ---- faults -----------------------------------------------------------------------------------------


async def _garbage(nc: Any, run_id: str, rng: random.Random) -> int:
    """Random bytes and schema-violating events on a subject of each event kind of the run."""
    from coevo.schemas import KIND_TO_MODEL, events_prefix, selector_keys

    n = 0
    for kind, key in ((k, selector_keys(k)[0]) for k in KIND_TO_MODEL):  # a subject a producer writes
        subject = f"{events_prefix(run_id)}.{key}"
        for payload in (
            rng.randbytes(rng.randint(0, 64)),
            json.dumps({"kind": kind, "run_id": run_id, "event_id": f"x{rng.random()}"}).encode(),
        ):
            try:
                await nc.jetstream().publish(subject, payload, timeout=2.0)
                n += 1
            except Exception:  # a node is down right now: that garbage is simply not stored
                pass
    return n


@dataclass
class Injector:
    """The bench's fault schedules, run side by side until ``until``; ``outage`` keeps at most one
    NATS node out (killed or cut off) at a time."""

    fleet: Fleet
    cluster: Any
    plan: ChaosPlan
    until: float
    disk: Path | None = None
    """the tmpfs under the learner's checkpoints (``disk_full``)"""
    faults: Counter[str] = field(default_factory=Counter)
    sigterm_s: list[float] = field(default_factory=list)
    outage: asyncio.Lock = field(default_factory=asyncio.Lock)

    def left(self) -> float:
        return self.until - time.monotonic()

    async def run(self) -> None:
        rng = random.Random(self.plan.seed)
        on = set(self.plan.faults)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.kills(rng, "kill" in on))
            if "node" in on:
                tg.create_task(self.nodes(random.Random(rng.random())))
            if "garbage" in on:
                tg.create_task(self.garbage(random.Random(rng.random())))
            if "link_cut" in on:
                tg.create_task(self.cuts(random.Random(rng.random()), "sigterm_cut" in on))
            if "disk_full" in on and self.disk is not None:
                tg.create_task(self.disk_full())
            if "consumer_delete" in on:
                tg.create_task(self.consumer_deletes(random.Random(rng.random())))
            if "long_partition" in on:
                tg.create_task(self.partitions(random.Random(rng.random())))

    async def kills(self, rng: random.Random, kill: bool) -> None:
        """kill -9 of a random agent; and, kill or not, agents that exited on their own come back."""
        while self.left() > 0:
            await asyncio.sleep(min(self.plan.kill_every_s, max(self.left(), 0.1)))
            for gone in await self.fleet.revive():  # not a fault we injected: reported as agent_exits
                self.fleet.exits[gone] += 1
            if kill and self.left() > 0:
                role = rng.choice(KILLABLE)
                await self.fleet.kill(role)
                await self.fleet.start(role)
                self.faults[f"kill -9 {role}"] += 1

    async def nodes(self, rng: random.Random) -> None:
        await asyncio.sleep(min(self.plan.node_every_s, self.left() / 2))
        while self.left() > 0:
            async with self.outage:
                node = rng.randrange(len(self.cluster.nodes))
                self.cluster.kill_node(node)
                self.faults["nats node killed"] += 1
                await asyncio.sleep(self.plan.node_down_s)
                await asyncio.to_thread(self.cluster.restart_node, node)
            await asyncio.sleep(self.plan.node_every_s)

    async def garbage(self, rng: random.Random) -> None:
        nc = await connect_nats(self.fleet.admin(), self.cluster.url, name="coevo-chaos")
        try:
            while self.left() > 0:
                self.faults["garbage messages"] += await _garbage(nc, self.fleet.run_id, rng)
                await asyncio.sleep(self.plan.garbage_every_s)
        finally:
            await nc.close()

    async def cuts(self, rng: random.Random, sigterm: bool) -> None:
        """Cut a host's link for ``cut_s``; meanwhile SIGTERM one of its agents (timed), started again
        once the link is back."""
        hosts = self.fleet.hosts
        await asyncio.sleep(min(self.plan.cut_every_s / 2, self.left() / 3))
        while self.left() > self.plan.cut_s:
            async with self.outage:
                host = rng.randrange(hosts.n)
                hosts.cut(host)
                self.faults["link cut"] += 1
                try:
                    await asyncio.sleep(min(5.0, self.plan.cut_s / 3))  # its agents notice
                    on_host = [r for r in ROLES if self.fleet.host_of(r) == host and r != "learner"]
                    if sigterm and on_host:
                        termed = rng.choice(on_host)
                        self.fleet.stopped.add(termed)  # started again by the kill loop's revive
                        self.sigterm_s.append(round(await self.fleet.terminate(termed), 2))
                        self.faults["sigterm while cut off"] += 1
                    await asyncio.sleep(max(0.0, self.plan.cut_s - min(5.0, self.plan.cut_s / 3)))
                finally:
                    hosts.heal(host)
            await asyncio.sleep(self.plan.cut_every_s)

    async def consumer_deletes(self, rng: random.Random) -> None:
        """Delete a random agent consumer of the run (the admin does; any role may)."""
        from coevo.runtime.bus import stream_name
        from coevo.runtime.history import TAIL_PREFIX

        stream = stream_name(self.fleet.run_id)
        nc = await connect_nats(self.fleet.admin(), self.cluster.url, name="coevo-chaos-delete")
        try:
            js = nc.jetstream(timeout=5.0)
            while self.left() > 0:
                await asyncio.sleep(min(self.plan.delete_every_s, max(self.left(), 0.1)))
                try:
                    names = sorted(
                        c.name
                        for c in await js.consumers_info(stream)
                        if not c.name.startswith(("history_", TAIL_PREFIX))  # readers, not agents
                    )
                    if names:
                        await js.delete_consumer(stream, rng.choice(names))
                        self.faults["consumer deleted"] += 1
                except Exception as exc:  # a node is out right now: delete one next time
                    log.info("chaos.delete_failed", error=repr(exc)[:200])
        finally:
            await nc.close()

    async def partitions(self, rng: random.Random) -> None:
        """Cut an agent off for ``partition_s`` (longer than its unshared consumers' inactive threshold):
        its process stopped, then continued."""
        await asyncio.sleep(min(self.plan.partition_every_s / 2, self.left() / 3))
        while self.left() > self.plan.partition_s:
            role = rng.choice(PARTITIONED)
            proc = self.fleet.procs[role]
            _signal(proc, signal.SIGSTOP)
            self.faults[f"partition {role}"] += 1
            try:
                await asyncio.sleep(self.plan.partition_s)
            finally:
                _signal(proc, signal.SIGCONT)
            await asyncio.sleep(self.plan.partition_every_s)

    async def disk_full(self) -> None:
        """Fill the tmpfs under the learner's checkpoints for ``disk_full_s``, then free it."""
        assert self.disk is not None
        await asyncio.sleep(min(self.plan.disk_every_s / 2, self.left() / 3))
        while self.left() > 0:
            filler = self.disk / ".chaos-filler"
            await asyncio.to_thread(_fill, filler)
            self.faults["disk full"] += 1
            await asyncio.sleep(self.plan.disk_full_s)
            filler.unlink(missing_ok=True)
            await asyncio.sleep(self.plan.disk_every_s)


def _fill(path: Path) -> None:
    """Write ``path`` until the file system is full."""
    chunk = b"\0" * (1 << 20)
    with contextlib.suppress(OSError), path.open("wb") as f:
        while True:
            f.write(chunk)
            f.flush()


@contextlib.contextmanager
def _small_disk(path: Path, mb: int) -> Iterator[Path | None]:
    """A tmpfs of ``mb`` MiB mounted at ``path`` (None where mounting is not allowed)."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        log.warning("chaos.disk_full_unavailable", error=done.stderr.strip())
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fault_points(run_dir: Path, event: str = "fault.injected", key: str = "point") -> dict[str, int]:
    """The fault points that fired in the agents of one run, by point (from their JSON logs); or the
    lines of another ``event``, by ``key``."""
    fired: Counter[str] = Counter()
    for path in run_dir.glob("*.jsonl"):
        with path.open(errors="replace") as f:
            for line in f:
                if f'"{event}"' in line:
                    with contextlib.suppress(ValueError):
                        fired[str(json.loads(line).get(key, "?"))] += 1
    return dict(fired)


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


async def run_fleet(
    cluster: Any, workdir: Path, run_id: str, plan: ChaosPlan, *, faults: bool, cache: Path | None, hosts: Any = None
) -> dict[str, Any]:
    from coevo.runtime.bus import NatsBus

    logs = workdir / run_id
    logs.mkdir(parents=True, exist_ok=True)
    active = plan if faults else replace(plan, faults=())
    fleet = Fleet(
        cluster.url,
        run_id,
        chaos_overrides(workdir / "runs", cache, len(cluster.nodes), active),
        logs,
        plan=active,
        hosts=hosts,
        credentials=credentials_dir(workdir / "nats"),
    )
    await fleet.provision()
    with contextlib.ExitStack() as stack:
        disk = (
            stack.enter_context(_small_disk(workdir / "runs" / run_id / "checkpoints", plan.disk_mb))
            if "disk_full" in active.faults
            else None
        )
        try:
            for role in ROLES:
                await fleet.start(role)
            t0 = time.monotonic()
            injector = Injector(fleet, cluster, active, t0 + plan.minutes * 60, disk=disk)
            await injector.run()
            seconds = time.monotonic() - t0
            await fleet.stop(("tasks",))  # no new groups; what was scheduled drains
            await _drain(fleet, time.monotonic() + plan.drain_s)
        finally:  # stopped (SIGINT, SIGTERM) or failed: no agent outlives the bench
            await fleet.stop(grace_s=10.0)
    async with await NatsBus.connect(cluster.url, run_id, nats_cfg=fleet.admin()) as bus:
        verdict = judge_stream(await bus.events(), seconds)
    return {
        **verdict,
        "seconds": round(seconds, 1),
        "faults_injected": sum(injector.faults.values()),
        "faults": dict(injector.faults),
        "fault_points_fired": _fault_points(workdir / "runs" / run_id),
        "consumers_recreated": _fault_points(workdir / "runs" / run_id, "consumer.recreated", "consumer"),
        "sigterm_while_cut_off_s": injector.sigterm_s,
        "disk_full_unavailable": "disk_full" in active.faults and disk is None,
        "agent_starts": dict(fleet.starts),
        "agent_exits": dict(fleet.exits),
    }


async def bench_chaos(
    plan: ChaosPlan, *, cache: Path | None = None, baseline: bool = True, workdir: Path | None = None
) -> dict[str, Any]:
    """``workdir``: keep the cluster's stores, the runs and the agents' logs there (default: a temporary
    directory, removed)."""
    from coevo.bench.hosts import Hosts
    from coevo.runtime.server import EmbeddedCluster

    with tempfile.TemporaryDirectory(prefix="coevo-chaos-") as tmp, contextlib.ExitStack() as stack:
        work = workdir or Path(tmp)
        runs = (f"chaos{plan.seed}", f"calm{plan.seed}")
        users = role_users(credentials_dir(work / "nats"), runs)
        hosts = stack.enter_context(Hosts(plan.hosts, tag=str(plan.seed % 100))) if plan.hosts else None
        async with EmbeddedCluster(
            work / "nats", nodes=plan.hosts or 3, auth=users, hosts=hosts.placement() if hosts else None
        ) as cluster:
            chaos = await run_fleet(cluster, work, runs[0], plan, faults=True, cache=cache, hosts=hosts)
            calm = (
                await run_fleet(cluster, work, runs[1], plan, faults=False, cache=cache, hosts=hosts)
                if baseline
                else None
            )
    out: dict[str, Any] = {"plan": {**plan.__dict__, "faults": list(plan.faults)}, "chaos": chaos}
    if calm is not None:
        out["fault_free"] = calm
        out["throughput_vs_fault_free"] = round(
            chaos["trajectories_per_second"] / max(calm["trajectories_per_second"], 1e-9), 3
        )
    slowest_stop = max(chaos["sigterm_while_cut_off_s"], default=0.0)
    out["ok"] = (
        chaos["groups_lost"] == 0
        and chaos["groups_trained_twice"] == 0
        and chaos["learner_versions_monotonic"]
        and slowest_stop < 5.0
    )
    return out
