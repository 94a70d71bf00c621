"""``coevo run``: the closed loop in one process (each agent can also run alone: ``coevo agent``).

Invariant: the run ends (budget, ``--steps``, Ctrl-C or SIGTERM) by stopping every agent
gracefully (in-flight work finishes or is nak'd for the next run), then writes ``summary.json``
from the event stream itself, so the summary of a run and of its replay agree.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from coevo.config import CoevoConfig
from coevo.runtime.agent import Agent, run_agents
from coevo.runtime.aio import wait_event
from coevo.runtime.app import open_runtime
from coevo.runtime.bus import NatsBus
from coevo.schemas import Event, GroupScored, LearnerStepped, RunFinished, StepJudged, TaskDecided

log = structlog.get_logger("coevo.loop")


def build_agents(bus: NatsBus, cfg: CoevoConfig, on_step: Any = None) -> list[Agent]:
    from coevo.agents.judge import JudgeAgent
    from coevo.agents.policy import PolicyAgent
    from coevo.agents.scorer import ScorerAgent
    from coevo.agents.tasks import TasksAgent
    from coevo.training.learner import LearnerAgent

    agents: list[Agent] = [TasksAgent(bus, cfg), PolicyAgent(bus, cfg), ScorerAgent(bus, cfg),
                           LearnerAgent(bus, cfg, on_step=on_step)]
    if cfg.scorer.reward != "outcome-only":
        agents.append(JudgeAgent(bus, cfg))
    if cfg.env.remote:
        from coevo.envs.service import EnvHost

        agents.append(EnvHost(bus, cfg))
    return agents


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


@dataclass
class RunTally:
    """What ``summary.json`` reports, accumulated event by event (pure: no I/O)."""

    counts: Counter[str] = field(default_factory=Counter)
    train: list[float] = field(default_factory=list)
    evals: dict[str, list[float]] = field(default_factory=dict)
    proc: list[float] = field(default_factory=list)
    outc: list[float] = field(default_factory=list)
    proc_heldout: list[float] = field(default_factory=list)  # held-out groups: the same tasks whatever the rewriter did
    outc_heldout: list[float] = field(default_factory=list)
    learner_steps: int = 0
    judge_steps: int = 0
    accepted: int = 0
    judge: Counter[str] = field(default_factory=Counter)
    judge_cost: float = 0.0

    def add(self, event: Event | None) -> None:
        if event is None:
            self.counts["undecodable"] += 1
            return
        self.counts[event.kind] += 1  # type: ignore[attr-defined]
        if isinstance(event, GroupScored):
            self._scored(event)
        elif isinstance(event, LearnerStepped):
            self.learner_steps += event.role == "policy"
            self.judge_steps += event.role == "judge"
        elif isinstance(event, TaskDecided):
            self.accepted += event.accepted
        elif isinstance(event, StepJudged):
            for v in event.votes:
                self.judge["errors"] += v.status == "error"
                self.judge["cache_hits"] += v.cached
                self.judge["calls"] += v.status != "error" and not v.cached
                self.judge_cost += v.cost_usd

    def _scored(self, event: GroupScored) -> None:
        heldout = event.purpose == "eval"
        if event.purpose == "train":
            self.train.append(event.accuracy)
        elif heldout:
            self.evals.setdefault(event.group_id.split("-")[0], []).append(event.accuracy)
        if event.judge_process_accuracy is not None:
            self.proc.append(event.judge_process_accuracy)
            if heldout:
                self.proc_heldout.append(event.judge_process_accuracy)
        if event.judge_outcome_accuracy is not None:
            self.outc.append(event.judge_outcome_accuracy)
            if heldout:
                self.outc_heldout.append(event.judge_outcome_accuracy)

    def summary(self, run_id: str, seconds: float) -> dict[str, Any]:
        k = max(1, len(self.train) // 5)
        rounds = [v for _, v in sorted(self.evals.items(), key=lambda kv: int(kv[0][4:] or 0))]
        tail = max(1, len(self.proc) // 4)
        seconds = max(seconds, 1e-9)
        return {
            "run_id": run_id,
            "policy_success_start": _mean(self.train[:k]),
            "policy_success_end": _mean(self.train[-k:]),
            "heldout_success_start": _mean(rounds[0]) if rounds else None,
            "heldout_success_end": _mean(rounds[-1]) if rounds else None,
            "judge_process_accuracy": _mean(self.proc[-tail:]),
            "judge_outcome_accuracy": _mean(self.outc[-tail:]),
            "judge_process_accuracy_heldout": _mean(self.proc_heldout[-max(1, len(self.proc_heldout) // 2):]),
            "judge_outcome_accuracy_heldout": _mean(self.outc_heldout[-max(1, len(self.outc_heldout) // 2):]),
            "rewrites_proposed": self.counts["task.rewritten"],
            "rewrites_accepted": self.accepted,
            "learner_steps": self.learner_steps,
            "judge_learner_steps": self.judge_steps,
            "events": dict(sorted(self.counts.items())),
            "trajectories_per_second": round(self.counts["trajectory.completed"] / seconds, 3),
            "judge_errors": self.judge["errors"],
            "judge_calls": self.judge["calls"],
            "judge_cache_hits": self.judge["cache_hits"],
            "judge_cost_usd": round(self.judge_cost, 6),
            "seconds": round(seconds, 1),
            "groups_scored": len(self.train),
        }


async def summarize(bus: NatsBus, started: float, ended: float) -> dict[str, Any]:
    """The run's summary, computed from the stored events."""
    tally = RunTally()
    async for _, event, _m in bus.history():
        tally.add(event)
    return tally.summary(bus.run_id, ended - started)


