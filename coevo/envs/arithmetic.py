"""Word problems: a family where the model's language matters, and every step can be checked.

A story of ``ops`` operations on one pile (``Mia has 17 shells. She finds 25 more. ...``), told one
sentence per step; at each step the policy chooses how many there are now among candidate numbers
(the right count and ``distractors`` wrong ones: off by one, the operation reversed or forgotten).
A wrong count loses the episode; the last right count wins it.

Knobs: ``ops`` (1..5 operations), ``digits`` (1..3: the size of the numbers), ``distractors``
(1..5 wrong candidates per step), ``hints`` (0/1: the sentence is followed by its equation, e.g.
``(17 + 25 = ?)``).

Invariants: a task (seed + knobs) always builds the same story and the same candidates in the same
order; every count stays non-negative; the right count is among the candidates exactly once and
every candidate is distinct; the reference label of an answer is +1 iff it is the right count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from coevo.envs.base import Environment, Family, Knob, Observation, PrecheckResult, StepResult
from coevo.errors import EnvError
from coevo.schemas import TaskSpec

NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben")
ITEMS = ("shells", "apples", "coins", "stamps", "marbles", "books", "cards", "pens")
Op = Literal["add", "sub", "mul"]


@dataclass(frozen=True)
class Move:
    op: Op
    n: int

    def apply(self, value: int) -> int:
        return value + self.n if self.op == "add" else value - self.n if self.op == "sub" else value * self.n

    def undo(self, value: int) -> int:
        """The operation reversed: the slip of a reader who got the verb backwards."""
        return value - self.n if self.op == "add" else value + self.n if self.op == "sub" else value // self.n

    def sentence(self, who: str, item: str) -> str:
        if self.op == "add":
            return f"{who} finds {self.n} more {item}."
        if self.op == "sub":
            return f"{who} gives {self.n} {item} to a friend."
        return f"{who}'s pile of {item} becomes {self.n} times as big."

    def equation(self, value: int) -> str:
        return f"({value} {'+' if self.op == 'add' else '-' if self.op == 'sub' else 'x'} {self.n} = ?)"


@dataclass(frozen=True)
class Problem:
    who: str
    item: str
    start: int
    moves: tuple[Move, ...]
    choices: tuple[tuple[int, ...], ...]
    """The candidates of each step, in the order shown."""

    def counts(self) -> list[int]:
        """The right count after each move."""
        out, value = [], self.start
        for m in self.moves:
            value = m.apply(value)
            out.append(value)
        return out


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 2, 10**digits - 1)


def build_problem(seed: int, ops: int, digits: int, distractors: int) -> Problem:
    rng = random.Random(seed * 7_919 + ops * 131 + digits * 17 + distractors)
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = start = _number(rng, digits)
    moves: list[Move] = []
    choices: list[tuple[int, ...]] = []
    for _ in range(ops):
        kinds: list[Op] = ["add", "sub", "mul"] if value <= 10**digits else ["add", "sub"]
        op = rng.choice(kinds)
        n = rng.randint(2, 4) if op == "mul" else _number(rng, digits)
        if op == "sub" and n > value:
            op = "add"
        move = Move(op, n)
        right = move.apply(value)
        slips = [right + 1, right - 1, move.undo(value), value, right + 10, right - 10, right + 2, right - 2]
        slips += [right + 3, right + 5, right + 20]  # enough non-negative slips near 0 too
        wrong = list(dict.fromkeys(s for s in slips if s >= 0 and s != right))
        k = min(distractors, len(wrong))
        shown = [right, *wrong[:k]]
        rng.shuffle(shown)
        moves.append(move)
        choices.append(tuple(shown))
        value = right
    return Problem(who, item, start, tuple(moves), tuple(choices))


def describe(problem: Problem, step: int, value: int, hints: bool) -> str:
    move = problem.moves[step]
    story = f"{problem.who} has {value} {problem.item}. {move.sentence(problem.who, problem.item)}"
    hint = f" {move.equation(value)}" if hints else ""
    return f"{story}{hint} How many {problem.item} does {problem.who} have now?"


class ArithmeticEnv(Environment):
    def __init__(self) -> None:
        self.problem: Problem | None = None
        self.step_index = 0
        self.value = 0
        self.hints = False
        self.done = True

    async def reset(self, task: TaskSpec) -> Observation:
        k = Arithmetic().knobs_of(task)
        self.problem = build_problem(int(task.params.get("seed", 0)), k["ops"], k["digits"], k["distractors"])
        self.step_index, self.value, self.hints, self.done = 0, self.problem.start, bool(k["hints"]), False
        return self._observe("")

    def _observe(self, feedback: str) -> Observation:
        assert self.problem is not None
        if self.done:
            return Observation(text=feedback, candidates=[], objective=self.objective)
        text = describe(self.problem, self.step_index, self.value, self.hints)
        return Observation(
            text=(feedback + " " + text).strip(),
            candidates=[str(c) for c in self.problem.choices[self.step_index]],
            objective=self.objective,
        )

    @property
    def objective(self) -> str:
        assert self.problem is not None
        return f"count how many {self.problem.item} {self.problem.who} has after each sentence"

    async def step(self, action: str) -> StepResult:
        if self.done or self.problem is None:
            raise EnvError("step after the episode ended (call reset)")
        right = self.problem.moves[self.step_index].apply(self.value)
        ok = action.strip() == str(right)
        outcome: Literal["won", "lost"] | None = None
        if not ok:
            outcome, feedback = "lost", f"Wrong: {self.problem.who} has {right} {self.problem.item}, not {action}."
        else:
            self.step_index, self.value = self.step_index + 1, right
            feedback = f"Right: {right}."
            if self.step_index == len(self.problem.moves):
                outcome = "won"
        self.done = outcome is not None
        return StepResult(self._observe(feedback), self.done, outcome, 1 if ok else -1, {"feedback": feedback})


class Arithmetic(Family):
    name = "arithmetic"
    knobs = (
        Knob("ops", 1, 5, harder=1),
        Knob("digits", 1, 3, harder=1),
        Knob("distractors", 1, 5, harder=1),
        Knob("hints", 0, 1, harder=-1),
    )
    max_steps_cap = 5
    initial_knobs: ClassVar[dict[str, tuple[int, int]]] = {
        "ops": (1, 2),
        "digits": (1, 1),
        "distractors": (1, 2),
        "hints": (0, 1),
    }
    """The initial pool draws each knob uniformly from this range (the rewriter then moves train tasks).
    Sized for SmolLM2-135M-Instruct in choice mode: on 2..3 operations of 1..2 digits among 3..4
    candidates it won 0.06 of 64 episodes (chance level), so the pool starts where chance wins about a
    quarter and there is room both ways."""

    def make_env(self) -> ArithmeticEnv:
        return ArithmeticEnv()

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        return self.drawn_pool(self.initial_knobs, "ar", n_train, n_heldout, seed)

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        try:
            k = self.knobs_of(task)
            problem = build_problem(int(task.params.get("seed", 0)), k["ops"], k["digits"], k["distractors"])
        except (EnvError, ValueError, TypeError) as exc:
            return PrecheckResult(False, f"does not build: {exc}")
        for right, shown in zip(problem.counts(), problem.choices, strict=True):
            if right < 0 or shown.count(right) != 1 or len(set(shown)) != len(shown):
                return PrecheckResult(False, f"step candidates {shown} do not hold the count {right} exactly once")
        return PrecheckResult(True, "", len(problem.moves))

    def walkthrough(self, task: TaskSpec) -> list[str]:
        k = self.knobs_of(task)
        return [
            str(c)
            for c in build_problem(int(task.params.get("seed", 0)), k["ops"], k["digits"], k["distractors"]).counts()
        ]
