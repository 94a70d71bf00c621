"""``coevo bench envs``: steps per second per family, in process and through env workers on NATS,
and sandbox executions per second."""

from __future__ import annotations

import asyncio
import functools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from coevo.config import load_config
from coevo.envs import make_family
from coevo.envs.base import Environment, Family
from coevo.observe.progress import tracked
from coevo.schemas import TaskSpec


async def _random_steps(make_env: Any, tasks: list[TaskSpec], seconds: float, concurrency: int) -> float:
    steps = 0
    deadline = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal steps
        rng = random.Random(i)
        env: Environment = make_env()
        while time.perf_counter() < deadline:
            obs = await env.reset(tasks[rng.randrange(len(tasks))])
            done = False
            while not done and time.perf_counter() < deadline:
                action = rng.choice(obs.candidates) if obs.candidates else _program(tasks[0])
                r = await env.step(action)
                obs, done = r.observation, r.done
                steps += 1
        await env.close()

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(worker(i))
    return steps / (time.perf_counter() - t0)


def _program(task: TaskSpec) -> str:
    if task.family == "coding":
        from coevo.envs.coding import humaneval_problems

        return humaneval_problems()[task.params["problem"]].solution or ""
    return "look"


async def _family(url: str, cache: Path, fam_name: str, seconds: float, concurrency: int) -> dict[str, Any]:
    """Random-play steps/s of one family, in process and through two env workers over NATS."""
    from coevo.envs.service import EnvHost, RemoteEnv
    from coevo.runtime.agent import run_agents
    from coevo.runtime.app import open_bus

    cfg = load_config(
        overrides={"env.family": fam_name, "env.cache_dir": str(cache), "log.console": "off", "agent.heartbeat_s": 60}
    )
    family: Family = make_family(cfg.env)
    tasks = family.initial_tasks(4, 0, 0)
    for t in tasks:  # compile / warm caches outside the timing
        await family.precheck(t)
    local = await _random_steps(family.make_env, tasks, seconds, concurrency)
    async with open_bus(f"benchenv{fam_name}", url=url, cfg=cfg) as bus:
        hosts = [EnvHost(bus, cfg) for _ in range(2)]
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(run_agents(hosts, handle_signals=False, until=stop))
            await asyncio.sleep(0.5)
            remote = await _random_steps(
                functools.partial(RemoteEnv, bus.nc, bus.run_id, fam_name), tasks, seconds, concurrency
            )
            stop.set()
    return {
        "in_process_steps_per_s": round(local, 1),
        "service_steps_per_s": round(remote, 1),
        "service_over_in_process": round(remote / local, 3) if local else None,
    }


async def bench_envs(
    seconds: float = 5.0, families: tuple[str, ...] = ("quickgame", "textworld", "coding"), concurrency: int = 4
) -> dict[str, Any]:
    from coevo.envs.sandbox import run_python
    from coevo.runtime.app import nats_endpoint

    out: dict[str, Any] = {"seconds": seconds, "concurrency": concurrency, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        async with nats_endpoint(None, Path(tmp) / "nats") as endpoint:
            for fam_name in tracked(families, "bench envs", unit="families"):
                out["families"][fam_name] = await _family(
                    endpoint.url, Path(tmp) / "cache", fam_name, seconds, concurrency
                )
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        await run_python("print(sum(range(1000)))")
        n += 1
    out["sandbox_executions_per_s"] = round(n / (time.perf_counter() - t0), 1)
    return out
