"""The one error path of the ``coevo`` command: what a user is told when a command fails as expected.

Invariant: an expected failure (one of coevo's errors, an ``OSError`` such as a missing file or a
refused connection, an error of the NATS client) is told in one line, ``coevo: <what>``, with exit
status 2 for a refused config and 1 otherwise; anything else is a bug and keeps its traceback. With
``--debug`` every failure keeps its traceback.
"""

from __future__ import annotations

from coevo.errors import CoevoError, ConfigError, ServerError


def one_line(exc: BaseException) -> str | None:
    """What an expected failure says, on one line; None for an unexpected one (a bug: traceback)."""
    if isinstance(exc, BaseExceptionGroup):  # a task group's failure: its first expected leaf
        for leaf in leaves(exc):
            line = one_line(leaf)
            if line is not None:
                return line
        return None
    if isinstance(exc, ServerError):
        text = _server_log(str(exc))
    elif isinstance(exc, CoevoError):
        text = str(exc)
    elif isinstance(exc, OSError):
        text = _os_error(exc)
    elif type(exc).__module__.split(".")[0] == "nats":
        text = f"NATS: {str(exc) or type(exc).__name__}"
    else:
        return None
    return " ".join(text.split()) or type(exc).__name__


def exit_status(exc: BaseException) -> int:
    """2: the command line or the config was refused; 1: the command failed."""
    if isinstance(exc, BaseExceptionGroup):
        return 2 if exc.subgroup(ConfigError) is not None else 1
    return 2 if isinstance(exc, ConfigError) else 1


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [leaf for e in group.exceptions for leaf in (leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


def _os_error(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return exc.strerror or str(exc) or type(exc).__name__


def _server_log(text: str) -> str:
    """A nats-server that stopped carries its whole log: its first line and the fatal or error lines."""
    lines = text.splitlines()
    if len(lines) <= 1:
        return text
    said = [line.split("] ", 2)[-1] for line in lines[1:] if "[FTL]" in line or "[ERR]" in line]
    return lines[0].split(":", 1)[0] + ": " + "; ".join(said or lines[-1:])
