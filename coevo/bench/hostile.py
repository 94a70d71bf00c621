"""``coevo bench hostile``: clients that attack the policy endpoint of a real run while honest ones play.

One run (``env.family = external``: the policy agent with its endpoint, the scorer and the learner,
on an embedded nats-server with the run's credentials, the tiny default models) serves the
endpoint. Honest agents open episodes with the run's key, play them with their episode keys and
finish them with outcomes that carry a learning signal. Meanwhile two hostile clients, one holding
an episode key (``ek-…``) and one an agent key (``ak-…``), send every attack of ``ATTACKS``
(``coevo.bench.hostile_clients``): malformed bodies, rewards that are huge, NaN, Infinity, ``1e39``
(finite in float64, infinite in float32) or ``1e999`` (JSON that parses to infinity), out-of-vocabulary
prompt token ids, oversized bodies, floods of opens, concurrent finishes of one episode, requests
for another episode, and structured-output schemas that are huge, deep, wide or hold keywords no grammar
enforces (refused before any compile) or as costly as the budgets allow (served, never a 5xx), while an
honest co-tenant's call is timed (``cotenant_latency_ms``: before and during those attacks).

What is reported, per attack: the requests sent, the status codes seen and whether they are what a
sound endpoint answers (``Expect``: refused with a 4xx; exactly one accepted; never a 5xx); and for
the run: whether it stayed up (every agent running, the endpoint answering), how many tensors of the
learner's model, of its latest published weights and of the policy engine are not finite, the
learner steps made, the recorded steps lost (each call answered inside an episode must be a stored
``StepTaken``, and each trajectory's step indices contiguous from 0) and the groups trained twice.
The verdict on the stream is pure (``stream_verdict``, ``attack_verdict``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from coevo.bench.chaos import twice_trained
from coevo.bench.hostile_clients import (
    ATTACKS,
    CHAT,
    Ctx,
    Holder,
    Honest,
    HostilePlan,
    Http,
    Ledger,
    Tally,
    attack_all,
    attack_verdict,
    chat_body,
    honest_agent,
)
from coevo.schemas import DeadLettered, Event, LearnerStepped, StepTaken, TrajectoryCompleted

__all__ = ["ATTACKS", "HostilePlan", "attack_verdict", "bench_hostile", "nonfinite", "stream_verdict"]


def run_overrides(plan: HostilePlan, work: Path, cache: Path | None, port: int) -> dict[str, Any]:
    """The run's config: the external family, policy only, short timeouts so that episodes a flood
    leaves open expire (``policy.episode_timeout_s``) within the bench."""
    return {
        "run.runs_dir": str(work / "runs"),
        **({"env.cache_dir": str(cache)} if cache is not None else {}),
        "log.console": "off",
        "env.family": "external",
        "loop": "policy-only",
        "scorer.reward": "outcome-only",
        "policy.n": plan.group,
        "policy.serve_port": port,
        "policy.max_concurrent_trajectories": 32,
        "policy.episode_timeout_s": 20.0,
        "policy.serve_backlog_timeout_s": 30.0,
        "tasks.max_groups_in_flight": 8,
        "learner.batch_samples": 16,
        **plan.overrides,
    }


# ---- the verdict (pure) -----------------------------------------------------------------------------


def stream_verdict(events: list[Event], accepted: dict[str, set[int]], opened: Iterable[str] = ()) -> dict[str, Any]:
    """What the stream holds against what the endpoint answered. ``accepted``: trajectory id -> the
    step indices of the calls the endpoint answered 200 inside that trajectory's episode; ``opened``:
    the trajectory ids of every episode the endpoint opened (each must end exactly once)."""
    steps: dict[str, list[int]] = {}
    rewards: list[float] = []
    for e in events:
        if isinstance(e, StepTaken):
            steps.setdefault(e.trajectory_id, []).append(e.step_index)
            if e.env_reward is not None:
                rewards.append(e.env_reward)
    ends = Counter(e.trajectory_id for e in events if isinstance(e, TrajectoryCompleted))
    claimed = {e.trajectory_id: e.num_steps for e in events if isinstance(e, TrajectoryCompleted)}
    gaps = sum(len(set(range(max(ix) + 1)) - set(ix)) for ix in steps.values())
    missing = {t: sorted(want - set(steps.get(t, []))) for t, want in accepted.items()}
    missing = {t: ix for t, ix in missing.items() if ix}
    short = {t: n - len(set(steps.get(t, []))) for t, n in claimed.items() if len(set(steps.get(t, []))) < n}
    reports = [e for e in events if isinstance(e, LearnerStepped) and e.role == "policy"]
    policy_steps = [e for e in reports if e.is_step]
    return {
        "steps_stored": sum(len(ix) for ix in steps.values()),
        "steps_accepted": sum(len(ix) for ix in accepted.values()),
        "steps_lost": sum(len(ix) for ix in missing.values()) + gaps + sum(short.values()),
        "steps_lost_accepted_not_stored": sum(len(ix) for ix in missing.values()),
        "steps_lost_index_gaps": gaps,
        "steps_lost_fewer_than_completed_says": sum(short.values()),
        "lost_examples": dict(list(missing.items())[:5]),
        "steps_stored_twice": sum(len(ix) - len(set(ix)) for ix in steps.values()),
        "trajectories_completed": len(ends),
        "trajectories_completed_twice": sum(n > 1 for n in ends.values()),
        "episodes_never_completed": len(set(opened) - set(ends)),
        "trajectories_expired_idle": sum(
            isinstance(e, TrajectoryCompleted) and (e.error or "").startswith("idle") for e in events
        ),
        "env_reward_max_abs": max((abs(r) for r in rewards), default=0.0),
        "env_rewards_not_finite_in_float32": sum(not _finite32(r) for r in rewards),
        "learner_steps": len(policy_steps),
        "learner_batches_not_finite": sum(e.not_finite for e in reports),
        "groups_disposed_untrained": sum(len(e.disposed_group_ids) - len(e.group_ids) for e in reports),
        "dead_lettered": dict(Counter(e.reason.split(":")[0][:80] for e in events if isinstance(e, DeadLettered))),
        "groups_trained_twice": len(twice_trained([e for e in events if isinstance(e, LearnerStepped)])),
    }


def _finite32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= 3.4028234663852886e38


def nonfinite(tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """How many of these (name, torch tensor) are not finite everywhere, and the first names."""
    import torch

    names, bad = 0, []
    for name, t in tensors:
        names += 1
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return {"tensors": names, "not_finite": len(bad), "examples": bad[:5]}


def published_tensors(path: Path) -> Iterable[tuple[str, Any]]:
    """Every tensor of a published weights directory (its safetensors files)."""
    from safetensors.torch import load_file

    for f in sorted(path.rglob("*.safetensors")):
        yield from ((f"{f.name}:{k}", v) for k, v in load_file(f).items())


# ---- the run ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def running(cfg: Any) -> AsyncIterator[tuple[Any, list[Any], asyncio.Task[None], asyncio.Event]]:
    """The run's agents in this process: (runtime, agents, their task, the event that stops them)."""
    from coevo.inference.clients import model_dir
    from coevo.loop import build_agents
    from coevo.runtime.agent import run_agents
    from coevo.runtime.app import open_runtime

    await asyncio.to_thread(model_dir, cfg, "policy")
    async with open_runtime(cfg, name="coevo-bench-hostile") as rt:
        agents = build_agents(rt.bus, cfg)
        stop = asyncio.Event()
        task = asyncio.create_task(run_agents(agents, handle_signals=False, until=stop), name="hostile-run")
        try:
            yield rt, agents, task, stop
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await task


