"""Environments in process: quick game, real TextWorld games, HumanEval and JSONL coding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from coevo.envs.coding import Coding, humaneval_problems
from coevo.envs.quickgame import QuickGame, build_world
from coevo.envs.textworld_env import TextWorld
from coevo.errors import ConfigError, EnvError
from coevo.schemas import TaskSpec


def qtask(seed: int = 1, **knobs: int) -> TaskSpec:
    base = {"steps": 4, "distractors": 2, "slack": 1, "hints": 0}
    return TaskSpec(task_id=f"q{seed}", family="quickgame", params={"seed": seed}, knobs={**base, **knobs})


async def play(env, task: TaskSpec, actions: list[str]):
    obs = await env.reset(task)
    results = []
    for a in actions:
        assert a in obs.candidates, (a, obs.candidates)
        r = await env.step(a)
        results.append(r)
        obs = r.observation
        if r.done:
            break
    return results


# ---- quick game --------------------------------------------------------------------------------


async def test_quickgame_walkthrough_wins_with_positive_labels_at_every_setting() -> None:
    g = QuickGame()
    for steps in range(1, 7):
        for distractors in range(5):
            for seed in range(6):
                t = qtask(seed, steps=steps, distractors=distractors, slack=0)
                walk = g.walkthrough(t)
                assert len(walk) == steps
                pre = await g.precheck(t)
                assert pre.ok and pre.solution_length == steps
                results = await play(g.make_env(), t, walk)
                assert results[-1].outcome == "won"
                assert [r.reference_label for r in results] == [1] * steps


async def test_quickgame_bad_actions_lose_and_are_labelled_bad() -> None:
    g = QuickGame()
    env = g.make_env()
    t = qtask(3, steps=4, distractors=0, slack=0)
    obs = await env.reset(t)
    good = g.walkthrough(t)[0]
    bad = next(c for c in obs.candidates if c != good) if len(obs.candidates) > 1 else "wait"
    r = await env.step(bad)
    assert r.reference_label == -1
    while not r.done:
        r = await env.step("wait")
    assert r.outcome in {"truncated", "lost"}
    with pytest.raises(EnvError):
        await env.step("wait")


async def test_quickgame_is_deterministic_with_stable_candidates() -> None:
    g = QuickGame()
    a, b = g.make_env(), g.make_env()
    t = qtask(11, steps=6, distractors=4)
    oa, ob = await a.reset(t), await b.reset(t)
    assert oa == ob
    for action in g.walkthrough(t):
        ra, rb = await a.step(action), await b.step(action)
        assert ra == rb
        assert ra.observation.candidates == sorted(
            ra.observation.candidates, key=lambda c: ("go take unlock".split().index(c.split()[0]),)
        )


async def test_quickgame_hardest_setting_defeats_random_play() -> None:
    """Outcome-only learning needs some wins to learn from; random play almost never wins here."""
    g = QuickGame()
    wins = n = 0
    rng = random.Random(0)
    for seed in range(100):
        t = qtask(seed, steps=6, distractors=4, slack=0)
        env = g.make_env()
        obs = await env.reset(t)
        while True:
            r = await env.step(rng.choice(obs.candidates))
            obs = r.observation
            if r.done:
                break
        wins += r.outcome == "won"
        n += 1
    assert wins / n < 0.05


def measured(task: TaskSpec) -> dict[str, float]:
    k = task.knobs
    w = build_world(task.params["seed"], k["steps"], k["distractors"], k["slack"])
    return {
        "steps": len(w.solution),
        "distractors": len(w.rooms) + sum(map(len, w.keys.values())),
        "slack": w.max_steps - len(w.solution),
        "hints": k["hints"],
    }


@pytest.mark.parametrize("direction", ["harder", "easier"])
async def test_quickgame_operators_move_difficulty_and_stay_in_bounds(direction: str) -> None:
    g = QuickGame()
    for seed in range(20):
        t = qtask(seed, steps=3, distractors=2, slack=1, hints=seed % 2)
        for op in g.operators(direction):
            child = g.apply(t, op)
            if child is None:  # at a bound (a train task's: its limits): must really be at the bound
                assert t.knobs[op[:-1]] in g.bounds(op[:-1], t.split)
                continue
            assert child.parent_id == t.task_id and child.version == t.version + 1
            assert (g.difficulty(child) > g.difficulty(t)) == (direction == "harder")
            name = op[:-1]
            before, after = measured(t)[name], measured(child)[name]
            assert (after > before) == (op.endswith("+")), (op, before, after)
            assert (await g.precheck(child)).ok
    top = qtask(1, steps=5, distractors=3, slack=0, hints=0)  # the top of a train task's limits
    assert all(g.apply(top, op) is None for op in g.operators("harder"))


# ---- TextWorld ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tw_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("twcache")


def twtask(seed: int, **knobs: int) -> TaskSpec:
    base = {"quest_length": 3, "objects": 5, "rooms": 2, "hints": 1}
    return TaskSpec(task_id=f"tw{seed}", family="textworld", params={"seed": seed}, knobs={**base, **knobs})


async def test_textworld_game_is_won_by_walkthrough_and_lost_by_bad_actions(tw_cache: Path) -> None:
    fam = TextWorld(tw_cache)
    t = twtask(5)
    walk = fam.walkthrough(t)
    assert walk
    results = await play(fam.make_env(), t, walk)
    assert results[-1].outcome == "won"
    assert all(r.reference_label == 1 for r in results)
    env = fam.make_env()
    obs = await env.reset(t)
    assert obs.candidates == sorted(obs.candidates) and "look" in obs.candidates
    r = await env.step("look")
    assert r.reference_label == -1
    while not r.done:
        r = await env.step("inventory")
    assert r.outcome == "truncated"
    assert env.steps == fam.max_steps(t)


async def test_textworld_compiles_once_per_spec(tw_cache: Path) -> None:
    first = TextWorld(tw_cache)
    t = twtask(6)
    assert (await first.precheck(t)).ok
    assert first.compiled == 1
    assert (await first.precheck(t)).ok
    again = TextWorld(tw_cache)  # a new process would see the same cache
    assert (await again.precheck(t)).ok
    assert first.compiled == 1 and again.compiled == 0


async def test_textworld_operators_measured(tw_cache: Path) -> None:
    import textworld

    fam = TextWorld(tw_cache)

    def stats(task: TaskSpec) -> dict[str, float]:
        env = textworld.start(
            str(fam.game_path(task)),
            request_infos=textworld.EnvInfos(policy_commands=True, objective=True, entities=True),
        )
        s = env.reset()
        env.close()
        game = json.loads((fam.game_path(task).with_suffix(".json")).read_text())
        rooms = sum(1 for _, i in game["infos"] if i["type"] == "r")
        rarity = -goal_commonness(Game.load(str(fam.game_path(task).with_suffix(".json"))))
        return {
            "quest_length": len(s["policy_commands"]),
            "objects": len(s["entities"]),
            "rooms": rooms,
            "hints": len(s["objective"]),
            "goal": rarity,
        }

    from textworld.generator.game import Game

    from coevo.envs.textworld_env import goal_commonness

    seeds = [1, 2, 3]
    base = [twtask(s, quest_length=3, objects=5, rooms=2, hints=1, goal=1) for s in seeds]
    for op in fam.operators("harder"):
        name = op[:-1]
        children = [fam.apply(t, op) for t in base]
        assert all(c is not None for c in children)
        before = sum(stats(t)[name] for t in base)
        after = sum(stats(c)[name] for c in children)  # type: ignore[arg-type]
        assert (after > before) == op.endswith("+"), (op, before, after)
    with pytest.raises(EnvError):
        fam.derive(base[0], {**base[0].knobs, "quest_length": 99})


# ---- coding ------------------------------------------------------------------------------------


async def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail() -> None:
    fam = Coding()
    tasks = fam.initial_tasks(200, 200, 0)
    assert len(tasks) == 164 and sum(t.split == "heldout" for t in tasks) == 32
    for t in tasks[::8]:
        pre = await fam.precheck(t)
        assert pre.ok, (t.task_id, pre.reason)
    t = next(t for t in tasks if t.params["problem"] == "HumanEval/2")
    env = fam.make_env()
    obs = await env.reset(t)
    assert "def truncate_number" in obs.text
    r = await env.step("    return number - int(number) + 1\n")
    assert r.outcome == "lost" and r.info["pass_matrix"] == [False, False, False]
    good = humaneval_problems()["HumanEval/2"].solution
    r = await fam.make_env().reset(t) and await _step(fam, t, good)
    assert r.outcome == "won" and r.info["pass_matrix"] == [True, True, True]


async def _step(fam: Coding, t: TaskSpec, program: str):
    env = fam.make_env()
    await env.reset(t)
    return await env.step(program)


async def test_coding_constraints_add_matching_tests() -> None:
    fam = Coding()
    t = next(t for t in fam.initial_tasks(200, 0, 0) if t.params["problem"] == "HumanEval/2")
    harder = fam.apply(t, "constraints+")
    assert harder is not None and "do not use import statements" in fam.prompt_for(harder)
    assert fam.tests_for(harder) == fam.tests_for(t)  # constraints are judged by coevo, not as tests
    assert fam.checks_for(harder) == ["test 0", "test 1", "test 2", "no_imports"]
    importing = "import math\ndef truncate_number(number):\n    return number - math.floor(number)\n"
    assert (await _step(fam, t, importing)).outcome == "won"
    r = await _step(fam, harder, importing)
    assert r.outcome == "lost" and r.info["pass_matrix"] == [True, True, True, False]
    assert r.info["constraint_violations"] == {
        "no_imports": ["line 1: `import math` (imports other than the prompt's own)"]
    }
    assert (await _step(fam, t, importing)).info["constraint_violations"] == {}
    hidden = fam.apply(t, "examples-")
    assert hidden is not None and ">>>" in fam.prompt_for(t) and ">>>" not in fam.prompt_for(hidden)
    # a constraint the reference solution breaks is caught by the pre-check
    uses_while = next(
        t
        for t in fam.initial_tasks(200, 0, 0)
        if "\n    while " in (humaneval_problems()[t.params["problem"]].solution or "")
    )
    two = fam.derive(uses_while, {"constraints": 2, "examples": 1})
    pre = await fam.precheck(two)
    no_while = fam.checks_for(two).index("no_while")
    assert not pre.ok and pre.reason.startswith(f"reference solution fails tests [{no_while}]"), pre.reason


async def test_jsonl_problems_with_call_and_io_tests(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [
        {
            "id": "add",
            "prompt": "def add(a, b):\n",
            "entry_point": "add",
            "tests": [{"input": [1, 2], "output": 3}, "assert candidate(5, 0) == 5"],
            "solution": "def add(a, b):\n    return a + b\n",
        },
        {
            "id": "echo",
            "prompt": "# read a line, print it twice\n",
            "entry_point": "",
            "tests": [{"stdin": "hi\n", "stdout": "hihi"}],
            "solution": "s = input()\nprint(s + s)\n",
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fam = Coding(path)
    tasks = {t.params["problem"]: t for t in fam.initial_tasks(10, 0, 0)}
    assert (await fam.precheck(tasks["add"])).ok and (await fam.precheck(tasks["echo"])).ok
    assert (await _step(fam, tasks["add"], "def add(a, b):\n    return a - b\n")).info["pass_matrix"] == [False, True]
    assert (await _step(fam, tasks["echo"], "print(input())")).outcome == "lost"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(EnvError, match=r"bad\.jsonl:1"):
        Coding(bad).initial_tasks(1, 0, 0)


async def test_textworld_episodes_run_concurrently_in_one_process(tmp_path: Path) -> None:
    """Several rollouts of not-yet-compiled games at once (what the policy agent does)."""
    import asyncio

    fam = TextWorld(tmp_path)
    tasks = [twtask(40 + i % 2) for i in range(6)]

    async def episode(t: TaskSpec) -> str:
        env = fam.make_env()
        obs = await env.reset(t)
        r = None
        for _ in range(3):
            r = await env.step(obs.candidates[0])
            obs = r.observation
            if r.done:
                break
        await env.close()
        return r.outcome if r else "none"

    outcomes = await asyncio.gather(*(episode(t) for t in tasks))
    assert len(outcomes) == 6 and fam.compiled == 2


def test_a_quick_game_pool_started_on_one_step_quests_keeps_its_heldout_tasks() -> None:
    """``start_from`` (``env.start_knobs``) draws the train tasks there; held-out tasks do not move."""
    fam, started = QuickGame(), QuickGame()
    started.start_from({"steps": (1, 1), "distractors": (0, 0)})
    tasks = started.initial_tasks(16, 8, 3)
    assert all(t.knobs["steps"] == 1 and t.knobs["distractors"] == 0 for t in tasks if t.split == "train")
    assert {t.knobs["slack"] for t in tasks if t.split == "train"} == {QuickGame.initial_knobs["slack"][0]}
    assert [t for t in tasks if t.split == "heldout"] == fam.initial_tasks(16, 8, 3)[16:]
    assert any(t.knobs["steps"] > 1 for t in fam.initial_tasks(16, 0, 3))
    with pytest.raises(ConfigError, match=r"env\.start_knobs\.steps: 1\.\.7 is not within its train bounds 1\.\.5"):
        started.start_from({"steps": (1, 7)})
