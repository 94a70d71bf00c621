"""What ``summary.json`` reports, accumulated event by event (pure: events in, a dict out).

Invariant: the summary is a function of the stored events only (and the run's duration), so the
summary of a run, of its replay and of an offline ``coevo report`` agree. ``RunSummary`` states what
every field means; docs/observability.md's table is generated from it (a test keeps them equal).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coevo.schemas import (
    AgentStatus,
    Event,
    GroupScored,
    LearnerStepped,
    RunFinished,
    StepAgreementMeasured,
    StepJudged,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
)


class Interval(BaseModel):
    """A change between two windows of groups: how many groups each held and the 95 % bootstrap
    interval of ``end - start`` (``coevo.observe.claims``; no interval below ``MIN_GROUPS`` a window)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    groups: tuple[int, int] = Field(description="groups in the first and in the last window")
    low: float | None = Field(description="lower end of the 95 % interval (None: too few groups to say)")
    high: float | None = Field(description="upper end of the 95 % interval (None: too few groups to say)")

    @classmethod
    def of(cls, first: list[float], last: list[float]) -> Interval | None:
        from coevo.observe.claims import change

        c = change(first, last)
        if c is None:
            return None
        low, high = c.interval or (None, None)
        return cls(groups=(c.n_start, c.n_end), low=low, high=high)


_CHANGE = (
    "{what}: groups in the first and last window and the 95 % bootstrap interval of end - start "
    "(low, high: None with fewer than 5 groups in a window, too few to say); 'improved' is said only "
    "when the interval lies above 0"
)


