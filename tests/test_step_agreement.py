"""Held-out step agreement: the ceiling's path, exact habit expectations, a model's exact choice probabilities."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coevo.acting import step_order
from coevo.acting.ceiling import Ceiling
from coevo.bench.heldout import CONSTANTS, base_agreement, episode_key, heldout_table, verb_choices
from coevo.bench.learn import eval_set
from coevo.bench.steps import (
    _PATHS,
    Agreement,
    agreement_fields,
    agreement_table,
    ceiling_paths,
    habit_rows,
    model_agreement,
    sample_states,
)
from coevo.bench.tables import protocol_table
from coevo.config import PolicyConfig, load_config
from coevo.envs.arithmetic import Arithmetic
from coevo.envs.coding import Coding
from coevo.envs.quickgame import QuickGame, world_of
from coevo.errors import ConfigError
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


async def test_the_ceiling_path_is_the_shortest_solution_shown_as_the_policy_sees_each_step() -> None:
    family, tasks, policy = QuickGame(), _heldout(8), PolicyConfig()
    paths = await ceiling_paths(family, tasks, SEEDS, policy)
    assert len(paths) == len(tasks) and all(len(row) == len(SEEDS) for row in paths)
    for i, (task, row) in enumerate(zip(tasks, paths, strict=True)):
        solution = world_of(task).solution
        for seed, path in zip(SEEDS, row, strict=True):
            assert [s.shown[s.pick] for s in path] == solution  # the reader plays a shortest path
            assert all(family.read(s.observation.text, s.shown) == s.pick for s in path)
            key = episode_key(task.task_id, seed, i)  # step k shows what the policy's step k shows
            assert [s.order for s in path] == [
                step_order(policy, key, k, len(s.observation.candidates)) for k, s in enumerate(path)
            ]
    # the seeds shuffle the same states differently, so a label carries no information
    first = [s.pick for row in paths for s in row[0]]
    second = [s.pick for row in paths for s in row[1]]
    assert first != second and len(set(first)) > 1
    _PATHS.clear()
    assert await ceiling_paths(family, tasks, SEEDS, policy) == paths  # seeded


async def test_a_cap_on_states_draws_the_same_states_of_each_path_for_every_caller() -> None:
    family, tasks, policy = QuickGame(), _heldout(8), PolicyConfig()
    full = await ceiling_paths(family, tasks, SEEDS, policy)
    capped = await ceiling_paths(family, tasks, SEEDS, policy, states=2)
    for whole_row, row in zip(full, capped, strict=True):
        for whole, path in zip(whole_row, row, strict=True):
            assert len(path) == min(2, len(whole))
            assert [whole.index(s) for s in path] == sorted(whole.index(s) for s in path)  # in path order
    assert any(len(p) > 2 for row in full for p in row)  # the cap leaves states out
    assert await ceiling_paths(family, tasks, SEEDS, policy, states=2) == capped  # every arm: the same states
    # a path's states depend on its task and seed alone, not on which other tasks are evaluated
    ids = [t.task_id for t in tasks]
    assert sample_states(full[3:], 2, ids[3:], SEEDS) == capped[3:]
    assert sample_states(full, None, ids, SEEDS) == full and sample_states(full, 99, ids, SEEDS) == full
    with pytest.raises(ValueError, match=">= 1"):
        sample_states(full, 0, ids, SEEDS)


async def test_a_family_without_a_reader_agrees_with_its_walkthrough() -> None:
    family = Arithmetic()
    tasks = [t for t in family.initial_tasks(0, 4, 1) if t.split == "heldout"]
    paths = await ceiling_paths(family, tasks, SEEDS, PolicyConfig())
    assert len(paths) == len(tasks) == 4
    for task, row in zip(tasks, paths, strict=True):
        assert all([s.shown[s.pick] for s in path] == family.walkthrough(task) for path in row)
    assert QuickGame().has_ceiling and family.has_ceiling and not Coding().has_ceiling


def test_the_walkthrough_follower_waits_off_the_path_for_a_command_not_shown() -> None:
    follower = Ceiling(Arithmetic(), ["take coin", "go east"])
    assert follower("", ["go west", "look", "take coin"], random.Random(0)) == 2 and follower.on_path
    assert follower("", ["go west", "inventory", "look"], random.Random(0)) == 2 and not follower.on_path
    assert follower("", ["go west"], random.Random(0)) is None and not follower.on_path
    assert follower("", ["go east", "go west"], random.Random(0)) == 0 and follower.on_path
    assert follower.pending == []


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


async def test_a_models_agreement_is_its_exact_probability_of_the_ceilings_choice(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt

    paths = await ceiling_paths(QuickGame(), _heldout(6), SEEDS, PolicyConfig())
    policy = PolicyConfig(prompt_format="raw")
    agreed = await model_agreement(tiny, paths, policy, "float32")
    sampled, greedy = agreed.sampled, agreed.greedy
    assert np.shape(sampled) == np.shape(greedy) == (len(paths), len(SEEDS))
    assert all(0 < x < 1 for row in sampled for x in row) and all(0 <= x <= 1 for row in greedy for x in row)
    colder = await model_agreement(tiny, paths, policy.model_copy(update={"temperature": 1e-5}), "float32")
    cold, cold_greedy = colder.sampled, colder.greedy
    assert np.allclose(cold, cold_greedy) and cold_greedy == greedy  # greedy is the T -> 0 limit

    # independently: the model's own logits on the label tokens of the first state's raw prompt
    s = paths[0][0][0]
    async with LocalEngine(tiny, dtype="float32") as engine:
        tok = engine.tokenizer
        ids = encode_prompt(tok, policy_prompt(s.observation.text, s.shown))
        labels = [tok.convert_tokens_to_ids(x) for x in INDEX_LABELS]
        c = await engine.complete("", choices=list(INDEX_LABELS[: len(s.shown)]), prompt_ids=ids)
    lm = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(lm(torch.tensor([ids])).logits[0, -1, labels[: len(s.shown)]].float(), -1)
    assert c.choice_logprobs == pytest.approx(want.tolist(), abs=1e-4)
    assert c.choice is not None and c.logprobs[0] == pytest.approx(c.choice_logprobs[c.choice])
    assert math.fsum(math.exp(x) for x in c.choice_logprobs) == pytest.approx(1.0)
    # a cell is the mean over its path of the model's probability of the ceiling's choice
    want_cell = []
    for s in paths[0][0]:
        ids = encode_prompt(tok, policy_prompt(s.observation.text, s.shown))
        with torch.no_grad():
            p = torch.softmax(lm(torch.tensor([ids])).logits[0, -1, labels[: len(s.shown)]].float(), -1)
        want_cell.append(float(p[s.pick]))
    assert sampled[0][0] == pytest.approx(sum(want_cell) / len(want_cell), abs=1e-4)


def test_the_table_pairs_runs_and_applies_the_verdict() -> None:
    habits = {"random": {"mean": 0.3, "low": 0.28, "high": 0.32}, "verb rule": {"mean": 0.45, "low": 0.4, "high": 0.5}}
    habits["best position rule"] = {"mean": 0.31, "low": 0.29, "high": 0.33, "rule": "always 1"}
    base = [[0.3, 0.35], [0.3, 0.32]]

    def run(trained: list[list[float]]) -> dict:
        states: Any = [[[None] * 3, [None] * 2]] * 2
        return agreement_fields(states, Agreement(trained, trained, {"go": 0.5}), Agreement(base, base, {"go": 0.4}))

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
    assert table["by_verb"] == {"base sampled": {"go": 0.4}, "policy-only": {"go": 0.5}, "full": {"go": 0.5}}


async def test_a_bench_eval_set_carries_the_ceilings_paths(tmp_path: Path) -> None:
    cfg = load_config(overrides={"run.runs_dir": str(tmp_path), "env.family": "quickgame"})
    ev = await eval_set(cfg, 4, heldout=4, seeds=2)
    assert ev.paths is not None and len(ev.paths) == len(ev.heldout) == 4
    assert (await eval_set(cfg, 4, heldout=4, seeds=2, measure="success")).paths is None
    generating = load_config(overrides={"run.runs_dir": str(tmp_path), "policy.mode": "generate"})
    assert (await eval_set(generating, 4, heldout=4, seeds=2)).paths is None
    with pytest.raises(ConfigError, match=r"policy\.mode is not choice") as e:  # steps only, none to measure
        await eval_set(generating, 4, heldout=4, seeds=2, measure="steps")
    assert e.value.field == "policy.mode"


async def test_bench_heldout_reports_the_bases_step_agreement_beside_the_habits(tiny: Path, tmp_path: Path) -> None:
    family, tasks = QuickGame(), _heldout(4)
    policy = PolicyConfig(prompt_format="raw")
    steps = await base_agreement(tiny, family, tasks, SEEDS, policy, "float32")
    paths = await ceiling_paths(family, tasks, SEEDS, policy)
    assert steps["states"] == sum(len(p) for row in paths for p in row)
    agreed = await model_agreement(tiny, paths, policy, "float32")
    assert steps["rows"]["base sampled"]["mean"] == pytest.approx(np.mean(agreed.sampled), abs=1e-4)
    assert steps["rows"]["base greedy"]["mean"] == pytest.approx(np.mean(agreed.greedy), abs=1e-4)
    # per verb: the habits' exact values, the base's its own; the counts add up to every state
    verbs = steps["by_verb"]
    assert sum(verbs["states"].values()) == steps["states"] and set(verbs["states"]) <= {"go", "take", "unlock"}
    assert verbs["base sampled"] == agreed.by_verb and set(agreed.by_verb) == set(verbs["states"])
    assert verbs["verb rule"]["take"] > verbs["random"]["take"]  # the rule takes every key it sees
    n = verbs["states"]
    overall = sum(agreed.by_verb[v] * n[v] for v in n) / steps["states"]  # by state, not by path
    flat = [s for row in paths for p in row for s in p]
    assert len(flat) == steps["states"] and 0 < overall < 1
    assert steps["rows"]["ceiling"]["mean"] == 1.0 and "verb rule" in steps["rows"]
    assert (
        await base_agreement(tiny, family, tasks, SEEDS, policy.model_copy(update={"mode": "generate"}), "float32")
        == {}
    )
    result = {"family": "quickgame", "tasks": 4, "seeds": list(SEEDS), "base": "tiny", "temperature": 1.0}
    table = heldout_table(result | {"rows": {}, "step_agreement": steps})
    assert f"held-out step agreement with the ceiling, on its path ({steps['states']} states):" in table
    assert "  by the ceiling's verb: go " in table and "\n    verb rule" in table
    assert re.search(r"\n  best position rule \(always \d\)\s+0\.\d\d  \[", table), table


def test_bench_heldout_measures_step_agreement_alone_on_request(tmp_path: Path) -> None:
    from coevo.cli import main

    out = tmp_path / "steps.json"
    args = ["bench", "heldout", "--heldout-tasks", "3", "--eval-seeds", "2", "--used-form-only"]
    assert main([*args, "--heldout-measure", "steps", "--cache-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompt_forms"] == {} and "base greedy" not in result["rows"]  # no held-out episode played
    assert "verb rule" in result["rows"] and result["rows"]["reader"]["mean"] == 1.0  # habits cost nothing
    steps = result["step_agreement"]
    assert steps["rows"]["ceiling"]["mean"] == 1.0 and 0 < steps["rows"]["base sampled"]["mean"] < 1
    assert steps["states"] == sum(steps["by_verb"]["states"].values()) >= 3 * 2 * 6


async def test_a_runs_closing_summary_sets_its_last_policy_s_step_agreement_beside_the_base_s(tmp_path: Path) -> None:
    import shutil

    from coevo.bench.heldout import run_baselines
    from coevo.inference.clients import model_dir
    from coevo.observe.closing import describe
    from coevo.observe.tally import RunTally
    from coevo.training.checkpoint import MARKER

    cfg = load_config(overrides={"run.runs_dir": str(tmp_path / "runs"), "env.cache_dir": str(tmp_path / "cache")})
    run_dir = tmp_path / "runs" / "r1"
    assert "step_agreement" not in await run_baselines(cfg, run_dir)  # no checkpoint yet: nothing to set beside
    last = run_dir / "checkpoints" / "policy" / "v00000003"
    shutil.copytree(model_dir(cfg, "policy"), last)  # a last policy with the base's weights
    (last / MARKER).touch()
    bars = await run_baselines(cfg, run_dir)
    steps = bars["step_agreement"]
    assert steps["trained"] == steps["base"] and steps["change"]["mean"] == 0.0  # the same weights
    assert set(steps["habits"]) == {"random", "best position rule", "verb rule"} and steps["states"] >= 6
    assert {"random", "verb rule", "reader", "base greedy"} <= set(bars)
    alone = await run_baselines(cfg, run_dir, success=False)  # no round scored: no success bars to measure
    assert set(alone) == {"step_agreement"} and alone["step_agreement"] == steps
    summary = {**RunTally().summary("r1", 60.0).model_dump(), "learner_steps": 3}
    text = describe(summary, cfg, {}, bars)
    line = next(x for x in text.splitlines() if x.startswith("  held-out step agreement: "))
    base = f"{steps['base']:.2f}"
    assert f": {base} -> {base} (+0.00, paired 95 % interval +0.00 to +0.00;" in line, line
    assert f"on the reader's path: {steps['states']} states); beside it random " in line
    assert "; the last policy's interval (from " in line and "does not clear" in line  # the base clears nothing
    assert "beside it on the same tasks" not in text  # no held-out round: no success bars to set it beside


def test_the_step_agreement_words_clear_a_bar_only_with_the_interval_s_low_end() -> None:
    from coevo.observe.claims import steps_verdict

    steps = {
        "states": 830,
        "habits": {"random": 0.43, "best position rule": 0.43, "verb rule": 0.64},
        "base greedy": 0.43,
        "base": 0.42,
        "trained": 0.71,
        "low": 0.68,
        "high": 0.74,
        "change": {"mean": 0.29, "low": 0.25, "high": 0.33},
    }
    said = steps_verdict(steps)
    assert said.startswith("held-out step agreement: 0.42 -> 0.71 (+0.29, paired 95 % interval +0.25 to +0.33;")
    assert "beside it random 0.43, best position rule 0.43, verb rule 0.64, base greedy 0.43" in said
    assert said.endswith("the last policy's interval (from 0.680) clears base and habits")
    assert steps_verdict(steps | {"low": 0.6}).endswith("(from 0.600) does not clear verb rule")
