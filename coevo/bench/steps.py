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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevo.acting.ceiling import PathStep, agreement, ceiling_path, choice_probs
from coevo.bench.heldout import CONSTANTS, bootstrap, episode_key, verb_choices, verdict

if TYPE_CHECKING:
    from coevo.config import ComputeDtype, PolicyConfig
    from coevo.envs.base import Family
    from coevo.schemas import TaskSpec


Paths = list[list[list[PathStep]]]
"""paths[task][seed]: the ceiling's states on that episode."""
Cells = list[list[float]]
"""agreement[task][seed]: the mean over the path's states."""
Dist = Callable[[list[str]], list[float]]
"""candidates as shown -> a habit's probability of each."""


CONCURRENCY = 8
"""Ceiling episodes played at once (TextWorld: one emulator each)."""


_PATHS: dict[tuple[str, ...], list[tuple[str, list[list[PathStep]]]]] = {}
"""Paths already played in this process, by task id (every run of a bench evaluates on the same ones)."""


async def ceiling_paths(
    family: Family, tasks: Sequence[TaskSpec], seeds: Sequence[int], policy: PolicyConfig, states: int | None = None
) -> Paths:
    """The ceiling's path of every held-out task × evaluation seed (the success protocol's keys). A task
    on which the ceiling takes no action of its own in some seed is left out (none in the built-in
    families): an empty path has nothing to agree with. ``states``: at most that many states of each
    path (``sample_states``), for long quests whose every state costs a forward pass per model."""
    key = (family.name, policy.model_dump_json(), repr(list(seeds)), *(t.model_dump_json() for t in tasks))
    if key not in _PATHS:
        permits = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int, task: TaskSpec, seed: int) -> list[PathStep]:
            async with permits:
                return await ceiling_path(family, task, episode_key(task.task_id, seed, i), policy)

        rows = [asyncio.gather(*(one(i, t, s) for s in seeds)) for i, t in enumerate(tasks)]
        played = zip(tasks, await asyncio.gather(*rows), strict=True)
        _PATHS[key] = [(t.task_id, row) for t, row in played if all(row)]
    kept = _PATHS[key]
    return sample_states([row for _, row in kept], states, [task_id for task_id, _ in kept], seeds)


def sample_states(paths: Paths, states: int | None, task_ids: Sequence[str], seeds: Sequence[int]) -> Paths:
    """At most ``states`` states of each path, drawn uniformly without replacement and kept in path order,
    from a key of the task and the seed alone: every arm, habit and run meets the same states (pure;
    ``None``: every state). ``task_ids`` names the paths' tasks in order."""
    import random

    if states is None:
        return [list(row) for row in paths]
    if states < 1:
        raise ValueError(f"states per path must be >= 1, got {states}")

    def pick(path: list[PathStep], task_id: str, seed: int) -> list[PathStep]:
        kept = random.Random(f"{task_id}/{seed}").sample(range(len(path)), min(states, len(path)))
        return [path[i] for i in sorted(kept)]

    return [[pick(p, t, s) for p, s in zip(row, seeds, strict=True)] for row, t in zip(paths, task_ids, strict=True)]


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
    from coevo.inference.chat import PromptForm
    from coevo.inference.engine import LocalEngine

    async with LocalEngine(model, dtype=dtype) as engine:
        form = PromptForm.of(engine, policy.prompt_format)

        async def one(s: PathStep) -> tuple[float, float]:
            measured = await choice_probs(engine, policy, s, form)
            assert measured is not None  # the local engine's constrained calls carry them
            return agreement(measured[0], s.pick)

        flat = [s for row in paths for p in row for s in p]
        agree = dict(zip(map(id, flat), await asyncio.gather(*(one(s) for s in flat)), strict=True))
    sampled = cells(paths, lambda s: agree[id(s)][0])
    greedy = cells(paths, lambda s: agree[id(s)][1])
    return Agreement(sampled, greedy, by_verb(paths, lambda s: agree[id(s)][0]))


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
