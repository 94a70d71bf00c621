"""``coevo dashboard`` and ``coevo report``: a run (or a bench result) as pages."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from coevo.cli._table import RUN_ARG, RUN_HELP, Command, arg


def cmd_dashboard(args: argparse.Namespace) -> int:
    from coevo.observe.live import ObserveOptions, observe_run
    from coevo.tools.events import open_run
    from coevo.tools.trace import trace

    opts = ObserveOptions(dashboard_port=args.port, host=args.host, trace=trace)

    async def go() -> int:
        import signal

        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with (
            open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus,
            observe_run(bus, opts, title=f"coevo run {args.run}") as live,
        ):
            print(f"dashboard of run {args.run} at {live.dashboard_url} (Ctrl-C stops it)", flush=True)
            await stop.wait()
        return 0

    return asyncio.run(go())


def cmd_report(args: argparse.Namespace) -> int:
    if (args.run is None) == (args.bench is None):
        raise SystemExit("coevo report: give --run RUN or --bench FILE.json")
    if args.bench is not None:
        from coevo.observe.report import write_bench_report

        out = args.out or args.bench.with_suffix("")
        path = write_bench_report(json.loads(args.bench.read_text()), out, name=args.bench.stem)
    else:
        from coevo.observe.offline import run_report

        out = args.out or args.runs_dir / args.run / "report"
        path = asyncio.run(run_report(args.run, args.runs_dir, args.nats_url, out, args.nats_credentials))
    print(f"wrote {path}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "dashboard",
        "serve the dashboard of a running or finished run",
        cmd_dashboard,
        source=True,
        args=(
            RUN_ARG,
            arg("--port", type=int, default=8765, help="port (0: any free port)"),
            arg("--host", default="127.0.0.1", help="address to listen on"),
        ),
    ),
    Command(
        "report",
        "HTML report with plots of a run (--run) or of a bench result (--bench)",
        cmd_report,
        source=True,
        args=(
            arg("--run", metavar="RUN", help=RUN_HELP),
            arg("--bench", type=Path, help="a `coevo bench ... --json` file"),
            arg("--out", type=Path, help="output directory (default: runs/<run>/report, or next to FILE)"),
        ),
    ),
)