def weights_report(agents: list[Any]) -> dict[str, Any]:
    """Non-finite tensors of the learner's lanes, of their latest published weights and of the engine."""
    from coevo.agents.policy import PolicyAgent
    from coevo.inference.engine import LocalEngine
    from coevo.training.learner import LearnerAgent

    out: dict[str, Any] = {}
    for a in agents:
        if isinstance(a, LearnerAgent):
            for role, q in a.lanes.items():
                out[f"learner_{role}_model"] = nonfinite(q.lane.model.state_dict().items())
            for role, (version, path, _sha) in a.published.items():
                out[f"published_{role}"] = {"version": version, **nonfinite(published_tensors(Path(path)))}
        if isinstance(a, PolicyAgent) and isinstance(a.client, LocalEngine):
            served = [*a.client.model.state_dict().items(), *a.client.beside.tensors.items()]  # base and adapter
            out["engine_policy"] = {"version": a.client.version, **nonfinite(served)}
    return out


async def wait_up(c: Ctx, agents: list[Any], task: asyncio.Task[None], deadline: float) -> None:
    """Until the endpoint answers and the learner published its first weights."""
    from coevo.training.learner import LearnerAgent

    learner = next(a for a in agents if isinstance(a, LearnerAgent))
    while time.monotonic() < deadline:
        if task.done():
            raise RuntimeError(f"the run ended while starting: {task.exception()!r}")
        r = await c.http.call("/v1/models", c.run_key, method="GET")
        if r.status == 200 and learner.published:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the endpoint or the learner did not come up within the startup limit")


