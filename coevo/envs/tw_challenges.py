"""TextWorld's own challenge games (``textworld.challenges``) as task families, for a held-out protocol.

- ``tw-coin_collector``: knobs ``length`` (rooms on the chain to the coin: the walkthrough's length)
  and ``distractors`` (dead-end rooms per chain room); TextWorld's level is ``100 × distractors + length``.
  Train: length 1..10; held-out: length 11..20.
- ``tw-treasure_hunter``: knob ``level`` 1..20 (1..10 easy: 5 rooms, no doors; 11..20 medium: 10 rooms,
  closed doors and containers; the hard levels 21..30 are left out, generating one can take minutes).
  Train: 1..10; held-out: 11..20.
- ``tw-cooking``: knobs ``recipe`` (ingredients, 1..3), ``take`` (of them to find, at most ``recipe``),
  ``rooms`` (0..3: 1, 6, 9 or 12 rooms) and the skills ``open``, ``cook``, ``cut`` (0/1). Train: recipe
  1..2, take 0..2, rooms 0..1, foods of TextWorld's train split; held-out: recipe 3, take 1..3, rooms
  2..3, foods of its test split (foods, and preparations of train foods, no train game has).

Play is ``TextWorldEnv``'s: candidates are the admissible commands in sorted order, nothing stripped; the
reference label of an action is +1 iff it is the first command of the winning policy from that state.

Invariants: the same spec (seed, knobs, and for cooking the food split its ``TaskSpec.split`` names)
always compiles to the same game, and only once per cache directory (a temporary directory renamed
into place, one compilation at a time, every TextWorld call on ``textworld_env``'s one thread); a seed
that cannot make the game moves on to derived seeds in a fixed order, so a spec still names one game;
``train_limits`` bound every train task and each of its rewrites, and every held-out task lies outside
them; a step budget of ``max_steps_factor × walkthrough length + 2`` (at most ``max_steps_cap``) ends a
game as ``truncated``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from coevo.envs.base import EnvError, Family, Knob, PrecheckResult, spec_hash
from coevo.envs.textworld_env import _COMPILE_LOCK, TextWorldEnv, _tw, default_cache_dir, walkthrough_wins
from coevo.errors import ConfigError
from coevo.schemas import TaskSpec

if TYPE_CHECKING:
    from coevo.config import EnvConfig

CONSISTENT_DRAWS = 1000
"""knob draws a task may take to find consistent knobs (cooking: no more to find than the recipe holds)"""
SEED_ATTEMPTS = 8
SEED_STRIDE = 1_000_003
"""A spec's seed ``s`` makes its game from ``s``, else ``s + k × SEED_STRIDE`` for the first k that can
(TextWorld fails on some seeds: no quest of that length fits the map, no food fits the skills)."""


class ChallengeFamily(Family):
    """One ``textworld.challenges`` game; subclasses name it and map knobs to its settings."""

    starts_from_knobs = True

    challenge: ClassVar[str]
    id_prefix: ClassVar[str]
    heldout_ranges: ClassVar[dict[str, tuple[int, int]]]
    """Where held-out tasks are drawn (train tasks: within ``train_limits``, else the knob's bounds)."""

    def __init__(self, cache_dir: Path | None = None, max_steps_factor: float = 3.0) -> None:
        self.cache_dir = Path(cache_dir or default_cache_dir()) / self.name
        self.max_steps_factor = max_steps_factor
        self.compiled = 0  # games compiled by this process (the rest came from the cache)

    def settings(self, knobs: dict[str, int], split: str) -> dict[str, Any]:
        """The challenge's ``make`` settings for these knobs (and, for cooking, the task's split)."""
        raise NotImplementedError

    def consistent(self, knobs: dict[str, int]) -> bool:
        """Whether knobs that each lie within bounds also agree with one another."""
        return True

    def game_path(self, task: TaskSpec) -> Path:
        """The compiled game for ``task``, compiling it if the cache does not have it."""
        settings = self.settings(self.knobs_of(task), task.split)
        seed = int(task.params.get("seed", 0))
        key = spec_hash(self.name, {"seed": seed, **settings}, {})[:20]
        final = self.cache_dir / key
        game = final / "game.z8"
        if game.exists():
            return game
        with _COMPILE_LOCK:  # TextWorld's generator keeps global state: one compilation at a time
            if game.exists():
                return game
            return self._compile(task, settings, seed, key, final, game)

    def _compile(self, task: TaskSpec, settings: dict[str, Any], seed: int, key: str, final: Path, game: Path) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.cache_dir))
        try:
            import textworld
            from textworld.generator import compile_game

            with warnings.catch_warnings():  # many rooms, few names: TextWorld adds adjectives and says so
                warnings.simplefilter("ignore", textworld.GenerationWarning)
                made, options = self._generate(settings, seed, tmp / "game.z8")
                compile_game(made, options)
            env = textworld.start(options.path, request_infos=textworld.EnvInfos(policy_commands=True))
            try:
                walkthrough = list(env.reset()["policy_commands"])
            finally:
                env.close()
            (tmp / "walkthrough.json").write_text(json.dumps(walkthrough))
            self.compiled += 1
            try:
                os.rename(tmp, final)
            except OSError:  # another process won the race: use theirs
                if not game.exists():
                    raise
        except Exception as exc:
            raise EnvError(f"{self.name}: cannot build {task.task_id}: {exc!r}") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return game

    def _generate(self, settings: dict[str, Any], seed: int, path: Path) -> tuple[Any, Any]:
        """The challenge's game from ``seed``, else from the first derived seed that makes one."""
        from textworld import GameOptions
        from textworld.challenges import CHALLENGES
        from textworld.generator import QuestGenerationError

        make = CHALLENGES[self.challenge][1]
        failure: Exception | None = None
        for attempt in range(SEED_ATTEMPTS):
            options = GameOptions()
            options.seeds = seed + attempt * SEED_STRIDE
            options.path = str(path)
            options.force_recompile = True
            try:
                return make(dict(settings), options), options
            except (QuestGenerationError, ValueError) as exc:  # this seed cannot make this game
                failure = exc
        raise EnvError(f"no game in {SEED_ATTEMPTS} seeds, last: {failure!r}")

    async def walkthrough_of(self, task: TaskSpec) -> list[str]:
        """On TextWorld's one thread (``_tw``): it may compile the game and start an emulator."""
        return list(await _tw(self.walkthrough, task))

    def walkthrough(self, task: TaskSpec) -> list[str]:
        """The winning policy from the start, recorded when the game was compiled (compiles it if needed)."""
        return list(json.loads((self.game_path(task).parent / "walkthrough.json").read_text()))

    def max_steps(self, task: TaskSpec) -> int:
        return min(self.max_steps_cap, int(self.max_steps_factor * len(self.walkthrough(task))) + 2)

    def make_env(self) -> ChallengeEnv:
        return ChallengeEnv(self)

    def apply(self, task: TaskSpec, operator: str) -> TaskSpec | None:
        child = super().apply(task, operator)
        return child if child is None or self.consistent(child.knobs) else None

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        """Train tasks drawn within ``start_ranges`` (the train limits, or ``env.start_knobs``), held-out
        ones within ``heldout_ranges``, each split from its own draw: the held-out tasks of a seed are
        the same whatever the train tasks are. Train seeds are even and held-out seeds odd, so no
        held-out game shares a train game's seed."""
        bounds = {k.name: self.bounds(k.name, "train") for k in self.knobs}
        train, heldout = self.start_ranges(bounds), {**bounds, **self.heldout_ranges}
        return [
            *self._drawn(train, "train", n_train, random.Random(seed + SEED_STRIDE)),
            *self._drawn(heldout, "heldout", n_heldout, random.Random(seed)),
        ]

    def _drawn(
        self, ranges: dict[str, tuple[int, int]], split: Literal["train", "heldout"], n: int, rng: random.Random
    ) -> list[TaskSpec]:
        out = []
        for i in range(n):
            knobs = self._consistent_knobs(ranges, rng)
            game_seed = 2 * rng.randrange(500_000) + (split == "heldout")
            task_id = f"{self.id_prefix}-{split[0]}{i}"
            out.append(
                TaskSpec(task_id=task_id, family=self.name, params={"seed": game_seed}, knobs=knobs, split=split)
            )
        return out

    def _consistent_knobs(self, ranges: dict[str, tuple[int, int]], rng: random.Random) -> dict[str, int]:
        for _ in range(CONSISTENT_DRAWS):
            knobs = {k: rng.randint(lo, hi) for k, (lo, hi) in ranges.items()}
            if self.consistent(knobs):
                return knobs
        raise ConfigError(  # the family's own ranges always hold consistent tasks: env.start_knobs narrowed them
            f"env.start_knobs: no {self.name} task is consistent within {ranges}", field="env.start_knobs"
        )

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        """Compile the game and replay its walkthrough to a win within the step budget."""
        return await walkthrough_wins(self, task)


