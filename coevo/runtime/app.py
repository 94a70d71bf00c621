"""Process-level wiring: run directory, logging, embedded or external NATS, the bus.

Invariant: leaving ``open_runtime`` flushes every publish, closes the connection and stops the
embedded server (if this process started one), in that order, whatever happened inside.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

from coevo.config import CoevoConfig
from coevo.runtime.bus import NatsBus
from coevo.runtime.logging import bind, configure_logging
from coevo.runtime.server import EmbeddedServer
from coevo.schemas import new_id


@dataclass
class Runtime:
    cfg: CoevoConfig
    run_id: str
    run_dir: Path
    bus: NatsBus
    url: str
    server: EmbeddedServer | None


def make_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + new_id()[:6]


@asynccontextmanager
async def open_runtime(cfg: CoevoConfig, *, name: str = "coevo", log_to_file: bool = True) -> AsyncIterator[Runtime]:
    run_id = cfg.run.run_id or make_run_id()
    run_dir = cfg.run.runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(run_dir if log_to_file else None, level=cfg.log.level, console=cfg.log.console)
    bind(run_id=run_id)
    log = structlog.get_logger("coevo.runtime")
    server: EmbeddedServer | None = None
    url = cfg.nats.url
    if url is None:
        server = EmbeddedServer(run_dir / "nats", binary=cfg.nats.server_binary,
                                max_payload=max(cfg.stream.max_msg_size, 1024 * 1024))
        await server.__aenter__()
        assert server.url is not None
        url = server.url
        log.info("nats.embedded_started", url=url, store=str(server.store_dir))
    try:
        bus = await NatsBus.connect(url, run_id, nats_cfg=cfg.nats, bus=cfg.bus, stream=cfg.stream, name=name)
        try:
            yield Runtime(cfg, run_id, run_dir, bus, url, server)
        finally:
            await bus.close()
    finally:
        if server is not None:
            await server.__aexit__(None, None, None)
