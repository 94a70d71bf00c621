"""Admission of new rollouts while the learner is behind (pure; times are arguments).

Invariant: a train group scored with policy samples counts as waiting for the learner until a
policy ``LearnerStepped`` names it (``disposed_group_ids``: the learner names every group it is done
with, trained, undone by the KL guard, stale, without signal or dead-lettered), or until
``timeout_s`` after it was scored (a safety net: a group whose naming was lost). The tasks agent pauses scheduling on it and the
policy endpoint answers 429 to new episodes on it: rollouts are paced to the learner instead of
being played and then dropped or corrected as stale. Both the age of the oldest waiting group and the
size of the queue count: within ``max_staleness`` versions, rollouts faster than the learner could
otherwise queue any number of steps' work, and the last of it would be trained that many versions
late (measured: 13 versions at max_staleness 2, SmolLM2 on the word problems, before ``queue_full``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from coevo.algorithm.recent import put_newest


@dataclass
class Backlog:
    """Train groups scored with policy samples that no policy ``LearnerStepped`` named yet: the
    learner's queue, by the policy version each group was scheduled at (pure; times are arguments).
    Bounded: an entry stops counting after ``timeout_s`` (a safety net: the learner names every group
    it disposes of, trained or not), and at most ``remember`` named ids are kept to ignore a score that
    arrives after the ``LearnerStepped`` that named it."""

    timeout_s: float
    remember: int = 4096
    groups: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    """group id -> (policy version at scheduling, time it was scored, its policy samples)"""
    trained_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def scored(self, group_id: str, version: int, now: float, samples: int = 0) -> None:
        """``samples``: the group's policy samples (the tasks agent's queue bound counts them; the
        endpoint, which sees episodes end and not their scores, counts groups)."""
        if group_id not in self.trained_ids:
            self.groups[group_id] = (version, now, samples)

    def trained(self, group_ids: Iterable[str]) -> None:
        for g in group_ids:
            self.groups.pop(g, None)
            put_newest(self.trained_ids, g, None, self.remember)

    def oldest(self, now: float) -> int | None:
        """The oldest scheduling version still waiting for the learner (None: none waits)."""
        self._expire(now)
        return min((v for v, _, _ in self.groups.values()), default=None)

    def queued(self, now: float) -> tuple[int, int]:
        """(groups, policy samples) waiting for the learner."""
        self._expire(now)
        return len(self.groups), sum(n for _, _, n in self.groups.values())

    def _expire(self, now: float) -> None:
        for g in [g for g, (_, t, _) in self.groups.items() if now - t > self.timeout_s]:
            del self.groups[g]


def queue_full(
    groups: int, samples: int, max_staleness: int, batch_samples: int, batch_groups: int | None
) -> str | None:
    """Why new rollouts must wait although no waiting group is too old yet (None: they may start): the
    learner's queue already holds ``max_staleness`` steps' work (batches of ``batch_samples`` samples,
    or of ``batch_groups`` groups when set), so a group scheduled now would be trained more than
    ``max_staleness`` versions after it. The queue then holds at least one batch, so the learner
    steps and releases it."""
    work = groups / batch_groups if batch_groups is not None else samples / batch_samples
    if work < max_staleness:
        return None
    held = f"{groups} groups" if batch_groups is not None else f"{samples} samples"
    return (
        f"the learner is behind: {held} wait to be trained, {work:.1f} steps' work "
        f"(learner.max_staleness = {max_staleness})"
    )


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