async def play(c: Ctx, rt: Any, tallies: dict[str, Tally], honest: Honest) -> tuple[float, bool]:
    """Honest agents play while the attacks run, then for the rest of ``plan.seconds``, then until a
    policy learner step names an honest group (at most ``plan.seconds`` more); (the attacks' seconds,
    whether every attack ran)."""
    from coevo.runtime.aio import wait_event

    t0 = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        for i in range(c.plan.honest):
            tg.create_task(honest_agent(c, i, honest), name=f"honest-{i}")
        complete = await attack_all(c, [Holder("episode"), Holder("agent")], tallies)
        attacks_s = time.monotonic() - t0
        await wait_event(c.stop, max(0.0, c.plan.seconds - attacks_s))
        deadline = time.monotonic() + c.plan.seconds
        while time.monotonic() < deadline:
            if honest_groups_trained(await rt.bus.events(["learner.stepped"]), honest.groups):
                break
            await wait_event(c.stop, 1.0)
        c.stop.set()
    return attacks_s, complete


async def bench_hostile(plan: HostilePlan, *, cache: Path | None = None, workdir: Path | None = None) -> dict[str, Any]:
    import aiohttp

    from coevo.config import load_config

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="coevo-hostile-") as tmp:
        port = free_port()
        cfg = load_config(overrides=run_overrides(plan, workdir or Path(tmp), cache, port))
        ledger = Ledger()
        tallies = {f"{n}/{k}": Tally(e) for n, (e, _) in ATTACKS.items() for k in ("episode", "agent")}
        honest = Honest()
        async with running(cfg) as (rt, agents, task, stop):
            policy = next(a for a in agents if getattr(a, "endpoint", None) is not None)
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=timeout) as session:
                c = Ctx(Http(session, ledger), policy.endpoint.key, 0, plan)
                await wait_up(c, agents, task, time.monotonic() + plan.startup_s)
                c.vocab = max(int(policy.client.tokenizer.vocab_size), len(policy.client.tokenizer))
                attacks_s, complete = await play(c, rt, tallies, honest)
                up = await still_up(c, agents, task)
                weights = await asyncio.to_thread(weights_report, agents)
            stop.set()
            with contextlib.suppress(Exception):
                await task
            counters = dict(policy.counters)  # after the stop: the open episodes' steps are published
            events = await rt.bus.events()
    verdict = stream_verdict(events, ledger.accepted, ledger.trajectories.values())
    result = {
        "plan": {**plan.__dict__},
        "seconds": round(time.monotonic() - t0, 1),
        "attack_seconds": round(attacks_s, 1),
        "attacks_complete": complete,
        **attacks_report(tallies),
        "stayed_up": up.pop("stayed_up"),
        "up": up,
        "weights": weights,
        "weights_not_finite": sum(w["not_finite"] for w in weights.values()),
        "endpoint_steps_recorded": counters.get("endpoint.calls.recorded", 0),
        "endpoint_errors_500": counters.get("endpoint.errors", 0),
        **verdict,
        "steps_recorded_not_stored": max(0, counters.get("endpoint.calls.recorded", 0) - verdict["steps_stored"]),
        "legitimate_requests_refused_after_attacks": dict(c.setup_refused),
        "cotenant_latency_ms": latency_report(c.cotenant_ms),
        "victims_touched": c.victims_touched,
        "flood_orphans": c.orphans,
        "honest": {
            "episodes_finished": honest.episodes,
            "groups": len(honest.groups),
            "groups_trained": honest_groups_trained(events, honest.groups),
            "opens_refused": dict(honest.refused),
            "failed": dict(honest.failed),
        },
    }
    return {"ok": sound(result), **result}


