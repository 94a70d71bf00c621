"""Prometheus ``/metrics`` and ``/healthz`` for every long-running coevo process, on aiohttp.

Invariants: each server has its own ``CollectorRegistry`` (no process-global metrics state); a
scrape reads the current values (agents' counters, the aggregator's latest points) and never
blocks the event loop on I/O; leaving ``serve`` closes the listening socket and every connection.
"""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector

from coevo.observe.series import SPECS

if TYPE_CHECKING:
    from coevo.observe.aggregate import Aggregator
    from coevo.runtime.agent import Agent

Health = Callable[[], tuple[bool, dict[str, Any]]]


class SeriesCollector:
    """The aggregator's latest value of every series (``coevo_<name>``) and events stored per kind."""

    def __init__(self, aggregator: Aggregator) -> None:
        self.aggregator = aggregator

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name, labels, value in self.aggregator.latest():
            spec = SPECS[name]
            fam = families.get(name)
            if fam is None:
                cls = CounterMetricFamily if spec.counter else GaugeMetricFamily
                fam = families[name] = cls(f"coevo_{name}", f"{spec.help} [{spec.unit}]", labels=list(spec.labels))
            fam.add_metric([v for _, v in labels], value)
        yield from families.values()
        events = CounterMetricFamily("coevo_events", "events stored in the run's stream, by kind", labels=["kind"])
        for kind, n in sorted(self.aggregator.tally.counts.items()):
            events.add_metric([kind], n)
        yield events


class AgentCollector:
    """State, uptime and counters of the agents this process runs."""

    def __init__(self, agents: Sequence[Agent]) -> None:
        self.agents = agents

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "coevo_agent_up", "1 while the agent runs (state label: its state)", labels=["agent", "role", "state"]
        )
        uptime = GaugeMetricFamily(
            "coevo_agent_uptime_seconds", "seconds since the agent started", labels=["agent", "role"]
        )
        counters = GaugeMetricFamily(
            "coevo_agent_counter",
            "the agent's own counters (handled, emitted, restarts, per consumer statistics)",
            labels=["agent", "role", "counter"],
        )
        for a in self.agents:
            up.add_metric([a.agent_id, a.role, a.state], float(a.state in ("running", "paused", "starting")))
            uptime.add_metric([a.agent_id, a.role], a.uptime_s)
            for k, v in sorted(a.snapshot_counters().items()):
                counters.add_metric([a.agent_id, a.role, k], v)
        yield from (up, uptime, counters)


def registry_for(*, agents: Sequence[Agent] = (), aggregator: Aggregator | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    if agents:
        registry.register(AgentCollector(agents))
    if aggregator is not None:
        registry.register(SeriesCollector(aggregator))
    return registry


def agents_health(agents: Sequence[Agent]) -> Health:
    def health() -> tuple[bool, dict[str, Any]]:
        states = {a.agent_id: a.state for a in agents}
        return all(s in ("starting", "running", "paused") for s in states.values()), {"agents": states}

    return health


def metrics_routes(registry: CollectorRegistry, health: Health) -> list[web.RouteDef]:
    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        ok, detail = health()
        return web.Response(
            status=200 if ok else 503,
            content_type="application/json",
            text=json.dumps({"status": "ok" if ok else "unhealthy", **detail}),
        )

    return [web.get("/metrics", metrics), web.get("/healthz", healthz)]


def metrics_app(registry: CollectorRegistry, health: Health) -> web.Application:
    app = web.Application()
    app.add_routes(metrics_routes(registry, health))
    return app


@asynccontextmanager
async def serve(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, fallback_any_port: bool = False
) -> AsyncIterator[str]:
    """Serve ``app``; yields its base URL (``http://host:port``). ``fallback_any_port``: when ``port`` is
    taken, take any free one instead of failing."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = await _start(runner, host, port, fallback_any_port)
        server = cast("asyncio.Server | None", site._server)  # TCPSite's: what loop.create_server returned
        sockets: Iterable[Any] = server.sockets if server else ()
        bound = next(iter(sockets)).getsockname()[1]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()


async def _start(runner: web.AppRunner, host: str, port: int, fallback: bool) -> web.TCPSite:
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        if not (fallback and exc.errno == errno.EADDRINUSE):
            raise
        site = web.TCPSite(runner, host, 0)
        await site.start()
    return site
