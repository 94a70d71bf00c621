"""Admission of new rollouts while the learner is behind (pure; times are arguments).

Invariant: a train group scored with policy samples counts as waiting for the learner until a
policy ``LearnerStepped`` names it (``disposed_group_ids``: the learner names every group it is done
with, trained, undone by the KL guard, stale, without signal or dead-lettered), or until
``timeout_s`` after it was scored (a safety net: a group whose naming was lost). The tasks agent pauses scheduling on it and the
policy endpoint answers 429 to new episodes on it: rollouts are paced to the learner instead of
being played and then dropped or corrected as stale.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Backlog:
    """Train groups scored with policy samples that no policy ``LearnerStepped`` named yet: the
    learner's queue, by the policy version each group was scheduled at (pure; times are arguments).
    Bounded: an entry stops counting after ``timeout_s`` (a safety net: the learner names every group
    it disposes of, trained or not), and at most ``remember`` named ids are kept to ignore a score that
    arrives after the ``LearnerStepped`` that named it."""

    timeout_s: float
    remember: int = 4096
    groups: dict[str, tuple[int, float]] = field(default_factory=dict)
    """group id -> (policy version at scheduling, time it was scored)"""
    trained_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def scored(self, group_id: str, version: int, now: float) -> None:
        if group_id not in self.trained_ids:
            self.groups[group_id] = (version, now)

    def trained(self, group_ids: Iterable[str]) -> None:
        for g in group_ids:
            self.groups.pop(g, None)
            self.trained_ids[g] = None
        while len(self.trained_ids) > self.remember:
            self.trained_ids.popitem(last=False)

    def oldest(self, now: float) -> int | None:
        """The oldest scheduling version still waiting for the learner (None: none waits)."""
        for g in [g for g, (_, t) in self.groups.items() if now - t > self.timeout_s]:
            del self.groups[g]
        return min((v for v, _ in self.groups.values()), default=None)


def behind(current: int, oldest: int | None, waiting: int, max_staleness: int, max_waiting: int) -> str | None:
    """Why new rollouts must wait (None: they may start): a waiting group would be trained more
    than ``max_staleness`` versions after it was scheduled, or ``max_waiting`` groups already wait."""
    if oldest is not None and current - oldest > max_staleness:
        return (
            f"the learner is behind: a group scheduled at policy version {oldest} is still untrained at version "
            f"{current} (learner.max_staleness = {max_staleness})"
        )
    if waiting >= max_waiting:
        return (
            f"the learner is behind: {waiting} groups wait to be trained (tasks.max_groups_in_flight = {max_waiting})"
        )
    return None
