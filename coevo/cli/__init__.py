"""The ``coevo`` command: a dispatcher over the command modules' tables.

Flags and config are parsed first; each command imports its heavy modules inside its function, so
``coevo --help`` imports none of torch, transformers, nats, vLLM or LiteLLM. A command is one row of a
module's ``COMMANDS`` (``coevo.cli._table.Command``); benches are rows of ``coevo.cli.bench.BENCHES``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coevo.cli import agent, bench, events, replay, run, server, trace, view
from coevo.cli._config import config_flags, resolve_config, run_source
from coevo.cli._table import Command
from coevo.cli.agent import _agent_metrics

__all__ = ["COMMANDS", "_agent_metrics", "build_parser", "main", "resolve_config"]

COMMANDS: tuple[Command, ...] = (
    *run.COMMANDS,
    *agent.COMMANDS,
    *server.COMMANDS,
    *events.COMMANDS,
    *trace.COMMANDS,
    *replay.COMMANDS,
    *view.COMMANDS,
    *bench.COMMANDS,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser, built from ``COMMANDS`` (one row per command; a row without ``run`` is a group)."""
    parser = argparse.ArgumentParser(
        prog="coevo", description="Online RL of LLM agents: policy, judge and environment rewriter co-evolve over NATS."
    )
    groups = {"": parser.add_subparsers(dest="command", required=True, metavar="COMMAND")}
    for command in COMMANDS:
        parent, _, name = command.path.rpartition(" ")
        p = groups[parent].add_parser(name, help=command.help)
        if command.run is None:
            groups[command.path] = p.add_subparsers(
                dest=command.path.replace(" ", "_") + "_command", required=True, metavar=command.metavar
            )
            continue
        for a in command.args:
            p.add_argument(*a.flags, **a.options)
        if command.overrides:
            p.set_defaults(_extra_overrides=dict(command.overrides))
        if command.config:
            config_flags(p)
        if command.source:
            run_source(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from coevo.runtime.memory import bound_malloc_arenas

    bound_malloc_arenas()  # before any thread starts
    parser = build_parser()
    args = parser.parse_args(argv)
    from coevo.errors import ConfigError

    if args.command not in ("run", "agent", "server"):  # tools: quiet logs, results on stdout
        from coevo.runtime.logging import configure_logging

        configure_logging(None, level="warning", console="pretty")
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"coevo: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # an agent of a task group refused its config (a learner's probe)
        refused = group.subgroup(ConfigError)
        if refused is None:
            raise
        print(f"coevo: {_leaves(refused)[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    return [leaf for e in group.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


if __name__ == "__main__":
    sys.exit(main())
