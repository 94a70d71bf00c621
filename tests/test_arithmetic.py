"""The word-problem family: stories that build the same way, labels that check each step, knobs that
move difficulty and stay in bounds."""

from __future__ import annotations

import itertools
import random

import pytest

from coevo.config import EnvConfig
from coevo.envs import make_family
from coevo.envs.arithmetic import Arithmetic, build_problem
from coevo.schemas import TaskSpec


def atask(seed: int = 1, **knobs: int) -> TaskSpec:
    base = {"ops": 3, "digits": 2, "distractors": 3, "hints": 0}
    return TaskSpec(task_id=f"a{seed}", family="arithmetic", params={"seed": seed}, knobs={**base, **knobs})


GRID = [
    {"ops": o, "digits": d, "distractors": x, "hints": h}
    for o, d, x, h in itertools.product(range(1, 6), range(1, 4), range(1, 6), (0, 1))
]


async def test_the_family_is_registered_and_its_pool_is_in_bounds() -> None:
    family = make_family(EnvConfig(family="arithmetic"))
    assert isinstance(family, Arithmetic)
    pool = family.initial_tasks(8, 4, seed=3)
    assert [t.split for t in pool] == ["train"] * 8 + ["heldout"] * 4
    assert len({t.task_id for t in pool}) == 12
    for t in pool:
        assert (await family.precheck(t)).ok
        assert family.knobs_of(t) == t.knobs


async def test_the_walkthrough_wins_with_positive_labels_at_every_setting() -> None:
    g = Arithmetic()
    for knobs in GRID:
        for seed in range(3):
            t = atask(seed, **knobs)
            assert (await g.precheck(t)).ok
            env = g.make_env()
            obs = await env.reset(t)
            results = []
            for answer in g.walkthrough(t):
                assert obs.candidates.count(answer) == 1
                assert len(obs.candidates) == len(set(obs.candidates)) == 1 + knobs["distractors"]
                r = await env.step(answer)
                results.append(r)
                obs = r.observation
            assert [r.reference_label for r in results] == [1] * knobs["ops"]
            assert [r.done for r in results] == [False] * (knobs["ops"] - 1) + [True]
            assert results[-1].outcome == "won"


async def test_a_wrong_count_loses_at_once_and_is_labelled_bad() -> None:
    g = Arithmetic()
    t = atask(5)
    env = g.make_env()
    obs = await env.reset(t)
    right = g.walkthrough(t)[0]
    wrong = next(c for c in obs.candidates if c != right)
    r = await env.step(wrong)
    assert (r.done, r.outcome, r.reference_label) == (True, "lost", -1)
    assert f"has {right}" in r.observation.text
    with pytest.raises(Exception, match="after the episode ended"):
        await env.step(right)


def test_stories_are_deterministic_and_counts_stay_non_negative() -> None:
    for knobs in GRID:
        for seed in range(5):
            a = build_problem(seed, knobs["ops"], knobs["digits"], knobs["distractors"])
            assert a == build_problem(seed, knobs["ops"], knobs["digits"], knobs["distractors"])
            assert all(c >= 0 for c in a.counts())
            assert all(c >= 0 for shown in a.choices for c in shown)


async def test_hints_show_the_equation_and_the_story_reads_as_words() -> None:
    g = Arithmetic()
    plain, hinted = await g.make_env().reset(atask(2, hints=0)), await g.make_env().reset(atask(2, hints=1))
    assert "= ?)" in hinted.text and "= ?)" not in plain.text
    assert plain.text.endswith("have now?") and " has " in plain.text


def test_random_play_rarely_wins_the_hardest_setting() -> None:
    wins, rng = 0, random.Random(0)
    for seed in range(200):
        p = build_problem(seed, 5, 3, 5)
        wins += all(rng.choice(shown) == right for shown, right in zip(p.choices, p.counts(), strict=True))
    assert wins / 200 < 0.01  # (1/6)^5


@pytest.mark.parametrize("direction", ["harder", "easier"])
async def test_operators_move_difficulty_and_stay_in_bounds(direction: str) -> None:
    g = Arithmetic()
    for seed in range(10):
        t = atask(seed, ops=3, digits=2, distractors=3, hints=seed % 2)
        for op in g.operators(direction):
            child = g.apply(t, op)
            if child is None:
                knob = g.knob(op[:-1])
                assert t.knobs[knob.name] in (knob.low, knob.high)
                continue
            assert (g.difficulty(child) > g.difficulty(t)) == (direction == "harder")
            assert (await g.precheck(child)).ok
            k, pk = child.knobs, t.knobs
            p, pp = (
                build_problem(seed, k["ops"], k["digits"], k["distractors"]),
                build_problem(seed, pk["ops"], pk["digits"], pk["distractors"]),
            )
            if op[:-1] == "ops":
                assert len(p.moves) - len(pp.moves) == (1 if op.endswith("+") else -1)
            if op[:-1] == "distractors":
                assert len(p.choices[0]) - len(pp.choices[0]) == (1 if op.endswith("+") else -1)
    top = atask(1, ops=5, digits=3, distractors=5, hints=0)
    assert all(g.apply(top, op) is None for op in g.operators("harder"))
