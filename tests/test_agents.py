"""Agent lifecycle against a real server: supervision, control, shutdown, separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time

import pytest

from coevo.errors import AgentFailed
from coevo.runtime.agent import Agent, run_agents
from coevo.runtime.bus import NatsBus
from coevo.schemas import AgentStatus, TaskScheduled, TaskSpec, TrajectoryCompleted
from tests.agents_for_tests import Echo, Flaky, Producer
from tests.conftest import PYTHON, subprocess_env


async def test_two_agents_in_one_loop(bus: NatsBus, cfg, monkeypatch) -> None:
    monkeypatch.setenv("COEVO_TEST_N", "25")
    producer, echo = Producer(bus, cfg), Echo(bus, cfg)

    async def stop_echo_after_producer() -> None:
        await producer.stopping.wait()
        echo.stop()

    async with asyncio.timeout(30):
        await asyncio.gather(run_agents([producer, echo], handle_signals=False), stop_echo_after_producer())
    done = await bus.events(["trajectory.completed"])
    scheduled = {e.event_id: e for e in await bus.events(["task.scheduled"])}
    assert len(done) == 25 and len(scheduled) == 25
    assert {d.causation_id for d in done} == set(scheduled)  # each answer references its cause
    statuses = [e for e in await bus.events(["agent.status"]) if isinstance(e, AgentStatus)]
    assert {s.agent_id for s in statuses if s.state == "stopped"} == {producer.agent_id, echo.agent_id}


async def test_crashed_task_is_restarted_and_counted(bus: NatsBus, cfg) -> None:
    agent = Flaky(bus, cfg)
    async with asyncio.timeout(10):
        await run_agents([agent], handle_signals=False)
    assert agent.attempts == 3
    assert agent.counters["restarts.main"] == 2


async def test_restart_budget_exhausted_fails_the_agent(bus: NatsBus, cfg) -> None:
    from coevo.config import load_config

    strict = load_config(overrides={**{"agent.max_restarts": 1, "agent.restart_backoff_s": [0.01]}})
    agent = Flaky(bus, strict)
    agent.fail_times = 5
    with pytest.raises(AgentFailed):
        async with asyncio.timeout(10):
            await agent.run()
    assert agent.state == "failed"
    last = [e for e in await bus.events(["agent.status"]) if e.agent_id == agent.agent_id][-1]
    assert last.state == "failed" and "crash 2" in (last.detail or "")


async def test_control_pause_resume_stop(bus: NatsBus, cfg) -> None:
    echo = Echo(bus, cfg)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(echo.run())
        for _ in range(100):
            try:
                reply = await bus.control(echo.agent_id, "status", timeout_s=0.5)
                break
            except Exception:
                await asyncio.sleep(0.05)
        assert reply.state == "running"
        assert (await bus.control(echo.agent_id, "pause")).state == "paused"
        await bus.publish_sync(
            echo.event(TaskScheduled, task=TaskSpec(task_id="p", family="q"), group_id="g", n_rollouts=1)
        )
        await asyncio.sleep(1.0)
        assert echo.counters["echoed"] == 0  # paused: nothing consumed
        await bus.control(echo.agent_id, "resume")
        async with asyncio.timeout(10):
            while echo.counters["echoed"] == 0:
                await asyncio.sleep(0.05)
        assert (await bus.control(echo.agent_id, "stop")).state == "draining"
    assert echo.state == "stopped"


def spawn_agent(
    target: str, nats_url: str, run_id: str, env_extra: dict[str, str], prefix: list[str] | None = None
) -> subprocess.Popen[bytes]:
    env = subprocess_env() | env_extra
    return subprocess.Popen(
        [
            *(prefix or []),
            PYTHON,
            "-m",
            "coevo",
            "agent",
            target,
            "--nats",
            nats_url,
            "--run-id",
            run_id,
            "--log.console",
            "json",
            "--agent.heartbeat_s",
            "0.5",
            "--bus.fetch_timeout_s",
            "0.2",
            "--run.runs_dir",
            env["COEVO_TEST_RUNS"],
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
        raise AssertionError(f"process did not exit in {timeout}s:\n{out[-3000:]}")
    return proc.returncode


async def test_agents_in_separate_processes_exchange_events(nats_url: str, run_id: str, bus: NatsBus, tmp_path) -> None:
    env = {"COEVO_TEST_N": "30", "COEVO_TEST_RUNS": str(tmp_path)}
    echo = spawn_agent("tests.agents_for_tests:Echo", nats_url, run_id, env)
    producer = spawn_agent("tests.agents_for_tests:Producer", nats_url, run_id, env)
    try:
        assert await wait_exit(producer, 60) == 0, producer.communicate()[0].decode()[-3000:]
    finally:
        echo.send_signal(signal.SIGTERM)
        assert await wait_exit(echo, 30) == 0
    done = [e for e in await bus.events(["trajectory.completed"]) if isinstance(e, TrajectoryCompleted)]
    assert sorted(d.task_id for d in done) == sorted(f"t{i}" for i in range(30))
    sources = {e.source.role for e in await bus.events(["task.scheduled", "trajectory.completed"])}
    assert sources == {"test-producer", "test-echo"}
    log_lines = (tmp_path / run_id / "coevo.log.jsonl").read_text().splitlines()
    assert log_lines and all('"run_id"' in line for line in log_lines)


async def test_sigterm_mid_work_loses_nothing(nats_url: str, run_id: str, bus: NatsBus, tmp_path) -> None:
    """SIGTERM while handlers are busy: in-flight work finishes, the rest is redelivered."""
    n = 40
    for i in range(n):
        await bus.publish(
            Echo(bus, None).event(
                TaskScheduled, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
            )
        )  # type: ignore[arg-type]
    await bus.flush()
    env = {"COEVO_TEST_DELAY": "0.3", "COEVO_TEST_RUNS": str(tmp_path)}
    first = spawn_agent("tests.agents_for_tests:Echo", nats_url, run_id, env)
    async with asyncio.timeout(60):
        while len(await bus.events(["trajectory.completed"])) < 4:
            await asyncio.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    assert await wait_exit(first, 30) == 0
    after_first = await bus.events(["trajectory.completed"])
    assert 4 <= len(after_first) < n
    second = spawn_agent("tests.agents_for_tests:Echo", nats_url, run_id, {**env, "COEVO_TEST_DELAY": "0"})
    try:
        async with asyncio.timeout(60):
            while len(await bus.events(["trajectory.completed"])) < n:
                await asyncio.sleep(0.2)
    finally:
        second.send_signal(signal.SIGTERM)
        assert await wait_exit(second, 30) == 0
    done = await bus.events(["trajectory.completed"])
    task_ids = [d.task_id for d in done]
    assert sorted(task_ids) == sorted(f"t{i}" for i in range(n))  # each exactly once: none lost, none twice
    stopped = [e for e in await bus.events(["agent.status"]) if e.state == "stopped"]
    assert len(stopped) == 2


async def test_sigterm_is_honoured_within_5_s_while_the_server_is_gone(tmp_path) -> None:
    """The agent's server dies under it (it keeps reconnecting, its publishes unacknowledged); a
    SIGTERM then ends it within 5 s (issue #24: it took over 50 s)."""
    from coevo.runtime.server import EmbeddedServer

    server = EmbeddedServer(tmp_path / "nats")
    url = server.start()
    run_id = "sigterm1"
    try:
        env = {"COEVO_TEST_DELAY": "0.2", "COEVO_TEST_RUNS": str(tmp_path)}
        async with await NatsBus.connect(url, run_id) as bus:
            for i in range(20):
                await bus.publish(
                    Echo(bus, None).event(
                        TaskScheduled, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
                    )
                )  # type: ignore[arg-type]
            await bus.flush()
            agent = spawn_agent("tests.agents_for_tests:Echo", url, run_id, env)
            async with asyncio.timeout(60):  # it works: some tasks are answered
                while not await bus.events(["trajectory.completed"]):
                    await asyncio.sleep(0.2)
        server.kill()
        await asyncio.sleep(1.0)  # it notices, and retries
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        await wait_exit(agent, 30)
        assert time.monotonic() - t0 < 5.0, time.monotonic() - t0
    finally:
        server.stop()


async def test_sigterm_is_honoured_within_5_s_while_a_worker_thread_computes(
    nats_url: str, run_id: str, bus: NatsBus, tmp_path
) -> None:
    """A handler's work in a worker thread (a forward pass, a weight load) cannot be cancelled, and
    Python's exit joins such threads: a stopped judge took 15 s more to end (chaos, #24). A stopped
    agent now ends at once; the unfinished task is redelivered."""
    await bus.publish_sync(
        Echo(bus, None).event(TaskScheduled, task=TaskSpec(task_id="t0", family="q"), group_id="g0", n_rollouts=1)
    )  # type: ignore[arg-type]
    agent = spawn_agent(
        "tests.agents_for_tests:Echo", nats_url, run_id, {"COEVO_TEST_THREAD_S": "60", "COEVO_TEST_RUNS": str(tmp_path)}
    )
    log = tmp_path / run_id / "coevo.log.jsonl"
    async with asyncio.timeout(60):  # its handler is inside the thread
        while not (log.exists() and "echo.thread_started" in log.read_text()):
            await asyncio.sleep(0.1)
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    assert await wait_exit(agent, 30) == 0
    assert time.monotonic() - t0 < 5.0, time.monotonic() - t0
    assert await bus.events(["trajectory.completed"]) == []  # nothing half done was published
    assert [e.state for e in await bus.events(["agent.status"]) if e.state == "stopped"] == ["stopped"]


async def test_sigterm_is_honoured_within_5_s_during_the_first_connect(tmp_path) -> None:
    """An agent whose server takes its connection but never answers (hung, or not NATS) retries its
    first connect for up to 30 s; a SIGTERM meanwhile ends it within 5 s, cleanly (issue #24). (A
    port nothing listens on is refused before the agent starts: ``coevo agent`` probes --nats.)"""
    silent = socket.socket()  # listens, never accepts: TCP connects succeed, no INFO ever comes
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    agent = spawn_agent(
        "tests.agents_for_tests:Echo", f"nats://127.0.0.1:{port}", "sigterm2", {"COEVO_TEST_RUNS": str(tmp_path)}
    )
    assert agent.stdout is not None
    os.set_blocking(agent.stdout.fileno(), False)
    seen = b""
    async with asyncio.timeout(60):  # it is inside its connect: nats-py has reported a refused attempt
        while b"nats.error" not in seen:
            seen += agent.stdout.read() or b""
            await asyncio.sleep(0.1)
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    code = await wait_exit(agent, 40)
    silent.close()
    assert time.monotonic() - t0 < 5.0, time.monotonic() - t0
    assert code == 0


async def test_drain_waits_for_work_but_not_for_a_server_that_is_gone() -> None:
    from coevo.runtime.aio import drain

    async def forever() -> None:
        await asyncio.Event().wait()

    quick = asyncio.create_task(asyncio.sleep(0.2))
    stuck = asyncio.create_task(forever())
    t0 = time.monotonic()
    assert await drain([quick], 5.0, lambda: True) == set() and time.monotonic() - t0 < 1.0  # done: at once
    assert await drain([stuck], 0.5, lambda: True) == {stuck}  # connected: the whole timeout
    assert 0.45 <= time.monotonic() - t0 - 0.2 < 1.5
    t1 = time.monotonic()
    assert await drain([stuck], 60.0, lambda: False, grace_s=0.3) == {stuck}  # gone: the grace only
    assert time.monotonic() - t1 < 1.0
    stuck.cancel()


class Stubborn(Agent):
    """Producer work that outlives its cancellation (work a stop cannot end, as a hung stop does)."""

    role = "test-stubborn"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.released = asyncio.Event()

    async def main(self) -> None:
        while not self.released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.hold_on()

    async def hold_on(self) -> None:
        await self.released.wait()


async def test_a_stop_that_does_not_end_says_what_it_waits_on(bus: NatsBus, cfg, monkeypatch, capsys) -> None:
    from coevo.runtime import agent as agent_module

    monkeypatch.setattr(agent_module, "NOT_STOPPED_REPORT_S", 0.5)
    stubborn = Stubborn(bus, cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"drain_timeout_s": 0.1})}))
    stop = asyncio.Event()

    async def scenario() -> None:
        await asyncio.sleep(0.2)
        stop.set()
        async with asyncio.timeout(10):
            while "hold_on" not in capsys.readouterr().err:
                await asyncio.sleep(0.05)
        stubborn.released.set()

    async with asyncio.timeout(20):
        await asyncio.gather(run_agents([stubborn], handle_signals=False, until=stop), scenario())
    assert stubborn.state == "stopped"
