"""``coevo bench learn`` / ``ladder`` over seeds: the statistics, the hard preset, a tiny run."""

from __future__ import annotations

import math
import random
import statistics
import time
from pathlib import Path

import pytest

from coevo.bench.learn import bench_learn, family_of, paired_stats, seed_stats, t975
from coevo.config import CoevoConfig, load_config
from coevo.envs import make_family
from coevo.envs.quickgame import QuickGame, QuickGameHard, State, build_world, candidates, transition
from coevo.schemas import TaskSpec

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
    easy, hard = QuickGame().initial_tasks(8, 8, seed), QuickGameHard().initial_tasks(8, 8, seed)
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


def test_default_pool_is_unchanged() -> None:
    """The presets refactor keeps the default pool the one earlier benchmark results were measured on."""
    pool = QuickGame().initial_tasks(8, 8, 0)
    assert [(t.task_id, t.params, t.knobs) for t in (pool[0], pool[-1])] == [
        ("qg-t0", {"seed": 42450}, {"steps": 3, "distractors": 1, "slack": 1, "hints": 0}),
        ("qg-h15", {"seed": 65304}, {"steps": 4, "distractors": 1, "slack": 1, "hints": 0})]


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


async def test_bench_learn_two_seeds_smoke(model_cache: Path) -> None:
    t0 = time.monotonic()
    out = await bench_learn(minutes=0.04, eval_every_s=1.0, episodes=4, cache_dir=model_cache, seeds=2,
                            overrides={"env.n_train": 2, "env.n_heldout": 2, "policy.n": 4})
    assert out["seeds"] == [0, 1]
    assert out["family"] == "quickgame"
    assert set(out["configs"]) == {"integrated", "outcome_only"}
    for c in out["configs"].values():
        assert [r["seed"] for r in c["runs"]] == [0, 1]
        assert all(r["heldout_tasks"] == 2 and r["curve"] for r in c["runs"])
        assert c["summary"]["train_success"]["n"] == 2
        assert c["summary"]["heldout_success"]["half_width"] is not None
        assert c["reached_0.8"].endswith("/2")
    assert out["paired"]["integrated - outcome_only"]["heldout_success"]["n"] == 2
    assert len(out["curves"]) == 4
    assert time.monotonic() - t0 < 300


async def test_ladder_runs_every_rung_once_per_seed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The aggregation, with the loop replaced by a stub that records the configs it is given."""
    import coevo.bench.learn as learn

    seen: list[tuple[str, int, int, str]] = []
    base = {"policy-only": 0.5, "policy+judge": 0.6, "full": 0.8}

    async def fake_run(cfg: CoevoConfig, seconds: float, **_: object) -> dict[str, object]:
        seen.append((cfg.loop, cfg.run.seed, cfg.env.seed, cfg.env.family))
        x = base[cfg.loop] + 0.1 * cfg.run.seed
        return {"seed": cfg.run.seed, "train_success": x, "heldout_success": x - 0.1, "train_success_initial": 0.1,
                "heldout_success_initial": 0.1, "seconds_to_0.8": 30.0 if x >= 0.8 else None,
                "seconds_to_0.8_or_budget": 30.0 if x >= 0.8 else seconds, "judge_process_accuracy":
                None if cfg.loop == "policy-only" else 0.7, "curve": [{"seconds": 0.0, "success": x}]}

    monkeypatch.setattr(learn, "run_budget", fake_run)
    out = await learn.bench_ladder(minutes=1.0, seeds=3, preset="hard", cache_dir=tmp_path)
    assert seen == [(loop, s, s, "quickgame-hard") for s in range(3) for loop in base]  # seed-major
    full = out["configs"]["full"]
    assert full["summary"]["train_success"]["mean"] == pytest.approx(0.9)
    assert full["summary"]["train_success"]["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3), abs=1e-6)
    assert full["reached_0.8"] == "3/3"
    assert out["configs"]["policy-only"]["reached_0.8"] == "0/3"
    middle = out["configs"]["policy+judge"]  # 0.6, 0.7, 0.8: only seed 2 reaches 0.8, at 30 s
    assert middle["reached_0.8"] == "1/3"
    assert middle["summary"]["seconds_to_0.8"]["mean"] == 30.0
    assert middle["summary"]["seconds_to_0.8_or_budget"]["mean"] == pytest.approx((60 + 60 + 30) / 3)
    assert out["configs"]["policy-only"]["summary"]["judge_process_accuracy"]["n"] == 0
    diff = out["paired"]["full - policy-only"]["train_success"]
    assert (diff["mean"], diff["sd"]) == (pytest.approx(0.3), 0.0)
    assert out["rungs"]["full"]["train_success"] == pytest.approx(0.9)


async def test_evaluator_plays_textworld_and_its_heldout_games(model_cache: Path) -> None:
    """The evaluator is the family's: TextWorld games (compiled before the clock), the policy's prompt."""
    from coevo.bench.learn import HELDOUT_SEED, eval_set
    from coevo.envs.textworld_env import TextWorld
    from coevo.inference.clients import model_dir

    cfg = load_config(overrides={"env.family": "textworld", "env.n_train": 1, "env.n_heldout": 1,
                                 "env.cache_dir": str(model_cache), "log.console": "off"})
    ev = await eval_set(cfg, episodes=2)
    assert isinstance(ev.family, TextWorld)
    assert [t.task_id for t in ev.heldout] == [t.task_id for t in TextWorld().initial_tasks(0, 1, HELDOUT_SEED)]
    assert all(ev.family.game_path(t).exists() for t in [*ev.train, *ev.heldout])  # compiled up front
    base = model_dir(cfg, "policy")
    for split in ("train", "heldout"):
        assert 0.0 <= (await ev.success(base, split, seed=0) or 0.0) <= 1.0