async def still_up(c: Ctx, agents: list[Any], task: asyncio.Task[None]) -> dict[str, Any]:
    """Whether the run is up: every agent running, the endpoint answering, the engine sampling."""
    up: dict[str, Any] = {
        "run_task_running": not task.done(),
        "agents": {a.agent_id: a.state for a in agents},
        "endpoint_answers": (await c.http.call("/v1/models", c.run_key, method="GET")).status == 200,
        "engine_samples": (await c.http.call(CHAT, c.run_key, chat_body())).status == 200,
    }
    running = all(s == "running" for s in up["agents"].values())
    return {"stayed_up": running and up["run_task_running"] and up["endpoint_answers"] and up["engine_samples"], **up}


def attacks_report(tallies: dict[str, Tally]) -> dict[str, Any]:
    return {
        "attacks": {name: t.report() for name, t in tallies.items() if t.sent},
        "attacks_answered_wrongly": sorted(name for name, t in tallies.items() if t.violations),
        "requests_sent": sum(t.sent for t in tallies.values()),
        "status_5xx_or_none": sum(v for t in tallies.values() for s, v in t.statuses.items() if s >= 500 or s == 0),
    }


def sound(r: dict[str, Any]) -> bool:
    """The bench's verdict: up, finite, nothing lost or trained twice, every attack answered as it should be,
    honest groups trained."""
    return bool(
        r["stayed_up"]
        and r["weights_not_finite"] == 0
        and r["steps_lost"] == 0
        and r["steps_recorded_not_stored"] == 0
        and r["groups_trained_twice"] == 0
        and r["victims_touched"] == 0
        and r["episodes_never_completed"] == 0
        and r["trajectories_completed_twice"] == 0
        and not r["attacks_answered_wrongly"]
        and r["attacks_complete"]
        and r["honest"]["groups_trained"] > 0
    )


def latency_report(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Per phase: the calls timed, those not answered 200, and the median and worst latency of the others."""
    out: dict[str, Any] = {}
    for when, ms in samples.items():
        ok = sorted(x for x in ms if not math.isnan(x))
        out[when] = {
            "calls": len(ms),
            "not_answered": len(ms) - len(ok),
            "median_ms": round(ok[len(ok) // 2], 1) if ok else None,
            "max_ms": round(ok[-1], 1) if ok else None,
        }
    return out


def honest_groups_trained(events: list[Event], groups: set[str]) -> int:
    named = {g for e in events if isinstance(e, LearnerStepped) and e.role == "policy" for g in e.group_ids}
    return len(named & groups)
