"""Held-out step agreement: how often a policy takes the ceiling's action on the ceiling's own path.

Held-out success on a long quest is all or nothing: a policy that reads three rooms of seven right wins
as often as one that reads none, and on the held-out region of a small model every arm scores about 0.
Step agreement sees the skill before the wins: every state the ceiling (the family's scripted reader;
a family without one: its walkthrough) passes through on each held-out task and evaluation seed, its
candidates shown in the order the episode's key draws (the keys of the success protocol,
``coevo.bench.heldout.episode_key``), and at each state the chance that a policy takes the ceiling's
action.

- A model's agreement at a state is its exact probability of the ceiling's choice, from the constrained
  distribution the policy samples from at its temperature (``Completion.choice_logprobs``; one forward
  pass, no draw); its greedy agreement is 1 where that choice is its most probable one.
- A habit is a distribution over the shown candidates: uniform random, each constant label (the best of
  them: the best position rule), and the verb rule (``heldout.VERBS``: it reads the action words, never the
  observation). Their agreements are exact expectations, not samples.
- A cell is the mean over one path's states, so a matrix task × seed bootstraps, pairs and meets
  ``verdict`` like a success matrix (``coevo.bench.heldout``).

Invariant: the ceiling agrees 1.0 at every state, by construction; the ceiling's path does not depend
on the policy, so every arm and every habit is measured on the same states.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevo.bench.heldout import CONSTANTS, bootstrap, episode_key, habit_episode, verb_choices, verdict

if TYPE_CHECKING:
    from coevo.config import ComputeDtype, PolicyConfig
    from coevo.envs.base import Family, Observation, StepResult
    from coevo.schemas import TaskSpec


@dataclass(frozen=True)
class PathStep:
    """A state on the ceiling's path: the observation, the order its candidates are shown in
    (``step_order``) and the ceiling's choice, an index in the shown list."""

    observation: Observation
    order: list[int]
    pick: int

    @property
    def shown(self) -> list[str]:
        return [self.observation.candidates[j] for j in self.order]


Paths = list[list[list[PathStep]]]
"""paths[task][seed]: the ceiling's states on that episode."""
Cells = list[list[float]]
"""agreement[task][seed]: the mean over the path's states."""
Dist = Callable[[list[str]], list[float]]
"""candidates as shown -> a habit's probability of each."""


def has_ceiling(family: Family) -> bool:
    """Whether ``family`` has a ceiling to agree with: a scripted reader or a walkthrough."""
    return family.readable or callable(getattr(family, "walkthrough", None))


WAITS = ("look", "inventory")
"""What the walkthrough's follower plays while its next command is not among the shown ones (a TextWorld
kitchen shows 36 of up to 112): an action the policy could take too, and a state off the path."""
CONCURRENCY = 8
"""Ceiling episodes played at once (TextWorld: one emulator each)."""


@dataclass
class Ceiling:
    """The ceiling's habit on one task: the scripted reader (``pending`` None), else a follower of the
    task's walkthrough. ``on_path``: whether its last choice was the ceiling's own, not a wait."""

    family: Family
    pending: list[str] | None
    on_path: bool = True

    @classmethod
    def of(cls, family: Family, task: TaskSpec) -> Ceiling:
        return cls(family, None if family.readable else list(family.walkthrough(task)))  # type: ignore[attr-defined]

    def __call__(self, obs: str, shown: list[str], _rng: random.Random) -> int | None:
        self.on_path = True
        if self.pending is None:
            return self.family.read(obs, shown)
        if self.pending and self.pending[0] in shown:
            return shown.index(self.pending.pop(0))
        self.on_path = False
        return next((shown.index(w) for w in WAITS if w in shown), None)


async def ceiling_path(family: Family, task: TaskSpec, key: str, policy: PolicyConfig) -> list[PathStep]:
    """The states of the ceiling's episode ``key`` on ``task`` where it took its own action, each shown as
    the policy agent shows step ``k`` of that episode (``step_order(policy, key, k, …)``)."""
    from coevo.agents.policy import step_order

    out: list[PathStep] = []
    k = 0
    ceiling = Ceiling.of(family, task)

    def keep(obs: Observation, action: str, _r: StepResult) -> None:
        nonlocal k
        order = step_order(policy, key, k, len(obs.candidates))
        k += 1
        shown = [obs.candidates[j] for j in order]
        if ceiling.on_path and action in shown:
            out.append(PathStep(obs, order, shown.index(action)))

    await habit_episode(family, task, key, ceiling, policy, keep)
    return out


_PATHS: dict[tuple[str, ...], Paths] = {}
"""Paths already played in this process (every run of a bench evaluates on the same ones)."""


