"""The environment interface. Environments know nothing of NATS or models.

Invariants:
- ``reset(task)`` then ``step(action)`` until ``done``; a step after ``done`` raises ``EnvError``;
- an episode's outcome is ``won``, ``lost``, ``truncated`` (step budget spent) or ``aborted``
  (the environment itself failed; never counted as a failure, never trained on);
- a family's rewrite operators only move knobs within the family's declared bounds (a train task's
  within ``train_limits`` too, so no rewrite reaches the held-out region), and ``precheck`` proves a
  task builds and is solvable before anyone rolls it out.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import json
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from coevo.errors import ConfigError, EnvError
from coevo.schemas import TaskSpec
from coevo.schemas.events import Direction, Outcome


@dataclass(frozen=True)
class Observation:
    text: str
    candidates: list[str] = field(default_factory=list)
    objective: str = ""


@dataclass(frozen=True)
class StepResult:
    observation: Observation
    done: bool
    outcome: Outcome | None = None
    reference_label: Literal[1, -1] | None = None
    """The environment's own verdict on the action just taken (+1 on a shortest path to the goal)."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Knob:
    """A difficulty knob. ``harder`` is the direction (+1 or -1) that makes the task harder."""

    name: str
    low: int
    high: int
    harder: Literal[1, -1] = 1

    def clamp(self, value: int) -> int:
        return max(self.low, min(self.high, value))


@dataclass(frozen=True)
class PrecheckResult:
    ok: bool
    reason: str = ""
    solution_length: int | None = None


class Environment(abc.ABC):
    """One episode at a time of one task."""

    @abc.abstractmethod
    async def reset(self, task: TaskSpec) -> Observation: ...

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None:
        return None


FRESH_WORLD_DRAWS = 8
"""seeds ``Family.fresh_world`` draws before it gives up on finding one that is no held-out task"""


