"""TextWorld's challenge games as families: real games compiled into a temporary cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coevo.config import load_config
from coevo.envs import make_family
from coevo.envs.textworld_env import _tw
from coevo.envs.tw_challenges import SEED_STRIDE, ChallengeFamily
from coevo.errors import ConfigError, EnvError
from coevo.schemas import TaskSpec
from tests.test_envs import play

FAMILIES = ("tw-coin_collector", "tw-treasure_hunter", "tw-cooking")
SMALL = {
    "tw-coin_collector": {"length": 3, "distractors": 1},
    "tw-treasure_hunter": {"level": 5},
    "tw-cooking": {"recipe": 1, "take": 1, "rooms": 0, "open": 1, "cook": 0, "cut": 1},
}


@pytest.fixture(scope="module")
def twc_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("twccache")


def family(name: str, cache: Path) -> ChallengeFamily:
    fam = make_family(load_config(overrides={"env.family": name, "env.cache_dir": str(cache)}).env)
    assert isinstance(fam, ChallengeFamily) and fam.name == name
    return fam


def small(name: str, seed: int = 4, split: str = "train") -> TaskSpec:
    return TaskSpec(task_id=f"s{seed}", family=name, params={"seed": seed}, knobs=dict(SMALL[name]), split=split)


def outside(fam: ChallengeFamily, knobs: dict[str, int]) -> bool:
    return any(not lo <= knobs[k] <= hi for k, (lo, hi) in fam.train_limits.items())


@pytest.mark.parametrize("name", FAMILIES)
def test_heldout_region_is_out_of_reach_of_train_tasks_and_their_rewrites(name: str, tmp_path: Path) -> None:
    fam = family(name, tmp_path)
    tasks = fam.initial_tasks(12, 12, seed=1)
    assert tasks == fam.initial_tasks(12, 12, seed=1)
    train = [t for t in tasks if t.split == "train"]
    held = [t for t in tasks if t.split == "heldout"]
    assert [t.task_id for t in train] == [f"{fam.id_prefix}-t{i}" for i in range(12)]
    assert [t.task_id for t in held] == [f"{fam.id_prefix}-h{i}" for i in range(12)]
    assert all(t.params["seed"] % 2 == 0 for t in train) and all(t.params["seed"] % 2 == 1 for t in held)
    reached: set[tuple[tuple[str, int], ...]] = set()
    frontier = list(train)
    while frontier:  # every knob setting any chain of rewrites of a train task reaches
        t = frontier.pop()
        key = tuple(sorted(t.knobs.items()))
        if key in reached:
            continue
        reached.add(key)
        assert not outside(fam, t.knobs) and fam.consistent(t.knobs), t.knobs
        frontier += [c for d in ("harder", "easier") for op in fam.operators(d) if (c := fam.apply(t, op))]
    assert len(reached) > len({tuple(sorted(t.knobs.items())) for t in train})  # rewrites moved knobs
    for h in held:
        assert outside(fam, h.knobs) and fam.consistent(h.knobs), h.knobs
        assert tuple(sorted(h.knobs.items())) not in reached
        with pytest.raises(EnvError):
            fam.derive(train[0], h.knobs)


def test_a_pool_started_on_short_chains_draws_its_train_tasks_there_and_the_same_heldout_tasks(tmp_path: Path) -> None:
    """``env.start_knobs`` moves where the initial train tasks are drawn, not the held-out tasks of a
    seed (nor their number of train tasks), and a rewrite still reaches the whole train region."""
    start = {"length": (1, 3), "distractors": (0, 0)}
    cfg = load_config(overrides={"env.family": "tw-coin_collector", "env.cache_dir": str(tmp_path)})
    short = make_family(cfg.env.model_copy(update={"start_knobs": start}))
    tasks = short.initial_tasks(32, 8, seed=5)
    train = [t for t in tasks if t.split == "train"]
    assert all(1 <= t.knobs["length"] <= 3 and t.knobs["distractors"] == 0 for t in train), train
    assert {t.knobs["length"] for t in train} == {1, 2, 3}
    default = family("tw-coin_collector", tmp_path)
    assert [t for t in tasks if t.split == "heldout"] == default.initial_tasks(0, 8, seed=5)
    assert default.initial_tasks(4, 8, seed=5)[4:] == default.initial_tasks(0, 8, seed=5)
    assert max(t.knobs["length"] for t in default.initial_tasks(32, 0, seed=5)) > 3
    longest = max(train, key=lambda t: t.knobs["length"])
    for _ in range(20):
        longest = short.apply(longest, "length+") or longest
    assert longest.knobs["length"] == short.train_limits["length"][1]


@pytest.mark.parametrize(
    ("name", "start", "says"),
    [
        ("tw-coin_collector", {"rooms": (1, 2)}, "env.start_knobs.rooms: family 'tw-coin_collector' has no such knob"),
        (
            "tw-coin_collector",
            {"length": (5, 12)},
            "env.start_knobs.length: 5..12 is not within its train bounds 1..10",
        ),
        ("coding", {"examples": (0, 1)}, "env.start_knobs: family 'coding' does not draw its initial tasks"),
    ],
)
def test_a_start_the_family_cannot_honour_is_refused_naming_the_field(
    name: str, start: dict, says: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides={"env.family": name, "env.cache_dir": str(tmp_path), "env.sandbox": "process"})
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        make_family(cfg.env.model_copy(update={"start_knobs": start}))
    assert refused.value.field == says.split(":")[0]
    with pytest.raises(ConfigError, match=r"env\.start_knobs: .*length: \[3, 1\] has its low end above its high end"):
        load_config(overrides={"env.family": name, "env.start_knobs": {"length": [3, 1]}})


def test_a_start_that_holds_no_consistent_task_is_refused_naming_the_field(tmp_path: Path) -> None:
    fam = family("tw-cooking", tmp_path)
    fam.start_from({"recipe": (1, 1), "take": (2, 2)})  # each within its bounds, never together
    with pytest.raises(ConfigError, match=re.escape("env.start_knobs: no tw-cooking task is consistent")) as refused:
        fam.initial_tasks(1, 0, seed=0)
    assert refused.value.field == "env.start_knobs"


def test_cooking_keeps_take_within_recipe(tmp_path: Path) -> None:
    fam = family("tw-cooking", tmp_path)
    t = small("tw-cooking")
    assert fam.apply(t, "take+") is None  # take == recipe
    assert fam.apply(t, "recipe+") is not None
    bad = TaskSpec(task_id="bad", family=fam.name, params={"seed": 1}, knobs={**t.knobs, "take": 2})
    with pytest.raises(EnvError, match="exceeds recipe"):
        fam.game_path(bad)


@pytest.mark.parametrize("name", FAMILIES)
async def test_walkthrough_wins_and_other_actions_are_labelled_minus_one(name: str, twc_cache: Path) -> None:
    fam = family(name, twc_cache)
    t = small(name)
    walk = await _tw(fam.walkthrough, t)
    assert walk
    played = fam.make_env()
    results = await play(played, t, walk)
    await played.close()
    assert len(results) == len(walk) and results[-1].outcome == "won"
    assert all(r.reference_label == 1 for r in results)
    env = fam.make_env()
    obs = await env.reset(t)
    assert "look" in obs.candidates and "inventory" in obs.candidates  # the game's own commands, kept
    r = await env.step("look")
    assert r.reference_label == -1 and not r.done
    while not r.done:
        r = await env.step("inventory")
        assert r.reference_label == -1
    assert r.outcome == "truncated" and env.steps == fam.max_steps(t) >= len(walk)
    await env.close()


@pytest.mark.parametrize("name", FAMILIES)
async def test_candidates_are_sorted_and_stable_across_resets(name: str, twc_cache: Path) -> None:
    fam = family(name, twc_cache)
    t = small(name)
    env = fam.make_env()
    first = await env.reset(t)
    again = await env.reset(t)
    other = fam.make_env()
    fresh = await other.reset(t)
    assert first.candidates == sorted(first.candidates) and len(first.candidates) > 1
    assert again == first and fresh == first
    await env.close()
    await other.close()


async def test_a_spec_compiles_once_per_cache_and_to_the_same_game(tmp_path: Path) -> None:
    name = "tw-coin_collector"
    t = small(name, seed=9)
    first = family(name, tmp_path / "a")
    path = await _tw(first.game_path, t)
    assert first.compiled == 1
    assert await _tw(first.game_path, t) == path and first.compiled == 1
    again = family(name, tmp_path / "a")  # a new process would see the same cache
    assert await _tw(again.game_path, t) == path and again.compiled == 0
    assert [p.name for p in path.parent.parent.iterdir()] == [path.parent.name]  # no temporary left
    elsewhere = family(name, tmp_path / "b")
    assert await _tw(elsewhere.walkthrough, t) == await _tw(first.walkthrough, t)
    assert elsewhere.compiled == 1
    here, there = first.make_env(), elsewhere.make_env()
    assert await here.reset(t) == await there.reset(t)
    await here.close()
    await there.close()
    await _tw(first.game_path, small(name, seed=10))
    assert first.compiled == 2


async def test_cooking_split_is_part_of_the_spec(twc_cache: Path) -> None:
    fam = family("tw-cooking", twc_cache)
    train, held = small("tw-cooking", seed=21), small("tw-cooking", seed=21, split="heldout")
    paths = {await _tw(fam.game_path, train), await _tw(fam.game_path, held)}
    assert len(paths) == 2 and fam.compiled == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
async def test_heldout_tasks_pass_precheck(name: str, twc_cache: Path) -> None:
    fam = family(name, twc_cache)
    for task in fam.initial_tasks(0, 2, seed=3):
        result = await fam.precheck(task)
        assert result.ok, (task, result)
        assert result.solution_length is not None and result.solution_length <= fam.max_steps(task)


async def test_a_seed_that_cannot_make_the_game_falls_back_to_the_next_derived_seed(tmp_path: Path) -> None:
    import json

    from textworld import GameOptions

    fam = family("tw-cooking", tmp_path)
    knobs = {"recipe": 3, "take": 1, "rooms": 2, "open": 1, "cook": 0, "cut": 1}
    task = TaskSpec(task_id="fallback", family=fam.name, params={"seed": 1}, knobs=knobs)
    assert (await fam.precheck(task)).ok  # TextWorld's cooking game raises ValueError for seed 1 here
    made = json.loads((fam.game_path(task).parent / "game.json").read_text())
    derived = GameOptions()
    derived.seeds = 1 + SEED_STRIDE
    assert made["metadata"]["seeds"] == derived.seeds