async def ceiling_paths(family: Family, tasks: Sequence[TaskSpec], seeds: Sequence[int], policy: PolicyConfig) -> Paths:
    """The ceiling's path of every held-out task × evaluation seed (the success protocol's keys). A task
    on which the ceiling takes no action of its own in some seed is left out (none in the built-in
    families): an empty path has nothing to agree with."""
    key = (family.name, policy.model_dump_json(), repr(list(seeds)), *(t.model_dump_json() for t in tasks))
    if key not in _PATHS:
        permits = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int, task: TaskSpec, seed: int) -> list[PathStep]:
            async with permits:
                return await ceiling_path(family, task, episode_key(task.task_id, seed, i), policy)

        rows = [asyncio.gather(*(one(i, t, s) for s in seeds)) for i, t in enumerate(tasks)]
        _PATHS[key] = [row for row in await asyncio.gather(*rows) if all(row)]
    return [list(row) for row in _PATHS[key]]


def uniform_dist(shown: list[str]) -> list[float]:
    return [1 / len(shown)] * len(shown)


def constant_dist(label: int) -> Dist:
    return lambda shown: [float(j == min(label, len(shown) - 1)) for j in range(len(shown))]


def verb_dist(shown: list[str]) -> list[float]:
    """The verb rule's distribution: uniform over ``verb_choices``."""
    picked = verb_choices(shown)
    return [float(j in picked) / len(picked) for j in range(len(shown))]


def habit_dists() -> dict[str, Dist]:
    return {
        "random": uniform_dist,
        **{f"always {j}": constant_dist(j) for j in range(CONSTANTS)},
        "verb rule": verb_dist,
    }


def cells(paths: Paths, agree: Callable[[PathStep], float]) -> Cells:
    """Each path's mean agreement (pure; ``ceiling_paths`` leaves out empty paths)."""
    return [[sum(map(agree, p)) / len(p) for p in row] for row in paths]


def _agreeing(dist: Dist) -> Callable[[PathStep], float]:
    return lambda s: dist(s.shown)[s.pick]


def habit_rows(paths: Paths) -> dict[str, dict[str, Any]]:
    """Every habit's agreement (mean, interval), the best constant as ``best position rule``, and the
    ceiling's 1.0."""
    rows = {name: bootstrap(cells(paths, _agreeing(d))) for name, d in habit_dists().items()}
    best = max((f"always {j}" for j in range(CONSTANTS)), key=lambda n: rows[n]["mean"])
    rows["best position rule"] = {**rows[best], "rule": best}
    rows["ceiling"] = bootstrap(cells(paths, lambda _s: 1.0))
    return rows


def path_states(paths: Paths) -> int:
    """How many states the paths hold (every one is measured once)."""
    return sum(len(p) for row in paths for p in row)


def verb_of(s: PathStep) -> str:
    """The first word of the ceiling's action at ``s`` (go, take, unlock, open ...): what a state asks."""
    return (s.shown[s.pick].split() or [""])[0]


def by_verb(paths: Paths, agree: Callable[[PathStep], float]) -> dict[str, float]:
    """Mean agreement over the states of each ``verb_of`` (pure): whether a policy reads the way (go) or
    has a habit (take, unlock), which the mean over all states mixes."""
    return {v: round(sum(map(agree, states)) / len(states), 4) for v, states in _by_verb_states(paths).items()}


def _by_verb_states(paths: Paths) -> dict[str, list[PathStep]]:
    groups: dict[str, list[PathStep]] = {}
    for s in (s for row in paths for p in row for s in p):
        groups.setdefault(verb_of(s), []).append(s)
    return dict(sorted(groups.items()))


def habit_by_verb(paths: Paths) -> dict[str, dict[str, float]]:
    """``by_verb`` of every habit, and the number of states of each verb (``states``)."""
    counts = {v: float(len(states)) for v, states in _by_verb_states(paths).items()}
    return {"states": counts} | {name: by_verb(paths, _agreeing(d)) for name, d in habit_dists().items()}


@dataclass(frozen=True)
class Agreement:
    """A model's agreement with the ceiling: per path at the policy's temperature and greedy, and the
    sampled agreement per ``verb_of``."""

    sampled: Cells
    greedy: Cells
    by_verb: dict[str, float]


_MEASURED: dict[tuple[str, ...], Agreement] = {}
"""Agreements already measured in this process, by model directory, policy and paths (a model directory
is never rewritten: the base of every run of a bench is measured once)."""


