"""The scorer: assembles each task's group and emits ``GroupScored`` with the training samples.

Invariants:
- a group is scored exactly once (its ``GroupScored`` id is derived from the group id, so a
  rescoring after a restart is stored once); only once its ``GroupScored`` is stored is it
  remembered as scored and its state dropped (bounded memory): a score that could not be stored
  is attempted again, never skipped;
- a group is scored when all ``n`` rollouts completed and every step of them was judged; a
  step still without votes ``vote_timeout_s`` after its trajectory completed is scored without
  step signal and listed in ``stragglers``; a group missing trajectories ``group_timeout_s``
  after it was scheduled is scored with those it has (or flagged when it has none);
- on restart the state is rebuilt from the stream up to the last event the consumer delivered
  (not its ack floor: an event acknowledged above an unacknowledged one, e.g. one whose delivery
  or ack a NATS node's death lost, is never delivered again), so what was acknowledged before the
  crash is not lost; what was delivered but not acknowledged comes again, and applying an event
  twice changes nothing; steps and votes, the bulk of the stream, are read only from the oldest
  group still open (a restart late in a long run stays cheap).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from coevo.algorithm import scoring
from coevo.config import CoevoConfig, ScorerConfig
from coevo.runtime.agent import Agent
from coevo.runtime.bus import stored_id
from coevo.runtime.consumer import Delivery, Subscription
from coevo.schemas import (
    Event,
    FailureDigest,
    GroupScore,
    GroupScored,
    StepJudged,
    StepTaken,
    TaskScheduled,
    TrainingSample,
    TrajectoryCompleted,
)

SCORED = "scored-"


def scored_id(group_id: str) -> str:
    return f"{SCORED}{group_id}"


@dataclass
class Group:
    scheduled: TaskScheduled | None = None
    trajectories: dict[int, TrajectoryCompleted] = field(default_factory=dict)
    steps: dict[str, StepTaken] = field(default_factory=dict)
    judged: dict[str, StepJudged] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)
    last_completed: float | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, TaskScheduled):
            self.scheduled = event
        elif isinstance(event, StepTaken):
            self.steps[event.event_id] = event
        elif isinstance(event, StepJudged):
            self.judged[event.step_event_id] = event
        elif isinstance(event, TrajectoryCompleted):
            self.trajectories.setdefault(event.rollout_index, event)  # first completion of each rollout wins
            self.last_completed = time.monotonic()

    def needed_steps(self) -> list[str]:
        return [sid for t in self.trajectories.values() if t.outcome != "aborted" for sid in t.step_event_ids]

    def readiness(self, now: float, cfg: CoevoConfig, need_votes: bool) -> str | None:
        """None (wait), 'complete', 'vote-timeout' or 'group-timeout'."""
        if self.scheduled is None:
            return None
        n = self.scheduled.n_rollouts
        have_all = len(self.trajectories) >= n and all(s in self.steps for s in self.needed_steps())
        if have_all:
            if not need_votes or all(s in self.judged for s in self.needed_steps()):
                return "complete"
            if self.last_completed is not None and now - self.last_completed > cfg.scorer.vote_timeout_s:
                return "vote-timeout"
            return None
        if now - self.first_seen > cfg.scorer.group_timeout_s:
            return "group-timeout"
        return None


def make_sample(
    sample_id: str, role: str, tokens: Any, advantage: float, model_version: int, step_event_id: str
) -> TrainingSample:
    """The one way to build a training sample: the tokens and sampling log-probs of ``tokens``
    (a ``StepTaken`` or a judge vote), with its advantage."""
    return TrainingSample(
        sample_id=sample_id,
        role=role,  # type: ignore[arg-type]
        prompt_token_ids=tokens.prompt_token_ids,
        response_token_ids=tokens.response_token_ids,
        logprobs=tokens.logprobs,
        allowed_token_ids=tokens.allowed_token_ids,
        grammar=getattr(tokens, "grammar", None),  # a judge's vote has none
        advantage=advantage,
        model_version=model_version,
        step_event_id=step_event_id,
    )


def group_records(g: Group) -> tuple[list[scoring.TrajRec], list[str]]:
    """The group as the pure scoring functions see it, and the steps still without votes."""
    stragglers: list[str] = []
    trajs: list[scoring.TrajRec] = []
    for t in sorted(g.trajectories.values(), key=lambda t: t.rollout_index):
        steps = []
        for sid in t.step_event_ids if t.outcome != "aborted" else []:
            if sid not in g.steps:
                continue
            judged = g.judged.get(sid)
            if judged is None:
                stragglers.append(sid)
            votes = tuple(scoring.VoteRec(v.value, v.status) for v in judged.votes) if judged else ()
            step = g.steps[sid]
            steps.append(scoring.StepRec(sid, step.step_index, votes, step.reference_label, step.env_reward or 0.0))
        trajs.append(scoring.TrajRec(t.trajectory_id, t.outcome, tuple(steps)))
    return trajs, stragglers


def policy_samples(trajs: list[scoring.TrajRec], g: Group, adv: dict[str, float]) -> list[TrainingSample]:
    """One sample per step with a nonzero advantage (docs/algorithm.md §1)."""
    out = []
    for s in (s for t in trajs for s in t.steps):
        st, a = g.steps[s.step_id], adv.get(s.step_id, 0.0)
        if a != 0.0 and st.response_token_ids:
            out.append(make_sample(f"p-{s.step_id}", "policy", st, a, st.policy_version, s.step_id))
    return out


def judge_vote_samples(
    trajs: list[scoring.TrajRec], g: Group, rewards: dict[str, float], sc: ScorerConfig
) -> list[TrainingSample]:
    """One sample per vote with a nonzero consistency advantage (docs/algorithm.md §2), standardised
    over the step's votes or, with ``scorer.judge_baseline = "group"``, over the group's; with
    ``scorer.judge_balance`` weighted by ``scoring.outcome_weights``."""
    won_w, lost_w = scoring.outcome_weights(trajs) if sc.judge_balance else (1.0, 1.0)
    judged = [(t, s, j) for t in trajs for s in t.steps if (j := g.judged.get(s.step_id)) is not None]
    weights = [won_w if t.outcome == "won" else lost_w for t, _, _ in judged]
    if sc.judge_baseline == "group":  # the weighted baseline: a constant vote gets no net push, balanced or not
        advantages = scoring.group_consistency_advantages(
            [(rewards[s.step_id], s.votes) for _, s, _ in judged], weights=weights
        )
    else:
        advantages = [scoring.consistency_advantages(rewards[s.step_id], s.votes) for _, s, _ in judged]
    out = []
    for (_, s, j), w, step_advantages in zip(judged, weights, advantages, strict=True):
        for vote, va in zip(j.votes, step_advantages, strict=True):
            if va is not None and va != 0.0 and vote.response_token_ids:
                sid = f"j-{s.step_id}-{vote.index}"
                out.append(make_sample(sid, "judge", vote, w * va, vote.model_version or 0, s.step_id))
    return out


def failed_judge(trajs: list[scoring.TrajRec], sc: ScorerConfig) -> str | None:
    """Why a group is kept out of training when more than half its votes failed (None otherwise; an
    outcome-only reward does not read the votes)."""
    errors = sum(v.status == "error" for t in trajs for s in t.steps for v in s.votes)
    total_votes = sum(len(s.votes) for t in trajs for s in t.steps)
    if total_votes and errors / total_votes > 0.5 and sc.reward != "outcome-only":
        return f"judge errors: {errors}/{total_votes} votes failed"
    return None


def score_group(g: Group, cfg: CoevoConfig, *, train_judge: bool) -> GroupScore:
    """The score of a ready group (pure: no I/O)."""
    assert g.scheduled is not None
    sc = cfg.scorer
    trajs, stragglers = group_records(g)
    acc = scoring.accuracy(trajs)
    common = GroupScore(
        task_id=g.scheduled.task.task_id,
        group_id=g.scheduled.group_id,
        slot_id=g.scheduled.slot_id,
        purpose=g.scheduled.purpose,
        n_trajectories=len(trajs),
        n_aborted=sum(t.outcome == "aborted" for t in trajs),
        trajectory_ids=[t.trajectory_id for t in trajs],
        step_event_ids=[s.step_id for t in trajs for s in t.steps],
        stragglers=stragglers,
        accuracy=0.0,
        policy_band_ok=False,
        judge_band_ok=False,
        flagged="no completed trajectory",
    )
    if acc is None:
        return common
    rewards = scoring.integrated_rewards(trajs, sc.lam, sc.reward, sc.env_reward_weight, sc.max_abs_env_reward)
    policy_ok, judge_ok = scoring.in_band(acc, *sc.policy_band), scoring.in_band(acc, *sc.judge_band)
    flagged = failed_judge(trajs, sc)
    trainable = g.scheduled.purpose in ("train", "candidate") and flagged is None
    judge_samples: list[TrainingSample] = []
    if trainable and train_judge and judge_ok:
        coding = g.scheduled.task.family == "coding"
        judge_samples = coding_judge_samples(trajs, g) if coding else judge_vote_samples(trajs, g, rewards, sc)
    consistency = [
        r
        for t in trajs
        for s in t.steps
        for r in scoring.consistency_rewards(rewards[s.step_id], s.votes)
        if r is not None
    ]
    proc, outc = scoring.judge_accuracies(trajs)
    return common.model_copy(
        update={
            "accuracy": acc,
            "policy_band_ok": policy_ok,
            "judge_band_ok": judge_ok,
            "policy_samples": policy_samples(trajs, g, scoring.step_advantages(trajs, rewards, lam=sc.lam))
            if trainable and policy_ok
            else [],
            "judge_samples": judge_samples,
            "judge_process_accuracy": proc,
            "judge_outcome_accuracy": outc,
            **scoring.vote_profile(trajs, rewards).fields(),
            "flagged": flagged,
            "failures": [failure_digest(t, g) for t in trajs if t.outcome in ("lost", "truncated")],
            "mean_reward": sum(rewards.values()) / len(rewards) if rewards else 0.0,
            "judge_consistency": sum(consistency) / len(consistency) if consistency else None,
        }
    )


def coding_judge_samples(trajs: list[scoring.TrajRec], g: Group) -> list[TrainingSample]:
    """The judge wrote tests: each test's reward comes from which programs pass it (docs/algorithm.md §2)."""
    programs = [(t.outcome == "won", g.judged.get(s.step_id)) for t in trajs for s in t.steps]
    programs = [(ok, j) for ok, j in programs if j is not None]
    if not programs:
        return []
    template = programs[0][1]
    assert template is not None
    results = [
        [(ok, j.votes[k].value == 1) for ok, j in programs if k < len(j.votes)]  # type: ignore[union-attr]
        for k in range(len(template.votes))
    ]
    group_id = g.scheduled.group_id if g.scheduled else ""
    return [
        make_sample(
            f"j-{group_id}-test{vote.index}", "judge", vote, adv, vote.model_version or 0, template.step_event_id
        )
        for vote, adv in zip(template.votes, scoring.coding_test_advantages(results), strict=True)
        if adv != 0.0 and vote.response_token_ids
    ]


