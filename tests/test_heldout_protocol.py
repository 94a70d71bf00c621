"""The held-out protocol: tasks no habit wins, a reader that wins them all, shuffled labels, intervals."""

from __future__ import annotations

import random
import re
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from coevo.acting import choose, step_order
from coevo.algorithm.prompts import CHAT_LABELS, INDEX_LABELS, shown_order
from coevo.algorithm.rewriter import parse_llm_proposal
from coevo.bench.heldout import bootstrap, constant, habit_table, play_habit, uniform, verdict
from coevo.config import PolicyConfig
from coevo.envs.base import Observation
from coevo.envs.quickgame import (
    COLORS,
    HELDOUT_COLORS,
    HELDOUT_ROOMS,
    ROOMS,
    QuickGame,
    QuickGameHard,
    State,
    World,
    candidates,
    transition,
    world_of,
)
from coevo.errors import EnvError
from coevo.inference.chat import PromptForm
from coevo.inference.engine import LocalEngine, encode_prompt
from coevo.inference.models import ensure_default_model
from coevo.schemas import TaskSpec

SEEDS = (999, 1000, 1001, 1002, 1003)
SHUFFLED = PolicyConfig()


@cache
def _pool(hard: bool) -> tuple[list[TaskSpec], list[TaskSpec]]:
    tasks = (QuickGameHard() if hard else QuickGame()).initial_tasks(64, 64, 0)
    return [t for t in tasks if t.split == "train"], [t for t in tasks if t.split == "heldout"]


def _exact_random(world: World) -> float:
    """Uniform random play's exact success on ``world`` (every path weighed by its probability)."""

    @cache
    def p(s: State, steps: int) -> float:
        if s.won:
            return 1.0
        if s.lost or steps == world.max_steps:
            return 0.0
        cands = candidates(world, s)
        return sum(p(transition(world, s, a)[0], steps + 1) for a in cands) / len(cands)

    return p(State(), 0)


@pytest.mark.parametrize("hard", [False, True])
async def test_the_reader_wins_every_heldout_and_train_task_through_shuffled_choices(hard: bool) -> None:
    family = QuickGameHard() if hard else QuickGame()
    train, heldout = _pool(hard)
    assert len(heldout) == 64 and all([(await family.precheck(t)).ok for t in heldout])
    reader = await play_habit(family, heldout, SEEDS, lambda obs, shown, _rng: family.read(obs, shown), SHUFFLED)
    assert np.asarray(reader).all()
    assert np.asarray(await play_habit(family, train, SEEDS[:1], lambda o, s, _r: family.read(o, s), SHUFFLED)).all()
    # the reader follows shortest paths: each of its steps is labelled good by the environment
    env = family.make_env()
    obs = await env.reset(heldout[0])
    while True:
        r = await env.step(obs.candidates[family.read(obs.text, obs.candidates) or 0])
        assert r.reference_label == 1
        if r.done:
            break
        obs = r.observation


async def test_habits_score_what_uniform_random_play_does_when_labels_are_shuffled() -> None:
    """With the shown order drawn per step, always answering label j is a uniformly random candidate:
    every constant scores random play's exact expectation, and none comes near the reader."""
    family = QuickGame()
    train, heldout = _pool(False)
    exact = float(np.mean([_exact_random(world_of(t)) for t in train]))
    assert 0.1 < exact < 0.4
    rows = await habit_table(family, train, SEEDS, SHUFFLED)
    tolerance = 4 * (exact * (1 - exact) / (len(train) * len(SEEDS))) ** 0.5
    for j in range(4):
        assert rows[f"always {j}"]["mean"] == pytest.approx(exact, abs=tolerance), j
    assert rows["random"]["mean"] == pytest.approx(exact, abs=tolerance)
    assert rows["reader"]["mean"] == 1.0
    # unshuffled, the candidate order (verb, direction, colour) is a habit's to exploit: always the last
    # label (take coin, take key, unlock come last) beats random play by far
    last = await play_habit(
        family, train, SEEDS[:1], lambda _o, shown, _r: len(shown) - 1, PolicyConfig(shuffle_choices=False)
    )
    assert np.mean(last) > exact + 0.15
    held = await habit_table(family, heldout, SEEDS, SHUFFLED)
    assert max(held[n]["high"] for n in ("random", "best position rule")) < 0.1
    assert held["reader"]["low"] == 1.0


