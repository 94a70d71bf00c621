"""Leases on weights directories: a version being loaded is never pruned under its reader.

A reader (a follower loading a version into its server, the weight server reading one to push)
holds a shared ``flock`` on the directory for as long as it reads; the pruner removes a directory
only under an exclusive lock it got without waiting, and otherwise leaves it for the next prune.

Invariants:
- a directory the pruner removed was read by nobody while it was removed; a reader that locks a
  directory the pruner has just removed finds it gone (its files missing) and fails as for any
  missing version, before reading anything;
- the lock lives in the kernel, on the directory's open file: a reader that dies releases it, so
  no lease outlives its process. Readers and pruner must share a host (or a file system whose
  ``flock`` spans hosts); across hosts without one, push the weights (``learner.weight_sync``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path


def _open(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # gone (or never there): the reader's own checks say so
        return None


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Hold a shared lease on ``path`` while the block reads it (blocks while it is being removed)."""
    fd = _open(path)
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.asynccontextmanager
async def reading_async(path: Path) -> AsyncIterator[None]:
    """``reading`` for a coroutine: the lock is taken on a thread, so the event loop never waits on it."""
    fd = _open(path)
    try:
        if fd is not None:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def remove_unless_read(path: Path) -> bool:
    """Remove ``path`` if nobody holds a lease on it; True when it is gone."""
    fd = _open(path)
    if fd is None:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    finally:
        os.close(fd)
