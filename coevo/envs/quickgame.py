"""The quick game: a tiny procedural text game that a model trained from scratch can learn on CPU.

A chain of rooms joined by doors, some locked (their key lies in the room before the door); the
goal is always to take the coin in the last room. Knobs: ``steps`` (shortest solution, 1..7),
``distractors`` (wrong keys and side rooms, some of them pits that lose the game), ``slack``
(extra steps allowed beyond the shortest solution) and ``hints`` (the next good action is shown).

The observation holds what a reading policy needs and nothing that names the answer: the way to the
coin room (its rooms in order), each exit's room and, when locked, the colour of its lock. ``read``
is a few lines that parse it and win every task: the ceiling of the held-out protocol.

Held-out protocol: train tasks (and every rewrite of one) stay within ``train_limits`` (at most 5
steps, 3 distractors) and use the train words (``ROOMS``, ``COLORS``); held-out tasks are longer (6..7
steps, up to 4 distractors) and use words training never shows (``HELDOUT_ROOMS``, ``HELDOUT_COLORS``).

Invariants: a task (seed + knobs + words) always builds the same world; the shortest solution has
exactly ``steps`` actions; candidates come in a stable order (verb, direction, colour): the policy
shuffles what it shows (``coevo.algorithm.prompts.shown_order``); the reference label of an action
is +1 iff it starts a shortest path to the goal from that state.

Two presets, registered as two families: ``quickgame`` (initial pool: 2..4 steps, 0..2 distractors,
one step of slack) and ``quickgame-hard`` (4..5 steps, 2..3 distractors, no slack), where outcome
rewards are sparse. They differ only in the pools: same game, knobs, precheck and rewrites.
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from coevo.envs.base import Environment, Family, Knob, Observation, PrecheckResult, StepResult
from coevo.errors import EnvError
from coevo.schemas import TaskSpec

DIRS = ("north", "south", "east", "west")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
COLORS = ("red", "blue", "green", "gold", "white")
ROOMS = ("hall", "kitchen", "cellar", "attic", "garden", "library", "study", "pantry", "tower", "yard")
HELDOUT_COLORS = ("black", "silver", "purple", "orange", "pink")
HELDOUT_ROOMS = ("vault", "gallery", "chapel", "forge", "cave", "loft", "porch", "den", "mill", "barn")
"""Words only held-out tasks use (``params.words = "heldout"``): no train task, rewrite or prompt shows them."""
WORDS = {"train": (ROOMS, COLORS), "heldout": (HELDOUT_ROOMS, HELDOUT_COLORS)}
VERBS = ("go", "take", "unlock")


@dataclass(frozen=True)
class Door:
    room: int
    direction: str
    to: int
    key: str | None  # colour of the key that unlocks it; None = open


@dataclass
class World:
    rooms: list[str]
    doors: list[Door]
    keys: dict[int, list[str]]  # room -> key colours lying there
    coin_room: int
    pits: set[int]
    max_steps: int
    solution: list[str] = field(default_factory=list)
    colors: tuple[str, ...] = COLORS
    """the palette its keys are drawn from, in its order (held colours are listed in it)"""

    def exits(self, room: int) -> list[Door]:
        return sorted((d for d in self.doors if d.room == room), key=lambda d: DIRS.index(d.direction))


@dataclass(frozen=True)
class State:
    room: int = 0
    held: frozenset[str] = frozenset()
    taken: frozenset[tuple[int, str]] = frozenset()
    unlocked: frozenset[tuple[int, str]] = frozenset()
    won: bool = False
    lost: bool = False


def _segments(total: int, rng: random.Random) -> list[int]:
    """Costs (1 = open door, 3 = locked door) summing to ``total``, at most 4 segments."""
    options: list[list[int]] = []

    def rec(left: int, acc: list[int]) -> None:
        if left == 0:
            options.append(acc)
            return
        if len(acc) == 4:
            return
        for c in (1, 3):
            if c <= left:
                rec(left - c, [*acc, c])

    rec(total, [])
    return rng.choice(options)


def build_world(seed: int, steps: int, distractors: int, slack: int, words: str = "train") -> World:
    if words not in WORDS:
        raise EnvError(f"quickgame: words {words!r} is not one of {sorted(WORDS)}")
    room_words, palette = WORDS[words]
    rng = random.Random(seed * 1_000_003 + steps * 101 + distractors * 7)
    segs = _segments(steps - 1, rng)
    names = rng.sample(room_words, len(room_words))
    colors = rng.sample(palette, len(palette))
    rooms = [names[0]]
    doors: list[Door] = []
    keys: dict[int, list[str]] = {}
    free: dict[int, list[str]] = {0: list(DIRS)}
    used_colors: list[str] = []
    solution: list[str] = []
    for cost in segs:
        here = len(rooms) - 1
        direction = rng.choice(free[here])
        free[here].remove(direction)
        there = len(rooms)
        rooms.append(names[there])
        free[there] = [d for d in DIRS if d != OPPOSITE[direction]]
        key = None
        if cost == 3:
            key = colors[len(used_colors)]
            used_colors.append(key)
            keys.setdefault(here, []).append(key)
            solution += [f"take {key} key", f"unlock {direction} door with {key} key"]
        doors.append(Door(here, direction, there, key))
        doors.append(Door(there, OPPOSITE[direction], here, key))
        solution.append(f"go {direction}")
    coin_room = len(rooms) - 1
    solution.append("take coin")
    pits: set[int] = set()
    spare = [c for c in colors if c not in used_colors]
    for i in range(distractors):
        if i % 2 == 1 and spare:  # a key that fits nothing
            keys.setdefault(rng.randrange(len(rooms)), []).append(spare.pop())
            continue
        hosts = [r for r in range(len(rooms)) if free.get(r) and r not in pits]
        if not hosts:
            if spare:
                keys.setdefault(rng.randrange(len(rooms)), []).append(spare.pop())
            continue
        host = rng.choice(hosts)
        direction = rng.choice(free[host])
        free[host].remove(direction)
        side = len(rooms)
        rooms.append(names[side])
        free[side] = []
        doors.append(Door(host, direction, side, None))
        doors.append(Door(side, OPPOSITE[direction], host, None))
        if i % 4 == 0:  # the first and fifth side rooms are pits: entering them loses
            pits.add(side)
    for r in keys:
        keys[r].sort(key=palette.index)
    return World(rooms, doors, keys, coin_room, pits, steps + slack, solution, palette)


def candidates(world: World, s: State) -> list[str]:
    out = [f"go {d.direction}" for d in world.exits(s.room)]
    out += [f"take {c} key" for c in world.keys.get(s.room, []) if (s.room, c) not in s.taken]
    if s.room == world.coin_room:
        out.append("take coin")
    for d in world.exits(s.room):
        if d.key is not None and (s.room, d.direction) not in s.unlocked:
            out += [f"unlock {d.direction} door with {c} key" for c in sorted(s.held, key=world.colors.index)]
    return out


def transition(world: World, s: State, action: str) -> tuple[State, str]:
    """The next state and the feedback text. Unknown actions waste the step."""
    words = action.split()
    if words[:1] == ["go"] and len(words) == 2:
        for d in world.exits(s.room):
            if d.direction == words[1]:
                if d.key is not None and (s.room, d.direction) not in s.unlocked:
                    return s, "the door is locked."
                lost = d.to in world.pits
                nxt = State(d.to, s.held, s.taken, s.unlocked, lost=lost)
                return nxt, ("you fall into a pit." if lost else f"you go {d.direction}.")
        return s, "you cannot go that way."
    if action == "take coin" and s.room == world.coin_room:
        return State(s.room, s.held, s.taken, s.unlocked, won=True), "you take the coin."
    if words[:1] == ["take"] and len(words) == 3 and words[2] == "key":
        color = words[1]
        if color in world.keys.get(s.room, []) and (s.room, color) not in s.taken:
            return State(
                s.room, s.held | {color}, s.taken | {(s.room, color)}, s.unlocked
            ), f"you take the {color} key."
        return s, "there is no such key here."
    if words[:1] == ["unlock"] and len(words) == 6:
        direction, color = words[1], words[4]
        for d in world.exits(s.room):
            if d.direction == direction and d.key is not None and color in s.held:
                if d.key != color:
                    return s, "the key does not fit."
                unlocked = s.unlocked | {(s.room, direction), (d.to, OPPOSITE[direction])}
                return State(s.room, s.held, s.taken, unlocked), f"you unlock the {direction} door."
        return s, "you cannot unlock that."
    return s, "nothing happens."


def distance_to_win(world: World, start: State, limit: int = 40) -> int | None:
    """Length of the shortest winning action sequence from ``start`` (None if none)."""
    if start.won:
        return 0
    seen = {start}
    frontier: deque[tuple[State, int]] = deque([(start, 0)])
    while frontier:
        s, d = frontier.popleft()
        if d >= limit:
            continue
        for a in candidates(world, s):
            n, _ = transition(world, s, a)
            if n.won:
                return d + 1
            if n.lost or n in seen:
                continue
            seen.add(n)
            frontier.append((n, d + 1))
    return None


def describe(world: World, s: State, steps_left: int, hint: str | None) -> str:
    items = [f"{c} key" for c in world.keys.get(s.room, []) if (s.room, c) not in s.taken]
    if s.room == world.coin_room:
        items.append("coin")
    exits = []
    for d in world.exits(s.room):
        locked = d.key is not None and (s.room, d.direction) not in s.unlocked
        exits.append(f"{d.direction} {world.rooms[d.to]}{f' locked {d.key}' if locked else ''}")
    held = ", ".join(f"{c} key" for c in sorted(s.held, key=world.colors.index)) or "nothing"
    way = ", ".join(world.rooms[: world.coin_room + 1])  # the main path's rooms are the first ones built
    text = (
        f"goal: take the coin in the {world.rooms[world.coin_room]}; the way: {way}. "
        f"room: {world.rooms[s.room]}. items: {', '.join(items) or 'none'}. "
        f"carry: {held}. exits: {', '.join(exits) or 'none'}. steps left: {steps_left}."
    )
    if hint:
        text += f" hint: {hint}."
    return text


_WAY = re.compile(r"the way: ([^.]*)\.")
_ROOM = re.compile(r"room: (\w+)\.")
_CARRY = re.compile(r"carry: ([^.]*)\.")
_EXITS = re.compile(r"exits: ([^.]*)\.")


def read(observation: str, shown: list[str]) -> int | None:
    """The scripted reader: the index in ``shown`` of the action a policy that reads ``observation``
    takes (no learning, no memory): take the coin when it lies here; else head for the next room of
    the way (back onto the way from a side room), unlocking its door with the key of the lock's
    colour, taking that key first. None when the text is not a quick-game observation."""
    way, room, carry, exits = (p.search(observation) for p in (_WAY, _ROOM, _CARRY, _EXITS))
    if way is None or room is None or carry is None or exits is None:
        return None
    if "take coin" in shown:
        return shown.index("take coin")
    rooms = way.group(1).split(", ")
    here = room.group(1)
    target = rooms[rooms.index(here) + 1] if here in rooms[:-1] else None
    for exit_ in exits.group(1).split(", "):
        words = exit_.split()
        if len(words) < 2 or not (words[1] == target or (target is None and words[1] in rooms)):
            continue
        action = f"go {words[0]}"
        if len(words) == 4:  # "<direction> <room> locked <colour>"
            key = words[3]
            held = f"{key} key" in carry.group(1)
            action = f"unlock {words[0]} door with {key} key" if held else f"take {key} key"
        return shown.index(action) if action in shown else None
    return None


class QuickGameEnv(Environment):
    def __init__(self) -> None:
        self.world: World | None = None
        self.state = State()
        self.steps = 0
        self.hints = False
        self.done = True

    async def reset(self, task: TaskSpec) -> Observation:
        self.world = world_of(task)
        self.state = State()
        self.steps = 0
        self.hints = bool(QuickGame().knobs_of(task)["hints"])
        self.done = False
        return self._observe("")

    def _best_action(self) -> str | None:
        assert self.world is not None
        best, best_d = None, None
        for a in candidates(self.world, self.state):
            n, _ = transition(self.world, self.state, a)
            if n.lost:
                continue
            d = 0 if n.won else distance_to_win(self.world, n)
            if d is not None and (best_d is None or d < best_d):
                best, best_d = a, d
        return best

    def _observe(self, feedback: str) -> Observation:
        assert self.world is not None
        hint = self._best_action() if self.hints else None
        text = describe(self.world, self.state, self.world.max_steps - self.steps, hint)
        return Observation(
            text=(feedback + " " + text).strip(),
            candidates=candidates(self.world, self.state),
            objective="take the coin",
        )

    async def step(self, action: str) -> StepResult:
        if self.done or self.world is None:
            raise EnvError("step after the episode ended (call reset)")
        before = distance_to_win(self.world, self.state)
        nxt, feedback = transition(self.world, self.state, action)
        after = 0 if nxt.won else (None if nxt.lost else distance_to_win(self.world, nxt))
        label: Literal[1, -1] = 1 if before is not None and after is not None and after == before - 1 else -1
        self.state = nxt
        self.steps += 1
        outcome: Literal["won", "lost", "truncated"] | None = None
        if nxt.won:
            outcome = "won"
        elif nxt.lost:
            outcome = "lost"
        elif self.steps >= self.world.max_steps:
            outcome = "truncated"
        self.done = outcome is not None
        obs = self._observe(feedback)
        return StepResult(obs, self.done, outcome, label, {"feedback": feedback})


def world_of(task: TaskSpec) -> World:
    k = QuickGame().knobs_of(task)
    seed, words = int(task.params.get("seed", 0)), str(task.params.get("words", "train"))
    return build_world(seed, k["steps"], k["distractors"], k["slack"], words)


class QuickGame(Family):
    name = "quickgame"
    starts_from_knobs = True
    knobs = (
        Knob("steps", 1, 7, harder=1),
        Knob("distractors", 0, 5, harder=1),
        Knob("slack", 0, 3, harder=-1),
        Knob("hints", 0, 1, harder=-1),
    )
    max_steps_cap = 10
    train_limits: ClassVar[dict[str, tuple[int, int]]] = {"steps": (1, 5), "distractors": (0, 3)}
    """No train task nor rewrite reaches the held-out region (6..7 steps)."""

    def make_env(self) -> QuickGameEnv:
        return QuickGameEnv()

    initial_knobs: ClassVar[dict[str, tuple[int, int]]] = {
        "steps": (2, 4),
        "distractors": (0, 2),
        "slack": (1, 1),
        "hints": (0, 0),
    }
    """The initial train pool draws each knob uniformly from this range (the rewriter then moves train tasks)."""
    heldout_knobs: ClassVar[dict[str, tuple[int, int]]] = {
        "steps": (6, 7),
        "distractors": (2, 4),
        "slack": (2, 2),
        "hints": (0, 0),
    }
    """Held-out tasks: longer than any train task can become (and up to 4 distractors), in the held-out
    words; two steps of slack, so that a reading policy's one slip is not the end (random play: ~0.02)."""
    id_prefix: ClassVar[str] = "qg"
    readable: ClassVar[bool] = True

    def read(self, observation: str, shown: list[str]) -> int | None:
        return read(observation, shown)

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        train = self.drawn_pool(self.start_ranges(self.initial_knobs), self.id_prefix, n_train, 0, seed)
        heldout = self.drawn_pool(self.heldout_knobs, self.id_prefix, 0, n_heldout, seed + 1_000_003)
        return train + [
            t.model_copy(update={"task_id": f"{self.id_prefix}-h{i}", "params": {**t.params, "words": "heldout"}})
            for i, t in enumerate(heldout)
        ]

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        try:
            world = world_of(task)
        except (EnvError, ValueError, TypeError) as exc:
            return PrecheckResult(False, f"does not build: {exc}")
        d = distance_to_win(world, State())
        if d is None or d > world.max_steps:
            return PrecheckResult(False, f"unsolvable within {world.max_steps} steps", d)
        return PrecheckResult(True, "", d)

    def walkthrough(self, task: TaskSpec) -> list[str]:
        return world_of(task).solution


class QuickGameHard(QuickGame):
    """The quick game's hard preset (family ``quickgame-hard``): the same game and knobs, an initial pool
    of longer solutions (4..5 actions), more distractors (2..3) and no slack, so a policy that plays at
    random wins about 3 % of its episodes (the default pool: about 20 %) and outcome rewards are sparse:
    most groups of 8 trajectories hold no success at all."""

    name = "quickgame-hard"
    initial_knobs: ClassVar[dict[str, tuple[int, int]]] = {
        "steps": (4, 5),
        "distractors": (2, 3),
        "slack": (0, 0),
        "hints": (0, 0),
    }
    heldout_knobs: ClassVar[dict[str, tuple[int, int]]] = {**QuickGame.heldout_knobs, "slack": (1, 1)}
    id_prefix: ClassVar[str] = "qgh"
