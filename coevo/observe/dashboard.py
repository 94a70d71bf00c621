"""The live dashboard: an aiohttp app over an ``Observer`` (curves, task pool, agents, trajectories).

Invariants:
- everything the browser loads is served from this package (``static/``: hand-written HTML, JS and
  SVG charts); no CDN, no download;
- the pages read JSON (``/api/...``) and one server-sent event stream (``/api/stream``) fed by the
  observer's bounded subscriber queue; a page that falls behind is told to reload;
- the trajectory browser answers with ``coevo trace``'s own data (the tracer is given by the caller:
  the tools live a layer above this package).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from coevo.observe.exposition import Health, metrics_routes, registry_for
from coevo.observe.observer import Observer
from coevo.runtime.aio import wait_event
from coevo.runtime.bus import NatsBus

TraceFn = Callable[[NatsBus, str], Awaitable[dict[str, Any]]]
PAGES = ("/", "/tasks", "/agents", "/trajectories", "/trajectory/{ident}", "/trace/{ident}")
STATIC = {"app.js": "application/javascript", "app.css": "text/css", "index.html": "text/html"}
OBSERVER: web.AppKey[Observer] = web.AppKey("observer", Observer)


def static_text(name: str) -> str:
    return resources.files("coevo.observe").joinpath("static", name).read_text(encoding="utf-8")


def dashboard_app(
    observer: Observer, *, trace: TraceFn | None = None, title: str = "coevo", health: Health | None = None
) -> web.Application:
    """The dashboard (pages, JSON API, live stream) plus ``/metrics`` and ``/healthz``."""
    app = web.Application()
    app[OBSERVER] = observer
    agg = observer.aggregator
    shell = static_text("index.html").replace("{{title}}", title)

    async def page(_r: web.Request) -> web.Response:
        return web.Response(text=shell, content_type="text/html")

    async def static(r: web.Request) -> web.Response:
        name = r.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(text=static_text(name), content_type=STATIC[name], headers={"Cache-Control": "no-cache"})

    async def series(_r: web.Request) -> web.Response:
        return web.json_response(agg.series_json())

    async def state(_r: web.Request) -> web.Response:
        return web.json_response({**agg.state_json(), "live": observer.running, "title": title}, dumps=_dumps)

    async def trajectories(r: web.Request) -> web.Response:
        limit = int(r.query.get("limit", "300"))
        return web.json_response(agg.trajectories.as_list()[:limit])

    async def traced(r: web.Request) -> web.Response:
        if trace is None:
            raise web.HTTPNotImplemented(text="this dashboard has no tracer")
        try:
            result = await trace(observer.bus, r.match_info["ident"])
        except KeyError as exc:
            raise web.HTTPNotFound(text=str(exc.args[0])) from None
        return web.json_response(result, dumps=_dumps)

    def default_health() -> tuple[bool, dict[str, Any]]:
        return observer.healthy, {"last_seq": agg.last_seq, "run_id": agg.run_id}

    app.add_routes([web.get(p, page) for p in PAGES])
    app.add_routes(
        [
            web.get("/static/{name}", static),
            web.get("/api/series", series),
            web.get("/api/state", state),
            web.get("/api/trajectories", trajectories),
            web.get("/api/trace/{ident}", traced),
            web.get("/api/stream", _stream),
        ]
    )
    app.add_routes(metrics_routes(registry_for(aggregator=agg), health or default_health))
    return app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


async def _stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: ``points`` (new points as ``[key, name, labels, t, value]``), ``tick`` (the
    run's clock and last sequence, once a second), ``reload`` (this page fell behind)."""
    observer = request.app[OBSERVER]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    sub = observer.subscribe()
    agg = observer.aggregator
    try:
        await resp.write(b"retry: 2000\n\n")
        while True:
            await wait_event(sub.wake, 1.0)
            sub.wake.clear()
            if sub.dropped:
                await resp.write(b"event: reload\ndata: {}\n\n")
                break
            batch = []
            while not sub.queue.empty():
                batch += [[p.key, p.name, dict(p.labels), p.t, p.value] for p in sub.queue.get_nowait()]
            if batch:
                await resp.write(f"event: points\ndata: {json.dumps(batch)}\n\n".encode())
            tick = {"t": round(agg.t_last, 1), "last_seq": agg.last_seq, "live": observer.running}
            await resp.write(f"event: tick\ndata: {json.dumps(tick)}\n\n".encode())
    except ConnectionResetError:  # the page went away
        pass
    finally:
        observer.unsubscribe(sub)
    return resp
