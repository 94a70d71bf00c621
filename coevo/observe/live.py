"""Observing a run from inside its own process (``coevo run``) or beside it (``coevo dashboard``).

Invariant: everything started here (the observer's task, the dashboard's and the metrics' HTTP
servers) lives inside ``observe_run``'s context; ``drain()`` makes the observer fold everything
stored so far and close its sinks, and leaving the context stops the servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coevo.observe.aggregate import Aggregator
from coevo.observe.dashboard import TraceFn, dashboard_app
from coevo.observe.exposition import agents_health, metrics_app, registry_for, serve
from coevo.observe.observer import Observer
from coevo.observe.sinks import Sink
from coevo.runtime.bus import NatsBus

if TYPE_CHECKING:
    from coevo.runtime.agent import Agent


@dataclass(frozen=True)
class ObserveOptions:
    """How a process shows itself: the dashboard, a Prometheus endpoint, the end-of-run report."""

    dashboard: bool = True
    dashboard_port: int = 8765
    """0: any free port; the default port falls back to a free one when taken"""
    metrics_port: int | None = None
    host: str = "127.0.0.1"
    report: bool = True
    trace: TraceFn | None = None
    """``coevo.tools.trace.trace``, given by the CLI (tools are a layer above this package)"""


@dataclass
class LiveRun:
    observer: Observer
    stop: asyncio.Event
    task: asyncio.Task[None]
    dashboard_url: str | None = None
    metrics_url: str | None = None

    @property
    def aggregator(self) -> Aggregator:
        return self.observer.aggregator

    async def drain(self) -> None:
        """Fold every event stored so far, flush and close the sinks (idempotent)."""
        self.stop.set()
        await asyncio.shield(self.task)


@asynccontextmanager
async def observe_run(
    bus: NatsBus,
    opts: ObserveOptions,
    *,
    sinks: Sequence[Sink] = (),
    marker: Path | None = None,
    agents: Sequence[Agent] = (),
    title: str = "coevo",
) -> AsyncIterator[LiveRun]:
    """Start the observer and the servers ``opts`` asks for; yields their handle."""
    observer = Observer(bus, sinks=sinks, marker=marker)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg, AsyncExitStack() as servers:
        live = LiveRun(observer, stop, tg.create_task(observer.run(stop), name="observer"))
        try:
            if opts.dashboard:
                app = dashboard_app(observer, trace=opts.trace, title=title)
                live.dashboard_url = await servers.enter_async_context(
                    serve(app, opts.host, opts.dashboard_port, fallback_any_port=opts.dashboard_port == 8765)
                )
            if opts.metrics_port is not None:
                registry = registry_for(agents=agents, aggregator=observer.aggregator)
                live.metrics_url = (
                    await servers.enter_async_context(
                        serve(metrics_app(registry, agents_health(agents)), opts.host, opts.metrics_port)
                    )
                    + "/metrics"
                )
            yield live
        finally:
            stop.set()


@asynccontextmanager
async def agent_metrics(
    agents: Sequence[Agent], port: int | None, host: str = "127.0.0.1"
) -> AsyncIterator[str | None]:
    """``/metrics`` and ``/healthz`` for the agents of a ``coevo agent`` process (nothing when ``port`` is None);
    a metrics agent's series are included."""
    if port is None:
        yield None
        return
    aggregator = next((agg for a in agents if isinstance(agg := getattr(a, "aggregator", None), Aggregator)), None)
    app = metrics_app(registry_for(agents=agents, aggregator=aggregator), agents_health(agents))
    async with serve(app, host, port) as url:
        yield url + "/metrics"
