"""`coevo agent metrics` on a real NATS server: it tails the stream, writes TensorBoard files once, serves
Prometheus; `coevo agent ROLE --metrics-port` serves any agent's counters and health."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from coevo.agents import resolve_role
from coevo.config import CoevoConfig
from coevo.observe.agent import MetricsAgent
from coevo.observe.live import agent_metrics
from coevo.runtime.agent import Agent, run_agents
from coevo.runtime.bus import NatsBus
from tests.conftest import _free_port
from tests.test_observe import a_run


def scrape(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def run_until(agent: Agent, done: Any, check: Any = None, timeout: float = 30.0) -> None:
    stop = asyncio.Event()

    async def watch() -> None:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.1)
        if check is not None:
            await asyncio.to_thread(check)
        stop.set()

    await asyncio.gather(run_agents([agent], handle_signals=False, until=stop), watch())


def success_points(tb: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return [s.value for s in acc.Scalars("success/success_train")]


async def test_metrics_agent_writes_tensorboard_once_and_serves_prometheus(bus: NatsBus, cfg: CoevoConfig) -> None:
    events = [e.model_copy(update={"run_id": bus.run_id}) for e in a_run()]
    for e in events:
        await bus.publish_sync(e)
    agent = resolve_role("metrics")(bus, cfg)
    assert isinstance(agent, MetricsAgent)
    port = _free_port()

    def check() -> None:
        families = scrape(f"http://127.0.0.1:{port}/metrics")
        assert families["coevo_success_train"].samples[0].value == 1.0
        up = [s for s in families["coevo_agent_up"].samples if s.labels["role"] == "metrics"]
        assert up and up[0].value == 1.0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"

    async with agent_metrics([agent], port) as url:
        assert url == f"http://127.0.0.1:{port}/metrics"
        await run_until(agent, lambda: agent.aggregator.last_seq >= len(events), check)
    tb = cfg.run.runs_dir / bus.run_id / "tb"
    assert success_points(tb) == [0.25, 0.5, 0.5, 0.75, 0.75, 1.0]
    marker = int((tb / "observed_seq").read_text())
    assert marker >= len(events)

    again = MetricsAgent(bus, cfg)  # a restarted metrics agent: the history is not written twice
    await run_until(again, lambda: again.aggregator.last_seq >= marker)
    assert success_points(tb) == [0.25, 0.5, 0.5, 0.75, 0.75, 1.0]
    assert again.aggregator.summary()["groups_scored"] == 6  # but its aggregator knows the whole run


async def test_any_agent_serves_its_counters_and_health(bus: NatsBus, cfg: CoevoConfig) -> None:
    agent = resolve_role("scorer")(bus, cfg)
    port = _free_port()
    seen: dict[str, Any] = {}

    def check() -> None:
        families = scrape(f"http://127.0.0.1:{port}/metrics")
        seen["roles"] = {s.labels["role"] for s in families["coevo_agent_up"].samples}
        seen["counters"] = {s.labels["counter"] for s in families["coevo_agent_counter"].samples}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            seen["health"] = json.loads(r.read())

    async with agent_metrics([agent], port):
        await run_until(agent, lambda: agent.state == "running", check)
        stopped = await asyncio.to_thread(status_of, f"http://127.0.0.1:{port}/healthz")
    assert seen["roles"] == {"scorer"} and "scorer.handled" in seen["counters"]
    assert seen["health"]["status"] == "ok" and stopped == 503  # a stopped agent is not healthy