class RunSummary(BaseModel):
    """``summary.json``: what a run did, from its stored events. Each field's description is its row in
    docs/observability.md (``summary_table`` writes that table; a test keeps the doc equal to it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(description="the run's id (its directory under runs/, its stream COEVO_<run_id>)")
    policy_success_start: float | None = Field(
        description=("mean success (fraction of rollouts won) of the first fifth of the train groups")
    )
    policy_success_end: float | None = Field(description="the same over the last fifth of the train groups")
    heldout_success_start: float | None = Field(
        description=("mean success of the first held-out evaluation round (fixed tasks, never trained on)")
    )
    heldout_success_end: float | None = Field(
        description=(
            "the same for the last complete evaluation round (every held-out group of it "
            "scored; a round cut short by the end of the run is left out)"
        )
    )
    judge_process_accuracy_start: float | None = Field(
        description=(
            "judge's step votes agreeing with the environment's step labels: the first quarter of the scored groups"
        )
    )
    judge_process_accuracy: float | None = Field(description="the same over the last quarter of the scored groups")
    policy_success_change: Interval | None = Field(
        default=None, description=_CHANGE.format(what="policy_success_end - policy_success_start")
    )
    heldout_success_change: Interval | None = Field(
        default=None, description=_CHANGE.format(what="heldout_success_end - heldout_success_start")
    )
    heldout_success_rounds: list[float] = Field(
        default_factory=list,
        description="mean success of every held-out evaluation round, in order (the curve between start and end)",
    )
    heldout_agreement_start: float | None = Field(
        default=None,
        description=(
            "held-out step agreement of the first evaluation round whose every group was measured: the policy's "
            "mean probability, at its temperature, of the ceiling's action (scripted reader or walkthrough) on "
            "the ceiling's path through each evaluation group's task (one path a group; families with a ceiling, "
            "a choosing policy)"
        ),
    )
    heldout_agreement_end: float | None = Field(
        default=None, description="the same for the last evaluation round whose every group was measured"
    )
    heldout_agreement_rounds: list[float] = Field(
        default_factory=list, description="held-out step agreement of every evaluation round, in order"
    )
    judge_process_accuracy_change: Interval | None = Field(
        default=None, description=_CHANGE.format(what="judge_process_accuracy - judge_process_accuracy_start")
    )
    judge_outcome_accuracy_start: float | None = Field(
        description=("judge's votes agreeing with the trajectory's outcome: first quarter of groups")
    )
    judge_outcome_accuracy: float | None = Field(description="the same over the last quarter of the scored groups")
    judge_vote_positive_start: float | None = Field(
        default=None,
        description="share of the judge's parseable votes that are +1, first quarter of the groups with votes "
        "(with judge_steps_silent: a judge that votes one way on everything has stopped learning, docs/benchmarks.md "
        "'Why a judge collapses')",
    )
    judge_vote_positive: float | None = Field(default=None, description="the same over the last quarter")
    judge_steps_silent_start: float | None = Field(
        default=None,
        description="share of the judged steps whose votes all earned the same consistency reward, steps that give "
        "the judge no training sample: first quarter of the groups with votes (every scored group counts, trained "
        "on or not, as for the judge's accuracies)",
    )
    judge_steps_silent: float | None = Field(default=None, description="the same over the last quarter")
    steps_without_votes: float | None = Field(
        default=None,
        description="share of the steps of scored groups scored without the judge's votes (they came after "
        "scorer.vote_timeout_s: a judge slower than the policy), over the run; those steps carry the outcome only",
    )
    steps_labelled_good: float | None = Field(
        default=None,
        description="share of the steps with a reference label labelled +1, over the run (a judge voting -1 on "
        "everything has process accuracy 1 - this)",
    )
    judge_process_accuracy_heldout: float | None = Field(
        description=("judge process accuracy on held-out groups, last half of them")
    )
    judge_outcome_accuracy_heldout: float | None = Field(
        description=("judge outcome accuracy on held-out groups, last half of them")
    )
    rewrites_proposed: int = Field(description="task rewrites the rewriter proposed (task.rewritten events)")
    rewrites_accepted: int = Field(
        description=("rewrites the acceptance gate accepted (they replaced their slot's task)")
    )
    rewrites_proposed_wide: int = Field(
        description=("of the rewrites proposed, those of a saturated slot (more than one knob step, tasks.saturated_*)")
    )
    rewrites_proposed_capped: int = Field(
        default=0,
        description="of the rewrites proposed, those an earlier overshoot capped below the knob steps their slot's "
        "saturation asked for (saturation.capped; counted from events of schema 2.1 on)",
    )
    rewrites_decided: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="the gate's verdicts by direction and where each measured candidate landed: harder ones "
        "accepted, too_hard (solved, below the band), unsolved (accuracy 0) or not_harder (at or above their "
        "parent's accuracy); easier ones accepted, too_easy (above the band) or not_easier; unmeasured: refused "
        "before any rollout",
    )
    learner_steps: int = Field(description="optimiser steps of the policy lane (= the last policy weights version)")
    judge_learner_steps: int = Field(description="optimiser steps of the judge lane")
    policy_kl_rejected: int = Field(
        description=("policy batches undone by learner.max_step_kl (their step moved the policy too far)")
    )
    policy_not_finite: int = Field(
        default=0,
        description="policy batches refused because a loss or gradient norm was not finite (weights untouched; "
        "their groups retried alone, then dead-lettered)",
    )
    policy_step_kl_max: float | None = Field(
        description=("largest KL per token a policy step moved its weights (measured under learner.max_step_kl)")
    )
    policy_mismatch_kl_max: float | None = Field(
        description="largest KL per token from the sampler to the learner's weights at a policy step (the drift "
        "of the weights since a stale sample was drawn included)"
    )
    policy_mismatch_kl_current_max: float | None = Field(
        default=None,
        description="largest KL per token from the sampler to the learner's weights at a policy step, on samples "
        "drawn by those same weights: the sampler's own mismatch",
    )
    policy_entropy_start: float | None = Field(
        default=None,
        description="mean entropy (nats per response token) of the distributions the policy's batches were drawn "
        "from, under the weights before each step: first quarter of the policy steps (a policy that collapses to "
        "one answer per prompt goes to 0)",
    )
    policy_entropy: float | None = Field(default=None, description="the same over the last quarter")
    policy_entropy_min: float | None = Field(
        default=None, description="the lowest entropy of any policy batch (nats per response token)"
    )
    policy_step_gap_max_s: float | None = Field(
        default=None,
        description="the longest the policy lane waited for a batch, in seconds of event time: from a session's "
        "first event to its first step, between two steps (less the later step's own time), or from its last step "
        "to its end (a resumed run's sessions apart; the learner starving or the samplers stalled)",
    )
    policy_step_gap_where: str | None = Field(
        default=None,
        description="where that wait was: 'before the first step', 'after version N' or 'after the last step'",
    )
    policy_samples: int = Field(
        description=("policy training samples the scorer produced (one per step of a trainable group)")
    )
    train_groups_with_samples: int = Field(
        description=(
            "train groups that produced policy samples (a group where every rollout won, or "
            "every one lost, has no signal and produces none)"
        )
    )
    train_groups_unanimous_end: float | None = Field(
        default=None,
        description="share of the last fifth of the train groups whose rollouts were all won or all lost (no "
        "outcome signal: near 1, the learner is starving, as when the policy has collapsed onto one line per task)",
    )
    events: dict[str, int] = Field(
        description=("number of stored events of each kind (all purposes, all agents, heartbeats included)")
    )
    trajectories_per_second: float = Field(description="completed trajectories (all purposes) per second of the run")
    judge_errors: int = Field(description="judge votes that failed (an API error is an error vote, never a -1)")
    judge_calls: int = Field(description="judge votes answered by a model call")
    judge_cache_hits: int = Field(description="judge votes answered from the response cache")
    judge_cost_usd: float = Field(description="cost of the judge's API calls, from LiteLLM's prices")
    seconds: float = Field(description="wall-clock duration of the run (this process's part of it after a resume)")
    groups_scored: int = Field(description="train groups scored (the groups policy_success_* averages over)")
    groups_scored_by_purpose: dict[str, int] = Field(
        description=(
            "scored groups by purpose: train, candidate (a rewrite under measurement), eval "
            "(held-out); their sum is events['group.scored']"
        )
    )
    busy_share: dict[str, float] = Field(
        default_factory=dict,
        description="share of the run's wall clock each worker spent computing: 'policy engine' and 'judge engine' "
        "(batches of forward passes of a local engine, from their agents' heartbeats) and 'learner' (its steps, "
        "both lanes). On shared cores they overlap: two at 0.5 each may have run at once half the time",
    )
    engine_tokens_per_s: dict[str, float] = Field(
        default_factory=dict,
        description="per local engine (policy, judge): token positions run per second busy, padding included",
    )
    engine_padding_share: dict[str, float] = Field(
        default_factory=dict,
        description="per local engine: the share of its token positions that were padding (a batch's rows are "
        "left-padded to its longest prompt; a finished row rides along a batch that still generates)",
    )


SUMMARY_FIELDS: dict[str, str] = {name: f.description or "" for name, f in RunSummary.model_fields.items()}
"""field -> what it means (the report's tooltips)"""
SUMMARY_TABLE = ("<!-- summary-table: generated from coevo.observe.tally.RunSummary -->", "<!-- /summary-table -->")
"""the markers around the generated table in docs/observability.md"""


def summary_table() -> str:
    """docs/observability.md's table of ``summary.json`` fields, from ``RunSummary``'s descriptions."""
    rows = "".join(f"| `{name}` | {text} |\n" for name, text in SUMMARY_FIELDS.items())
    return f"{SUMMARY_TABLE[0]}\n| field | meaning |\n|---|---|\n{rows}{SUMMARY_TABLE[1]}"


def _where(after: int | None, *, last: bool) -> str:
    """Where a wait for a policy batch was: before any step, after the session's last, or after version ``after``."""
    return "before the first step" if after is None else "after the last step" if last else f"after version {after}"


def eval_round(group_id: str) -> str:
    """The evaluation round an eval group belongs to (``eval3-…`` -> ``eval3``: the tasks agent's ids)."""
    return group_id.split("-")[0]


def round_index(name: str) -> int:
    """The number of an evaluation round (``eval3`` -> 3)."""
    return int(name[4:] or 0)


def landed(event: TaskDecided) -> str:
    """Where the gate's verdict put a candidate (``accept_rewrite``'s cases, read from the verdict and the
    two accuracies alone: a refused candidate between its parent and 0 was below the band, one above its
    parent's accuracy going easier was above it)."""
    c, p = event.candidate_accuracy, event.parent_accuracy
    if event.accepted:
        return "accepted"
    if c is None:
        return "unmeasured"
    if event.direction == "harder":
        return "unsolved" if c == 0 else "too_hard" if c < p else "not_harder"
    return "too_easy" if c > p else "not_easier"


def _busy_s(event: LearnerStepped) -> float:
    """The seconds a learner step itself took (its tokens at its rate)."""
    return event.tokens / event.tokens_per_second if event.tokens_per_second > 0 else 0.0


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _quarter(xs: list[float], *, first: bool) -> list[float]:
    """The first or the last quarter of ``xs`` (at least one value)."""
    k = max(1, len(xs) // 4)
    return xs[:k] if first else xs[-k:]


@dataclass
class RunTally:
    """The summary's inputs, accumulated event by event."""

    counts: Counter[str] = field(default_factory=Counter)
    train: list[float] = field(default_factory=list)
    evals: dict[str, list[float]] = field(default_factory=dict)
    agreements: dict[str, dict[str, float | None]] = field(default_factory=dict)  # round -> group -> agreement
    round_sizes: Counter[str] = field(default_factory=Counter)  # eval round -> its groups (old events: so far)
    proc: list[float] = field(default_factory=list)
    outc: list[float] = field(default_factory=list)
    proc_heldout: list[float] = field(default_factory=list)  # held-out groups: the same tasks whatever the rewriter did
    outc_heldout: list[float] = field(default_factory=list)
    positive: list[float] = field(default_factory=list)
    silent: list[float] = field(default_factory=list)
    labelled_good: list[float] = field(default_factory=list)
    steps_scored: int = 0
    steps_unvoted: int = 0
    purposes: Counter[str] = field(default_factory=Counter)
    policy_samples: int = 0
    groups_with_samples: int = 0
    learner_steps: int = 0
    judge_steps: int = 0
    kl_rejected: int = 0
    not_finite: int = 0
    step_kl_max: float | None = None
    mismatch_kl_max: float | None = None
    mismatch_kl_current_max: float | None = None
    entropy: list[float] = field(default_factory=list)
    gap: tuple[float, str] | None = None  # the longest wait for a policy batch so far, and where
    mark: tuple[float, int | None] | None = None  # this session's last step (or start): time, version
    last_ts: float | None = None
    accepted: int = 0
    wide: int = 0
    capped: int = 0
    judge: Counter[str] = field(default_factory=Counter)
    judge_cost: float = 0.0
    learner_busy_s: float = 0.0
    decided: dict[str, Counter[str]] = field(default_factory=lambda: {"harder": Counter(), "easier": Counter()})
    engines: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)
    """agent id -> its role and its last heartbeat's ``engine.*`` counters (totals since it started)"""

    def add(self, event: Event | None) -> None:
        if event is None:
            self.counts["undecodable"] += 1
            return
        self.counts[event.kind] += 1  # type: ignore[attr-defined]
        self._wait(event)
        if isinstance(event, GroupScored):
            self._scored(event)
        elif isinstance(event, AgentStatus):
            work = {k.removeprefix("engine."): v for k, v in event.counters.items() if k.startswith("engine.")}
            if work:
                self.engines[event.agent_id] = (event.role, work)
        elif isinstance(event, LearnerStepped):
            self.learner_busy_s += _busy_s(event)
            self.learner_steps += event.role == "policy" and event.is_step
            self.judge_steps += event.role == "judge" and event.is_step
            if event.role == "policy":
                self.kl_rejected += event.kl_rejected
                self.not_finite += event.not_finite
            if event.role == "policy" and event.is_step:
                self.mismatch_kl_max = max(self.mismatch_kl_max or 0.0, event.mismatch_kl)
                if event.mismatch_kl_current is not None:
                    self.mismatch_kl_current_max = max(self.mismatch_kl_current_max or 0.0, event.mismatch_kl_current)
                if event.step_kl is not None:
                    self.step_kl_max = max(self.step_kl_max or 0.0, event.step_kl)
                if event.entropy is not None:
                    self.entropy.append(event.entropy)
        elif isinstance(event, TaskDecided):
            self.accepted += event.accepted
            self.decided[event.direction][landed(event)] += 1
        elif isinstance(event, TaskRewritten):
            self.wide += event.moves > 1
            self.capped += event.moves_wanted is not None and event.moves < event.moves_wanted
        elif isinstance(event, TaskScheduled) and event.purpose == "eval":
            name = eval_round(event.group_id)
            self.round_sizes[name] = event.round_size or self.round_sizes[name] + 1  # old events: a count
        elif isinstance(event, StepAgreementMeasured):  # a redelivered group's second measure is not counted
            self.agreements.setdefault(eval_round(event.group_id), {}).setdefault(event.group_id, event.agreement)
        elif isinstance(event, StepJudged):
            for v in event.votes:
                self.judge["errors"] += v.status == "error"
                self.judge["cache_hits"] += v.cached
                self.judge["calls"] += v.status != "error" and not v.cached
                self.judge_cost += v.cost_usd

    def _wait(self, event: Event) -> None:
        """The waits for a policy batch, in the stream's order: a session starts at its first event and ends
        at its ``RunFinished`` (a resumed run's downtime is no wait); a step ends a wait, less its own time."""
        ts = event.ts
        if self.mark is None:  # a session's first event
            self.mark = (ts, None)
        if isinstance(event, LearnerStepped) and event.role == "policy" and event.is_step:
            self._waited(ts - self.mark[0] - _busy_s(event), self.mark[1])
            self.mark = (ts, event.version)
        elif isinstance(event, RunFinished):
            self._waited(ts - self.mark[0], self.mark[1], last=True)
            self.mark = None
        self.last_ts = ts

    def _waited(self, seconds: float, after: int | None, *, last: bool = False) -> None:
        if self.gap is None or seconds > self.gap[0]:
            self.gap = (max(seconds, 0.0), _where(after, last=last))

    def _longest_gap(self) -> dict[str, Any]:
        """``policy_step_gap_max_s`` and ``policy_step_gap_where``: the longest wait, this session's open one
        (from its last step to the last event) included; none without events."""
        gap = self.gap
        if self.mark is not None and self.last_ts is not None:
            open_s = self.last_ts - self.mark[0]
            if gap is None or open_s > gap[0]:
                gap = (open_s, _where(self.mark[1], last=True))
        return {} if gap is None else {"policy_step_gap_max_s": round(gap[0], 1), "policy_step_gap_where": gap[1]}

    def _scored(self, event: GroupScored) -> None:
        heldout = event.purpose == "eval"
        self.purposes[event.purpose] += 1
        self.steps_scored += len(event.step_event_ids)
        self.steps_unvoted += len(event.stragglers)
        if event.purpose == "train":
            self.train.append(event.accuracy)
            self.policy_samples += len(event.policy_samples)
            self.groups_with_samples += bool(event.policy_samples)
        elif heldout:
            self.evals.setdefault(eval_round(event.group_id), []).append(event.accuracy)
        if event.judge_process_accuracy is not None:
            self.proc.append(event.judge_process_accuracy)
            if heldout:
                self.proc_heldout.append(event.judge_process_accuracy)
        if event.judge_outcome_accuracy is not None:
            self.outc.append(event.judge_outcome_accuracy)
            if heldout:
                self.outc_heldout.append(event.judge_outcome_accuracy)
        for values, x in (
            (self.positive, event.judge_vote_positive),
            (self.silent, event.judge_steps_silent),
            (self.labelled_good, event.steps_labelled_good),
        ):
            if x is not None:
                values.append(x)

    def _rewrites(self) -> dict[str, Any]:
        """The ``rewrites_*`` fields."""
        return {
            "rewrites_proposed": self.counts["task.rewritten"],
            "rewrites_accepted": self.accepted,
            "rewrites_proposed_wide": self.wide,
            "rewrites_proposed_capped": self.capped,
            "rewrites_decided": {d: dict(sorted(c.items())) for d, c in self.decided.items() if c},
        }

    def _compute(self, seconds: float) -> dict[str, Any]:
        """``busy_share``, ``engine_tokens_per_s`` and ``engine_padding_share`` (engines summed per role)."""
        work: dict[str, Counter[str]] = {}
        for role, counters in self.engines.values():
            work.setdefault(role, Counter()).update(counters)
        busy = {f"{role} engine": w["busy_ms"] / 1e3 / seconds for role, w in sorted(work.items())}
        if self.learner_busy_s:
            busy["learner"] = self.learner_busy_s / seconds
        return {
            "busy_share": {k: round(v, 4) for k, v in busy.items()},
            "engine_tokens_per_s": {
                r: round(w["tokens"] * 1e3 / w["busy_ms"], 1) for r, w in work.items() if w["busy_ms"]
            },
            "engine_padding_share": {r: round(w["padding"] / w["tokens"], 4) for r, w in work.items() if w["tokens"]},
        }

    def _agreement_rounds(self) -> dict[str, Any]:
        """The ``heldout_agreement_*`` fields: the mean of each evaluation round whose every scheduled group
        was measured (a group with an empty path counts as measured, with no value)."""
        ordered = sorted(self.agreements.items(), key=lambda kv: round_index(kv[0]))
        means = [
            m
            for name, by_group in ordered
            if len(by_group) >= self.round_sizes[name]
            and (m := _mean([a for a in by_group.values() if a is not None])) is not None
        ]
        return {
            "heldout_agreement_start": means[0] if means else None,
            "heldout_agreement_end": means[-1] if means else None,
            "heldout_agreement_rounds": means,
        }

    def summary(self, run_id: str, seconds: float) -> RunSummary:
        k = max(1, len(self.train) // 5)
        ordered = sorted(self.evals.items(), key=lambda kv: round_index(kv[0]))
        complete = [v for name, v in ordered if len(v) >= self.round_sizes[name]]
        rounds = complete or [v for _, v in ordered]
        seconds = max(seconds, 1e-9)
        return RunSummary(
            run_id=run_id,
            policy_success_start=_mean(self.train[:k]),
            policy_success_end=_mean(self.train[-k:]),
            heldout_success_start=_mean(rounds[0]) if rounds else None,
            heldout_success_end=_mean(rounds[-1]) if rounds else None,
            judge_process_accuracy_start=_mean(_quarter(self.proc, first=True)),
            judge_process_accuracy=_mean(_quarter(self.proc, first=False)),
            policy_success_change=Interval.of(self.train[:k], self.train[-k:]),
            heldout_success_change=Interval.of(rounds[0], rounds[-1]) if len(rounds) > 1 else None,
            heldout_success_rounds=[m for r in rounds if (m := _mean(r)) is not None],
            **self._agreement_rounds(),
            judge_process_accuracy_change=Interval.of(
                _quarter(self.proc, first=True), _quarter(self.proc, first=False)
            ),
            judge_outcome_accuracy_start=_mean(_quarter(self.outc, first=True)),
            judge_outcome_accuracy=_mean(_quarter(self.outc, first=False)),
            judge_vote_positive_start=_mean(_quarter(self.positive, first=True)),
            judge_vote_positive=_mean(_quarter(self.positive, first=False)),
            judge_steps_silent_start=_mean(_quarter(self.silent, first=True)),
            judge_steps_silent=_mean(_quarter(self.silent, first=False)),
            steps_labelled_good=_mean(self.labelled_good),
            steps_without_votes=round(self.steps_unvoted / self.steps_scored, 4) if self.steps_scored else None,
            judge_process_accuracy_heldout=_mean(self.proc_heldout[-max(1, len(self.proc_heldout) // 2) :]),
            judge_outcome_accuracy_heldout=_mean(self.outc_heldout[-max(1, len(self.outc_heldout) // 2) :]),
            **self._rewrites(),
            learner_steps=self.learner_steps,
            judge_learner_steps=self.judge_steps,
            policy_kl_rejected=self.kl_rejected,
            policy_not_finite=self.not_finite,
            policy_step_kl_max=_round(self.step_kl_max, 4),
            policy_mismatch_kl_max=_round(self.mismatch_kl_max, 4),
            policy_mismatch_kl_current_max=_round(self.mismatch_kl_current_max, 7),
            policy_entropy_start=_mean(_quarter(self.entropy, first=True)),
            policy_entropy=_mean(_quarter(self.entropy, first=False)),
            policy_entropy_min=round(min(self.entropy), 4) if self.entropy else None,
            **self._longest_gap(),
            policy_samples=self.policy_samples,
            train_groups_with_samples=self.groups_with_samples,
            train_groups_unanimous_end=_mean([float(a in (0.0, 1.0)) for a in self.train[-k:]]),
            events=dict(sorted(self.counts.items())),
            trajectories_per_second=round(self.counts["trajectory.completed"] / seconds, 3),
            judge_errors=self.judge["errors"],
            judge_calls=self.judge["calls"],
            judge_cache_hits=self.judge["cache_hits"],
            judge_cost_usd=round(self.judge_cost, 6),
            seconds=round(seconds, 1),
            groups_scored=len(self.train),
            groups_scored_by_purpose=dict(sorted(self.purposes.items())),
            **self._compute(seconds),
        )
