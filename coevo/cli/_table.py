"""The shape of the command table: a row per command (``Command``), its flags (``Arg``).

Each command module (``run``, ``agent``, ``server``, ``events``, ``trace``, ``replay``, ``view``,
``bench``) declares its rows in ``COMMANDS``; ``coevo.cli`` builds the parser from them in order. A
module imports only the standard library and the config at its top: heavy modules are imported inside
the command's function, so that ``coevo --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Arg:
    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    """One row of the CLI: ``path`` is the words typed ("bench learn"); no ``run`` makes it a group."""

    path: str
    help: str
    run: Callable[[argparse.Namespace], int] | None = None
    args: tuple[Arg, ...] = ()
    config: bool = False
    """every field of the config tree as a flag, plus --config, --set, --nats, --run-id, --dry-run"""
    source: bool = False
    """--nats / --runs-dir: where a recorded run's events are"""
    overrides: dict[str, str] = field(default_factory=dict)
    """flag dest -> config field it sets"""
    metavar: str = "ACTION"


JSON_ARG = arg("--json", type=Path, help="write results here")
RUN_HELP = "id of the run (its directory under --runs-dir, or its events on --nats)"
RUN_ARG = arg("--run", required=True, metavar="RUN", help=RUN_HELP)
