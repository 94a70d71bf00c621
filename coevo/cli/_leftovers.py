"""A command that fails leaves nothing behind: the run directories it created under ``run.runs_dir``
are removed when they hold nothing but its own logs and resolved config (never a checkpoint, a
store or a report: those are a run's, kept however it ended).

Invariant: only directories that did not exist when the command started are ever removed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DISPOSABLE = ("config.json",)
"""files besides logs that a run directory may hold and still be removed (written before anything ran)"""


def disposable(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds only logs and the resolved config."""
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    return all(p.name.startswith("coevo.log") or p.suffix == ".log" or p.name in DISPOSABLE for p in files)


@contextmanager
def removed_on_failure(runs_dir: Path) -> Iterator[None]:
    """Run the block; if it raises, remove the run directories it created that are ``disposable`` (and
    ``runs_dir`` itself when the block created it and it is left empty)."""
    existed = runs_dir.exists()
    before = {p.name for p in runs_dir.iterdir()} if runs_dir.is_dir() else set()
    try:
        yield
    except BaseException:
        if runs_dir.is_dir():
            for p in runs_dir.iterdir():
                if p.name not in before and p.is_dir() and disposable(p):
                    shutil.rmtree(p, ignore_errors=True)
            if not existed and not any(runs_dir.iterdir()):
                runs_dir.rmdir()
        raise
