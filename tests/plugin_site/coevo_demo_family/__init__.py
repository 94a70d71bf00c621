"""A task family shipped by a separate distribution (``coevo-demo-family``), found by coevo through
its entry point in the group ``coevo.families`` (see the ``.dist-info`` next to this package).

The counter game: reach ``target`` exactly by adding 1 or 2; going past it loses. Knobs: ``target``
(harder when larger) and ``hints`` (the good move is shown). Random play wins about two times in
three at target 3, so groups carry both outcomes.
"""

from __future__ import annotations

import random
from typing import Literal

from coevo.envs.base import Environment, Family, Knob, Observation, PrecheckResult, StepResult
from coevo.errors import EnvError
from coevo.schemas import TaskSpec

ACTIONS = ["add 1", "add 2"]


class CounterEnv(Environment):
    def __init__(self) -> None:
        self.target, self.value, self.hints, self.done = 0, 0, False, True

    def _observe(self, feedback: str = "") -> Observation:
        text = f"{feedback} the counter is {self.value}; the target is {self.target}.".strip()
        if self.hints:
            text += f" hint: {self._best()}."
        return Observation(text, list(ACTIONS), objective=f"make the counter exactly {self.target}")

    def _best(self) -> str:
        return "add 2" if self.target - self.value >= 2 else "add 1"

    async def reset(self, task: TaskSpec) -> Observation:
        knobs = CounterFamily().knobs_of(task)
        self.target, self.hints, self.value, self.done = knobs["target"], bool(knobs["hints"]), 0, False
        return self._observe()

    async def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvError("step after the episode ended (call reset)")
        label: Literal[1, -1] = 1 if action == self._best() else -1
        if action in ACTIONS:
            self.value += ACTIONS.index(action) + 1
        outcome: Literal["won", "lost"] | None = None
        if self.value == self.target:
            outcome = "won"
        elif self.value > self.target:
            outcome = "lost"
        self.done = outcome is not None
        return StepResult(self._observe(f"you {action}."), self.done, outcome, label)


class CounterFamily(Family):
    name = "demo-counter"
    knobs = (Knob("target", 2, 9, harder=1), Knob("hints", 0, 1, harder=-1))
    max_steps_cap = 10

    def make_env(self) -> CounterEnv:
        return CounterEnv()

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        rng = random.Random(seed)
        return [
            TaskSpec(
                task_id=f"counter-{'t' if i < n_train else 'h'}{i}",
                family=self.name,
                knobs={"target": rng.randint(3, 4), "hints": 0},
                split="train" if i < n_train else "heldout",
            )
            for i in range(n_train + n_heldout)
        ]

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        try:
            knobs = self.knobs_of(task)
        except EnvError as exc:
            return PrecheckResult(False, str(exc))
        return PrecheckResult(True, "", (knobs["target"] + 1) // 2)


def not_a_family(cfg: object) -> object:
    """Registered as ``demo-broken``: a factory that returns something else (a clear error)."""
    return object()
