"""``coevo run``: the closed loop in one process (each agent can also run alone: ``coevo agent``).

Invariant: the run ends (budget, ``--steps``, Ctrl-C or SIGTERM) by stopping every agent
gracefully (in-flight work finishes or is nak'd for the next run), then writes ``summary.json``
from the event stream itself, so the summary of a run and of its replay agree. While it runs, an
observer folds the same stream into metrics (TensorBoard, the dashboard, ``/metrics``); it has read
every event, ``run.finished`` included, before the report is written and the process exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from coevo.config import CoevoConfig
from coevo.observe.aggregate import Aggregator
from coevo.observe.closing import describe
from coevo.observe.live import LiveRun, ObserveOptions, observe_run
from coevo.observe.tally import RunTally
from coevo.runtime.agent import Agent, run_agents
from coevo.runtime.aio import off_the_loop, wait_event
from coevo.runtime.app import Runtime, open_runtime
from coevo.runtime.bus import NatsBus
from coevo.runtime.credentials import credentials_dir
from coevo.schemas import RunFinished

__all__ = ["Progress", "RunTally", "build_agents", "describe", "run_main", "summarize"]

log = structlog.get_logger("coevo.loop")

Baselines = Callable[[CoevoConfig, Path, bool], Awaitable[dict[str, Any]]]
"""Measures habits and the base on a run's held-out tasks, by name (when the bool says a round was
scored), and the step agreement of the run's last policy (its directory given) against the base's
(``coevo.bench.heldout.run_baselines``)."""


def build_agents(bus: NatsBus, cfg: CoevoConfig, on_step: Any = None) -> list[Agent]:
    from coevo.agents.judge import JudgeAgent
    from coevo.agents.policy import PolicyAgent
    from coevo.agents.scorer import ScorerAgent
    from coevo.agents.tasks import TasksAgent
    from coevo.training.learner import LearnerAgent

    agents: list[Agent] = [
        TasksAgent(bus, cfg),
        PolicyAgent(bus, cfg),
        ScorerAgent(bus, cfg),
        LearnerAgent(bus, cfg, on_step=on_step),
    ]
    if cfg.env.family == "external" and cfg.env.tasks_from is None:
        agents.pop(0)  # no pool: the outside agents bring their own tasks (the policy endpoint groups them)
    if cfg.scorer.reward != "outcome-only":
        agents.append(JudgeAgent(bus, cfg))
    if cfg.env.remote:
        from coevo.envs.service import EnvHost

        agents.append(EnvHost(bus, cfg))
    if cfg.stream.retain_bytes:
        from coevo.runtime.retention import RetentionAgent

        agents.append(RetentionAgent(bus, cfg))
    return agents


async def summarize(bus: NatsBus, started: float, ended: float) -> dict[str, Any]:
    """The run's summary, computed from the stored events."""
    tally = RunTally()
    async for _, event, _m in bus.history():
        tally.add(event)
    return tally.summary(bus.run_id, ended - started).model_dump()


class Progress:
    """Live progress: a rich status line on a terminal, a log line every 30 s otherwise. Every number is
    labelled; the recent train success and the train groups among those scored come from the observer's
    aggregator when there is one (the closing summary counts train groups: so does this line)."""

    def __init__(self, agents: list[Agent], aggregator: Aggregator | None = None) -> None:
        self.agents = agents
        self.aggregator = aggregator
        self.t0 = time.monotonic()

    def line(self) -> str:
        c: Counter[str] = Counter()
        for a in self.agents:
            c.update(a.counters)
        won = c["trajectories.won"]
        done = sum(v for k, v in c.items() if k.startswith("trajectories."))
        recent, scored = "", f"{c['groups_scored']}"
        if self.aggregator is not None:  # the run's stream, a resumed run's earlier sessions included
            purposes = self.aggregator.tally.purposes
            scored = f"{sum(purposes.values())} ({purposes['train']} train)"
            if train := self.aggregator.tally.train[-20:]:
                recent = f" | train success, last {len(train)} groups: {sum(train) / len(train):.0%}"
        return (
            f"{time.monotonic() - self.t0:5.0f}s | trajectories {done}, {won / done if done else 0:.0%} won "
            f"(all so far){recent} | groups scored {scored} | learner steps: policy "
            f"{c['steps.policy']}, judge {c['steps.judge']} | rewrites: {c['rewrites_accepted']} accepted "
            f"of {c['rewrites_proposed']} proposed"
        )

    async def run(self, stop: asyncio.Event) -> None:
        from coevo.observe.status import show_status

        await show_status(self.line, stop)  # on a terminal, log lines print above the line, never into it


