"""``coevo schemas export``, ``coevo events export|import``: events as files."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from coevo.cli._table import RUN_ARG, Command, arg


def cmd_schemas_export(args: argparse.Namespace) -> int:
    from coevo.schemas import json_schemas

    args.dir.mkdir(parents=True, exist_ok=True)
    schemas = json_schemas()
    for kind, schema in schemas.items():
        (args.dir / f"{kind}.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(schemas)} schemas to {args.dir}")
    return 0


def cmd_events_export(args: argparse.Namespace) -> int:
    from coevo.tools.events import export_events, open_run

    async def go() -> int:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            return await export_events(bus, args.out, args.format)

    n = asyncio.run(go())
    print(f"exported {n} events of run {args.run} to {args.out}")
    return 0


def cmd_events_import(args: argparse.Namespace) -> int:
    from coevo.runtime.app import make_run_id, open_bus, run_reader_config
    from coevo.tools.events import import_events, read_export

    run_id = args.run_id or make_run_id()

    async def go() -> int:
        rows = read_export(args.file)
        cfg = run_reader_config(args.runs_dir / run_id / "nats", args.nats_url, args.nats_credentials)
        async with open_bus(run_id, url=args.nats_url, store=args.runs_dir / run_id / "nats", cfg=cfg) as bus:
            return await import_events(bus, rows)

    n = asyncio.run(go())
    print(f"imported {n} events as run {run_id}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command("schemas", "event schemas"),
    Command(
        "schemas export",
        "write the JSON Schema of every event into DIR",
        cmd_schemas_export,
        args=(arg("dir", type=Path),),
    ),
    Command("events", "export a run's events, or import an export under a new run id"),
    Command(
        "events export",
        "write every event of a run, in order, with sequence numbers",
        cmd_events_export,
        source=True,
        args=(arg("out", type=Path), RUN_ARG, arg("--format", choices=["jsonl", "parquet"], default="jsonl")),
    ),
    Command(
        "events import",
        "load an export into a server under a new run id",
        cmd_events_import,
        source=True,
        args=(arg("file", type=Path), arg("--run-id", help="new run id (default: generated)")),
    ),
)
