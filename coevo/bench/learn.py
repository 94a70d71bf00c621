"""Learning benchmarks: ``coevo bench learn`` and ``coevo bench ladder``.

``learn`` and ``ladder`` run the whole loop in process (embedded NATS, tiny local models, the quick
game) for a wall-clock budget per configuration, and measure the policy with an evaluator that
plays a fixed task set with the newest policy checkpoint every ``eval_every_s`` seconds.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from coevo.config import CoevoConfig, load_config
from coevo.observe.progress import progress_bar, tracked
from coevo.schemas import TaskSpec


async def evaluate(model_dir: Path, tasks: list[TaskSpec], episodes: int, seed: int = 0) -> float:
    """Success rate of the policy at ``model_dir`` (sampling, as it acts) on ``tasks``."""
    from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt
    from coevo.envs.quickgame import QuickGame
    from coevo.inference.engine import LocalEngine

    game = QuickGame()
    rng = random.Random(seed)
    wins = 0
    async with LocalEngine(model_dir, seed=seed) as engine:
        async def one(task: TaskSpec) -> bool:
            env = game.make_env()
            obs = await env.reset(task)
            for _ in range(game.max_steps_cap):
                c = await engine.complete(policy_prompt(obs.text, obs.candidates),
                                          choices=list(INDEX_LABELS[: len(obs.candidates)]))
                assert c.choice is not None
                r = await env.step(obs.candidates[c.choice])
                if r.done:
                    return r.outcome == "won"
                obs = r.observation
            return False

        results = await asyncio.gather(*(one(tasks[rng.randrange(len(tasks))]) for _ in range(episodes)))
        wins = sum(results)
    return wins / episodes


def bench_tasks(cfg: CoevoConfig) -> tuple[list[TaskSpec], list[TaskSpec]]:
    from coevo.envs import make_family

    tasks = make_family(cfg.env).initial_tasks(cfg.env.n_train, cfg.env.n_heldout, cfg.env.seed)
    return [t for t in tasks if t.split == "train"], [t for t in tasks if t.split == "heldout"]


async def run_budget(cfg: CoevoConfig, seconds: float, *, eval_every_s: float, episodes: int) -> dict[str, Any]:
    """Run the loop for ``seconds`` and evaluate on the initial train and held-out tasks."""
    from coevo.inference.clients import model_dir
    from coevo.loop import build_agents, summarize
    from coevo.runtime.agent import run_agents
    from coevo.runtime.aio import wait_event
    from coevo.runtime.app import open_runtime
    from coevo.training.lane import latest_checkpoint

    train, heldout = bench_tasks(cfg)
    base = await asyncio.to_thread(model_dir, cfg, "policy")
    await asyncio.to_thread(model_dir, cfg, "judge")
    curve: list[dict[str, float]] = []
    async with open_runtime(cfg, name="coevo-bench") as rt:
        ckpts = rt.run_dir / "checkpoints" / "policy"
        stop = asyncio.Event()
        agents = build_agents(rt.bus, cfg)
        t0 = time.monotonic()

        async def evaluator() -> None:
            while not stop.is_set():
                ckpt = latest_checkpoint(ckpts) or base
                t = time.monotonic() - t0
                success = await evaluate(ckpt, train, episodes, seed=len(curve))
                version = int(ckpt.name[1:]) if ckpt != base else 0
                curve.append({"seconds": round(t, 1), "success": success, "policy_version": version})
                bar.update(completed=min(t, seconds))
                if t >= seconds:
                    stop.set()
                    return
                await wait_event(stop, eval_every_s)

        with progress_bar(f"{cfg.loop}, {cfg.scorer.reward} reward", seconds, unit="s") as bar:
            await asyncio.gather(run_agents(agents, handle_signals=False, until=stop), evaluator())
        final_ckpt = latest_checkpoint(ckpts) or base
        held = await evaluate(final_ckpt, heldout, episodes, seed=999) if heldout else None
        held0 = await evaluate(base, heldout, episodes, seed=999) if heldout else None
        summary = await summarize(rt.bus, 0.0, time.monotonic() - t0)
    return {"curve": curve, "initial_success": curve[0]["success"], "final_success": curve[-1]["success"],
            "best_success": max(p["success"] for p in curve), "heldout_initial": held0, "heldout_final": held,
            "judge_process_accuracy": summary["judge_process_accuracy"],
            "judge_outcome_accuracy": summary["judge_outcome_accuracy"],
            "judge_process_accuracy_heldout": summary["judge_process_accuracy_heldout"],
            "judge_outcome_accuracy_heldout": summary["judge_outcome_accuracy_heldout"],
            "rewrites_accepted": summary["rewrites_accepted"], "learner_steps": summary["learner_steps"],
            "trajectories_per_second": round(summary["events"].get("trajectory.completed", 0) / seconds, 2)}


def bench_config(tmp: Path, overrides: dict[str, Any]) -> CoevoConfig:
    base = {"run.runs_dir": str(tmp / "runs"), "log.console": "off", "agent.heartbeat_s": 10.0,
            "run.minutes": 0}
    return load_config(overrides={**base, **overrides})


async def bench_learn(minutes: float = 10.0, eval_every_s: float = 30.0, episodes: int = 64,
                      cache_dir: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        common = {"env.cache_dir": str(cache_dir or Path(tmp) / "cache")}
        t0 = time.monotonic()
        integrated = await run_budget(bench_config(Path(tmp) / "a", common), minutes * 60,
                                      eval_every_s=eval_every_s, episodes=episodes)
        seconds = time.monotonic() - t0
        outcome = await run_budget(bench_config(Path(tmp) / "b", {**common, "scorer.reward": "outcome-only"}),
                                   minutes * 60, eval_every_s=eval_every_s, episodes=episodes)
    reached = next((p["seconds"] for p in integrated["curve"] if p["success"] >= 0.8), None)
    return {
        "initial_success": integrated["initial_success"],
        "final_success": integrated["final_success"],
        "best_success": integrated["best_success"],
        "seconds": round(seconds, 1),
        "seconds_to_0.8": reached,
        "outcome_only_final_success": outcome["final_success"],
        "outcome_only_best_success": outcome["best_success"],
        "curves": {"integrated": integrated["curve"], "outcome_only": outcome["curve"]},
        "integrated": {k: v for k, v in integrated.items() if k != "curve"},
        "outcome_only": {k: v for k, v in outcome.items() if k != "curve"},
        "target": "final_success >= 0.8 within 10 minutes",
    }


async def bench_ladder(minutes: float = 5.0, eval_every_s: float = 30.0, episodes: int = 64,
                       cache_dir: Path | None = None) -> dict[str, Any]:
    rungs = {"policy-only": {"loop": "policy-only"}, "policy+judge": {"loop": "policy+judge"},
             "full": {"loop": "full"}}
    out: dict[str, Any] = {"minutes_per_rung": minutes, "rungs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        common = {"env.cache_dir": str(cache_dir or Path(tmp) / "cache")}
        for name, overrides in tracked(list(rungs.items()), "bench ladder", unit="rungs"):
            r = await run_budget(bench_config(Path(tmp) / name, {**common, **overrides}), minutes * 60,
                                 eval_every_s=eval_every_s, episodes=episodes)
            out["rungs"][name] = {"train_success": r["final_success"], "heldout_success": r["heldout_final"],
                                  "train_success_initial": r["initial_success"],
                                  "heldout_success_initial": r["heldout_initial"],
                                  "judge_process_accuracy": r["judge_process_accuracy"],
                                  "judge_outcome_accuracy": r["judge_outcome_accuracy"],
                                  "judge_process_accuracy_heldout": r["judge_process_accuracy_heldout"],
                                  "judge_outcome_accuracy_heldout": r["judge_outcome_accuracy_heldout"],
                                  "rewrites_accepted": r["rewrites_accepted"], "learner_steps": r["learner_steps"],
                                  "curve": r["curve"]}
    return out