class ChallengeEnv(TextWorldEnv):
    """``TextWorldEnv``'s play on a challenge game: it asks its family only for ``game_path`` and
    ``max_steps``, which a ``ChallengeFamily`` answers as ``TextWorld`` does."""

    def __init__(self, family: ChallengeFamily) -> None:
        super().__init__(family)  # type: ignore[arg-type]


class CoinCollector(ChallengeFamily):
    name = "tw-coin_collector"
    challenge = "tw-coin_collector"
    id_prefix = "twcc"
    knobs = (Knob("length", 1, 30, harder=1), Knob("distractors", 0, 2, harder=1))
    train_limits = {"length": (1, 10)}
    heldout_ranges = {"length": (11, 20)}
    max_steps_cap = 100

    def settings(self, knobs: dict[str, int], split: str) -> dict[str, Any]:
        return {"level": 100 * knobs["distractors"] + knobs["length"]}


class TreasureHunter(ChallengeFamily):
    name = "tw-treasure_hunter"
    challenge = "tw-treasure_hunter"
    id_prefix = "twt"
    knobs = (Knob("level", 1, 20, harder=1),)
    train_limits = {"level": (1, 10)}
    heldout_ranges = {"level": (11, 20)}
    max_steps_cap = 64

    def settings(self, knobs: dict[str, int], split: str) -> dict[str, Any]:
        return {"level": knobs["level"]}


