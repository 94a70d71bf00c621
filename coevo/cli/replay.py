"""``coevo replay`` and ``coevo rejudge``: recorded events through a fresh agent or another judge."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from coevo.cli._config import parse_value
from coevo.cli._table import RUN_ARG, Command, arg


def cmd_replay(args: argparse.Namespace) -> int:
    from coevo.tools import replay as rp
    from coevo.tools.events import load_events, open_run, run_config

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key.strip()] = parse_value(value)
    cfg = run_config(args.runs_dir, args.run, overrides)

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            events = await load_events(bus, args.start, args.end)
        if args.into == "scorer":
            report = rp.replay_scorer(events, cfg)
        elif args.into == "judge":
            report = await rp.replay_judge(events, cfg)
        elif args.into == "rewriter":
            report = await rp.replay_rewriter(events, cfg)
        else:
            report = await asyncio.to_thread(rp.replay_learner, events, cfg)
        return report.as_dict()

    result = asyncio.run(go())
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["identical"] else 1


def cmd_rejudge(args: argparse.Namespace) -> int:
    from coevo.config import load_config
    from coevo.tools.events import open_run, run_config
    from coevo.tools.rejudge import rejudge, unparsed

    if args.steps is not None and args.steps < 1:
        raise SystemExit("coevo rejudge: --steps must be >= 1")
    recorded_cfg = run_config(args.runs_dir, args.run, {})
    use_recorded = args.judge == "recorded"
    cfg = recorded_cfg if use_recorded else load_config(Path(args.judge))

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            return await rejudge(bus, cfg, use_recorded, args.steps)

    result = asyncio.run(go())
    print(json.dumps(result, indent=2))
    if not result["steps"]:
        print(f"coevo: rejudge: run {args.run} has no judged steps to judge again", file=sys.stderr)
        return 1
    problem = unparsed(result["rejudge_votes"])
    if problem is not None:
        print(f"coevo: {problem[0]}", file=sys.stderr)
    return 1 if problem is not None and problem[1] else 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "replay",
        "feed recorded events into a fresh agent; report the first divergence",
        cmd_replay,
        source=True,
        args=(
            RUN_ARG,
            arg("--into", required=True, choices=["scorer", "judge", "rewriter", "learner"]),
            arg("--from", dest="start", type=int, help="first stream sequence"),
            arg("--to", dest="end", type=int, help="last stream sequence"),
            arg("--set", action="append", default=[], metavar="KEY=VALUE", help="change the config for the replay"),
        ),
    ),
    Command(
        "rejudge",
        "run another judge over a run's steps; agreement and accuracies",
        cmd_rejudge,
        source=True,
        args=(
            RUN_ARG,
            arg("--judge", default="recorded", help="'recorded' (the original responses) or a config file"),
            arg(
                "--steps",
                type=int,
                metavar="N",
                help="judge N of the run's judged steps, evenly spread over it (default: all)",
            ),
        ),
    ),
)
