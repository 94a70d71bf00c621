"""Process-level wiring: run directory, logging, embedded or external NATS, the bus.

Invariant: leaving ``open_runtime`` flushes every publish, closes the connection and stops the
embedded server (if this process started one), in that order, whatever happened inside.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

from coevo.config import CoevoConfig, NatsConfig, load_config
from coevo.errors import ConfigError
from coevo.runtime.bus import NatsBus
from coevo.runtime.credentials import ADMIN, credential_path, credentials_dir, role_users
from coevo.runtime.logging import bind, configure_logging
from coevo.runtime.proc import dump_tasks_on_usr1
from coevo.runtime.server import EmbeddedServer
from coevo.schemas import new_id


@dataclass
class Runtime:
    cfg: CoevoConfig
    run_id: str
    run_dir: Path
    bus: NatsBus


def make_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + new_id()[:6]


@dataclass(frozen=True)
class NatsEndpoint:
    """Where a bus connects: a URL, and for a run's embedded server the admin's credentials file."""

    url: str
    credentials_file: Path | None = None

    def nats_config(self, base: NatsConfig) -> NatsConfig:
        if self.credentials_file is None:
            return base
        return base.model_copy(update={"credentials_file": self.credentials_file})


@asynccontextmanager
async def nats_endpoint(
    url: str | None,
    store: Path,
    *,
    run_id: str | None = None,
    binary: str = "nats-server",
    max_payload: int = 8 * 1024 * 1024,
    existing: bool = False,
) -> AsyncIterator[NatsEndpoint]:
    """``url`` as given; without one, an embedded server over ``store``, stopped on exit. For a run
    (``run_id``) it requires credentials: a user per role with that run's permissions, and ``admin``
    (whose file the endpoint names); without a run (benches of the bare server) it takes anyone on loopback.

    ``existing``: the store must already hold a JetStream directory (reading a finished run)."""
    if url is not None:
        yield NatsEndpoint(url)
        return
    if existing and not (store / "jetstream").exists():
        where = f"run {run_id!r} " if run_id else ""
        raise ConfigError(
            f"no {where}event store at {store}: pass the --runs-dir that holds the run (now "
            f"{store.parent.parent}), or --nats URL for a run on a server",
            field="run.runs_dir",
        )
    users = role_users(credentials_dir(store), (run_id,)) if run_id is not None else None
    async with EmbeddedServer(store, binary=binary, max_payload=max_payload, auth=users) as server:
        assert server.url is not None
        structlog.get_logger("coevo.runtime").info(
            "nats.embedded_started",
            url=server.url,
            store=str(store),
            credentials=str(credentials_dir(store)) if users else None,
        )
        yield NatsEndpoint(server.url, users.credentials[ADMIN].path if users else None)


@asynccontextmanager
async def open_bus(
    run_id: str,
    *,
    url: str | None = None,
    store: Path | None = None,
    cfg: CoevoConfig | None = None,
    name: str = "coevo",
    existing: bool = False,
) -> AsyncIterator[NatsBus]:
    """The one way to reach a run's bus: on ``url``, or on an embedded server over ``store`` (as its
    admin: the run's stream, buckets and object store exist once this yields).

    ``cfg`` supplies the connection, bus and stream settings (defaults otherwise); on exit every
    publish is flushed, the connection closed and the embedded server (if any) stopped."""
    cfg = cfg or CoevoConfig()
    if url is None and store is None:
        raise ValueError("open_bus needs a NATS url or a store directory for an embedded server")
    async with nats_endpoint(
        url,
        store or Path(),
        run_id=run_id,
        binary=cfg.nats.server_binary,
        existing=existing,
        max_payload=max(cfg.stream.max_msg_size, 1024 * 1024),
    ) as endpoint:
        bus = await NatsBus.connect(
            endpoint.url,
            run_id,
            nats_cfg=endpoint.nats_config(cfg.nats),
            bus=cfg.bus,
            stream=cfg.stream,
            name=name,
            reading=existing,  # a tool reading a run's history: older schema majors are upcast
        )
        try:
            if bus.manages and not existing:  # reading a run creates nothing
                await bus.provision()
            yield bus
        finally:
            await bus.close()


def run_reader_config(store: Path, url: str | None, credentials: Path | None = None) -> CoevoConfig:
    """How a tool reads a run on ``url``: with ``credentials``, else the run's own admin file in
    ``store`` when there is one (a run's embedded server is reached through ``store`` itself)."""
    own = credential_path(credentials_dir(store), ADMIN)
    chosen = credentials or (own if url is not None and own.exists() else None)
    return load_config(overrides={"nats.credentials_file": str(chosen)} if chosen else {})


async def provision_runs(url: str, admin: Path, run_ids: tuple[str, ...], replicas: int = 1) -> None:
    """Create each run's stream, buckets and object store as its admin (``coevo server --run-id``):
    agents started with a role's credentials may not create them."""
    cfg = load_config(overrides={"nats.credentials_file": str(admin), "stream.replicas": replicas})
    for run_id in run_ids:
        async with open_bus(run_id, url=url, cfg=cfg):
            pass


@asynccontextmanager
async def open_runtime(
    cfg: CoevoConfig, *, name: str = "coevo", log_to_file: bool = True, console_filter: logging.Filter | None = None
) -> AsyncIterator[Runtime]:
    run_id = cfg.run.run_id or make_run_id()
    run_dir = cfg.run.runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = run_dir if log_to_file else None
    configure_logging(log_dir, level=cfg.log.level, console=cfg.log.console, console_filter=console_filter)
    bind(run_id=run_id)
    dump_tasks_on_usr1()
    async with open_bus(run_id, url=cfg.nats.url, store=run_dir / "nats", cfg=cfg, name=name) as bus:
        yield Runtime(cfg, run_id, run_dir, bus)
