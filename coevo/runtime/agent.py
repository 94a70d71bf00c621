"""The agent: a long-lived coroutine with subscriptions, heartbeats, supervision and control.

Invariants:
- everything an agent starts lives in one ``TaskGroup`` inside ``run()``; when ``run()``
  returns, nothing of the agent is left running and its publishes are acknowledged;
- a crashed consumer or ``main()`` is restarted with backoff and counted; a task that crashes more
  than ``agent.max_restarts`` times within ``agent.restart_window_s`` makes the agent report
  ``failed`` and ``run()`` raise ``AgentFailed`` (older crashes no longer count: rare transient
  crashes over a long run never add up to a failure);
- ``stop()`` (SIGINT/SIGTERM, a control message, or the owner) stops fetching, lets in-flight
  handlers finish within ``agent.drain_timeout_s`` and naks the rest, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar, TypeVar

import nats.errors
import structlog

from coevo.config import CoevoConfig
from coevo.errors import AgentFailed, PublishError
from coevo.runtime import outbox
from coevo.runtime.aio import cancel_all, drain, first_completed, unless_set, wait_event
from coevo.runtime.bus import TRANSIENT, NatsBus
from coevo.runtime.consumer import Consumer, Subscription, backoff
from coevo.runtime.memory import trimmed_while
from coevo.runtime.proc import dump_tasks
from coevo.schemas import AgentStatus, ControlReply, ControlRequest, Event, Source, kind_of, new_id
from coevo.schemas.events import AgentState

log = structlog.get_logger("coevo.agents")
NOT_STOPPED_REPORT_S = 60.0
"""agents still running this long after their stop: logged, with every task's stack (``dump_tasks``)"""

E = TypeVar("E", bound=Event)


class RestartBudget:
    """At most ``max_restarts`` crashes within any ``window_s``; older crashes no longer count.

    A pure decision (the clock is injectable): ``crash()`` records one and says how many are recent,
    ``exhausted`` says whether that is one too many, ``backoff()`` grows with the recent crashes
    only, so a task that crashed long ago restarts as quickly as one that never did.
    """

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self._crashes: deque[float] = deque()

    def crash(self) -> int:
        """Record a crash now; the number of crashes within the window, this one included."""
        now = self.clock()
        self._crashes.append(now)
        while self._crashes[0] <= now - self.window_s:
            self._crashes.popleft()
        return len(self._crashes)

    @property
    def recent(self) -> int:
        return len(self._crashes)

    @property
    def exhausted(self) -> bool:
        return len(self._crashes) > self.max_restarts

    def backoff(self, delays: list[float]) -> float:
        """The delay before the next restart: ``delays[k - 1]`` after the k-th recent crash (the last
        one repeats)."""
        return delays[min(max(len(self._crashes), 1), len(delays)) - 1]


