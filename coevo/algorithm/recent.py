"""What a long-lived process remembers of an unbounded stream (groups scored, verdicts, responses kept,
episodes ended, views of the newest events) without growing with it.

Invariant: after ``put_newest`` the map holds at most ``limit`` keys, ``key`` is its newest, and the
keys it forgot were the oldest; they are returned, so state kept beside the map is dropped with them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def put_newest(d: OrderedDict[K, V], key: K, value: V, limit: int) -> list[tuple[K, V]]:
    """``d[key] = value`` as ``d``'s newest entry, then the oldest entries beyond ``limit`` forgotten
    (returned, oldest first)."""
    d[key] = value
    d.move_to_end(key)
    forgotten = []
    while len(d) > limit:
        forgotten.append(d.popitem(last=False))
    return forgotten
