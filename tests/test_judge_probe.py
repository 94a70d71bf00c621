"""The judge probe: a judge model's votes against the environment's step labels, per way of asking."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from coevo.bench.heldout import heldout_table
from coevo.bench.judge_probe import Asking, auc, judge_probe, labelled_steps, probabilities, vote_stats
from coevo.config import PolicyConfig
from coevo.envs.quickgame import QuickGame
from coevo.inference.models import ensure_default_model


def test_auc_counts_good_above_bad_with_ties_half() -> None:
    assert auc([0.9, 0.8, 0.1, 0.2], [1, 1, -1, -1]) == 1.0
    assert auc([0.1, 0.2, 0.9, 0.8], [1, 1, -1, -1]) == 0.0
    assert auc([0.5, 0.5, 0.5], [1, -1, -1]) == 0.5
    assert auc([0.3, 0.6, 0.4], [1, 1, -1]) == 0.5  # 0.3 < 0.4, 0.6 > 0.4
    assert auc([0.3, 0.6], [1, 1]) is None


def test_vote_stats_read_a_biased_but_informed_judge() -> None:
    # every good step at 0.10, every bad one at 0.05: votes nearly always "-", the order still perfect
    p, labels = [0.10] * 50 + [0.05] * 50, [1] * 50 + [-1] * 50
    r = vote_stats(p, labels, temperature=1.0)
    assert r["auc"] == 1.0 and r["balanced_accuracy"] == 1.0
    assert r["plus_share"] == pytest.approx(0.075) and r["accuracy"] == pytest.approx(0.5 * 0.10 + 0.5 * 0.95)
    colder = vote_stats(p, labels, temperature=0.5)  # a lower temperature sharpens towards the bias
    q_good = 1 / (1 + math.exp(-math.log(0.10 / 0.90) / 0.5))
    assert colder["plus_share"] < r["plus_share"] and colder["accuracy"] == pytest.approx(
        0.5 * q_good + 0.5 * (1 - 1 / (1 + math.exp(-math.log(0.05 / 0.95) / 0.5))), abs=1e-4
    )


async def test_labelled_steps_are_random_play_with_both_labels() -> None:
    family = QuickGame()
    tasks = [t for t in family.initial_tasks(0, 12, 7)]
    steps = await labelled_steps(family, tasks, PolicyConfig(), seed=999, limit=40)
    assert len(steps) == 40
    assert {s.label for s in steps} == {1, -1}
    assert await labelled_steps(family, tasks, PolicyConfig(), seed=999, limit=40) == steps  # seeded


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("judge", tmp_path_factory.mktemp("models"))


async def test_probe_on_a_model_reports_each_asking(tiny_judge: Path) -> None:
    family = QuickGame()
    tasks = family.initial_tasks(0, 6, 3)
    steps = await labelled_steps(family, tasks, PolicyConfig(), seed=999, limit=12)
    asks = {"chat": Asking("chat", "Good? Answer - or +.", ("+", "-")), "odd": Asking("chat", "?", ("+-+-", "-"))}
    p = probabilities(tiny_judge, steps, asks, "float32")
    chat = p["chat"]
    assert isinstance(chat, list) and len(chat) == 12 and all(0 < x < 1 for x in chat)
    assert len(set(chat)) > 1  # the prompts differ, so do the probabilities
    assert isinstance(p["odd"], str) and "single token" in p["odd"]

    result = await judge_probe(tiny_judge, family, tasks, PolicyConfig(), 0.8, 999, "float32")
    assert result["steps"] == len(await labelled_steps(family, tasks, PolicyConfig(), 999))
    assert 0 < result["labelled_good"] < 1 and result["temperature"] == 0.8
    judged = result["chat (the judge's)"]
    assert 0 <= judged["plus_share"] <= 1 and judged["auc"] is not None
    table = heldout_table(
        {"family": "quickgame", "tasks": 6, "seeds": [999], "base": "tiny", "temperature": 1.0, "rows": {}}
        | {"judge_probe": result}
    )
    assert f"judge on {result['steps']} labelled steps" in table and "chat (the judge's)" in table
