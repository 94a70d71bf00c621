"""The ceiling of a held-out task, and a policy's agreement with it on its path.

The ceiling is the family's scripted reader, or, for a family without one, a follower of the task's
walkthrough. Its path through an episode is every state where it took its own action, each shown as
the policy agent shows step ``k`` of that episode (``step_order``: the same key, the same shuffle). A
policy's agreement at a state is its exact probability of the ceiling's choice at its temperature
(``Completion.choice_logprobs``: one forward pass, no draw).

Used by the policy agent (each evaluation group's step agreement) and by the benches
(``coevo.bench.steps``), so that both walk the same path and ask the model the same way.

Invariant: the ceiling's path depends on the task, the episode's key and the policy's display settings
only, never on a model, so every model and every habit is measured on the same states.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coevo.acting import choose, step_order
from coevo.algorithm.prompts import episode_seed

if TYPE_CHECKING:
    from coevo.config import PolicyConfig
    from coevo.envs.base import Environment, Family, Observation, StepResult
    from coevo.inference.chat import PromptForm
    from coevo.schemas import TaskSpec

Habit = Callable[[str, list[str], random.Random], int | None]
"""(observation text, candidates as shown, the episode's rng) -> index in the shown list."""

WAITS = ("look", "inventory")
"""What the walkthrough's follower plays while its next command is not among the shown ones (a TextWorld
kitchen shows 36 of up to 112): an action the policy could take too, and a state off the path."""


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


@dataclass
class Ceiling:
    """The ceiling's habit on one task: the scripted reader (``pending`` None), else a follower of the
    task's walkthrough. ``on_path``: whether its last choice was the ceiling's own, not a wait."""

    family: Family
    pending: list[str] | None
    on_path: bool = True

    @classmethod
    async def of(cls, family: Family, task: TaskSpec) -> Ceiling:
        return cls(family, None if family.readable else await family.walkthrough_of(task))

    def __call__(self, obs: str, shown: list[str], _rng: random.Random) -> int | None:
        self.on_path = True
        if self.pending is None:
            return self.family.read(obs, shown)
        if self.pending and self.pending[0] in shown:
            return shown.index(self.pending.pop(0))
        self.on_path = False
        return next((shown.index(w) for w in WAITS if w in shown), None)


async def habit_episode(
    family: Family,
    task: TaskSpec,
    key: str,
    habit: Habit,
    policy: PolicyConfig,
    on_step: Callable[[Observation, str, StepResult], None] | None = None,
    make_env: Callable[[], Environment] | None = None,
) -> str | None:
    """One episode of ``habit`` on ``task`` in a new environment (``make_env``, default the family's),
    its candidates shown in the order ``key`` draws and its rng seeded from ``key``; ``on_step(observation,
    action, result)`` sees every step. The outcome (None: the step cap ended it). The environment is closed."""
    rng, env = random.Random(episode_seed(key)), (make_env or family.make_env)()
    try:
        obs = await env.reset(task)
        for k in range(family.max_steps_cap):
            shown = [obs.candidates[j] for j in step_order(policy, key, k, len(obs.candidates))]
            pick = habit(obs.text, shown, rng) if shown else None
            action = shown[pick] if pick is not None else ""
            r = await env.step(action)
            if on_step is not None:
                on_step(obs, action, r)
            if r.done:
                return r.outcome
            obs = r.observation
    finally:
        await env.close()
    return None


async def ceiling_path(
    family: Family, task: TaskSpec, key: str, policy: PolicyConfig, make_env: Callable[[], Environment] | None = None
) -> list[PathStep]:
    """The states of the ceiling's episode ``key`` on ``task`` (in ``make_env``'s environment, default the
    family's) where it took its own action, each shown as the policy agent shows step ``k`` of that
    episode (``step_order(policy, key, k, …)``)."""
    out: list[PathStep] = []
    k = 0
    ceiling = await Ceiling.of(family, task)

    def keep(obs: Observation, action: str, _r: StepResult) -> None:
        nonlocal k
        order = step_order(policy, key, k, len(obs.candidates))
        k += 1
        shown = [obs.candidates[j] for j in order]
        if ceiling.on_path and action in shown:
            out.append(PathStep(obs, order, shown.index(action)))

    await habit_episode(family, task, key, ceiling, policy, keep, make_env)
    return out


async def choice_probs(
    client: Any, policy: PolicyConfig, s: PathStep, form: PromptForm
) -> tuple[list[float], int] | None:
    """The policy's probability of each shown candidate at ``s`` (its temperature, its prompt form) and the
    model version that answered; None when the client returns no choice distribution (a server
    without constrained log-probs)."""
    c, _, _ = await choose(
        client, policy, s.observation, list(s.observation.candidates), None, order=s.order, form=form
    )
    if c.choice_logprobs is None:
        return None
    return [math.exp(x) for x in c.choice_logprobs], c.model_version


def agreement(probs: list[float], pick: int) -> tuple[float, float]:
    """A state's agreement (pure): the probability of the ceiling's choice ``pick``, and 1.0 where it is
    the most probable choice (greedy agreement; the first of a tie)."""
    return probs[pick], float(max(range(len(probs)), key=probs.__getitem__) == pick)
