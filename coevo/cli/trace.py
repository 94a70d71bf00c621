"""``coevo trace IDENT``: the causal timeline of a trajectory, task, step or weights version."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from coevo.cli._table import RUN_ARG, Command, arg


def cmd_trace(args: argparse.Namespace) -> int:
    from coevo.tools.events import open_run
    from coevo.tools.trace import trace

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            return await trace(bus, args.ident)

    try:
        result = asyncio.run(go())
    except KeyError as exc:
        print(f"coevo: {exc.args[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        from rich import print as rprint

        from coevo.tools.trace_view import tree

        rprint(tree(result))
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "trace",
        "causal timeline of a trajectory, task, step or weights version",
        cmd_trace,
        source=True,
        args=(
            arg("ident", help="trajectory id, task id, step event id, or a weights version (policy:12)"),
            RUN_ARG,
            arg("--json", action="store_true", help="JSON instead of a tree"),
        ),
    ),
)
