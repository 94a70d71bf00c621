"""Progress bars of long offline commands (benches, export/import, replay, rejudge).

Invariant: a bar is drawn on stderr and only when stderr is a terminal, so stdout (the results,
often JSON) and logs of non-interactive runs are unchanged; ``advance`` is cheap either way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

_ACTIVE: ContextVar[Progress | None] = ContextVar("coevo_progress", default=None)
"""The display a nested bar joins (one live display per terminal: nested bars are its extra rows)."""


class RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        unit = task.fields.get("unit", "")
        return Text("–" if speed is None else f"{speed:,.1f} {unit}/s", style="progress.data.speed")


class Bar:
    """One task of a progress display (a no-op when nothing is drawn)."""

    def __init__(self, progress: Progress | None = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(
        self, *, completed: float | None = None, total: float | None = None, description: str | None = None
    ) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, total=total, description=description)


@contextmanager
def progress_bar(
    description: str, total: float | None = None, *, unit: str = "events", force: bool = False
) -> Iterator[Bar]:
    """A bar with count, rate, elapsed and remaining time (``total`` None: count and rate only); inside
    another bar, a row of the same display. ``force``: draw even when stderr is not a terminal (tests)."""
    if not (force or sys.stderr.isatty()):
        yield Bar()
        return
    active = _ACTIVE.get()
    if active is not None:
        yield Bar(active, active.add_task(description, total=total, unit=unit))
        return
    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=Console(stderr=True), transient=False) as p:
        token = _ACTIVE.set(p)
        try:
            yield Bar(p, p.add_task(description, total=total, unit=unit))
        finally:
            _ACTIVE.reset(token)


T = TypeVar("T")


def tracked(items: Sequence[T], description: str, *, unit: str = "events") -> Iterator[T]:
    """``items`` one by one, with a progress bar (see ``progress_bar``)."""
    with progress_bar(description, len(items), unit=unit) as bar:
        for item in items:
            yield item
            bar.advance()
