"""``coevo bench async``: what asynchrony buys when generation and training run on separate devices.

The same loop runs twice per seed, every role as its own ``coevo agent`` process against one embedded
nats-server: synchronously (``learner.max_staleness = 0``: lock-step waves of
``tasks.max_groups_in_flight`` groups; the learner trains each whole wave in one step per lane and the
next wave is scheduled, and played, only with the weights of that step) and asynchronously (the default
bound, with the learner stepping on as many samples as a sync step did, on average). On one host the processes are
pinned to disjoint cores, as separate devices would be: the rollout roles (tasks, policy, judge,
scorer) and the nats-server on one core, the learner alone on another, one torch thread each
(``OMP_NUM_THREADS=1``), so overlapping the two can at most double the rate of steps.

Everything is read from the stream afterwards (``measure``, pure): learner steps per minute,
trajectories per second, the time and the policy version at which the success of the last ``window``
train groups first reaches ``target``, the staleness each lane trained at, the share of the time the
rollouts had no group in flight (waiting for the learner), the share of the learner's compute time
with a group in flight (what the two overlapped), and whether each trajectory was played with
the policy version that was current when its group was scheduled.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevo.bench.chaos import Fleet
from coevo.runtime.credentials import credentials_dir, role_users
from coevo.runtime.proc import die_with_parent
from coevo.schemas import Event, GroupScored, LearnerStepped, TaskScheduled, TrajectoryCompleted, WeightsPublished

ROLLOUT_ROLES = ("tasks", "policy", "judge", "scorer")
LEARNER_ROLE = "learner"
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class AsyncPlan:
    minutes: float = 3.0
    """measured wall clock per run, from the first scheduled group"""
    seeds: int = 2
    loop: str = "policy+judge"
    """fixed tasks (no rewriting), so success on train groups measures learning, not the task mix"""
    target: float = 0.8
    window: int = 8
    """train groups in the rolling success"""
    overrides: dict[str, Any] = field(default_factory=dict)
    """config overrides for both modes (``--set``)"""
    startup_s: float = 240.0


# ---- cores ------------------------------------------------------------------------------------------


def split_cores() -> tuple[frozenset[int], frozenset[int]]:
    """(rollout cores, learner cores): the first two CPUs this process may use, one each."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError(f"coevo bench async needs two cores to pin to; this process may use {cores}")
    return frozenset(cores[:1]), frozenset(cores[1:2])


def threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def pin(pid: int, cores: frozenset[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (threads it starts later inherit the affinity)."""
    for tid in threads(pid) or [pid]:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def affinity(pid: int) -> dict[str, Any]:
    """Read back: the cores any thread of ``pid`` may run on, and how many threads it has."""
    cores: set[int] = set()
    tids = threads(pid)
    for tid in tids:
        try:
            cores |= os.sched_getaffinity(tid)
        except (ProcessLookupError, PermissionError):
            pass
    return {"cores": sorted(cores), "threads": len(tids)}


@dataclass
class PinnedFleet(Fleet):
    """The agent processes of one run, each pinned to its cores, one torch thread each."""

    cores: dict[str, frozenset[int]] = field(default_factory=dict)

    async def start(self, role: str) -> None:
        args = self.agent_args(role)
        self.starts[role] += 1
        with (self.logs / f"{role}-{self.starts[role]}.log").open("wb") as log:
            self.procs[role] = await asyncio.create_subprocess_exec(
                *args, stdout=log, stderr=log, env={**os.environ, **ONE_THREAD}, preexec_fn=die_with_parent
            )
        pin(self.procs[role].pid, self.cores[role])  # before the interpreter has started a second thread

    def log_tail(self, role: str, chars: int = 2000) -> str:
        path = self.logs / f"{role}-{self.starts[role]}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


# ---- the measurement, from the stream (pure) --------------------------------------------------------


def scheduled_versions(events: list[Event]) -> dict[str, int]:
    """Group id -> the newest policy version published before its ``TaskScheduled`` (stream order)."""
    version, out = 0, {}
    for e in events:
        if isinstance(e, WeightsPublished) and e.role == "policy":
            version = e.version
        elif isinstance(e, TaskScheduled):
            out[e.group_id] = version
    return out


def trajectory_versions(events: list[Event], at: dict[str, int]) -> dict[str, int]:
    """How many trajectories were played wholly with the version current at their group's scheduling,
    how many had a step with older weights (the policy had not applied them yet) or newer ones (a
    step landed while the group was in flight)."""
    out = {"on_version": 0, "behind": 0, "ahead": 0}
    for e in events:
        if isinstance(e, TrajectoryCompleted) and e.group_id in at and e.policy_versions:
            v = at[e.group_id]
            behind, ahead = min(e.policy_versions) < v, max(e.policy_versions) > v
            out["behind"] += behind
            out["ahead"] += ahead
            out["on_version"] += not (behind or ahead)
    return out


def in_flight(events: list[Event]) -> list[tuple[float, float]]:
    """The spans (unix time) with a group in flight: scheduled, not yet scored. The last one is open
    (ends at infinity) when a group was still in flight at the end of the stream."""
    marks = sorted(
        (e.ts, 1 if isinstance(e, TaskScheduled) else -1) for e in events if isinstance(e, TaskScheduled | GroupScored)
    )
    spans, count, start = [], 0, 0.0
    for ts, delta in marks:
        if count <= 0 < count + delta:
            start = ts
        elif count > 0 >= count + delta:
            spans.append((start, ts))
        count += delta
    if count > 0:
        spans.append((start, float("inf")))
    return spans


def covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` inside ``spans`` (disjoint)."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def idle_fraction(events: list[Event], t0: float, seconds: float) -> float:
    """Share of ``[t0, t0 + seconds]`` with no group in flight: the rollouts waiting for the learner."""
    return round(1 - covered(in_flight(events), t0, t0 + seconds) / seconds, 4)


def overlap_fraction(events: list[Event], steps: list[LearnerStepped]) -> float | None:
    """Share of these steps' compute time (ending at each step's event) with a group in flight: what
    asynchrony overlaps. Lock-step waves overlap nothing; a learner that is the bottleneck of an
    asynchronous loop may still leave the rollouts idle (its queue full), and that is not this."""
    spans = in_flight(events)
    timed = [(s.ts - s.tokens / s.tokens_per_second, s.ts) for s in steps if s.tokens_per_second > 0]
    busy = sum(b - a for a, b in timed)
    return round(sum(covered(spans, a, b) for a, b in timed) / busy, 4) if busy > 0 else None


def rolling_success(scored: list[GroupScored], t0: float, window: int) -> list[tuple[float, float]]:
    """(seconds since ``t0``, mean success of the last ``window`` train groups) at each train group."""
    train = sorted((e for e in scored if e.purpose == "train"), key=lambda e: e.ts)
    out = []
    for i, e in enumerate(train):
        last = train[max(0, i + 1 - window) : i + 1]
        out.append((round(e.ts - t0, 1), round(statistics.fmean(g.accuracy for g in last), 4)))
    return out


def version_at(steps: list[LearnerStepped], ts: float) -> int:
    return max((s.version for s in steps if s.ts <= ts), default=0)


def staleness(steps: list[LearnerStepped]) -> dict[str, int]:
    """Samples trained at each staleness (lane version at the step - the sample's version), summed."""
    hist: dict[str, int] = {}
    for s in steps:
        for k, n in s.staleness_histogram.items():
            hist[k] = hist.get(k, 0) + n
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def step_seconds(steps: list[LearnerStepped]) -> float:
    """Compute time of these steps (tokens / tokens per second, as the lane measured it)."""
    return sum(s.tokens / s.tokens_per_second for s in steps if s.tokens_per_second > 0)


def measure(events: list[Event], t0: float, seconds: float, *, target: float, window: int) -> dict[str, Any]:
    """One run's numbers over ``[t0, t0 + seconds]`` (unix time)."""
    inside = [e for e in events if t0 <= e.ts <= t0 + seconds]
    steps = [e for e in inside if isinstance(e, LearnerStepped) and e.is_step]
    policy = [s for s in steps if s.role == "policy"]
    judge = [s for s in steps if s.role == "judge"]
    curve = rolling_success([e for e in inside if isinstance(e, GroupScored)], t0, window)
    reached = next(((t, s) for t, s in curve[window - 1 :] if s >= target), None)  # full windows only
    hist = staleness(policy)
    trained = sum(hist.values())
    trajectories = sum(isinstance(e, TrajectoryCompleted) for e in inside)
    return {
        "seconds": round(seconds, 1),
        "learner_steps": len(policy),
        "learner_steps_per_minute": round(len(policy) / seconds * 60, 2),
        "judge_steps": len(judge),
        "trajectories": trajectories,
        "trajectories_per_second": round(trajectories / seconds, 3),
        "policy_step_s": round(step_seconds(policy) / len(policy), 3) if policy else None,
        "judge_step_s": round(step_seconds(judge) / len(judge), 3) if judge else None,
        "learner_busy_fraction": round(step_seconds(steps) / seconds, 3),
        "rollouts_idle_fraction": idle_fraction(events, t0, seconds),
        "learner_overlap_fraction": overlap_fraction(events, steps),
        "samples_per_step": round(trained / len(policy), 1) if policy else None,
        "samples_trained_per_minute": round(trained / seconds * 60, 1),
        "seconds_to_target": reached[0] if reached else None,
        "steps_to_target": version_at(policy, t0 + reached[0]) if reached else None,
        "success_start": curve[window - 1][1] if len(curve) >= window else None,
        "success_end": curve[-1][1] if curve else None,
        "trained_staleness": hist,
        "judge_trained_staleness": staleness(judge),
        "stale_fraction": round(1 - hist.get("0", 0) / trained, 4) if trained else None,
        "trajectory_versions": trajectory_versions(inside, scheduled_versions(events)),
        "curve": curve[:: max(1, len(curve) // 40)],
    }


def _mean(values: list[Any]) -> float | None:
    xs = [v for v in values if v is not None]
    return round(statistics.fmean(xs), 3) if xs else None


MEANS = (
    "learner_steps_per_minute",
    "trajectories_per_second",
    "seconds_to_target",
    "steps_to_target",
    "learner_busy_fraction",
    "rollouts_idle_fraction",
    "learner_overlap_fraction",
    "policy_step_s",
    "judge_step_s",
    "samples_per_step",
    "samples_trained_per_minute",
    "stale_fraction",
    "success_end",
)


def summarize_mode(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds (time and steps to target over the seeds that reached it)."""
    out: dict[str, Any] = {k: _mean([r[k] for r in runs]) for k in MEANS}
    out["reached_target"] = sum(r["seconds_to_target"] is not None for r in runs)
    out["seeds"] = len(runs)
    return out


def compare(sync: list[dict[str, Any]], asyn: list[dict[str, Any]]) -> dict[str, Any]:
    """Async over sync, per seed and of the means; time to target as sync / async (above 1: async faster)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    s, a = summarize_mode(sync), summarize_mode(asyn)
    return {
        "learner_steps_per_minute": ratio(a["learner_steps_per_minute"], s["learner_steps_per_minute"]),
        "learner_steps_per_minute_by_seed": [
            ratio(x["learner_steps_per_minute"], y["learner_steps_per_minute"]) for x, y in zip(asyn, sync, strict=True)
        ],
        "trajectories_per_second": ratio(a["trajectories_per_second"], s["trajectories_per_second"]),
        "samples_trained_per_minute": ratio(a["samples_trained_per_minute"], s["samples_trained_per_minute"]),
        "time_to_target_sync_over_async": ratio(s["seconds_to_target"], a["seconds_to_target"]),
        "steps_to_target_async_over_sync": ratio(a["steps_to_target"], s["steps_to_target"]),
    }


# ---- runs -------------------------------------------------------------------------------------------


def run_overrides(plan: AsyncPlan, work: Path, cache: Path, seed: int, staleness: int) -> dict[str, Any]:
    return {
        "run.runs_dir": str(work / "runs"),
        "env.cache_dir": str(cache),
        "log.console": "off",
        "loop": plan.loop,
        "run.seed": seed,
        **plan.overrides,
        "learner.max_staleness": staleness,
    }


def async_overrides(base: dict[str, Any], plan: AsyncPlan, sync: dict[str, Any]) -> dict[str, Any]:
    """The async run's config: batches of as many samples as the sync learner stepped on (on average:
    the same work per step), unless the plan sets the batch (``learner.batch_samples``, or
    ``learner.batch_groups``: a wave's worth of groups, whatever they hold)."""
    if {"learner.batch_groups", "learner.batch_samples"} & plan.overrides.keys() or not sync["samples_per_step"]:
        return base
    return {**base, "learner.batch_samples": max(1, round(sync["samples_per_step"]))}


async def first_scheduled(fleet: PinnedFleet, deadline: float) -> float:
    """Unix time of the run's first ``TaskScheduled`` (every agent has started by then, or fails)."""
    from coevo.runtime.bus import NatsBus

    async with await NatsBus.connect(fleet.url, fleet.run_id, nats_cfg=fleet.admin()) as bus:
        while time.monotonic() < deadline:
            for role, proc in fleet.procs.items():
                if proc.returncode is not None:
                    raise RuntimeError(f"{role} exited ({proc.returncode}) while starting:\n{fleet.log_tail(role)}")
            scheduled = await bus.events(["task.scheduled"])
            if scheduled:
                return min(e.ts for e in scheduled)
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no group scheduled within the startup limit; logs in {fleet.logs}")


async def run_mode(
    url: str,
    work: Path,
    run_id: str,
    overrides: dict[str, Any],
    plan: AsyncPlan,
    cores: tuple[frozenset[int], frozenset[int]],
) -> dict[str, Any]:
    """Start the fleet, measure ``plan.minutes`` from the first scheduled group, stop, read the stream."""
    from coevo.runtime.bus import NatsBus

    logs = work / run_id
    logs.mkdir(parents=True, exist_ok=True)
    roles = {**dict.fromkeys(ROLLOUT_ROLES, cores[0]), LEARNER_ROLE: cores[1]}
    fleet = PinnedFleet(url, run_id, overrides, logs, cores=roles, credentials=credentials_dir(work / "nats"))
    seconds = plan.minutes * 60
    await fleet.provision()
    try:
        for role in roles:
            await fleet.start(role)
        t0 = await first_scheduled(fleet, time.monotonic() + plan.startup_s)
        await asyncio.sleep(min(5.0, seconds / 4))  # every agent has its threads by now
        pinned = {role: affinity(proc.pid) for role, proc in fleet.procs.items()}
        await asyncio.sleep(max(0.0, t0 + seconds - time.time()))
        exited = {role: p.returncode for role, p in fleet.procs.items() if p.returncode is not None}
    finally:
        await fleet.stop(tuple(roles), grace_s=30.0)
    async with await NatsBus.connect(url, run_id, nats_cfg=fleet.admin()) as bus:
        events = await bus.events()
    return {
        **measure(events, t0, seconds, target=plan.target, window=plan.window),
        "max_staleness": overrides["learner.max_staleness"],
        "affinity": pinned,
        "agents_exited": exited,
    }


async def bench_async(plan: AsyncPlan, *, cache: Path | None = None, workdir: Path | None = None) -> dict[str, Any]:
    """A sync then an async run of each seed, with their ratios (the async batch: ``async_overrides``)."""
    from coevo.config import load_config
    from coevo.inference.clients import model_dir
    from coevo.runtime.server import EmbeddedServer

    cores = split_cores()
    default = load_config(overrides=plan.overrides).learner.max_staleness  # ``--set`` it for async's bound
    if default == 0:
        raise ValueError("learner.max_staleness = 0 is the sync mode; set the async bound to 1 or more")
    nats: dict[str, Any] = {}
    modes = {"sync": 0, "async": default}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="coevo-async-") as tmp:
        work = workdir or Path(tmp)
        models = cache or work / "cache"
        run_ids = tuple(f"{mode}{seed}" for seed in range(plan.seeds) for mode in modes)
        async with EmbeddedServer(work / "nats", auth=role_users(credentials_dir(work / "nats"), run_ids)) as server:
            assert server.url is not None
            nats_pid = server.server_pid
            if nats_pid is not None:
                pin(nats_pid, cores[0])
                nats = affinity(nats_pid)
            for seed in range(plan.seeds):
                base = load_config(overrides=run_overrides(plan, work, models, seed, 0))
                for role in ("policy", "judge"):  # built once here, not by three agents at once
                    await asyncio.to_thread(model_dir, base, role)
                sync = await run_mode(
                    server.url, work, f"sync{seed}", run_overrides(plan, work, models, seed, 0), plan, cores
                )
                overrides = async_overrides(run_overrides(plan, work, models, seed, modes["async"]), plan, sync)
                runs["sync"].append(sync)
                runs["async"].append(
                    {
                        **await run_mode(server.url, work, f"async{seed}", overrides, plan, cores),
                        **{k: overrides.get(f"learner.{k}") for k in ("batch_groups", "batch_samples")},
                    }
                )
    ratios = compare(runs["sync"], runs["async"])
    return {
        "plan": {**plan.__dict__, "max_staleness": modes},
        "cores": {"rollouts": sorted(cores[0]), "learner": sorted(cores[1]), "nats-server": nats},
        "sync": summarize_mode(runs["sync"]),
        "async": summarize_mode(runs["async"]),
        "ratios": ratios,
        "target": "async/sync learner steps per minute >= 1.6 with pinned cores",
        "met": (ratios["learner_steps_per_minute"] or 0) >= 1.6,
        "runs": runs,
    }
