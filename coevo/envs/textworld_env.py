"""TextWorld games (the engine ALFWorld is built on), compiled offline and cached by spec hash.

Knobs: ``quest_length`` (walkthrough length), ``objects`` (objects in the world, most of them
distractors), ``rooms`` (world size), ``hints`` (1: the objective spells out every step; 0:
only the final goal) and ``goal`` (the same world with a quest about a commoner or rarer object). Candidates are the admissible commands in sorted order; the reference
label of an action is +1 iff it is the first command of the winning policy from that state.

Invariants: the same spec always compiles to the same game, and compiles only once per cache
directory (written to a temporary directory, then renamed into place); a step budget of
``max_steps_factor × quest_length`` ends a game as ``truncated``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from coevo.envs.base import EnvError, Environment, Family, Knob, Observation, PrecheckResult, StepResult, spec_hash
from coevo.schemas import TaskSpec

if TYPE_CHECKING:
    from coevo.config import EnvConfig

# TextWorld's own games are not in jericho's list of known games; the warning says nothing useful.
warnings.filterwarnings("ignore", message=r".*is not fully supported\. Score, move, change detection")


GOAL_CHOICES = 3
"""The ``goal`` knob picks, in the same world, one of this many quests ranked from the commonest goal
object (0: the most entities of its type in the world) to the rarest."""

_COMPILE_LOCK = threading.Lock()
_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None


async def _tw(fn: Any, *args: Any) -> Any:
    """Run a TextWorld call on the one thread that may touch TextWorld in this process: its game
    generator, its logic parser and jericho's emulator are not thread-safe (concurrent use
    corrupts parsing and crashes the process)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="textworld")
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)


def default_cache_dir() -> Path:
    return Path(os.environ.get("COEVO_CACHE_DIR", Path.home() / ".cache" / "coevo"))


async def walkthrough_wins(family: Any, task: TaskSpec) -> PrecheckResult:
    """A TextWorld family's precheck: compile ``task``'s game and replay its walkthrough (the family's
    ``walkthrough``) in the family's environment (``make_env``) to a win within its step budget."""
    try:
        walkthrough = await _tw(family.walkthrough, task)
        env = family.make_env()
        await env.reset(task)
        result = None
        for cmd in walkthrough:
            result = await env.step(cmd)
        await env.close()
    except EnvError as exc:
        return PrecheckResult(False, str(exc))
    if result is None or result.outcome != "won":
        return PrecheckResult(False, "walkthrough does not win", len(walkthrough))
    return PrecheckResult(True, "", len(walkthrough))


class TextWorld(Family):
    name = "textworld"
    knobs = (
        Knob("quest_length", 1, 8, harder=1),
        Knob("objects", 2, 16, harder=1),
        Knob("rooms", 1, 8, harder=1),
        Knob("hints", 0, 1, harder=-1),
        Knob("goal", 0, GOAL_CHOICES - 1, harder=1),
    )
    max_steps_cap = 50

    def __init__(self, cache_dir: Path | None = None, max_steps_factor: float = 3.0) -> None:
        self.cache_dir = Path(cache_dir or default_cache_dir()) / "textworld"
        self.max_steps_factor = max_steps_factor
        self.compiled = 0  # games compiled by this process (the rest came from the cache)

    def max_steps(self, task: TaskSpec) -> int:
        return min(self.max_steps_cap, int(self.max_steps_factor * self.knobs_of(task)["quest_length"]) + 2)

    def game_path(self, task: TaskSpec) -> Path:
        """The compiled game for ``task``, compiling it if the cache does not have it."""
        knobs = self.knobs_of(task)
        seed = int(task.params.get("seed", 0))
        key = spec_hash(self.name, {"seed": seed}, knobs)[:20]
        final = self.cache_dir / key
        game = final / "game.z8"
        if game.exists():
            return game
        with _COMPILE_LOCK:  # TextWorld's generator keeps global state: one compilation at a time
            if game.exists():
                return game
            return self._compile(task, knobs, seed, key, final, game)

    def _compile(self, task: TaskSpec, knobs: dict[str, int], seed: int, key: str, final: Path, game: Path) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.cache_dir))
        try:
            from textworld import GameOptions
            from textworld.generator import compile_game, make_game

            candidates = []
            for q in range(GOAL_CHOICES):  # same map, objects and grammar; another quest each time
                options = GameOptions()
                options.seeds = {"map": seed, "objects": seed, "grammar": seed, "quest": seed * GOAL_CHOICES + q}
                options.nb_rooms = knobs["rooms"]
                options.nb_objects = knobs["objects"]
                options.quest_length = knobs["quest_length"]
                options.grammar.only_last_action = not knobs["hints"]
                options.path = str(tmp / "game.z8")
                options.force_recompile = True
                made = make_game(options)
                candidates.append((-goal_commonness(made), q, made, options))
            candidates.sort(key=lambda c: (c[0], c[1]))  # commonest goal object first
            _, _, made, options = candidates[knobs["goal"]]
            compile_game(made, options)
            self.compiled += 1
            try:
                os.rename(tmp, final)
            except OSError:  # another process won the race: use theirs
                if not game.exists():
                    raise
        except Exception as exc:
            raise EnvError(f"textworld: cannot build {task.task_id}: {exc!r}") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return game

    def make_env(self) -> TextWorldEnv:
        return TextWorldEnv(self)

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        import random

        rng = random.Random(seed)
        out = []
        for i in range(n_train + n_heldout):
            split: Literal["train", "heldout"] = "train" if i < n_train else "heldout"
            knobs = {
                "quest_length": rng.randint(2, 4),
                "objects": rng.randint(3, 6),
                "rooms": rng.randint(1, 3),
                "hints": 1,
            }
            out.append(
                TaskSpec(
                    task_id=f"tw-{split[0]}{i}",
                    family=self.name,
                    params={"seed": rng.randrange(1_000_000)},
                    knobs=knobs,
                    split=split,
                )
            )
        return out

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        """Compile the game and replay its walkthrough to a win."""
        return await walkthrough_wins(self, task)

    async def walkthrough_of(self, task: TaskSpec) -> list[str]:
        """On TextWorld's one thread (``_tw``): it may compile the game and start an emulator."""
        return list(await _tw(self.walkthrough, task))

    def walkthrough(self, task: TaskSpec) -> list[str]:
        import textworld

        env = textworld.start(str(self.game_path(task)), request_infos=textworld.EnvInfos(policy_commands=True))
        try:
            return list(env.reset()["policy_commands"])
        finally:
            env.close()