class Agent:
    """Base class. Subclasses set ``role`` and override ``subscriptions()`` and/or ``main()``."""

    role: ClassVar[str] = "agent"
    emits: ClassVar[tuple[type[Event], ...]] = ()
    """Event types this agent publishes (besides its ``AgentStatus``); ``emit`` enforces it."""

    def __init__(self, bus: NatsBus, cfg: CoevoConfig, *, agent_id: str | None = None) -> None:
        self.bus = bus
        self.cfg = cfg
        self.agent_id = agent_id or f"{self.role}-{new_id()[:8]}"
        self.state: AgentState = "starting"
        self.counters: Counter[str] = Counter()
        self.model_version: int | None = None
        self.log = structlog.get_logger(f"coevo.agent.{self.role}").bind(agent_id=self.agent_id)
        self.stopping = asyncio.Event()
        self._consumers: list[Consumer] = []
        self._started = time.monotonic()
        self._resumed = asyncio.Event()
        self._resumed.set()

    # ---- to override -------------------------------------------------------------------------

    def subscriptions(self) -> list[Subscription]:
        """What this agent consumes. Reads only ``self.cfg`` and class attributes: the topology
        (docs/architecture.md's table) calls it on an instance that was never initialised."""
        return []

    async def main(self) -> None:
        """Producer work. Returning ends it (the agent keeps consuming until stopped)."""

    # ---- helpers for subclasses --------------------------------------------------------------

    @property
    def source(self) -> Source:
        return Source(agent_id=self.agent_id, role=self.role, model_version=self.model_version)

    def event(self, cls: type[E], *, cause: Event | None = None, **fields: Any) -> E:
        """Build an event of this run from this agent; ``cause`` sets causation/correlation ids.

        Built while a delivery is handled (and without an explicit id), its id derives from the
        input and its content, so a redelivery that produces the same fact stores it once."""
        if cause is not None:
            fields.setdefault("causation_id", cause.event_id)
            fields.setdefault("correlation_id", cause.correlation_id or cause.event_id)
        event = cls(run_id=self.bus.run_id, source=self.source, **fields)
        box = outbox.current()
        if box is not None and "event_id" not in fields:
            event = event.model_copy(update={"event_id": box.derived_id(event)})
        return event

    async def emit(self, event: Event, *, confirm: bool = False) -> None:
        """Publish ``event``. Inside a handler it is stored before the input is acked (the outbox);
        elsewhere ``confirm`` waits until it is stored (retried under its id)."""
        if not isinstance(event, self.emits):
            raise TypeError(f"{self.role} does not declare {type(event).__name__} in its `emits`")
        if confirm and outbox.current() is None:
            await self.bus.publish_sync(event)
        else:
            await self.bus.publish(event)
        self.counters[f"emitted.{event.kind}"] += 1  # type: ignore[attr-defined]

    async def emit_stored(self, event: Event) -> None:
        """Publish ``event`` and wait until it is stored, inside a handler too (past the outbox): for a
        fact this agent's own state may record only once it is stored. ``PublishError`` when it cannot
        be (a handler's input is then redelivered, and the fact published again under its id)."""
        if not isinstance(event, self.emits):
            raise TypeError(f"{self.role} does not declare {type(event).__name__} in its `emits`")
        await self.bus.publish_sync(event)
        self.counters[f"emitted.{event.kind}"] += 1  # type: ignore[attr-defined]

    async def emit_durable(self, event: Event) -> None:
        """Publish ``event`` and wait until it is stored, sent again under its id (``bus.publish_retries``
        tries a round, ``agent.restart_backoff_s`` between rounds) until it is: for a fact no input
        guards, which a lost publish would lose for good (the learner's ``WeightsPublished``).
        ``PublishError`` only when the agent stops first (its bus then reports it unstored)."""
        attempt = 0
        while True:
            try:
                await self.emit_stored(event)
                return
            except PublishError as exc:
                attempt += 1
                self.counters[f"republished.{kind_of(event)}"] += 1
                self.log.warning(
                    "agent.publish_retried", event_id=event.event_id, attempt=attempt, error=str(exc)[:300]
                )
                if not await self.sleep(backoff(self.cfg.agent.restart_backoff_s, attempt)):
                    raise

    async def wait_resumed(self) -> bool:
        """Block while paused; False when the agent is stopping."""
        while not self._resumed.is_set() and not self.stopping.is_set():
            await first_completed(self._resumed.wait(), self.stopping.wait())
        return not self.stopping.is_set()

    async def until_answered(self, what: str, fn: Callable[[], Awaitable[None]]) -> bool:
        """Run ``fn`` (work before the agent starts, such as rebuilding state from the stream: it
        must be safe to run again), again after each transient bus failure (``bus.TRANSIENT``: a
        node down, a partition, a claim unreadable now) with ``agent.restart_backoff_s``, until it
        succeeds (True) or the agent is stopped (False), which also cancels a run of ``fn`` under
        way (a read of the stream during a partition can wait minutes: a stop is honoured at once).
        A restart of the whole process would only meet the same outage, slower."""
        attempt = 0
        while True:
            try:
                return await unless_set(self.stopping, fn())
            except TRANSIENT as exc:
                self.counters[f"retried.{what}"] += 1
                attempt += 1
                self.log.warning("agent.startup_retried", what=what, attempt=attempt, error=repr(exc)[:300])
                if not await self.sleep(backoff(self.cfg.agent.restart_backoff_s, attempt)):
                    return False

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; returns False when stopping."""
        return not await wait_event(self.stopping, seconds)

    # ---- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.log.info("agent.stopping")
            self.stopping.set()

    def pause(self) -> None:
        self._resumed.clear()
        for c in self._consumers:
            c.resumed.clear()
        self.state = "paused"

    def resume(self) -> None:
        self._resumed.set()
        for c in self._consumers:
            c.resumed.set()
        self.state = "running"

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    def snapshot_counters(self) -> dict[str, int]:
        out = dict(self.counters)
        for c in self._consumers:
            for k, v in vars(c.stats).items():
                out[f"{c.sub.durable}.{k}"] = v
        return out

    async def run(self) -> None:
        structlog.contextvars.bind_contextvars(agent_id=self.agent_id, role=self.role)
        self._started = time.monotonic()
        control = await self.bus.serve_control(self.agent_id, self._on_control)
        lost = await self.bus.watch_lost_deliveries(self.source)
        drain = self.cfg.agent.drain_timeout_s
        self._consumers = [Consumer(self.bus, s, self.source, drain_timeout_s=drain) for s in self.subscriptions()]
        failure: BaseException | None = None
        try:
            self.state = "running"
            await self._report()
            async with asyncio.TaskGroup() as tg:
                # supervised like the rest: a status that cannot be published (NATS failing over) is
                # retried, it never takes the agent down
                beat = tg.create_task(self._supervise("heartbeat", self._heartbeat), name=f"{self.agent_id}:heartbeat")
                for c in self._consumers:
                    tg.create_task(
                        self._supervise(c.sub.durable, functools.partial(c.run, self.stopping)),
                        name=f"{self.agent_id}:{c.sub.durable}",
                    )
                main = tg.create_task(self._supervise("main", self._main_once), name=f"{self.agent_id}:main")
                tg.create_task(self._end_when_stopped([beat, main]), name=f"{self.agent_id}:stop")
        except BaseException as exc:
            failure = exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) else exc
            raise failure from None
        finally:
            self.state = "failed" if isinstance(failure, Exception) else "stopped"
            for sub in (control, lost):  # a connection already closed has no subscriptions left
                with contextlib.suppress(nats.errors.ConnectionClosedError):
                    await sub.unsubscribe()
            try:
                await asyncio.wait_for(self._report(detail=repr(failure) if failure else None), 1.0)
                await self.bus.flush_while_connected()
            except Exception as exc:  # the server is gone: the status is lost, the work is redelivered
                self.log.warning("agent.final_report_failed", error=repr(exc))
            self.log.info("agent.stopped", state=self.state, counters=self.snapshot_counters())

    async def _end_when_stopped(self, tasks: list[asyncio.Task[None]]) -> None:
        """Once stopped, give producer work ``agent.drain_timeout_s`` to end (a second while the
        bus is disconnected), then cancel it: a stop is honoured in every state. Consumers drain
        their handlers by the same rule (``Consumer.run``)."""
        await first_completed(self.stopping.wait(), asyncio.wait(tasks))
        late = await drain(tasks, self.cfg.agent.drain_timeout_s, self.bus.connected)
        for task in late:
            self.log.warning("agent.cancelled_on_stop", task=task.get_name())
        await cancel_all(late)

    async def _main_once(self) -> None:
        await self.main()
        await self.stopping.wait()

    async def _supervise(self, name: str, start: Callable[[], Awaitable[None]]) -> None:
        ac = self.cfg.agent
        budget = RestartBudget(ac.max_restarts, ac.restart_window_s)
        while not self.stopping.is_set():
            try:
                await start()
                return
            except Exception as exc:
                recent = budget.crash()
                self.counters[f"restarts.{name}"] += 1
                self.log.error(
                    "agent.task_crashed",
                    task=name,
                    restarts=self.counters[f"restarts.{name}"],
                    recent=recent,
                    window_s=ac.restart_window_s,
                    error=repr(exc),
                    exc_info=exc,
                )
                if budget.exhausted:
                    self.stop()
                    raise AgentFailed(self.agent_id, recent, exc) from exc
                if not await self.sleep(budget.backoff(ac.restart_backoff_s)):
                    return

    async def _heartbeat(self) -> None:
        while await self.sleep(self.cfg.agent.heartbeat_s):
            await self._report()

    async def _report(self, detail: str | None = None) -> None:
        await self.bus.publish(
            self.event(
                AgentStatus,
                agent_id=self.agent_id,
                role=self.role,
                state=self.state,
                uptime_s=self.uptime_s,
                counters=self.snapshot_counters(),
                detail=detail,
            )
        )

    async def _on_control(self, request: ControlRequest) -> ControlReply:
        if request.command == "pause":
            self.pause()
        elif request.command == "resume":
            self.resume()
        elif request.command == "stop":
            self.stop()
            self.state = "draining"
        return ControlReply(
            agent_id=self.agent_id,
            role=self.role,
            state=self.state,
            uptime_s=self.uptime_s,
            counters=self.snapshot_counters(),
        )


async def run_agents(
    agents: Iterable[Agent], *, handle_signals: bool = True, until: asyncio.Event | None = None
) -> None:
    """Run agents side by side in one event loop; SIGINT/SIGTERM or ``until`` stops them all. The
    process's heap is trimmed every ``agent.heap_trim_s`` (the first agent's config) meanwhile."""
    agents = list(agents)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    watchdog: list[asyncio.TimerHandle] = []

    def not_stopped() -> None:  # a stop drains within seconds: one that does not says what it waits on
        running = [t.get_name() for t in tasks if not t.done()]
        if running:
            log.warning("agents.not_stopped", agents=running, after_s=NOT_STOPPED_REPORT_S)
            dump_tasks()

    def stop_all() -> None:
        for a in agents:
            a.stop()
        if not watchdog:
            watchdog.append(loop.call_later(NOT_STOPPED_REPORT_S, not_stopped))

    installed = []
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop_all)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
    try:
        async with asyncio.TaskGroup() as tg:
            tasks += [tg.create_task(a.run(), name=a.agent_id) for a in agents]
            if agents:
                tg.create_task(trimmed_while(tasks, agents[0].cfg.agent.heap_trim_s), name="run_agents:heap_trim")
            if until is not None:

                async def watch() -> None:
                    await first_completed(until.wait(), asyncio.wait(tasks))
                    stop_all()

                tg.create_task(watch(), name="run_agents:until")
    finally:
        for handle in watchdog:
            handle.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