class Progress:
    """Live progress: a rich status line on a terminal, a log line every 10 s otherwise."""

    def __init__(self, agents: list[Agent]) -> None:
        self.agents = agents
        self.t0 = time.monotonic()

    def line(self) -> str:
        c: Counter[str] = Counter()
        for a in self.agents:
            c.update(a.counters)
        won = c["trajectories.won"]
        done = sum(v for k, v in c.items() if k.startswith("trajectories."))
        return (f"{time.monotonic() - self.t0:6.0f}s  trajectories {done} (won {won / done if done else 0:.0%})  "
                f"groups {c['groups_scored']}  learner steps {c['steps.policy']}/{c['steps.judge']}  "
                f"rewrites {c['rewrites_accepted']}/{c['rewrites_proposed']}")

    async def run(self, stop: asyncio.Event) -> None:
        import sys

        from rich.console import Console

        console = Console(stderr=True)
        if sys.stderr.isatty():
            with console.status(self.line()) as status:
                while not stop.is_set():
                    await wait_event(stop, 1.0)
                    status.update(self.line())
        else:
            while not stop.is_set():
                await wait_event(stop, 10.0)
                log.info("progress", status=self.line())


async def run_main(cfg: CoevoConfig) -> int:
    from coevo.inference.clients import model_dir

    async with open_runtime(cfg, name="coevo-run") as rt:
        (Path(rt.run_dir) / "config.json").write_text(cfg.model_dump_json(indent=2))  # replay reads it back
        await asyncio.to_thread(model_dir, cfg, "policy")
        await asyncio.to_thread(model_dir, cfg, "judge")
        stop = asyncio.Event()
        steps_done = 0

        def on_step(role: str, _m: Any) -> None:
            nonlocal steps_done
            if role == "policy":
                steps_done += 1
                if cfg.run.steps is not None and steps_done >= cfg.run.steps:
                    stop.set()

        agents = build_agents(rt.bus, cfg, on_step=on_step)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        started = time.time()
        log.info("run.started", run_id=rt.run_id, family=cfg.env.family, loop=cfg.loop, reward=cfg.scorer.reward,
                 run_dir=str(rt.run_dir))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(run_agents(agents, handle_signals=False, until=stop), name="agents")
                tg.create_task(Progress(agents).run(stop), name="progress")
                if cfg.run.minutes > 0:
                    tg.create_task(_deadline(stop, cfg.run.minutes * 60), name="deadline")
                await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        summary = await summarize(rt.bus, started, time.time())
        src = agents[0]
        await rt.bus.publish_sync(src.event(RunFinished, summary=summary))
        summary["events"]["run.finished"] = summary["events"].get("run.finished", 0) + 1
        path = Path(rt.run_dir) / "summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        log.info("run.finished", summary=str(path), learner_steps=summary["learner_steps"],
                 policy_success_start=summary["policy_success_start"],
                 policy_success_end=summary["policy_success_end"])
        print(json.dumps(summary, indent=2))
    return 0


async def _deadline(stop: asyncio.Event, seconds: float) -> None:
    await wait_event(stop, seconds)
    stop.set()