def goal_object(game: Any) -> Any:
    """The entity the quest's winning command is about (its first argument), or None."""
    try:
        action = game.quests[0].win_events[0].actions[-1]
    except (IndexError, AttributeError):
        return None
    things = [v for v in action.variables if v.type not in ("P", "I", "r", "d")]  # not player, rooms, doors
    portable = [v for v in things if v.type in ("o", "f", "k")]  # the thing carried, eaten or used
    return (portable or things or [None])[0]


def goal_commonness(game: Any) -> int:
    """How many entities of the goal object's type the world holds (more = easier to confuse less)."""
    goal = goal_object(game)
    if goal is None:
        return 0
    return sum(1 for info in game.infos.values() if info.type == goal.type)


class TextWorldEnv(Environment):
    def __init__(self, family: TextWorld) -> None:
        self.family = family
        self._env: Any = None
        self._state: Any = None
        self.steps = 0
        self.limit = 0
        self.done = True

    async def reset(self, task: TaskSpec) -> Observation:
        import textworld

        path = await _tw(self.family.game_path, task)
        await self.close()
        infos = textworld.EnvInfos(
            admissible_commands=True,
            objective=True,
            policy_commands=True,
            won=True,
            lost=True,
            description=True,
            inventory=True,
        )
        self._env = await _tw(lambda: textworld.start(str(path), request_infos=infos))
        self._state = await _tw(self._env.reset)
        self.steps = 0
        self.limit = self.family.max_steps(task)
        self.done = False
        s = self._state
        return Observation(
            text=f"{s['objective'].strip()}\n{s['description'].strip()}",
            candidates=sorted(s["admissible_commands"]),
            objective=s["objective"].strip(),
        )

    async def step(self, action: str) -> StepResult:
        if self.done or self._env is None:
            raise EnvError("step after the episode ended (call reset)")
        policy = list(self._state["policy_commands"] or [])
        label: Literal[1, -1] = 1 if policy and action == policy[0] else -1
        self._state, _, game_over = await _tw(self._env.step, action)
        self.steps += 1
        s = self._state
        outcome: Literal["won", "lost", "truncated"] | None = None
        if s["won"]:
            outcome = "won"
        elif s["lost"]:
            outcome = "lost"
        elif game_over or self.steps >= self.limit:
            outcome = "truncated"
        self.done = outcome is not None
        obs = Observation(
            text=s.feedback.strip(), candidates=sorted(s["admissible_commands"] or []), objective=s["objective"].strip()
        )
        return StepResult(obs, self.done, outcome, label, {"policy": policy})

    async def close(self) -> None:
        if self._env is not None:
            env, self._env = self._env, None
            await _tw(env.close)


def family(cfg: EnvConfig) -> TextWorld:
    """The ``textworld`` entry point of ``coevo.families``: games compiled into ``env.cache_dir``."""
    return TextWorld(cfg.cache_dir)