class _HideFromConsole(logging.Filter):
    """The console of ``coevo run`` shows warnings, errors and the few records a person acts on (where the
    run is, what it waits for, where to point an agent); the rest (checkpoints, weight versions, probes,
    the agents' counter dumps) goes to the log file only, beside everything else."""

    FOR_PEOPLE = frozenset(
        {
            "run.started",
            "run.loading_models",
            "policy.endpoint",
            "run.measuring_baselines",
            "progress",
            "learner.resumed",
            "tasks.resumed",
        }
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        msg = record.msg
        return isinstance(msg, dict) and msg.get("event") in self.FOR_PEOPLE


# ---- coevo run -----------------------------------------------------------------------------------


async def run_main(
    cfg: CoevoConfig,
    opts: ObserveOptions | None = None,
    baselines: Baselines | None = None,
    resume: Callable[[str], str] | None = None,
) -> int:
    """Run the loop until its budget or a signal, then print its summary; ``baselines`` measures what habits
    and the base score on the run's held-out tasks, to set beside its last round (the CLI passes
    ``coevo.bench.heldout.run_baselines``); ``resume``: run id -> the command that continues the run,
    printed when a signal stopped it."""
    from coevo.inference.clients import model_dir

    opts = opts or ObserveOptions()
    async with open_runtime(cfg, name="coevo-run", console_filter=_HideFromConsole()) as rt:
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

        agents = await off_the_loop(lambda: build_agents(rt.bus, cfg, on_step=on_step), _loading)
        with Interrupts(stop) as signals:
            async with _observe(rt, cfg, opts, agents) as live:
                started = time.time()
                _announce(rt, cfg, live)
                await _run_until_stopped(agents, stop, cfg, live)
                summary = await _finish(rt, agents, started)
                await live.drain()
                links = await _links(rt, live, summary, opts)
            if signals.interrupted and resume is not None:
                links["resume"] = resume(rt.run_id)
            bars = await _baselines(cfg, rt.run_dir, summary, baselines, signals.hurry) if baselines else {}
            print(describe(summary, cfg, links, bars, interrupted=signals.interrupted), flush=True)
    return 0


class Interrupts:
    """SIGINT and SIGTERM from the agents' start to the closing summary. One that comes while the run goes
    on stops it (the agents drain; ``interrupted`` names it). One that comes after the run stopped (by a
    signal or its budget) skips what is left of the closing measurements (``hurry``, awaited by
    ``_baselines``) and removes the handlers: after it, SIGINT and SIGTERM have their default action (the
    process ends at once, without a summary and without a traceback: a ``KeyboardInterrupt`` raised
    wherever the loop happened to be printed one after the summary), to the end of the process."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop, self.hurry = stop, asyncio.Event()
        self.interrupted: str | None = None
        self._loop = asyncio.get_running_loop()

    def __enter__(self) -> Interrupts:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            self.interrupted = sig.name
            self.stop.set()
            log.warning("run.stopping", signal=sig.name, hint="once more skips the closing measurements")
        else:
            self.hurry.set()
            self.__exit__()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # for good: the process is ending
            log.warning("run.hurrying", signal=sig.name, hint="the summary without its closing measurements")


async def _baselines(
    cfg: CoevoConfig, run_dir: Path, summary: dict[str, Any], measure: Baselines, hurry: asyncio.Event
) -> dict[str, Any]:
    """Habits and the base greedy on the run's held-out tasks when a round was scored, and the step
    agreement of base and last policy (best effort: a failure is logged, the summary prints without them;
    ``hurry`` set before they are done: they are cancelled, and ``{"skipped": why}``)."""
    success = summary["heldout_success_end"] is not None
    log.info("run.measuring_baselines", habits_and_base_greedy=success, step_agreement=True)
    measuring: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(measure(cfg, Path(run_dir), success))
    hurried: asyncio.Future[Any] = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait({measuring, hurried}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (measuring, hurried):
            task.cancel()
        await asyncio.gather(measuring, hurried, return_exceptions=True)  # both ended: nothing left behind
    if measuring.cancelled():
        return {"skipped": "a second signal skipped them"} if hurry.is_set() else {}
    if (exc := measuring.exception()) is not None:
        log.warning("run.baselines_failed", error=repr(exc)[:300])
        return {}
    return measuring.result()


def _loading(seconds: float) -> None:
    log.info("run.loading_models", seconds=round(seconds))


def _observe(rt: Runtime, cfg: CoevoConfig, opts: ObserveOptions, agents: list[Agent]) -> Any:
    from coevo.observe.sinks import make_sinks

    lc = cfg.log
    sinks = make_sinks(
        rt.run_dir,
        rt.run_id,
        tensorboard=lc.tensorboard,
        wandb=lc.wandb,
        project=lc.wandb_project,
        config=cfg.model_dump(mode="json"),
    )
    return observe_run(
        rt.bus,
        opts,
        sinks=sinks,
        marker=rt.run_dir / "tb" / "observed_seq",
        agents=agents,
        title=f"coevo run {rt.run_id}",
    )


def _announce(rt: Runtime, cfg: CoevoConfig, live: LiveRun) -> None:
    log.info(
        "run.started",
        run_id=rt.run_id,
        family=cfg.env.family,
        loop=cfg.loop,
        reward=cfg.scorer.reward,
        run_dir=str(rt.run_dir),
        dashboard=live.dashboard_url,
        metrics=live.metrics_url,
        nats_credentials=None if cfg.nats.url else str(credentials_dir(rt.run_dir / "nats")),
    )
    if live.dashboard_url:
        print(f"coevo run {rt.run_id}: dashboard at {live.dashboard_url}", flush=True)
    if live.metrics_url:
        print(f"coevo run {rt.run_id}: Prometheus metrics at {live.metrics_url}", flush=True)


async def _run_until_stopped(agents: list[Agent], stop: asyncio.Event, cfg: CoevoConfig, live: LiveRun) -> None:
    """Run until the budget, the policy step count or a signal (``Interrupts``) sets ``stop``, the agents drained."""
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_agents(agents, handle_signals=False, until=stop), name="agents")
        tg.create_task(Progress(agents, live.aggregator).run(stop), name="progress")
        if cfg.run.minutes > 0:
            tg.create_task(_deadline(stop, cfg.run.minutes * 60), name="deadline")
        await stop.wait()


async def _finish(rt: Runtime, agents: list[Agent], started: float) -> dict[str, Any]:
    summary = await summarize(rt.bus, started, time.time())
    await rt.bus.publish_sync(agents[0].event(RunFinished, summary=summary))
    summary["events"]["run.finished"] = summary["events"].get("run.finished", 0) + 1
    path = Path(rt.run_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    log.info(
        "run.finished",
        summary=str(path),
        learner_steps=summary["learner_steps"],
        policy_success_start=summary["policy_success_start"],
        policy_success_end=summary["policy_success_end"],
    )
    if summary["learner_steps"] == 0:
        log.warning(
            "run.no_learner_step", groups_scored=summary["groups_scored"], policy_samples=summary["policy_samples"]
        )
    return summary


async def _links(rt: Runtime, live: LiveRun, summary: dict[str, Any], opts: ObserveOptions) -> dict[str, str]:
    links = {"summary": f"{rt.run_dir / 'summary.json'} (every field: docs/observability.md)"}
    if opts.report:
        from coevo.observe.report import write_report

        report = await asyncio.to_thread(write_report, live.aggregator, rt.run_dir / "report", summary=summary)
        links["report"] = str(report)
    if (rt.run_dir / "tb").is_dir():
        links["tensorboard"] = f"tensorboard --logdir {rt.run_dir / 'tb'}"
    links["dashboard"] = f"coevo dashboard --run {rt.run_id} --runs-dir {rt.run_dir.parent}" + (
        f" (the live one at {live.dashboard_url} stopped with the run)" if live.dashboard_url else ""
    )
    return links


async def _deadline(stop: asyncio.Event, seconds: float) -> None:
    await wait_event(stop, seconds)
    stop.set()
