"""Held-out step agreement: the ceiling's path, exact habit expectations, a model's exact choice probabilities."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from coevo.bench.heldout import CONSTANTS, verb_choices
from coevo.bench.learn import eval_set
from coevo.bench.steps import agreement_fields, agreement_table, ceiling_paths, habit_rows, has_ceiling, model_agreement
from coevo.bench.tables import protocol_table
from coevo.config import PolicyConfig, load_config
from coevo.envs.arithmetic import Arithmetic
from coevo.envs.quickgame import QuickGame, world_of
from coevo.inference.engine import LocalEngine, encode_prompt
from coevo.inference.models import ensure_default_model

SEEDS = (999, 1000)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))


def _heldout(n: int) -> list:
    return [t for t in QuickGame().initial_tasks(0, n, 5) if t.split == "heldout"]


def test_verb_rule_reads_the_action_words_only() -> None:
    assert verb_choices(["go north", "take red key", "take coin", "unlock east door with red key"]) == [1, 2]
    assert verb_choices(["go north", "unlock east door with red key", "go south"]) == [1]
    assert verb_choices(["go north", "open box", "go west"]) == [1]
    assert verb_choices(["go north", "go south", ""]) == [0, 1, 2]


async def test_the_ceiling_path_is_the_shortest_solution_shown_shuffled() -> None:
    family, tasks = QuickGame(), _heldout(8)
    paths = await ceiling_paths(family, tasks, SEEDS, PolicyConfig())
    assert len(paths) == len(tasks) and all(len(row) == len(SEEDS) for row in paths)
    for task, row in zip(tasks, paths, strict=True):
        solution = world_of(task).solution
        for path in row:
            assert [s.shown[s.pick] for s in path] == solution  # the reader plays a shortest path
            assert all(family.read(s.observation.text, s.shown) == s.pick for s in path)
    # the seeds shuffle the same states differently, so a label carries no information
    first = [s.pick for row in paths for s in row[0]]
    second = [s.pick for row in paths for s in row[1]]
    assert first != second and len(set(first)) > 1
    assert await ceiling_paths(family, tasks, SEEDS, PolicyConfig()) == paths  # seeded


async def test_habit_rows_are_exact_expectations() -> None:
    paths = await ceiling_paths(QuickGame(), _heldout(16), SEEDS, PolicyConfig())
    rows = habit_rows(paths)
    assert rows["ceiling"]["mean"] == 1.0 and rows["ceiling"]["low"] == 1.0
    random_cells = [[np.mean([1 / len(s.shown) for s in p]) for p in row] for row in paths]
    assert rows["random"]["mean"] == pytest.approx(np.mean(random_cells), abs=1e-4)
    for j in range(CONSTANTS):
        cells = [[np.mean([s.pick == min(j, len(s.shown) - 1) for s in p]) for p in row] for row in paths]
        assert rows[f"always {j}"]["mean"] == pytest.approx(np.mean(cells), abs=1e-4)
    best = max(range(CONSTANTS), key=lambda j: rows[f"always {j}"]["mean"])
    assert rows["best position rule"]["rule"] == f"always {best}"
    # the verb rule takes every key and coin, unlocks every door, and guesses exits: above random, far
    # below the ceiling, since every held-out quest has more exits to choose than keys to take
    assert rows["random"]["mean"] < rows["verb rule"]["mean"] < 0.8


def test_a_family_without_a_reader_agrees_with_its_walkthrough() -> None:
    assert has_ceiling(QuickGame()) and has_ceiling(Arithmetic())


async def test_a_models_agreement_is_its_exact_probability_of_the_ceilings_choice(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt

    paths = await ceiling_paths(QuickGame(), _heldout(6), SEEDS, PolicyConfig())
    policy = PolicyConfig(prompt_format="raw")
    sampled, greedy = await model_agreement(tiny, paths, policy, "float32")
    assert np.shape(sampled) == np.shape(greedy) == (len(paths), len(SEEDS))
    assert all(0 < x < 1 for row in sampled for x in row) and all(0 <= x <= 1 for row in greedy for x in row)
    cold, cold_greedy = await model_agreement(tiny, paths, policy.model_copy(update={"temperature": 1e-5}), "float32")
    assert np.allclose(cold, cold_greedy) and cold_greedy == greedy  # greedy is the T -> 0 limit

    # independently: the model's own logits on the label tokens of the first state's raw prompt
    s = paths[0][0][0]
    async with LocalEngine(tiny, dtype="float32") as engine:
        tok = engine.tokenizer
        ids = encode_prompt(tok, policy_prompt(s.observation.text, s.shown))
        labels = [tok.convert_tokens_to_ids(x) for x in INDEX_LABELS[: len(s.shown)]]
        c = await engine.complete("", choices=list(INDEX_LABELS[: len(s.shown)]), prompt_ids=ids)
    lm = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(lm(torch.tensor([ids])).logits[0, -1, labels].float(), -1)
    assert c.choice_logprobs == pytest.approx(want.tolist(), abs=1e-4)
    assert c.choice is not None and c.logprobs[0] == pytest.approx(c.choice_logprobs[c.choice])
    assert math.fsum(math.exp(x) for x in c.choice_logprobs) == pytest.approx(1.0)
    first_path = paths[0][0]
    assert len(first_path) >= 1 and sampled[0][0] > 0


def test_the_table_pairs_runs_and_applies_the_verdict() -> None:
    habits = {"random": {"mean": 0.3, "low": 0.28, "high": 0.32}, "verb rule": {"mean": 0.45, "low": 0.4, "high": 0.5}}
    habits["best position rule"] = {"mean": 0.31, "low": 0.29, "high": 0.33, "rule": "always 1"}
    base = [[0.3, 0.35], [0.3, 0.32]]

    def run(trained: list[list[float]]) -> dict:
        return agreement_fields([[[None] * 3, [None] * 2]] * 2, trained, base, base)  # type: ignore[list-item]

    runs = {"policy-only": [run([[0.4, 0.5], [0.4, 0.45]])], "full": [run([[0.9, 0.95], [0.9, 0.92]])]}
    table = agreement_table(runs, habits)
    assert runs["full"][0]["heldout_path_states"] == 10 and table["states"] == 10
    assert runs["full"][0]["heldout_step_agreement"] == pytest.approx(0.9175)
    assert table["trained"]["full"]["verdict"] == "gain"
    assert table["trained"]["policy-only"]["verdict"].startswith("no gain: interval does not clear")
    assert "verb rule 0.45" in table["trained"]["policy-only"]["verdict"]
    assert table["paired"]["full - policy-only"]["mean"] == pytest.approx(0.48)
    text = protocol_table({"heldout_steps": table}, "heldout_steps", "step agreement")
    assert "| held-out (same tasks and seeds) | step agreement [95 % interval] | verdict |" in text
    assert "| full | 0.92 [" in text and "| paired full - policy-only | +0.48 [" in text


async def test_a_bench_eval_set_carries_the_ceilings_paths(tmp_path: Path) -> None:
    cfg = load_config(overrides={"run.runs_dir": str(tmp_path), "env.family": "quickgame"})
    ev = await eval_set(cfg, 4, heldout=4, seeds=2)
    assert ev.paths is not None and len(ev.paths) == len(ev.heldout) == 4
    generating = load_config(overrides={"run.runs_dir": str(tmp_path), "policy.mode": "generate"})
    assert (await eval_set(generating, 4, heldout=4, seeds=2)).paths is None