async def model_agreement(model: Path, paths: Paths, policy: PolicyConfig, dtype: ComputeDtype = "auto") -> Agreement:
    """``model``'s agreement with the ceiling on ``paths``, at the policy's temperature and greedy, acting
    as the policy agent does (``choose``: its prompt form, the shown order), served in ``dtype``.
    ``policy.mode`` must be ``choice``: a generating policy has no distribution over the candidates."""
    if policy.mode != "choice":
        raise ValueError(f"step agreement needs policy.mode = choice (the policy's is {policy.mode})")
    key = (str(Path(model).resolve()), policy.model_dump_json(), dtype, repr(_shape(paths)), _digest(paths))
    if key not in _MEASURED:
        _MEASURED[key] = await _agreement(model, paths, policy, dtype)
    return _MEASURED[key]


def _shape(paths: Paths) -> list[list[int]]:
    return [[len(p) for p in row] for row in paths]


def _digest(paths: Paths) -> str:
    import hashlib

    text = "".join(
        f"{s.observation.text}|{chr(31).join(s.observation.candidates)}|{s.order}|{s.pick};"
        for row in paths
        for p in row
        for s in p
    )
    return hashlib.sha256(text.encode()).hexdigest()


async def _agreement(model: Path, paths: Paths, policy: PolicyConfig, dtype: ComputeDtype) -> Agreement:
    from coevo.agents.policy import choose
    from coevo.inference.chat import PromptForm
    from coevo.inference.engine import LocalEngine

    async with LocalEngine(model, dtype=dtype) as engine:
        form = PromptForm.of(engine, policy.prompt_format)

        async def one(s: PathStep) -> list[float]:
            c, _, _ = await choose(
                engine, policy, s.observation, list(s.observation.candidates), None, order=s.order, form=form
            )
            assert c.choice_logprobs is not None  # a constrained call
            return [math.exp(x) for x in c.choice_logprobs]

        flat = [s for row in paths for p in row for s in p]
        probs = dict(zip(map(id, flat), await asyncio.gather(*(one(s) for s in flat)), strict=True))
    sampled = cells(paths, lambda s: probs[id(s)][s.pick])
    greedy = cells(paths, lambda s: float(max(range(len(probs[id(s)])), key=probs[id(s)].__getitem__) == s.pick))
    return Agreement(sampled, greedy, by_verb(paths, lambda s: probs[id(s)][s.pick]))


def mean_cell(c: Cells) -> float | None:
    return round(sum(map(sum, c)) / sum(map(len, c)), 6) if c and c[0] else None


def agreement_fields(paths: Paths, trained: Agreement, base: Agreement) -> dict[str, Any]:
    """A run's step agreement on the held-out paths (pure): trained at the policy's temperature, the base
    at it and greedy, each a task × seed matrix, their means, per verb, and the states measured."""
    return {
        "heldout_step_agreement_initial": mean_cell(base.sampled),
        "heldout_step_agreement": mean_cell(trained.sampled),
        "heldout_step_agreement_by_verb_initial": base.by_verb,
        "heldout_step_agreement_by_verb": trained.by_verb,
        "heldout_path_states": path_states(paths),
        "heldout_steps": trained.sampled,
        "heldout_steps_initial": base.sampled,
        "heldout_steps_base_greedy": base.greedy,
    }


def agreement_table(
    runs: dict[str, list[dict[str, Any]]], habits: dict[str, Any], habits_by_verb: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The step-agreement table of a bench's runs (pure): the habits' rows, the base at the policy's
    temperature and greedy, each configuration's agreement with its verdict, and paired differences
    against the first configuration, by bootstrap over runs, tasks and seeds."""
    import numpy as np

    first, *rest = runs
    arms = {c: np.asarray([r["heldout_steps"] for r in rs]) for c, rs in runs.items()}
    rows = {
        **habits,
        "base greedy": bootstrap([r["heldout_steps_base_greedy"] for r in runs[first]]),
        "base sampled": bootstrap([r["heldout_steps_initial"] for r in runs[first]]),
    }
    return {
        "rows": rows,
        "trained": {c: {**(t := bootstrap(a)), "verdict": verdict(t, rows)} for c, a in arms.items()},
        "paired": {f"{c} - {first}": bootstrap(arms[c] - arms[first]) for c in rest},
        "states": runs[first][0]["heldout_path_states"],
        "by_verb": {
            **(habits_by_verb or {}),
            "base sampled": runs[first][0].get("heldout_step_agreement_by_verb_initial"),
            **{c: _mean_by_verb([r.get("heldout_step_agreement_by_verb") for r in rs]) for c, rs in runs.items()},
        },
    }


def _mean_by_verb(runs: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each verb's agreement averaged over runs (pure; None where a run did not record it)."""
    if not runs or any(r is None for r in runs):
        return None
    verbs = sorted({v for r in runs if r for v in r})
    return {v: round(sum(r.get(v, 0.0) for r in runs if r) / len(runs), 4) for v in verbs}