class Family(abc.ABC):
    """A family of tasks: how to build them, make them harder or easier, and check them."""

    name: ClassVar[str]
    knobs: ClassVar[tuple[Knob, ...]] = ()
    max_steps_cap: ClassVar[int] = 50
    train_limits: ClassVar[dict[str, tuple[int, int]]] = {}
    """Knob ranges a train task and every rewrite of one stay within (a knob not named: its bounds).
    A family whose held-out tasks lie outside them measures on tasks no training task reaches."""

    starts_from_knobs: ClassVar[bool] = False
    """Whether ``initial_tasks`` draws its train tasks' knobs through ``start_ranges``, so that
    ``env.start_knobs`` (``start_from``) sets where a run's pool starts."""
    start_knobs: Mapping[str, tuple[int, int]] = MappingProxyType({})
    """Where ``start_from`` put the initial train tasks: knob -> (low, high); a knob not named keeps
    the family's own starting range."""

    def start_from(self, ranges: Mapping[str, tuple[int, int]]) -> None:
        """Draw the initial train tasks' knobs from ``ranges`` (``env.start_knobs``), each within that
        knob's train bounds, so the rewriter can take them anywhere there later; raises a ConfigError
        naming the field and the knob otherwise."""
        if ranges and not self.starts_from_knobs:
            raise ConfigError(
                f"env.start_knobs: family {self.name!r} does not draw its initial tasks from knob ranges",
                field="env.start_knobs",
            )
        names = [k.name for k in self.knobs]
        for name, (lo, hi) in ranges.items():
            field = f"env.start_knobs.{name}"
            if name not in names:
                raise ConfigError(f"{field}: family {self.name!r} has no such knob (its knobs: {names})", field)
            low, high = self.bounds(name, "train")
            if not low <= lo <= hi <= high:
                raise ConfigError(
                    f"{field}: {lo}..{hi} is not within its train bounds {low}..{high} "
                    "(train tasks and their rewrites stay there)",
                    field,
                )
        self.start_knobs = MappingProxyType(dict(ranges))

    def start_ranges(self, ranges: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """The family's own starting ``ranges`` with ``start_knobs`` in place of the knobs it names."""
        return {**ranges, **self.start_knobs}

    @abc.abstractmethod
    def make_env(self) -> Environment: ...

    @abc.abstractmethod
    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]: ...

    @abc.abstractmethod
    async def precheck(self, task: TaskSpec) -> PrecheckResult: ...

    def drawn_pool(
        self, ranges: dict[str, tuple[int, int]], id_prefix: str, n_train: int, n_heldout: int, seed: int
    ) -> list[TaskSpec]:
        """An initial pool: ``n_train`` then ``n_heldout`` tasks, each knob drawn uniformly from its
        range (a fixed knob draws nothing) and a seed param, all from ``seed``."""
        rng = random.Random(seed)
        tasks = []
        for i in range(n_train + n_heldout):
            split: Literal["train", "heldout"] = "train" if i < n_train else "heldout"
            knobs = {k: lo if lo == hi else rng.randint(lo, hi) for k, (lo, hi) in ranges.items()}
            tasks.append(
                TaskSpec(
                    task_id=f"{id_prefix}-{split[0]}{i}",
                    family=self.name,
                    params={"seed": rng.randrange(1_000_000)},
                    knobs=knobs,
                    split=split,
                )
            )
        return tasks

    def knobs_of(self, task: TaskSpec) -> dict[str, int]:
        """Every knob's value for ``task`` (its low bound when unset); out of bounds is an error."""
        out = {}
        for k in self.knobs:
            v = task.knobs.get(k.name, k.low)
            if not k.low <= v <= k.high:
                raise EnvError(f"{self.name}: knob {k.name}={v} outside [{k.low}, {k.high}]")
            out[k.name] = v
        return out

    def knob(self, name: str) -> Knob:
        for k in self.knobs:
            if k.name == name:
                return k
        raise KeyError(f"{self.name} has no knob {name!r}")

    readable: ClassVar[bool] = False
    """Whether ``read`` is a scripted reader that wins every task (the held-out protocol's ceiling)."""

    def read(self, observation: str, shown: list[str]) -> int | None:
        """The scripted reader's choice: an index in ``shown`` from the observation alone (no learning,
        no memory); None where the family has no reader."""
        return None

    async def walkthrough_of(self, task: TaskSpec) -> list[str]:
        """``walkthrough(task)`` off the event loop (a family whose library owns a thread runs it there)."""
        return list(await asyncio.to_thread(self.walkthrough, task))  # type: ignore[attr-defined]

    @property
    def has_ceiling(self) -> bool:
        """Whether the held-out protocol has a ceiling to agree with: the scripted reader, or a
        ``walkthrough(task)`` (the commands that win the task) where the family has one."""
        return self.readable or callable(getattr(self, "walkthrough", None))

    def bounds(self, name: str, split: str) -> tuple[int, int]:
        """The range knob ``name`` may take in a task of ``split`` (train: within ``train_limits``)."""
        k = self.knob(name)
        lo, hi = self.train_limits.get(name, (k.low, k.high)) if split == "train" else (k.low, k.high)
        return max(k.low, lo), min(k.high, hi)

    def operators(self, direction: Direction) -> list[str]:
        """Names of the edits that move ``task`` in ``direction`` (one per knob)."""
        return [f"{k.name}{'+' if (k.harder == 1) == (direction == 'harder') else '-'}" for k in self.knobs]

    def apply(self, task: TaskSpec, operator: str) -> TaskSpec | None:
        """Apply ``knob+`` / ``knob-``; None when the knob is already at its bound."""
        name, sign = operator[:-1], operator[-1]
        knob = self.knob(name)
        lo, hi = self.bounds(name, task.split)
        current = task.knobs.get(name, knob.low)
        new = max(lo, min(hi, current + (1 if sign == "+" else -1)))
        if new == current or not lo <= current <= hi:
            return None
        return self.derive(task, {**task.knobs, name: new})

    def fresh_world(self, task: TaskSpec, salt: str, avoid: Collection[str] = ()) -> TaskSpec | None:
        """A child of ``task`` with the same knobs in another world: a new ``seed`` param drawn from the
        task's id and ``salt`` (the id of the event that asked for it: the same arguments give the same
        world, so replays agree; another salt, another world), never a task whose ``spec_hash`` is in
        ``avoid`` (the held-out tasks). The seed keeps its parity (a family may split train and held-out
        seeds by it, as the TextWorld challenges do). None for tasks without an integer ``seed`` param;
        a family whose seed means something else (an index into fixed levels) overrides this."""
        seed = task.params.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            return None
        for attempt in range(FRESH_WORLD_DRAWS):
            digest = hashlib.sha256(f"{task.task_id}/world/{salt}/{attempt}".encode()).hexdigest()
            child = self.derive(task, dict(task.knobs), {"seed": 2 * (int(digest[:8], 16) % 500_000) + seed % 2})
            if spec_hash(self.name, child.params, child.knobs) not in avoid:
                return child
        return None

    def derive(self, task: TaskSpec, knobs: dict[str, int], params: dict[str, Any] | None = None) -> TaskSpec:
        """A rewritten child of ``task`` (lineage kept: parent id, version + 1)."""
        for name, value in knobs.items():
            lo, hi = self.bounds(name, task.split)
            if not lo <= value <= hi:
                where = " (a train task's limits)" if (lo, hi) != (self.knob(name).low, self.knob(name).high) else ""
                raise EnvError(f"{self.name}: knob {name}={value} outside [{lo}, {hi}]{where}")
        root = task.task_id.split("__v")[0]
        version = task.version + 1
        merged = {**task.params, **(params or {})}
        digest = spec_hash(self.name, merged, knobs)[:8]
        return TaskSpec(
            task_id=f"{root}__v{version}-{digest}",
            family=self.name,
            params=merged,
            knobs=knobs,
            parent_id=task.task_id,
            version=version,
            split=task.split,
        )

    def difficulty(self, task: TaskSpec) -> float:
        """A scalar for tests and reports: sum of knob positions, oriented so higher = harder."""
        total = 0.0
        for k in self.knobs:
            v = task.knobs.get(k.name, k.low)
            span = max(1, k.high - k.low)
            pos = (v - k.low) / span
            total += pos if k.harder == 1 else 1 - pos
        return total


def spec_hash(family: str, params: dict[str, Any], knobs: dict[str, int]) -> str:
    blob = json.dumps({"family": family, "params": params, "knobs": knobs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
