"""Episodes of agents outside coevo: which group and rollout each one fills, and its open state.

Invariants:
- every episode fills one rollout index of one group: a pooled one (a ``TaskScheduled`` of the
  tasks agent, handed out rollout by rollout) or one of the agent's own task ids (its episodes
  fill groups of ``n`` in arrival order; a full group opens the next);
- an episode ends exactly once (finished by its agent, found idle, or aborted when the endpoint
  stops), and a pooled group's ``offer`` returns once each of its rollouts ended;
- a pooled group whose offer was abandoned (the agent stopping: the group will be redelivered)
  hands out none of its remaining rollouts;
- open episodes are bounded (``max_open``), also under concurrent opens (a slot is reserved before
  an open waits for its group or rollout);
- an episode's key finds it while it is open, never after.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from coevo.algorithm.recent import put_newest
from coevo.inference.chat import Turn
from coevo.schemas import TaskScheduled, TaskSpec, new_id


@dataclass
class Episode:
    episode_id: str
    scheduled: TaskScheduled
    rollout_index: int
    trajectory_id: str
    goal: str
    on_end: Callable[[], None] | None = None
    step_ids: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    key: str = field(default_factory=lambda: f"ek-{secrets.token_urlsafe(24)}")
    """the episode's own API key: a call authenticated with it belongs to this episode"""
    pending: dict[str, Any] | None = None
    """the last call's StepTaken fields, waiting for the next observation (the next call or the finish)"""
    pending_call: str | None = None
    """the last call's id (``coevo.call_id`` of its answer), for its reward"""
    calls: int = 0
    turn: Turn | None = None
    """chat: what the last call left, for token-in/token-out"""
    text_turn: tuple[str, list[int], str, list[int]] | None = None
    """completions: (prompt text, prompt ids, response text, response ids) of the last call"""
    last_active: float = field(default_factory=time.monotonic)
    ended: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def task(self) -> TaskSpec:
        return self.scheduled.task

    def describe(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "task_id": self.task.task_id,
            "group_id": self.scheduled.group_id,
            "rollout_index": self.rollout_index,
            "trajectory_id": self.trajectory_id,
            "goal": self.goal,
            "task": self.task.model_dump(mode="json"),
            "calls": self.calls,
            "ended": self.ended,
        }


@dataclass
class PoolGroup:
    scheduled: TaskScheduled
    attempt: int
    left: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: bool = False

    def ended_one(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.done.set()


@dataclass(frozen=True)
class Rollout:
    group: PoolGroup
    index: int

    @property
    def trajectory_id(self) -> str:
        g = self.group
        return f"{g.scheduled.group_id}-r{self.index}" + (f"-a{g.attempt}" if g.attempt > 1 else "")


class Pool:
    """Rollouts of scheduled groups, waiting for an agent to ask for an episode."""

    def __init__(self, maxsize: int = 4096) -> None:
        self.queue: asyncio.Queue[Rollout] = asyncio.Queue(maxsize)

    async def offer(self, scheduled: TaskScheduled, attempt: int) -> None:
        """Hand out the group's rollouts; return once every one of them ended."""
        group = PoolGroup(scheduled, attempt, scheduled.n_rollouts)
        try:
            for i in range(scheduled.n_rollouts):
                await self.queue.put(Rollout(group, i))
            await group.done.wait()
        finally:
            group.abandoned = not group.done.is_set()

    async def take(self, wait_s: float) -> Rollout | None:
        """The next rollout to play, or None after ``wait_s`` without one."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    rollout = await self.queue.get()
            except TimeoutError:
                return None
            if not rollout.group.abandoned:
                return rollout


class OwnGroups:
    """Groups of the agents' own task ids: ``n`` episodes each, in arrival order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.open: dict[str, tuple[TaskScheduled, int]] = {}
        self.lock = asyncio.Lock()

    def next_slot(self, task_id: str) -> tuple[TaskScheduled, int] | None:
        """The open group of ``task_id`` and the index the next episode takes (None: open a new group)."""
        entry = self.open.get(task_id)
        if entry is None or entry[1] >= self.n:
            return None
        self.open[task_id] = (entry[0], entry[1] + 1)
        return entry[0], entry[1]

    def opened(self, scheduled: TaskScheduled) -> int:
        self.open[scheduled.task.task_id] = (scheduled, 1)
        return 0


class Book:
    """The open episodes, bounded; the ids of recently ended ones (to tell "ended" from "unknown")."""

    def __init__(self, max_open: int, remember: int = 10_000) -> None:
        self.max_open = max_open
        self.episodes: dict[str, Episode] = {}
        self.keys: dict[str, Episode] = {}
        self.agents: dict[str, str | None] = {}
        """agent key -> the id of its current episode (None before its first)"""
        self.rotations: dict[str, asyncio.Lock] = {}
        """agent key -> the lock its rotations take one at a time (each ends the one before it)"""
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.remember = remember
        self.reserved = 0

    @contextlib.contextmanager
    def reserve(self) -> Iterator[bool]:
        """A slot for an episode being opened (False: ``max_open`` are open or being opened); the
        slot is the episode's once it is added, and free again if the open fails."""
        if len(self.episodes) + self.reserved >= self.max_open:
            yield False
            return
        self.reserved += 1
        try:
            yield True
        finally:
            self.reserved -= 1

    def by_key(self, key: str) -> Episode | None:
        return self.keys.get(key)

    def new_agent(self) -> str:
        key = f"ak-{secrets.token_urlsafe(24)}"
        self.agents[key] = None
        self.rotations[key] = asyncio.Lock()
        return key

    def current(self, agent: str) -> Episode | None:
        """The open episode agent key ``agent`` holds now."""
        episode_id = self.agents.get(agent)
        return self.episodes.get(episode_id) if episode_id is not None else None

    def add(
        self,
        scheduled: TaskScheduled,
        index: int,
        trajectory_id: str,
        goal: str,
        on_end: Callable[[], None] | None = None,
    ) -> Episode:
        ep = Episode(f"ep-{new_id()[:20]}", scheduled, index, trajectory_id, goal, on_end)
        self.episodes[ep.episode_id] = ep
        self.keys[ep.key] = ep
        return ep

    def get(self, episode_id: str) -> Episode | None:
        return self.episodes.get(episode_id)

    def close(self, ep: Episode, outcome: str) -> None:
        """Mark ``ep`` ended (once) and forget it."""
        if ep.ended:
            return
        ep.ended = True
        self.episodes.pop(ep.episode_id, None)
        self.keys.pop(ep.key, None)
        put_newest(self.ended, ep.episode_id, outcome, self.remember)
        if ep.on_end is not None:
            ep.on_end()

    def idle(self, now: float, timeout_s: float) -> list[Episode]:
        return [e for e in self.episodes.values() if now - e.last_active > timeout_s]
