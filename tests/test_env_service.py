"""Environments as live services over a real NATS server, workers in separate processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import pytest

from coevo.envs.quickgame import QuickGame
from coevo.envs.service import RemoteEnv
from coevo.errors import EnvError, EnvTimeout
from coevo.runtime.bus import NatsBus
from coevo.schemas import TaskSpec
from tests.conftest import PYTHON, subprocess_env


def spawn_env_worker(nats_url: str, run_id: str, family: str, runs: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            PYTHON,
            "-m",
            "coevo",
            "agent",
            "env",
            "--family",
            family,
            "--nats",
            nats_url,
            "--run-id",
            run_id,
            "--log.console",
            "off",
            "--run.runs_dir",
            runs,
            *extra,
        ],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def wait_workers(bus: NatsBus, n: int, timeout: float = 30.0) -> list[str]:
    async with asyncio.timeout(timeout):
        while True:
            statuses = [e for e in await bus.events(["agent.status"]) if e.role == "env" and e.state == "running"]
            ids = sorted({s.agent_id for s in statuses})
            if len(ids) >= n:
                return ids
            await asyncio.sleep(0.2)


@pytest.fixture
async def two_workers(nats_url: str, run_id: str, bus: NatsBus, tmp_path):
    procs = [spawn_env_worker(nats_url, run_id, "quickgame", str(tmp_path)) for _ in range(2)]
    try:
        await wait_workers(bus, 2)
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=20)


def qtask(i: int) -> TaskSpec:
    return TaskSpec(
        task_id=f"q{i}",
        family="quickgame",
        params={"seed": i},
        knobs={"steps": 3, "distractors": 1, "slack": 1, "hints": 0},
    )


async def test_two_workers_in_separate_processes_serve_one_client(two_workers, bus: NatsBus) -> None:
    fam = QuickGame()
    envs = [RemoteEnv(bus.nc, bus.run_id, "quickgame") for _ in range(12)]
    local = [fam.make_env() for _ in envs]
    for i, (remote, loc) in enumerate(zip(envs, local, strict=True)):
        assert await remote.reset(qtask(i)) == await loc.reset(qtask(i))
    assert len({e.worker_id for e in envs}) == 2  # the queue group spread the episodes
    for i, (remote, loc) in enumerate(zip(envs, local, strict=True)):
        for action in fam.walkthrough(qtask(i)):
            r, lr = await remote.step(action), await loc.step(action)  # sticky: same worker each step
            assert (r.observation, r.done, r.outcome, r.reference_label) == (
                lr.observation,
                lr.done,
                lr.outcome,
                lr.reference_label,
            )
        assert r.outcome == "won"
    with pytest.raises(EnvError, match="without an open episode"):
        await envs[0].step("go north")


async def test_killed_worker_aborts_its_episodes(two_workers, bus: NatsBus) -> None:
    envs = [RemoteEnv(bus.nc, bus.run_id, "quickgame") for _ in range(8)]
    for i, e in enumerate(envs):
        await e.reset(qtask(i))
    two_workers[0].kill()  # kill -9 one worker while it holds episodes
    two_workers[0].wait()
    outcomes = {}
    for e in envs:
        wid = e.worker_id
        r = await e.step("wait")
        outcomes.setdefault(wid, set()).add(r.outcome if r.done else "alive")
    assert any(o == {"aborted"} for o in outcomes.values())  # the dead worker's episodes
    assert any("aborted" not in o for o in outcomes.values())  # the survivor's go on
    fresh = RemoteEnv(bus.nc, bus.run_id, "quickgame")
    await fresh.reset(qtask(99))  # new episodes go to the survivor
    assert fresh.worker_id is not None


async def test_slow_step_times_out_with_a_clear_error(nats_url: str, run_id: str, bus: NatsBus, tmp_path) -> None:
    proc = spawn_env_worker(nats_url, run_id, "coding", str(tmp_path))
    try:
        await wait_workers(bus, 1)
        env = RemoteEnv(bus.nc, run_id, "coding", step_timeout_s=1.0)
        task = TaskSpec(
            task_id="c2",
            family="coding",
            params={"source": "humaneval", "problem": "HumanEval/2"},
            knobs={"constraints": 0, "examples": 1},
        )
        obs = await env.reset(task)
        assert "truncate_number" in obs.text
        with pytest.raises(EnvTimeout, match=r"did not answer a step within 1.0s"):
            await env.step("    import time\n    time.sleep(3)\n    return 0.0\n")
        nobody = RemoteEnv(bus.nc, run_id, "textworld", step_timeout_s=1.0, open_retries=2)
        with pytest.raises(EnvError, match="no textworld environment worker"):
            await nobody.reset(TaskSpec(task_id="t", family="textworld"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


async def test_a_rollout_cancelled_on_stop_does_not_wait_for_its_sessions_close(bus: NatsBus, run_id: str) -> None:
    """#24 chaos: a policy stopped while cut off cancelled its rollouts, and each one's ``finally``
    waited 5 s for its env worker to confirm the close (9 s for a stop). Within a cancellation the
    close is still sent, and waited for half a second: the worker expires idle sessions anyway."""
    import time

    from coevo.schemas.envproto import env_subject

    seen: list[bytes] = []

    async def stalled(msg) -> None:  # a worker across a cut: it never answers
        seen.append(msg.data)

    sub = await bus.nc.subscribe(env_subject(run_id, "quick", "w1"), cb=stalled)
    env = RemoteEnv(bus.nc, run_id, "quick")
    env.worker_id, env.session_id = "w1", "s1"
    entered = asyncio.Event()

    async def rollout() -> None:
        try:
            entered.set()
            await asyncio.Event().wait()  # a step in flight
        finally:
            await env.close()

    task = asyncio.create_task(rollout())
    await entered.wait()
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t0 < 2.0
    await bus.nc.flush()
    assert seen and b"s1" in seen[0] and env.session_id is None  # the close was sent
    await sub.unsubscribe()