def test_shown_order_is_a_permutation_drawn_from_episode_and_step() -> None:
    orders = {tuple(shown_order(6, seed, step)) for seed in range(20) for step in range(5)}
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len(orders) > 50  # 100 draws of 720 permutations
    assert shown_order(6, 3, 1) == shown_order(6, 3, 1)
    # every position shows every candidate about equally often: no label is tied to an action
    first = [shown_order(4, seed, 0)[0] for seed in range(4000)]
    assert all(abs(first.count(i) / 4000 - 0.25) < 0.03 for i in range(4))
    assert step_order(PolicyConfig(shuffle_choices=False), "t", 0, 5) == [0, 1, 2, 3, 4]


def test_more_candidates_than_labels_show_a_new_draw_each_step() -> None:
    """A state with 80 admissible commands shows 36 (one label each), a different 36 at every step, so
    every command is shown within a few steps; unshuffled, the first 36."""
    policy = PolicyConfig()
    orders = [step_order(policy, "task/1/0", k, 80) for k in range(12)]
    assert all(len(o) == len(INDEX_LABELS) == len(set(o)) and max(o) < 80 for o in orders)
    assert len({tuple(o) for o in orders}) == 12 and set().union(*orders) == set(range(80))
    assert step_order(PolicyConfig(shuffle_choices=False), "t", 0, 80) == list(range(36))


def test_heldout_tasks_lie_outside_every_train_task_and_rewrite() -> None:
    family = QuickGame()
    train, heldout = _pool(False)
    for t in heldout:
        assert t.knobs["steps"] >= 6 and t.params["words"] == "heldout"
    # every rewrite a train task can reach, by any sequence of operators
    seen, frontier = set(), list(train)
    while frontier:
        task = frontier.pop()
        key = tuple(sorted(task.knobs.items()))
        if key in seen:
            continue
        seen.add(key)
        assert task.knobs["steps"] <= 5 and task.knobs["distractors"] <= 3
        for direction in ("harder", "easier"):
            for op in family.operators(direction):  # type: ignore[arg-type]
                if (child := family.apply(task, op)) is not None:
                    frontier.append(child)
    assert any(dict(k)["steps"] == 5 for k in seen) and any(dict(k)["distractors"] == 3 for k in seen)
    with pytest.raises(EnvError, match=r"steps=6 outside \[1, 5\] \(a train task's limits\)"):
        family.derive(train[0], {**train[0].knobs, "steps": 6})
    with pytest.raises(ValueError, match=r"outside \[0, 3\]"):
        parse_llm_proposal(family, train[0], "harder", '{"knobs": {"distractors": 4}}')


def test_heldout_words_never_appear_in_training_and_back() -> None:
    def words(tasks: list[TaskSpec]) -> set[str]:
        out: set[str] = set()
        for t in tasks:
            w = world_of(t)
            out |= set(w.rooms) | {c for keys in w.keys.values() for c in keys}
        return out

    train, heldout = _pool(False)
    train_words, held_words = words(train), words(heldout)
    assert train_words <= set(ROOMS) | set(COLORS)
    assert held_words <= set(HELDOUT_ROOMS) | set(HELDOUT_COLORS)
    assert held_words & set(HELDOUT_COLORS)  # held-out worlds do have keys of their own colours