def failure_digest(t: scoring.TrajRec, g: Group) -> FailureDigest:
    """The numbered ``action -> feedback`` lines of a failed trajectory, the steps where *every*
    vote was -1 (an unparseable or failed vote is not a -1), and the judge's reasoning there."""
    lines, negative, rationales = [], [], []
    for k, s in enumerate(t.steps, 1):
        st = g.steps[s.step_id]
        feedback = st.next_observation.split(".")[0] if st.next_observation else ""
        lines.append(f"{k}. {st.action_text or '(no valid action)'} -> {feedback}")
        if s.votes and all(v.status == "ok" and v.value == -1 for v in s.votes):
            negative.append(k)
            judged = g.judged.get(s.step_id)
            why = next((v.rationale.strip() for v in judged.votes if v.rationale.strip()), "") if judged else ""
            if why:
                rationales.append(f"step {k}: {why[-300:]}")
    return FailureDigest(
        trajectory_id=t.trajectory_id,
        outcome=t.outcome,
        steps=lines,
        all_negative_steps=negative,
        rationales=rationales,
    )


class ScorerAgent(Agent):
    role = "scorer"
    emits = (GroupScored,)
    REMEMBER = 100_000  # scored group ids kept to ignore late events (votes after a timeout); oldest go first
    KINDS = (TaskScheduled, StepTaken, TrajectoryCompleted, StepJudged)

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.groups: dict[str, Group] = {}
        self.scored: dict[str, None] = {}  # ids of scored groups, oldest first, at most REMEMBER
        self.need_votes = self.cfg.scorer.reward != "outcome-only"
        self.train_judge = self.cfg.trains_judge
        self._lock = asyncio.Lock()  # the straggler clock and the consumer must not score a group twice

    def subscriptions(self) -> list[Subscription]:
        # one consumer, concurrency 1: events are applied in stream order
        return [Subscription("scorer", self.KINDS, self.on_event, concurrency=1)]

    async def run(self) -> None:
        if await self.until_answered("scorer.rebuild", self.rebuild):
            await super().run()

    async def rebuild(self) -> None:
        """Re-apply what this consumer was delivered before a restart.

        Up to ``delivered``, not the ack floor: the floor is the last event below which *all* are
        acknowledged, and one acknowledged above it is not delivered again (a lost delivery or ack
        leaves such a gap until it is redelivered). Events between the two that were not
        acknowledged come again: ``Group.add`` is idempotent."""
        delivered = await self.bus.consumer_position("scorer")
        if delivered:
            await self.replay(delivered)

    async def replay(self, delivered: int) -> None:
        """The state at stream sequence ``delivered``: every group scored so far is remembered (its
        ``GroupScored`` may be stored after ``delivered``), every other group holds its events
        stored up to ``delivered``.

        Two reads, so that a restart late in a long run does not decode every step and vote ever
        stored (the bulk of the stream): the small events that say which groups exist and which are
        scored (``task.scheduled``, and the ids of ``group.scored``, derived from their group's: their
        payloads, the largest events and often claims, are not read, so a store that cannot be read
        now does not hold up the rebuild), then steps, trajectories and votes only from
        the ``TaskScheduled`` of the oldest group still open. A group's events are stored after its
        ``TaskScheduled`` (the policy plays what it reads from the stream), so an open group misses
        none. Only events stored before that point of groups never scheduled (orphans, which would
        only be dropped after ``group_timeout_s``) are not reloaded.
        """
        first_seq: dict[str, int] = {}
        async for seq, event, msg in self.bus.history(["task.scheduled", "group.scored"], undecoded=["group.scored"]):
            scored = stored_id(msg) if event is None else None
            if scored is not None and scored.startswith(SCORED):
                gid = scored.removeprefix(SCORED)
                self.remember(gid)
                self.groups.pop(gid, None)
                first_seq.pop(gid, None)
            elif isinstance(event, TaskScheduled) and event.group_id not in self.scored and seq <= delivered:
                self.groups.setdefault(event.group_id, Group()).add(event)
                first_seq.setdefault(event.group_id, seq)
        n = len(self.groups)
        start = min(first_seq.values(), default=delivered + 1)
        kinds = ["step.taken", "trajectory.completed", "step.judged"]
        async for _, event, _msg in self.bus.history(kinds, start_seq=start, end_seq=delivered):
            if event is not None and getattr(event, "group_id", None) not in self.scored:
                self.groups.setdefault(event.group_id, Group()).add(event)  # type: ignore[attr-defined]
                n += 1
        self.log.info(
            "scorer.rebuilt",
            events=n,
            groups=len(self.groups),
            scored=len(self.scored),
            from_seq=start,
            delivered=delivered,
        )

    async def on_event(self, event: Any, _d: Delivery) -> None:
        gid = event.group_id
        if gid in self.scored:
            return
        g = self.groups.setdefault(gid, Group())
        g.add(event)
        await self.maybe_score(gid, g)

    async def maybe_score(self, gid: str, g: Group) -> None:
        async with self._lock:
            if gid not in self.scored:
                await self._score(gid, g)

    async def _score(self, gid: str, g: Group) -> None:
        why = g.readiness(time.monotonic(), self.cfg, self.need_votes)
        if why is None:
            return
        score = score_group(g, self.cfg, train_judge=self.train_judge)
        if why != "complete":
            self.log.warning(
                "scorer.straggler_policy",
                group_id=gid,
                why=why,
                stragglers=len(score.stragglers),
                trajectories=score.n_trajectories,
            )
            self.counters[f"scored.{why}"] += 1
        assert g.scheduled is not None
        # stored before the group is forgotten as scored: a failed store leaves it open, so its
        # redelivered input (or the next tick of the straggler clock) scores it again, under the same id
        await self.emit_stored(
            self.event(GroupScored, cause=g.scheduled, event_id=scored_id(gid), correlation_id=gid, **dict(score))
        )
        self.counters["groups_scored"] += 1
        self.remember(gid)
        del self.groups[gid]

    def remember(self, gid: str) -> None:
        self.scored[gid] = None
        while len(self.scored) > self.REMEMBER:
            del self.scored[next(iter(self.scored))]

    async def main(self) -> None:
        """The straggler clock: re-check waiting groups every second; drop orphans (events of a group
        whose ``TaskScheduled`` this scorer never saw: late events of a long-forgotten group)."""
        while await self.sleep(1.0):
            self.drop_orphans(time.monotonic())
            for gid, g in list(self.groups.items()):
                await self.maybe_score(gid, g)

    def drop_orphans(self, now: float) -> None:
        for gid, g in list(self.groups.items()):
            if g.scheduled is None and now - g.first_seen > self.cfg.scorer.group_timeout_s:
                del self.groups[gid]
                self.counters["groups.orphans_dropped"] += 1
                self.log.warning("scorer.orphan_dropped", group_id=gid)
