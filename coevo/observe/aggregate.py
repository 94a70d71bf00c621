"""The one aggregator: a run's events in, time series and page views out (pure: no I/O, no clock).

Invariants:
- ``add`` folds one event into the state and returns the points it produced; the same events in
  the same order give the same points, live (``coevo run``, ``coevo agent metrics``) or offline
  (``coevo report``, ``coevo dashboard`` over a finished run);
- time is the events' own (``ts``, seconds since the run's first event): running totals and rates
  are emitted at most once per ``tick_s`` of event time, and once more by ``finish()``;
- memory is bounded whatever the run's length (``Series`` caps, bounded views, 16-group windows).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coevo.observe.series import CHARTS, MIXED_WINDOW, SPECS, Point, Series, series_key
from coevo.observe.tally import RunTally, eval_round, round_index
from coevo.observe.views import AgentsView, PoolView, TrajectoriesView, knob_difficulty
from coevo.schemas import (
    AgentStatus,
    DeadLettered,
    Event,
    GroupScored,
    LearnerStepped,
    RunFinished,
    StepAgreementMeasured,
    StepJudged,
    StepTaken,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
    TaskSpec,
    TrajectoryCompleted,
    WeightsApplied,
)

Labels = tuple[tuple[str, str], ...]
REWARD_WINDOW = 16


@dataclass(frozen=True)
class ConsumerInfo:
    """A durable consumer's state as JetStream reports it."""

    name: str
    pending: int
    ack_pending: int
    redelivered: int = 0
    waiting: int = 0