def test_bootstrap_and_verdict() -> None:
    always = bootstrap([[1, 1], [1, 1], [1, 1]])
    assert (always["mean"], always["low"], always["high"]) == (1.0, 1.0, 1.0)
    half = bootstrap([[1, 1], [0, 0]] * 16)
    assert half["mean"] == 0.5 and 0.3 < half["low"] < 0.5 < half["high"] < 0.7
    # paired: two arms that differ on the same tasks by exactly one win in four
    a = np.array([[1, 1], [1, 1], [0, 0], [0, 0]] * 4)
    b = np.array([[0, 1], [1, 0], [0, 0], [0, 0]] * 4)
    diff = bootstrap(a - b)
    assert diff["mean"] == 0.25 and diff["low"] > 0
    rows = {"base greedy": {"mean": 0.3}, "random": {"mean": 0.1}, "best position rule": {"mean": 0.2}}
    assert verdict({"low": 0.35}, rows) == "gain"
    assert verdict({"low": 0.25}, rows) == "no gain: interval does not clear base greedy 0.30"
    assert verdict({"low": 0.15}, {**rows, "base greedy": {"mean": 0.1}}) == (
        "no gain: interval does not clear best position rule 0.20"
    )
    assert verdict({"low": 0.1}, rows) == (
        "no gain: interval does not clear base greedy 0.30, random 0.10, best position rule 0.20"
    )


def test_habits_are_what_they_say() -> None:
    rng = random.Random(0)
    assert constant(2)("", ["a", "b", "c", "d"], rng) == 2
    assert constant(3)("", ["a", "b"], rng) == 1  # past the last label: the last one
    picks = {uniform("", ["a", "b", "c"], rng) for _ in range(100)}
    assert picks == {0, 1, 2}


# ---- prompts as the model reads them ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))


def test_prompt_form_is_chat_only_for_a_template_of_the_models_own(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    assert not PromptForm(tok, "auto").chat and PromptForm(tok, "raw").ids([]) is None
    messages = [{"role": "system", "content": "answer with a label"}, {"role": "user", "content": "go?"}]
    forced = PromptForm(tok, "chat").ids(messages)
    assert forced is not None and tok.decode(forced).endswith("user: go?\nassistant:")
    own = tmp_path / "instruct"
    shutil.copytree(tiny, own)
    tok2 = AutoTokenizer.from_pretrained(own)
    tok2.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    form = PromptForm(tok2, "auto")
    assert form.chat and tok2.decode(form.ids(messages) or []) == "<system>answer with a label<user>go?<assistant>"


async def test_choose_shows_the_shuffled_order_and_names_the_candidate_it_picked(tiny: Path) -> None:
    obs = Observation("goal: take the coin. room: hall.", ["go north", "go south", "take red key", "take coin"])
    order = [2, 0, 3, 1]
    policy = PolicyConfig(temperature=GREEDY_T)
    async with LocalEngine(tiny, seed=0) as engine:
        for form_name in ("raw", "chat"):
            form = PromptForm(engine.tokenizer, form_name)  # type: ignore[arg-type]
            c, index, _ = await choose(engine, policy, obs, obs.candidates, None, order=order, form=form)
            assert c.choice is not None and index == order[c.choice]
            text = engine.tokenizer.decode(c.prompt_token_ids)
            if form_name == "raw":  # "0 go north | 1 go south | ..." after BOS
                listed = re.findall(r"(\w) ((?:go|take) [\w ]+?)(?= \||\nchoose)", text)
                assert c.prompt_token_ids == encode_prompt(engine.tokenizer, text.removeprefix("<|bos|>"))
            else:  # numbered from 1, one per line, in the user turn, then the generation prompt
                listed = re.findall(r"\n(\w)\. ((?:go|take) [\w ]+)", text)
                assert text.endswith("Answer with its number.\nassistant:"), text
            assert [a for _, a in listed] == [obs.candidates[i] for i in order], text
            assert "".join(lab for lab, _ in listed) == (INDEX_LABELS if form_name == "raw" else CHAT_LABELS)[:4]


GREEDY_T = 1e-5
