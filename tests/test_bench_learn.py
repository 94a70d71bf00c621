"""``coevo bench learn`` / ``ladder`` over seeds: the statistics, the hard preset, a tiny run."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from coevo.bench.learn import (
    HELDOUT_SEED,
    LADDER,
    LEARN,
    METRICS,
    PAIRED,
    RUNG_KEYS,
    RUNGS,
    Budget,
    Protocol,
    StepWatch,
    aggregate_seeds,
    bench_config,
    bench_learn,
    family_of,
    ladder_result,
    learn_result,
    paired_stats,
    plan_runs,
    rungs_named,
    seed_stats,
    t975,
)
from coevo.config import load_config
from coevo.envs import make_family
from coevo.envs.quickgame import QuickGame, QuickGameHard, State, build_world, candidates, transition
from coevo.schemas import TaskSpec
from coevo.training.lane import StepMetrics

# ---- statistics ----------------------------------------------------------------------------------


def test_seed_stats_on_known_numbers() -> None:
    s = seed_stats([0.5, 0.7, 0.9])
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(0.7)
    assert s["sd"] == pytest.approx(0.2)
    half = 4.303 * 0.2 / math.sqrt(3)
    assert s["half_width"] == pytest.approx(half, abs=1e-6)
    assert (s["low"], s["high"]) == pytest.approx((0.7 - half, 0.7 + half), abs=1e-6)


def test_seed_stats_one_value_none_and_nothing() -> None:
    assert seed_stats([0.4]) == {"n": 1, "mean": 0.4, "sd": None, "half_width": None, "low": None, "high": None}
    assert seed_stats([None, 1.0, None, 3.0])["n"] == 2  # a run without the metric is left out
    assert seed_stats([None, 1.0, None, 3.0])["half_width"] == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))
    assert seed_stats([])["mean"] is None
    assert seed_stats([None])["n"] == 0


def test_t_quantiles() -> None:
    assert t975(1) == 12.706
    assert t975(2) == 4.303
    assert t975(30) == 2.042
    assert t975(40) == pytest.approx(2.0211, abs=1e-3)  # past the table: Cornish-Fisher
    assert t975(1000) == pytest.approx(1.9623, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_paired_differences() -> None:
    d = paired_stats([0.9, 0.8, None, 0.7], [0.5, 0.6, 0.2, 0.7])
    assert d["n"] == 3
    assert d["mean"] == pytest.approx(0.2)
    assert d["sd"] == pytest.approx(statistics.stdev([0.4, 0.2, 0.0]))


# ---- the hard preset -----------------------------------------------------------------------------


def _random_success(tasks: list[TaskSpec], episodes: int = 200) -> float:
    rng = random.Random(0)
    wins = 0
    for t in tasks:
        k = t.knobs
        world = build_world(int(t.params["seed"]), k["steps"], k["distractors"], k["slack"])
        for _ in range(episodes):
            s, n = State(), 0
            while not (s.won or s.lost) and n < world.max_steps:
                s, _ = transition(world, s, rng.choice(candidates(world, s)))
                n += 1
            wins += s.won
    return wins / (episodes * len(tasks))


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_hard_preset_is_harder_by_construction(seed: int) -> None:
    # the train pools differ (the held-out region is shared but for its slack: tests/test_heldout_protocol.py)
    easy, hard = QuickGame().initial_tasks(16, 0, seed), QuickGameHard().initial_tasks(16, 0, seed)
    easy_checks = [await QuickGame().precheck(t) for t in easy]
    hard_checks = [await QuickGameHard().precheck(t) for t in hard]
    assert all(c.ok for c in easy_checks + hard_checks)
    for t, c in zip(hard, hard_checks, strict=True):
        assert t.family == "quickgame-hard"
        assert c.solution_length == len(QuickGameHard().walkthrough(t)) >= 4
        assert t.knobs["slack"] == 0 and t.knobs["distractors"] >= 2 and t.knobs["hints"] == 0
    assert min(c.solution_length or 0 for c in hard_checks) >= max(c.solution_length or 0 for c in easy_checks)
    assert statistics.fmean(QuickGame().difficulty(t) for t in hard) > max(QuickGame().difficulty(t) for t in easy)
    assert _random_success(hard) < _random_success(easy) / 3  # outcome rewards are sparse


def test_default_train_pool_is_unchanged() -> None:
    """The train pool is the one earlier benchmark results were measured on; the held-out tasks come from
    their own region (6..7 steps, held-out words) since the held-out protocol."""
    pool = QuickGame().initial_tasks(8, 8, 0)
    assert [(t.task_id, t.params, t.knobs) for t in (pool[0], pool[7])] == [
        ("qg-t0", {"seed": 42450}, {"steps": 3, "distractors": 1, "slack": 1, "hints": 0}),
        ("qg-t7", {"seed": 739426}, {"steps": 3, "distractors": 2, "slack": 1, "hints": 0}),
    ]
    assert pool[-1].task_id == "qg-h7" and pool[-1].params["words"] == "heldout" and pool[-1].knobs["steps"] >= 6


def test_presets_select_families() -> None:
    assert family_of("quickgame", "default") == "quickgame"
    assert family_of("quickgame", "hard") == "quickgame-hard"
    assert family_of("textworld", "default") == "textworld"
    with pytest.raises(ValueError, match="no hard preset"):
        family_of("textworld", "hard")
    with pytest.raises(ValueError, match="unknown preset"):
        family_of("quickgame", "brutal")
    cfg = load_config(overrides={"env.family": "quickgame-hard"})
    assert isinstance(make_family(cfg.env), QuickGameHard)


# ---- a tiny run: two seeds, every configuration (about 35 s on a busy 2-core machine) ----------


async def test_bench_learn_two_seeds_smoke(model_cache: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    progress = tmp_path / "learn.partial.json"
    out = await bench_learn(
        0.04,
        eval_every=1.0,
        episodes=4,
        cache_dir=model_cache,
        seeds=2,
        overrides={"env.n_train": 2, "env.n_heldout": 2, "policy.n": 4},
        protocol=Protocol(tasks=2, seeds=2),
        progress=progress,
    )
    # every run was written as it finished: the last write holds all four, as the result has them
    written = json.loads(progress.read_text())
    finished = written["finished_runs"]
    assert written["machine"]["cores"] >= 1  # where they ran
    assert {c: [r["seed"] for r in rs] for c, rs in finished.items()} == {"integrated": [0, 1], "outcome_only": [0, 1]}
    assert out["seeds"] == [0, 1]
    assert out["family"] == "quickgame"
    assert set(out["configs"]) == {"integrated", "outcome_only"}
    for c in out["configs"].values():
        assert [r["seed"] for r in c["runs"]] == [0, 1]
        assert all(r["heldout_tasks"] == 2 and r["curve"] for r in c["runs"])
        for r in c["runs"]:  # what the loop trained on, beside the initial tasks' success
            assert 0 <= r["slots_rewritten"] <= 2
            assert r["pool_accuracy"] is None or 0.0 <= r["pool_accuracy"] <= 1.0
            assert all({"pool_accuracy", "slots_rewritten"} <= set(p) for p in r["curve"])
            # every point plays the same draws: the base (version 0) scores one number wherever it is evaluated
            assert {p["success"] for p in r["curve"] if p["policy_version"] == 0} == {r["curve"][0]["success"]}
            assert all(0 < a < 1 for a in r["heldout_agreement_rounds"])  # the run's own rounds, as far as it got
        assert c["summary"]["train_success"]["n"] == 2
        assert c["summary"]["heldout_success"]["half_width"] is not None
        assert c["reached_0.8"].endswith("/2")
    assert out["paired"]["integrated - outcome_only"]["heldout_success"]["n"] == 2
    assert len(out["curves"]) == 4
    # the held-out protocol: habits and the base on the same 2 tasks x 2 evaluation seeds, a verdict per arm
    table = out["heldout_protocol"]
    assert table["rows"]["reader"]["mean"] == 1.0 and table["rows"]["reader"]["tasks"] == 2
    assert table["rows"]["base greedy"]["runs"] == 2 and table["rows"]["base sampled"]["seeds"] == 2
    for c in ("integrated", "outcome_only"):
        runs = out["configs"][c]["runs"]
        assert table["trained"][c]["mean"] == pytest.approx(
            statistics.mean(r["heldout_success"] for r in runs), abs=1e-4
        )
        assert table["trained"][c]["verdict"] == "gain" or table["trained"][c]["verdict"].startswith("no gain")
    assert set(table["paired"]) == {"outcome_only - integrated"}
    steps = out["heldout_steps"]  # step agreement with the reader on its path: the same tasks and seeds
    assert steps["rows"]["ceiling"]["mean"] == 1.0 and steps["states"] >= 2 * 2 * 6  # held-out quests: 6+ steps
    for c in ("integrated", "outcome_only"):
        runs = out["configs"][c]["runs"]
        assert steps["trained"][c]["mean"] == pytest.approx(
            statistics.mean(r["heldout_step_agreement"] for r in runs), abs=1e-4
        )
        assert all(0 < r["heldout_step_agreement"] < 1 for r in runs)
    assert time.monotonic() - t0 < 300


def test_pool_snapshot_reads_the_train_slots_active_tasks() -> None:
    from coevo.agents.tasks import Slot
    from coevo.bench.learn import pool_snapshot
    from coevo.schemas import TaskSpec

    def slot(i: int, split: str, acc: float | None, history: list[str]) -> Slot:
        task = TaskSpec(task_id=f"t{i}", family="quickgame", split=split)
        return Slot(slot_id=f"s{i}", split=split, active=task, last_accuracy=acc, history=history)

    assert pool_snapshot([]) == {"pool_accuracy": None, "slots_rewritten": 0}
    slots = [
        slot(0, "train", 0.5, []),
        slot(1, "train", None, ["t9"]),
        slot(2, "train", 0.25, ["t8", "t7"]),
        slot(3, "heldout", 1.0, []),
    ]
    assert pool_snapshot(slots) == {"pool_accuracy": 0.375, "slots_rewritten": 2}  # held-out slots left out


# ---- configurations × seeds: the plan and the aggregation, on hand-written runs ------------------


def test_plan_is_seed_major_and_a_seed_seeds_both_weights_and_pool(tmp_path: Path) -> None:
    plan = plan_runs(LADDER, 3)
    assert plan == [(s, c, {"loop": c, "run.seed": s, "env.seed": s}) for s in range(3) for c in LADDER]
    cfgs = [bench_config(tmp_path, {"env.family": "quickgame-hard", **run}) for _, _, run in plan]
    assert [(c.loop, c.run.seed, c.env.seed, c.env.family) for c in cfgs] == [
        (loop, s, s, "quickgame-hard") for s in range(3) for loop in ("policy-only", "policy+judge", "full")
    ]
    (_, _, integrated), (_, _, outcome) = plan_runs(LEARN, 1)
    assert bench_config(tmp_path, integrated).scorer.reward != "outcome-only"
    assert bench_config(tmp_path, outcome).scorer.reward == "outcome-only"
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        plan_runs(LADDER, 0)
    later = plan_runs(LADDER, range(3, 5))  # --first-seed 3 --seeds 2
    assert [(s, c, run["run.seed"], run["env.seed"]) for s, c, run in later] == [
        (s, c, s, s) for s in (3, 4) for c in LADDER
    ]
    with pytest.raises(ValueError, match="distinct and >= 0"):
        plan_runs(LADDER, [3, 3])


def _run(seed: int, train: float, heldout: float, reached: float | None, judge: float | None) -> dict[str, Any]:
    """A run as ``run_budget`` reports it, with the fields the aggregation reads (a 60 s budget)."""
    return {
        "seed": seed,
        "train_success": train,
        "heldout_success": heldout,
        "train_success_initial": 0.1,
        "heldout_success_initial": 0.1,
        "heldout_gain": round(heldout - 0.1, 6),
        "seconds_to_0.8": reached,
        "seconds_to_0.8_or_budget": 60.0 if reached is None else reached,
        "judge_process_accuracy": judge,
        "curve": [{"seconds": 0.0, "success": train}, {"seconds": 60.0, "success": train}],
    }


LADDER_RUNS = {  # three seeds per rung; only policy+judge's seed 2 and every full run reach 0.8
    "policy-only": [_run(0, 0.5, 0.4, None, None), _run(1, 0.6, 0.5, None, None), _run(2, 0.7, 0.6, None, None)],
    "policy+judge": [_run(0, 0.6, 0.5, None, 0.7), _run(1, 0.7, 0.5, None, 0.7), _run(2, 0.8, 0.8, 30.0, 0.7)],
    "full": [_run(0, 0.8, 0.6, 40.0, 0.6), _run(1, 0.9, 0.8, 30.0, 0.7), _run(2, 1.0, 0.7, 20.0, 0.8)],
}


def _ladder_out() -> dict[str, Any]:
    return aggregate_seeds(
        copy.deepcopy(LADDER_RUNS),
        seeds=3,
        family="quickgame-hard",
        preset="hard",
        budget=Budget("seconds", 60.0),
        episodes=64,
    )


def _interval(mean: float, sd: float, t: float, n: int) -> dict[str, Any]:
    half = t * sd / math.sqrt(n)
    return {
        "n": n,
        "mean": pytest.approx(mean),
        "sd": pytest.approx(sd, abs=1e-6),
        "half_width": pytest.approx(half, abs=1e-6),
        "low": pytest.approx(mean - half, abs=1e-6),
        "high": pytest.approx(mean + half, abs=1e-6),
    }


def test_aggregate_seeds_summarises_each_configuration() -> None:
    out = _ladder_out()
    assert {
        k: out[k] for k in ("family", "preset", "minutes_per_run", "seeds", "episodes_per_evaluation", "heldout_seed")
    } == {
        "family": "quickgame-hard",
        "preset": "hard",
        "minutes_per_run": 1.0,
        "seeds": [0, 1, 2],
        "episodes_per_evaluation": 64,
        "heldout_seed": HELDOUT_SEED,
    }
    assert list(out["configs"]) == list(LADDER)
    for c, rung in out["configs"].items():
        assert rung["runs"] == LADDER_RUNS[c]  # one entry per seed, seed order, as run
    full, middle, bottom = (out["configs"][c] for c in ("full", "policy+judge", "policy-only"))
    assert full["summary"]["train_success"] == _interval(0.9, 0.1, 4.303, 3)
    assert full["summary"]["seconds_to_0.8"] == _interval(30.0, 10.0, 4.303, 3)
    assert full["summary"]["judge_process_accuracy"] == _interval(0.7, 0.1, 4.303, 3)
    assert (full["reached_0.8"], middle["reached_0.8"], bottom["reached_0.8"]) == ("3/3", "1/3", "0/3")
    assert middle["summary"]["seconds_to_0.8"] == {
        "n": 1,
        "mean": 30.0,
        "sd": None,
        "half_width": None,
        "low": None,
        "high": None,
    }  # the one run that reached it
    assert middle["summary"]["seconds_to_0.8_or_budget"] == _interval(50.0, statistics.stdev([60, 60, 30]), 4.303, 3)
    assert bottom["summary"]["seconds_to_0.8"]["n"] == 0
    assert bottom["summary"]["judge_process_accuracy"] == {
        "n": 0,
        "mean": None,
        "sd": None,
        "half_width": None,
        "low": None,
        "high": None,
    }  # no judge
    assert full["summary"]["learner_steps"]["n"] == 0  # a metric no run reports
    assert set(full["summary"]) == set(METRICS)


@pytest.mark.parametrize("seeds", [[0, 1], [0, 2, 1], [0, 1, 2, 3]])
def test_aggregate_seeds_wants_every_seed_once_in_order(seeds: list[int]) -> None:
    runs = {**copy.deepcopy(LADDER_RUNS), "full": [_run(s, 0.9, 0.8, 30.0, 0.7) for s in seeds]}
    with pytest.raises(ValueError, match="'full' has runs for seeds"):
        aggregate_seeds(runs, seeds=3, family="quickgame", preset="default", budget=Budget("seconds", 60.0), episodes=4)


def test_a_later_seed_range_and_the_runs_config_fields_are_recorded() -> None:
    runs = {c: [_run(s, 0.5, 0.4, None, None) for s in (3, 4)] for c in LADDER}
    over = {"learner.lr": 1e-4, "policy.model": "smollm2-135m-instruct"}
    out = aggregate_seeds(
        runs,
        seeds=range(3, 5),
        family="quickgame",
        preset="default",
        budget=Budget("seconds", 60.0),
        episodes=4,
        overrides=over,
    )
    assert out["seeds"] == [3, 4] and out["overrides"] == over
    assert out["configs"]["full"]["summary"]["train_success"]["n"] == 2
    with pytest.raises(ValueError, match=r"not \[0, 1\] in order"):
        aggregate_seeds(runs, seeds=2, family="quickgame", preset="default", budget=Budget("seconds", 60.0), episodes=4)


def test_ladder_result_pairs_each_rung_with_the_bottom_one_and_the_one_below() -> None:
    out = _ladder_out()
    before = copy.deepcopy(out)
    result = ladder_result(out)
    assert out == before  # pure: a new dict
    assert {k: v for k, v in result.items() if k not in ("paired", "rungs")} == out
    assert list(result["paired"]) == ["policy+judge - policy-only", "full - policy-only", "full - policy+judge"]
    up = result["paired"]["full - policy-only"]
    assert set(up) == set(PAIRED)
    assert up["train_success"] == _interval(0.3, 0.0, 4.303, 3)  # 0.8-0.5, 0.9-0.6, 1.0-0.7
    assert up["heldout_success"] == _interval(0.2, 0.1, 4.303, 3)  # 0.2, 0.3, 0.1
    assert up["heldout_gain"] == up["heldout_success"]  # every run's base scored 0.1
    assert up["seconds_to_0.8_or_budget"] == _interval(-30.0, 10.0, 4.303, 3)  # -20, -30, -40
    assert result["paired"]["policy+judge - policy-only"]["judge_process_accuracy"]["n"] == 0
    added = result["paired"]["full - policy+judge"]  # what environment adaptation adds to judge training
    assert added["train_success"] == _interval(0.2, 0.0, 4.303, 3)  # 0.8-0.6, 0.9-0.7, 1.0-0.8
    assert added["heldout_success"]["mean"] == pytest.approx((0.1 + 0.3 - 0.1) / 3, abs=1e-6)
    assert list(result["rungs"]) == ["policy-only", "policy+judge", "full"]  # bottom first
    for c, rung in result["rungs"].items():
        assert set(rung) == {*RUNG_KEYS, "curve"}
        assert rung["curve"] == LADDER_RUNS[c][0]["curve"]  # the first seed's
    assert [result["rungs"][c]["train_success"] for c in LADDER] == pytest.approx([0.6, 0.7, 0.9])
    assert [result["rungs"][c]["judge_process_accuracy"] for c in LADDER] == [
        None,
        pytest.approx(0.7),
        pytest.approx(0.7),
    ]
    assert json.loads(json.dumps(result)) == result


def test_one_rung_is_compared_with_its_own_base_only() -> None:
    assert rungs_named(" full ") == {"full": RUNGS["full"]}
    assert list(rungs_named("policy+judge,policy+judge-balanced")) == ["policy+judge", "policy+judge-balanced"]
    for bad in ("", "full,full", "full,nope"):
        with pytest.raises(ValueError, match="one or more distinct rungs"):
            rungs_named(bad)
    for name, overrides in RUNGS.items():  # every rung is a valid configuration, and differs from the others
        assert load_config(overrides=overrides).loop in name
    assert load_config(overrides=RUNGS["policy-only-fresh"]).tasks.train_worlds == "fresh"
    both = load_config(overrides=RUNGS["policy+judge-balanced-group"]).scorer
    assert both.judge_balance and both.judge_baseline == "group"
    assert len({json.dumps(o, sort_keys=True) for o in RUNGS.values()}) == len(RUNGS)
    out = _ladder_out()
    result = ladder_result({**out, "configs": {"full": out["configs"]["full"]}})
    assert result["paired"] == {} and list(result["rungs"]) == ["full"]
    assert result["rungs"]["full"]["heldout_gain"] == pytest.approx(
        result["rungs"]["full"]["heldout_success"] - 0.1, abs=1e-6
    )


def test_learn_result_pairs_integrated_with_outcome_only() -> None:
    runs = {
        "integrated": [_run(0, 0.9, 0.6, 40.0, 0.8), _run(1, 0.7, 0.5, None, 0.6)],
        "outcome_only": [_run(0, 0.6, 0.4, None, 0.5), _run(1, 0.8, 0.45, 50.0, 0.5)],
    }
    out = aggregate_seeds(
        runs, seeds=2, family="quickgame", preset="default", budget=Budget("seconds", 60.0), episodes=4
    )
    before = copy.deepcopy(out)
    result = learn_result(out)
    assert out == before
    diff = result["paired"]["integrated - outcome_only"]
    assert diff["heldout_success"] == _interval(0.125, statistics.stdev([0.2, 0.05]), 12.706, 2)
    assert diff["train_success"] == _interval(0.1, statistics.stdev([0.3, -0.1]), 12.706, 2)
    assert diff["seconds_to_0.8_or_budget"] == _interval(-5.0, statistics.stdev([-20.0, 10.0]), 12.706, 2)
    assert result["headline"] == {
        "integrated.train_success": pytest.approx(0.8),
        "integrated.heldout_success": pytest.approx(0.55),
        "integrated.seconds_to_0.8": 40.0,
        "outcome_only.train_success": pytest.approx(0.7),
        "outcome_only.heldout_success": pytest.approx(0.425),
        "outcome_only.seconds_to_0.8": 50.0,
    }
    assert result["curves"] == {f"{c} s{s}": runs[c][s]["curve"] for c in LEARN for s in (0, 1)}
    assert result["target"] == "final train success >= 0.8 within 10 minutes"


async def test_evaluator_plays_textworld_and_its_heldout_games(model_cache: Path) -> None:
    """The evaluator is the family's: TextWorld games (compiled before the clock), the policy's prompt."""
    from coevo.bench.learn import eval_set
    from coevo.envs.textworld_env import TextWorld
    from coevo.inference.clients import model_dir

    cfg = load_config(
        overrides={
            "env.family": "textworld",
            "env.n_train": 1,
            "env.n_heldout": 1,
            "env.cache_dir": str(model_cache),
            "log.console": "off",
        }
    )
    ev = await eval_set(cfg, episodes=2, heldout=1, seeds=1)
    assert isinstance(ev.family, TextWorld)
    assert [t.task_id for t in ev.heldout] == [t.task_id for t in TextWorld().initial_tasks(0, 1, HELDOUT_SEED)]
    assert all(ev.family.game_path(t).exists() for t in [*ev.train, *ev.heldout])  # compiled up front
    assert ev.paths is not None  # the walkthrough's path, each of its commands a shown candidate
    assert [s.shown[s.pick] for s in ev.paths[0][0]] == ev.family.walkthrough(ev.heldout[0])
    base = model_dir(cfg, "policy")
    for split in ("train", "heldout"):
        assert 0.0 <= (await ev.success(base, split, seed=0) or 0.0) <= 1.0


# ---- step budgets --------------------------------------------------------------------------------


def test_a_budget_parses_steps_minutes_and_seconds_and_names_what_is_wrong() -> None:
    assert Budget.parse("steps:60") == Budget("steps", 60)
    assert Budget.parse("minutes:2") == Budget("seconds", 120.0)
    assert Budget.parse("3") == Budget("seconds", 180.0)
    assert Budget.parse("seconds:30", cap_s=99).seconds == 30.0
    assert Budget.parse("steps:5", cap_s=99).seconds == 99  # a step budget's wall clock is its cap
    for bad, why in (
        ("steps:2.5", "positive integer"),
        ("steps:0", "positive integer"),
        ("hours:1", "unknown unit"),
        ("steps:x", "expected steps:N"),
    ):
        with pytest.raises(ValueError, match=why):
            Budget.parse(bad)


def test_per_task_success_is_each_task_over_the_evaluation_seeds() -> None:
    from coevo.bench.learn import by_task, mean_of

    a, b, c = (TaskSpec(task_id=t, family="quick", params={}) for t in "abc")
    won = [[1, 1, 0], [0, 1, 0], [0, 0, 0]]  # task x evaluation seed
    assert by_task([a, b, c], won) == {
        "a": pytest.approx(2 / 3, abs=1e-6),
        "b": pytest.approx(1 / 3, abs=1e-6),
        "c": 0.0,
    }
    assert mean_of(won) == pytest.approx(3 / 9, abs=1e-6) and mean_of([]) is None


def test_step_milestones_end_on_the_budget() -> None:
    assert Budget("steps", 10).milestones(4) == [4, 8, 10]
    assert Budget("steps", 8).milestones(4) == [4, 8]
    assert Budget("steps", 3).milestones(10) == [3]
    assert Budget("steps", 3).milestones(0.5) == [1, 2, 3]


def _watch_published(tmp_path: Path, versions: int) -> tuple[StepWatch, asyncio.Event]:
    """A StepWatch of milestones 4 and 8 over publications v1..v``versions`` (each file ``w`` holds its version)."""
    published, keep, stop = tmp_path / "published", tmp_path / "kept", asyncio.Event()
    keep.mkdir()
    for v in range(1, versions + 1):
        (published / f"v{v:06d}-abc").mkdir(parents=True)
        (published / f"v{v:06d}-abc" / "w").write_text(str(v))
    return StepWatch(published, keep, [4, 8], stop), stop


async def test_a_run_the_cap_ends_is_evaluated_at_its_newest_version(tmp_path: Path) -> None:
    """Milestones 4 and 8; the run reaches version 6 before the cap: 4, then 6 (not 4 again, not the base)."""
    watch, stop = _watch_published(tmp_path, 6)
    for v in range(1, 7):
        watch.on_step("policy", StepMetrics.untrained(v, 0))
        watch.on_step("judge", StepMetrics.untrained(v + 10, 0))  # the judge lane's versions are not the policy's
    first = await watch.next(cap_s=60)
    assert first is not None and first[0] == 4 and (first[1] / "w").read_text() == "4" and not stop.is_set()
    last = await watch.next(cap_s=0.2)
    assert last is not None and last[0] == 6 and (last[1] / "w").read_text() == "6" and stop.is_set()
    assert await watch.next(cap_s=0.2) is None


async def test_a_milestone_that_arrives_while_waiting_is_not_evaluated_again_at_the_cap(tmp_path: Path) -> None:
    watch, stop = _watch_published(tmp_path, 4)

    async def learner() -> None:
        await asyncio.sleep(0)  # next() is waiting by now
        for v in range(1, 5):
            watch.on_step("policy", StepMetrics.untrained(v, 0))

    got, _ = await asyncio.gather(watch.next(cap_s=60), learner())
    assert got is not None and got[0] == 4
    assert await watch.next(cap_s=0.2) is None and stop.is_set()  # version 4 was the newest: nothing more


async def _tiny_step_bench(model_cache: Path, steps: int, episodes: int, protocol: Protocol) -> dict[str, Any]:
    """``bench learn`` of ``steps`` policy steps on 2 train and 2 held-out tasks, groups of 4: a cap of
    120 s ends a stalled run with its numbers (once in CI, a run ran into the test's timeout instead, and
    said nothing)."""
    return await bench_learn(
        Budget("steps", steps, cap_s=120),
        eval_every=min(2, steps),
        episodes=episodes,
        cache_dir=model_cache,
        overrides={"env.n_train": 2, "env.n_heldout": 2, "policy.n": 4, "learner.batch_samples": 8},
        protocol=protocol,
    )


@pytest.mark.timeout(420)
async def test_a_step_budget_ends_each_run_at_that_policy_version_and_evaluates_it(model_cache: Path) -> None:
    out = await _tiny_step_bench(model_cache, 3, 4, Protocol(tasks=2, seeds=2))  # 11 s a run on a quiet machine
    assert out["budget"] == "3 policy steps" and out["steps_per_run"] == 3 and out["minutes_per_run"] is None
    for c in ("integrated", "outcome_only"):
        (run,) = out["configs"][c]["runs"]
        assert run["budget_reached"] is True and run["policy_steps"] == 3, (c, run)
        # step 0 is the base model; then each milestone's own version, copied when it was published
        assert [(p["step"], p["policy_version"]) for p in run["curve"]] == [(0, 0), (2, 2), (3, 3)]
        assert run["learner_steps"] >= 3 and run["heldout_success"] is not None
        # 2 held-out tasks x 2 evaluation seeds: each task's rate is over its 2 episodes, their mean the whole
        by_task = run["heldout_by_task"]
        assert len(by_task) == run["heldout_tasks"] == 2
        for when, whole in (("final", "heldout_success"), ("initial", "heldout_success_initial")):
            assert statistics.mean(t[when] for t in by_task.values()) == pytest.approx(run[whole]), (c, when)
            assert all(t[when] in (0.0, 0.5, 1.0) for t in by_task.values())
        assert out["configs"][c]["summary"]["seconds"]["n"] == 1


@pytest.mark.timeout(300)
async def test_a_bench_that_measures_step_agreement_only_plays_no_heldout_episode(model_cache: Path) -> None:
    out = await _tiny_step_bench(model_cache, 1, 2, Protocol(tasks=2, seeds=1, measure="steps"))
    assert "heldout_protocol" not in out and out["heldout_steps"]["rows"]["ceiling"]["mean"] == 1.0
    for c in ("integrated", "outcome_only"):
        (run,) = out["configs"][c]["runs"]
        assert run["heldout_success"] is None and "heldout_wins" not in run
        assert 0 < run["heldout_step_agreement"] < 1 and len(run["heldout_steps"]) == 2
        assert out["heldout_steps"]["trained"][c]["mean"] == pytest.approx(run["heldout_step_agreement"], abs=1e-4)
        assert set(run["heldout_step_agreement_by_verb"]) <= {"go", "take", "unlock"}
    from coevo.bench.tables import tables

    verbs = out["heldout_steps"]["by_verb"]  # per verb, every habit beside the base and each configuration
    assert {"states", "random", "verb rule", "base sampled", "integrated", "outcome_only"} <= set(verbs)
    text = tables(out)
    assert "step agreement [95 % interval]" in text and "step agreement by the ceiling's verb:" in text


def test_the_tables_quote_means_intervals_paired_differences_and_each_step() -> None:
    from coevo.bench.learn import aggregate_seeds, learn_result
    from coevo.bench.tables import tables

    def run(seed: int, success: list[float], seconds: list[float]) -> dict[str, object]:
        curve = [
            {"step": 10 * i, "seconds": t, "success": s} for i, (s, t) in enumerate(zip(success, seconds, strict=True))
        ]
        return {
            "seed": seed,
            "train_success_initial": success[0],
            "train_success": success[-1],
            "seconds_to_0.8": None,
            "best_train_success": max(success),
            "seconds": seconds[-1],
            "policy_steps": 20,
            "curve": curve,
        }

    runs = {
        "integrated": [run(0, [0.0, 0.25, 0.5], [0, 10, 20]), run(1, [0.0, 0.5, 0.75], [0, 12, 24])],
        "outcome_only": [run(0, [0.0, 0.25, 0.25], [0, 4, 8]), run(1, [0.0, 0.25, 0.5], [0, 6, 12])],
    }
    out = learn_result(
        aggregate_seeds(
            runs, seeds=2, family="quickgame", preset="default", budget=Budget.parse("steps:20"), episodes=8
        )
    )
    text = tables(out)
    # mean 0.625, sd 0.177, half-width t(0.975, 1) = 12.706 · 0.177 / √2 = 1.59
    assert "| integrated | 0.00 ± 0.00 → 0.62 ± 1.59 | 0.62 ± 1.59 |" in text
    assert "paired integrated - outcome_only: train_success +0.25 ± 0.00" in text  # +0.25 on both seeds
    # seconds 8 and 12: mean 10, half-width 12.706 · 2.83 / √2 = 25
    assert "| outcome_only | 0.00 ± 0.00 | 0.25 ± 0.00 (5 ± 13 s) | 0.38 ± 1.59 (10 ± 25 s) |" in text
    assert "step 20" in text and "20 policy steps per run" in text


def test_the_tables_of_a_wall_clock_budget_give_each_evaluation_with_its_seconds_and_version() -> None:
    from coevo.bench.tables import tables

    def run(seed: int, success: list[float], versions: list[int], entropy: tuple[float, float]) -> dict[str, Any]:
        curve = [
            {"seconds": 900.0 * i + seed, "success": x, "policy_version": v}
            for i, (x, v) in enumerate(zip(success, versions, strict=True))
        ]
        return {
            **_run(seed, success[-1], 0.5, None, None),
            "train_success_initial": success[0],
            "policy_entropy_start": entropy[0],
            "policy_entropy": entropy[1],
            "curve": curve,
        }

    runs = {
        "full": [run(0, [0.25, 0.75, 1.0], [0, 70, 80], (0.4, 0.1)), run(1, [0.25, 0.5, 1.0], [0, 90, 120], (0.2, 0.1))]
    }
    text = tables(
        ladder_result(
            aggregate_seeds(
                runs, seeds=2, family="quickgame", preset="default", budget=Budget.parse("minutes:30"), episodes=8
            )
        )
    )
    assert "train success at each evaluation (seconds, policy version):" in text and "per policy step" not in text
    # evaluation 1: success 0.75 and 0.5 (mean 0.62, half-width 12.706 · 0.177 / √2 = 1.59), 900.5 s, versions 70 and 90
    assert "| full | 0.25 ± 0.00 (0 ± 6 s, version 0 ± 0) | 0.62 ± 1.59 (900 ± 6 s, version 80 ± 127) |" in text
    assert "| 0.30 ± 1.27 → 0.10 ± 0.00 |" in text  # the policy's entropy, first and last quarter of the steps


def test_bench_runs_take_a_config_file_sets_and_one_base_as_coevo_run_does() -> None:
    """``bench learn|ladder --config F --set K=V --base B --lora-lanes``: every run's overrides, the
    file first, then the sets, then the base (policy and judge), checked before anything runs."""
    import argparse

    from coevo.cli.bench import _run_overrides

    args = argparse.Namespace(
        config=Path(__file__).parents[1] / "configs" / "smollm2.toml",
        set=["learner.lr=1e-4", "env.n_heldout=8"],
        base="smollm2-135m-instruct",
        lora_lanes=True,
    )
    over = _run_overrides(args)
    assert over["policy.n"] == 4 and over["judge.mode"] == "verdict"  # from the file
    assert over["learner.lr"] == "1e-4" and over["env.n_heldout"] == "8"  # --set, over the file's 3e-4 and 4
    assert over["policy.model"] == over["judge.model"] == "smollm2-135m-instruct" and over["learner.lora"] == {}
    cfg = load_config(overrides=over)
    assert cfg.learner.lr == 1e-4 and cfg.env.n_heldout == 8 and cfg.learner.lora is not None
    with pytest.raises(SystemExit, match=r"learner\.lrr"):
        _run_overrides(argparse.Namespace(config=None, set=["learner.lrr=1"], base=None, lora_lanes=False))
