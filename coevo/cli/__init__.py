"""The ``coevo`` command: a dispatcher over the command modules' tables.

Flags and config are parsed first; each command imports its heavy modules inside its function, so
``coevo --help`` imports none of torch, transformers, nats, vLLM or LiteLLM. A command is one row of a
module's ``COMMANDS`` (``coevo.cli._table.Command``); benches are rows of ``coevo.cli.bench.BENCHES``.
"""

from __future__ import annotations

import argparse
import sys

from coevo.cli import agent, bench, events, replay, run, server, trace, view
from coevo.cli._checks import check_nats
from coevo.cli._config import config_flags, resolve_config, run_source
from coevo.cli._failure import exit_status, one_line
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
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    groups = {"": parser.add_subparsers(dest="command", required=True, metavar="COMMAND")}
    for command in COMMANDS:
        parent, _, name = command.path.rpartition(" ")
        p = groups[parent].add_parser(name, help=command.help, description=command.help)
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
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        p.set_defaults(func=command.run, _path=command.path)
    return parser


DEBUG_HELP = "show the traceback of a failure (default: one line, coevo: <what>)"


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown flag is refused by its command's own parser
    (``coevo run``'s usage, not the top-level one)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser
        for word in args._path.split():
            (sub,) = (a for a in command._actions if isinstance(a, argparse._SubParsersAction))
            command = sub.choices[word]
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_suggestion(command, unknown)}")
    return args


def _suggestion(command: argparse.ArgumentParser, unknown: list[str]) -> str:
    """`` (did you mean --policy-model?)`` for a misspelt flag."""
    import difflib

    flags = [o for a in command._actions for o in a.option_strings]
    for word in unknown:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.partition("=")[0], flags, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def main(argv: list[str] | None = None) -> int:
    from coevo.runtime.memory import bound_malloc_arenas

    bound_malloc_arenas()  # before any thread starts
    args = parse(build_parser(), argv)
    if args.command not in ("run", "agent"):  # tools and the server: quiet logs, results on stdout
        from coevo.runtime.logging import configure_logging

        configure_logging(None, level="warning", console="pretty")
    try:
        check_nats(getattr(args, "nats_url", None))  # a dead --nats fails in a second, before anything is opened
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the one error path: an expected failure in one line (--debug: the traceback)
        line = None if args.debug else one_line(exc)
        if line is None:
            raise
        print(f"coevo: {line}", file=sys.stderr)
        return exit_status(exc)


if __name__ == "__main__":
    sys.exit(main())