COOKING_ROOMS = (1, 6, 9, 12)
"""The ``rooms`` knob indexes the cooking game's possible room counts (its ``go`` setting)."""


class Cooking(ChallengeFamily):
    name = "tw-cooking"
    challenge = "tw-cooking"
    id_prefix = "twc"
    knobs = (
        Knob("recipe", 1, 3, harder=1),
        Knob("take", 0, 3, harder=1),
        Knob("rooms", 0, len(COOKING_ROOMS) - 1, harder=1),
        Knob("open", 0, 1, harder=1),
        Knob("cook", 0, 1, harder=1),
        Knob("cut", 0, 1, harder=1),
    )
    train_limits = {"recipe": (1, 2), "take": (0, 2), "rooms": (0, 1)}
    heldout_ranges = {"recipe": (3, 3), "take": (1, 3), "rooms": (2, 3)}
    max_steps_cap = 100

    def consistent(self, knobs: dict[str, int]) -> bool:
        return knobs.get("take", 0) <= knobs.get("recipe", 1)

    def settings(self, knobs: dict[str, int], split: str) -> dict[str, Any]:
        if not self.consistent(knobs):
            raise EnvError(f"{self.name}: take={knobs['take']} exceeds recipe={knobs['recipe']}")
        skills = {k: bool(knobs[k]) for k in ("open", "cook", "cut")}
        food_split = "train" if split == "train" else "test"
        go = COOKING_ROOMS[knobs["rooms"]]
        return {
            "recipe": knobs["recipe"],
            "take": knobs["take"],
            "go": go,
            **skills,
            "split": food_split,
            "recipe_seed": 0,
        }


def coin_collector_family(cfg: EnvConfig) -> CoinCollector:
    """The ``tw-coin_collector`` entry point of ``coevo.families``: games compiled into ``env.cache_dir``."""
    return CoinCollector(cfg.cache_dir)


def treasure_hunter_family(cfg: EnvConfig) -> TreasureHunter:
    """The ``tw-treasure_hunter`` entry point of ``coevo.families``."""
    return TreasureHunter(cfg.cache_dir)


def cooking_family(cfg: EnvConfig) -> Cooking:
    """The ``tw-cooking`` entry point of ``coevo.families``."""
    return Cooking(cfg.cache_dir)