class Aggregator:
    """Events -> series (``SPECS``), the summary's tally, and the views of the dashboard's pages."""

    def __init__(
        self,
        *,
        cap: int = 2000,
        tick_s: float = 5.0,
        window_s: float = 30.0,
        difficulty: Callable[[TaskSpec], float | None] = knob_difficulty,
    ) -> None:
        self.cap, self.tick_s, self.window_s, self.difficulty = cap, tick_s, window_s, difficulty
        self.series: dict[str, Series] = {}
        self.tally = RunTally()
        self.pool, self.agents, self.trajectories = PoolView(), AgentsView(), TrajectoriesView()
        self._last_totals: dict[tuple[str, str], float] = {}
        """(agent, counter) -> the running total its last heartbeat reported"""
        self.run_id: str | None = None
        self.t0: float | None = None
        self.t_last = 0.0
        self.last_seq = 0
        self.finished: dict[str, Any] | None = None
        self.learner: dict[str, dict[str, Any]] = {}
        self.staleness: dict[str, dict[str, int]] = {}
        self._totals: dict[tuple[str, Labels], float] = {}
        self._dirty: set[tuple[str, Labels]] = set()
        self._rewards: deque[float] = deque(maxlen=REWARD_WINDOW)
        self._mixed: deque[bool] = deque(maxlen=MIXED_WINDOW)
        self._agreed: set[str] = set()  # eval rounds whose step agreement was plotted (the tally holds the rest)
        self._rates: deque[tuple[float, int, int]] = deque()  # (t, trajectories, env steps) per tick
        self._next_tick: float | None = None
        self._handlers: dict[type[Event], Callable[[Any, float], list[Point]]] = {
            GroupScored: self._group,
            LearnerStepped: self._learner,
            WeightsApplied: self._weights,
            TaskScheduled: self._scheduled,
            TaskRewritten: self._rewritten,
            TaskDecided: self._decided,
            StepJudged: self._judged,
            TrajectoryCompleted: self._trajectory,
            StepAgreementMeasured: self._agreement,
            AgentStatus: self._status,
            DeadLettered: self._dead,
            RunFinished: self._finished,
            StepTaken: lambda e, t: [],
        }

    # ---- input -------------------------------------------------------------------------------

    def add(self, event: Event | None, seq: int = 0) -> list[Point]:
        """Fold one stored event (None: undecodable) into the state; the points it produced."""
        self.last_seq = max(self.last_seq, seq)
        self.tally.add(event)
        if event is None:
            return []
        if self.t0 is None:
            self.t0, self.run_id = event.ts, event.run_id
        t = max(0.0, event.ts - self.t0)
        self.t_last = max(self.t_last, t)
        out = self._tick(t, event.ts)
        handler = self._handlers.get(type(event))
        if handler is not None:
            out += handler(event, t)
        return out

    def add_consumers(self, infos: list[ConsumerInfo], wall: float) -> list[Point]:
        """JetStream's view of the durable consumers (not in the events: polled by the observer)."""
        t = max(0.0, wall - self.t0) if self.t0 is not None else 0.0
        out = []
        for c in infos:
            self.agents.consumers[c.name] = {
                "name": c.name,
                "pending": c.pending,
                "ack_pending": c.ack_pending,
                "redelivered": c.redelivered,
                "waiting": c.waiting,
            }
            labels = (("consumer", c.name),)
            out += [
                self._point("consumer_pending", labels, t, c.pending, wall),
                self._point("consumer_ack_pending", labels, t, c.ack_pending, wall),
            ]
        return out

    def finish(self) -> list[Point]:
        """Emit the running totals and rates not emitted yet (the end of a run or of a file)."""
        wall = (self.t0 or 0.0) + self.t_last
        return self._emit_totals(self.t_last, wall)

    # ---- output ------------------------------------------------------------------------------

    def summary(self, seconds: float | None = None) -> dict[str, Any]:
        """The run summary as ``summary.json`` holds it (``RunSummary``'s fields)."""
        return self.tally.summary(self.run_id or "", self.t_last if seconds is None else seconds).model_dump()

    def series_json(self) -> dict[str, Any]:
        """Every series with its points, and the catalogue (for the dashboard and the report)."""
        return {
            "charts": {k: {"title": v[0], "unit": v[1]} for k, v in CHARTS.items()},
            "specs": {
                k: {"help": s.help, "chart": s.chart, "unit": s.unit, "counter": s.counter} for k, s in SPECS.items()
            },
            "series": {
                k: {"name": s.name, "labels": dict(s.labels), "points": s.visible()} for k, s in self.series.items()
            },
        }

    def state_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "t": round(self.t_last, 1),
            "last_seq": self.last_seq,
            "t0": self.t0,
            "summary": self.summary(),
            "finished": self.finished,
            "learner": self.learner,
            "staleness": self.staleness,
            **self.pool.as_dict(),
            **self.agents.as_dict(),
        }

    def latest(self) -> list[tuple[str, Labels, float]]:
        """The latest value of every series (for Prometheus)."""
        return [(s.name, s.labels, s.last[1]) for s in self.series.values() if s.last is not None]

    # ---- helpers -----------------------------------------------------------------------------

    def _point(self, name: str, labels: Labels, t: float, value: float, wall: float, step: int | None = None) -> Point:
        key = series_key(name, labels)
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = Series(name, labels, cap=self.cap)
        p = Point(name, labels, round(t, 3), float(value), s.count if step is None else step, wall)
        s.append(p.t, p.value)
        return p

    def _add_total(self, name: str, amount: float, labels: Labels = ()) -> None:
        if amount:
            key = (name, labels)
            self._totals[key] = self._totals.get(key, 0.0) + amount
            self._dirty.add(key)

    def _tick(self, t: float, wall: float) -> list[Point]:
        if self._next_tick is None:
            self._next_tick = t + self.tick_s
            self._rates.append((t, 0, 0))
        if t < self._next_tick:
            return []
        self._next_tick = t + self.tick_s
        return self._emit_totals(t, wall)

    def _emit_totals(self, t: float, wall: float) -> list[Point]:
        out = [self._point(n, labels, t, self._totals[(n, labels)], wall) for n, labels in sorted(self._dirty)]
        self._dirty.clear()
        trajs, steps = self.tally.counts["trajectory.completed"], self.tally.counts["step.taken"]
        self._rates.append((t, trajs, steps))
        while len(self._rates) > 2 and self._rates[1][0] <= t - self.window_s:
            self._rates.popleft()
        t_a, trajs_a, steps_a = self._rates[0]
        if t - t_a > 0:
            out += [
                self._point("trajectories_per_second", (), t, round((trajs - trajs_a) / (t - t_a), 3), wall),
                self._point("env_steps_per_second", (), t, round((steps - steps_a) / (t - t_a), 3), wall),
            ]
        return out

    # ---- one handler per event type ----------------------------------------------------------

    def _group(self, e: GroupScored, t: float) -> list[Point]:
        self.pool.scored(e)
        self.trajectories.scored(e)
        out = []
        if e.purpose == "train":
            self._rewards.append(e.mean_reward)
            self._mixed.append(0.0 < e.accuracy < 1.0)
            out += [
                self._point("success_train", (), t, e.accuracy, e.ts),
                self._point("train_groups_mixed", (), t, round(sum(self._mixed) / len(self._mixed), 4), e.ts),
                self._point("reward_mean", (), t, round(e.mean_reward, 5), e.ts),
            ]
            if len(self._rewards) >= 2:
                out.append(self._point("reward_std", (), t, round(statistics.stdev(self._rewards), 5), e.ts))
        elif e.purpose == "eval":
            out += self._eval_round(e, t)
        for name, value in (
            ("judge_process_accuracy", e.judge_process_accuracy),
            ("judge_outcome_accuracy", e.judge_outcome_accuracy),
            ("judge_consistency", e.judge_consistency),
        ):
            if value is not None:
                out.append(self._point(name, (), t, value, e.ts))
        return out

    def _eval_round(self, e: GroupScored, t: float) -> list[Point]:
        """A round's point once every scheduled group of it is scored (the tally, fed first, holds both)."""
        name = eval_round(e.group_id)
        accs = self.tally.evals[name]
        if len(accs) != self.tally.round_sizes[name]:
            return []
        step = round_index(name)
        return [self._point("success_heldout", (), t, round(statistics.fmean(accs), 4), e.ts, step=step)]

    def _agreement(self, e: StepAgreementMeasured, t: float) -> list[Point]:
        """A round's point once every scheduled group of it was measured (the tally keeps a group's first
        measure only), plotted once."""
        name = eval_round(e.group_id)
        by_group = self.tally.agreements[name]
        values = [a for a in by_group.values() if a is not None]
        if name in self._agreed or len(by_group) != self.tally.round_sizes[name] or not values:
            return []
        self._agreed.add(name)
        step = round_index(name)
        return [self._point("heldout_agreement", (), t, round(statistics.fmean(values), 4), e.ts, step=step)]

    def _learner(self, e: LearnerStepped, t: float) -> list[Point]:
        self.trajectories.trained(e)
        if not e.is_step:  # a report of groups disposed of untrained: no step to plot
            return []
        labels = (("role", e.role),)
        hist = self.staleness.setdefault(e.role, {})
        n = sum(e.staleness_histogram.values())
        for k, v in e.staleness_histogram.items():
            hist[k] = hist.get(k, 0) + v
            self._add_total("learner_staleness_samples_total", v, (("role", e.role), ("staleness", k)))
        self.learner[e.role] = {
            "version": e.version,
            "loss": e.loss,
            "kl": e.kl,
            "clip_fraction": e.clip_fraction,
            "mismatch_kl": e.mismatch_kl,
            "entropy": e.entropy,
            "tokens_per_second": e.tokens_per_second,
            "samples": e.samples,
            "t": round(t, 1),
        }
        out = [
            self._point(name, labels, t, value, e.ts, step=e.version)
            for name, value in (
                ("learner_loss", e.loss),
                ("learner_kl", e.kl),
                ("learner_clip_fraction", e.clip_fraction),
                ("learner_mismatch_kl", e.mismatch_kl),
                ("learner_tokens_per_second", e.tokens_per_second),
            )
        ]
        if e.mismatch_kl_current is not None:
            point = self._point("learner_mismatch_kl_current", labels, t, e.mismatch_kl_current, e.ts, step=e.version)
            out.append(point)
        if e.entropy is not None:
            out.append(self._point("learner_entropy", labels, t, e.entropy, e.ts, step=e.version))
        if e.entropy_coef is not None:
            out.append(self._point("learner_entropy_coef", labels, t, e.entropy_coef, e.ts, step=e.version))
        if n:
            mean = sum(_num(k) * v for k, v in e.staleness_histogram.items()) / n
            out.append(self._point("learner_staleness_mean", labels, t, round(mean, 4), e.ts, step=e.version))
        return out

    def _weights(self, e: WeightsApplied, t: float) -> list[Point]:
        if not e.ok:
            self._add_total("weights_apply_failures_total", 1, (("role", e.role), ("server", e.server)))
            return []
        labels = (("role", e.role), ("server", e.server), ("transport", e.transport))
        return [self._point("weights_pause_ms", labels, t, round(e.pause_ms, 3), e.ts, step=e.version)]

    def _scheduled(self, e: TaskScheduled, t: float) -> list[Point]:
        self.trajectories.scheduled(e)
        difficulty = self.difficulty(e.task) if e.purpose != "candidate" else None
        if self.pool.scheduled(e, difficulty) and difficulty is not None and e.slot_id is not None:
            return [self._point("task_difficulty", (("slot", e.slot_id),), t, difficulty, e.ts)]
        return []

    def _rewritten(self, e: TaskRewritten, t: float) -> list[Point]:
        self.pool.rewritten(e, t)
        self._add_total("rewrites_proposed_total", 1)
        if not e.precheck_ok:
            self._add_total("rewrites_rejected_total", 1)
        return []

    def _decided(self, e: TaskDecided, t: float) -> list[Point]:
        self.pool.decided(e, t)
        self._add_total("rewrites_accepted_total" if e.accepted else "rewrites_rejected_total", 1)
        return []

    def _judged(self, e: StepJudged, t: float) -> list[Point]:
        self._add_total("judge_errors_total", sum(v.status == "error" for v in e.votes))
        self._add_total("judge_calls_total", sum(v.status != "error" and not v.cached for v in e.votes))
        self._add_total("judge_cost_usd_total", sum(v.cost_usd for v in e.votes))
        return []

    def _trajectory(self, e: TrajectoryCompleted, t: float) -> list[Point]:
        self.trajectories.completed(e, t)
        return []

    def _status(self, e: AgentStatus, t: float) -> list[Point]:
        restarts = self.agents.status(e)
        self._add_total(
            "agent_restarts_total", self._growth(e.agent_id, "restarts", restarts), (("agent", e.agent_id),)
        )
        for key, total in e.counters.items():  # an agent's counters are its totals since it started
            if key.startswith("endpoint.tokens."):
                self._add_total(
                    "endpoint_prompts_total",
                    self._growth(e.agent_id, key, total),
                    (("tokens", key.removeprefix("endpoint.tokens.")),),
                )
        return []

    def _growth(self, agent_id: str, key: str, total: float) -> float:
        """How much an agent's running total ``key`` grew since its last heartbeat (all of it at the first)."""
        last = self._last_totals.get((agent_id, key), 0.0)
        self._last_totals[(agent_id, key)] = total
        return max(total - last, 0.0)

    def _dead(self, e: DeadLettered, t: float) -> list[Point]:
        self.agents.dead_lettered(e, t)
        self._add_total("dead_letters_total", 1, (("consumer", e.consumer),))
        return []

    def _finished(self, e: RunFinished, t: float) -> list[Point]:
        self.finished = dict(e.summary)
        return self._emit_totals(t, e.ts)


def _num(key: str) -> float:
    try:
        return float(key.rstrip("+"))
    except ValueError:
        return 0.0
