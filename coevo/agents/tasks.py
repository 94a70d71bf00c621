"""The task pool and the environment rewriter agent (docs/algorithm.md §4).

Invariants:
- every slot has one active task, the ids of the tasks it replaced, and at most one candidate
  rewrite; slots live in JetStream KV, so a restarted agent resumes them (and its in-flight groups);
- held-out slots are never rewritten and their groups (``purpose = eval``) are never trained on;
- at most ``tasks.max_groups_in_flight`` groups are scheduled and not yet scored, and no new group
  is scheduled while a train group that was scheduled more than ``learner.max_staleness`` policy
  versions ago is still in flight (admission control pauses rollouts, it drops nothing);
- a held-out round leaves one of those groups to training while train slots exist (``eval_turn``): its
  episodes, however long, never stop training;
- a train group stays counted against that bound after it is scored, until a policy
  ``LearnerStepped`` names it (``Backlog``): a learner slower than the rollouts pauses scheduling
  instead of training ever staler samples (soft state: an entry the learner never names stops
  counting after ``backlog_timeout_s``), and so does a queue that already holds
  ``learner.max_staleness`` steps' work (``admission.queue_full``);
- at ``learner.max_staleness = 0`` groups go in lock-step waves (``Lockstep``): the next wave only once
  every group of the last one is scored and the weights trained on it (policy, judge) are published;
  each ``TaskScheduled`` carries the policy version it was scheduled at (``source.model_version``);
- a candidate is decided once, by the acceptance gate on its measured accuracy, and every decision
  is a ``TaskDecided`` event;
- train slots are picked by stride scheduling on ``saturation.weight`` (round-robin while none is
  saturated); a saturated slot's rewrites ask for ``saturation.moves`` knob steps (``TaskRewritten.moves``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coevo.algorithm import saturation, scoring
from coevo.algorithm.admission import Backlog, queue_full
from coevo.algorithm.rewriter import BuiltinRewriter, Proposal, Rewriter, critic_summary, fresh_world, wants_fresh_world
from coevo.config import LLMRewriterConfig, TasksConfig
from coevo.envs import make_family
from coevo.envs.base import spec_hash
from coevo.inference.engine import CachesCalls
from coevo.runtime.agent import Agent
from coevo.runtime.aio import wait_event
from coevo.runtime.consumer import Delivery, Subscription
from coevo.runtime.kv import Bucket
from coevo.schemas import (
    GroupScored,
    LearnerStepped,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
    TaskSpec,
    WeightsPublished,
    new_id,
)


class Slot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slot_id: str
    split: Literal["train", "heldout"]
    active: TaskSpec
    history: list[str] = Field(default_factory=list)
    candidate: TaskSpec | None = None
    """the rewrite under measurement"""
    candidate_direction: Literal["harder", "easier"] | None = None
    candidate_scheduled: bool = False
    parent_accuracy: float | None = None
    groups_since_rewrite: int = 0
    last_accuracy: float | None = None
    rewrites_proposed: int = 0
    rewrites_accepted: int = 0
    saturated_streak: int = 0
    """consecutive scored train groups of the active task all won or all lost (``coevo.algorithm.saturation``)"""
    candidate_moves: int | None = None
    """knob moves of the candidate under measurement (None: not known, a slot saved before they were kept)"""
    overshoot: saturation.Overshoot | None = None
    """the direction and fewest moves a rejected candidate of the active task overshot with
    (``saturation.capped``)"""


def is_eval(group_id: str) -> bool:
    """Whether a group is a held-out evaluation group (the tasks agent names them ``eval{k}-…``)."""
    return group_id.startswith("eval")


class InFlight(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: dict[str, int] = Field(default_factory=dict, description="group id -> policy version at scheduling")
    scheduled_at: dict[str, float] = Field(default_factory=dict, description="group id -> unix time scheduled")
    slot_of: dict[str, str] = Field(default_factory=dict, description="candidate group id -> its slot")
    world_of: dict[str, str] = Field(
        default_factory=dict,
        description="train group id playing a fresh world (tasks.train_worlds) -> the slot's active task id then",
    )
    train_groups_scheduled: int = 0
    eval_rounds: int = Field(default=0, description="held-out rounds queued so far (round k's groups: eval{k}-…)")
    eval_queue: list[str] = Field(
        default_factory=list, description="held-out slots of the last round not scheduled yet (kept across a resume)"
    )
    eval_clock_at: float | None = Field(
        default=None,
        description="unix time tasks.eval_every_s counts from: the last round's end (its last group scored), "
        "its queueing until then",
    )

    def evaluating(self) -> bool:
        """Whether a held-out round has a group in flight (scheduled, not yet scored)."""
        return any(map(is_eval, self.groups))

    def round_ended(self, forgotten: list[str], now: float) -> None:
        """After groups were forgotten (scored or lost): when one was the last held-out group of a round
        wholly scheduled, the evaluation clock starts now."""
        if any(map(is_eval, forgotten)) and not self.eval_queue and not self.evaluating():
            self.eval_clock_at = now

    def forget(self, group_id: str) -> None:
        self.groups.pop(group_id, None)
        self.scheduled_at.pop(group_id, None)
        self.slot_of.pop(group_id, None)
        self.world_of.pop(group_id, None)

    def expired(self, now: float, timeout_s: float) -> list[str]:
        """Groups scheduled more than ``timeout_s`` ago and never scored (pure)."""
        return [g for g in self.groups if now - self.scheduled_at.get(g, now) > timeout_s]


def eval_turn(inflight: InFlight, capacity: int, training: bool) -> bool:
    """Whether the next group is the queued round's (pure): while there are train slots (``training``), a
    round leaves one of the ``capacity`` groups in flight to training (a capacity of one: the round goes
    first), so a round of long episodes does not stop training until it ends."""
    if not inflight.eval_queue:
        return False
    return not training or sum(map(is_eval, inflight.groups)) < max(1, capacity - 1)


def round_due(inflight: InFlight, tc: TasksConfig, now: float) -> bool:
    """Whether a held-out round is due after a train group (pure): every ``tasks.eval_every`` train
    groups, and, when ``tasks.eval_every_s`` is set, that many seconds after the last round ended
    (whichever comes first). The clock stands still while a round runs: on a slow machine a round takes
    minutes, and rounds back to back would leave training little of the run."""
    if inflight.train_groups_scheduled % tc.eval_every == 0:
        return True
    last, every = inflight.eval_clock_at, tc.eval_every_s
    return every is not None and last is not None and not inflight.evaluating() and now - last >= every


@dataclass
class Lockstep:
    """Scheduling at ``learner.max_staleness = 0`` (pure): waves of ``size`` groups at one version of
    each model. A wave is scheduled whole; the next one waits until every group of it is scored and,
    for each lane (policy, judge) it gave samples to, a newer version of that lane is published (at
    most ``timeout_s``). The learner trains each wave in one step per lane, so generation and training
    alternate: each trajectory is played with the weights current when its group was scheduled, and
    each sample is trained by the version that produced it."""

    size: int
    timeout_s: float
    left: int = 0
    """groups of the open wave still to schedule"""
    versions: dict[str, int] | None = None
    """the lanes' versions when the last wave was scheduled"""
    trains: set[str] = field(default_factory=set)
    """the lanes the last wave gave samples to (a new version of each will come)"""
    done_at: float | None = None

    def admits(self, in_flight: int, versions: dict[str, int], now: float) -> bool:
        if self.left > 0:
            return True
        if in_flight:
            return False
        self.done_at = now if self.done_at is None else self.done_at
        last = self.versions or {}
        if (
            any(versions.get(lane, 0) <= last.get(lane, 0) for lane in self.trains)
            and now - self.done_at < self.timeout_s
        ):
            return False  # a step that trains the last wave is not published yet
        self.left, self.versions, self.trains, self.done_at = self.size, dict(versions), set(), None
        return True

    def scheduled(self) -> None:
        self.left = max(0, self.left - 1)

    def scored(self, lanes: Iterable[str]) -> None:
        self.trains |= set(lanes)


class TasksAgent(Agent):
    role = "tasks"
    emits = (TaskScheduled, TaskRewritten, TaskDecided)
    lockstep_timeout_s = 120.0
    """lock-step: how long a trained wave waits for its step's weights before the next wave goes anyway"""
    backlog_timeout_s = 120.0
    """how long a scored train group waits for the learner step that names it before it stops gating"""

    def __init__(self, *a: Any, rewriter: Rewriter | None = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.family = make_family(self.cfg.env)
        self.rewriter: Rewriter | None = None
        rewriting = self.cfg.loop == "full" and self.cfg.tasks.rewriter.backend != "off"
        self.llm_client: Any = None
        if rewriting:
            self.rewriter = rewriter or self._make_rewriter()
        self.slots: dict[str, Slot] = {}
        self.inflight = InFlight()
        self.policy_version = 0
        self.judge_version = 0
        self.changed = asyncio.Event()
        self._kv: Bucket | None = None
        self.stride = saturation.Stride()
        self.lockstep = Lockstep(self.cfg.tasks.max_groups_in_flight, self.lockstep_timeout_s)
        self.backlog = Backlog(self.backlog_timeout_s)
        self.scoring = 0  # scores being taken into account (on_scored awaits after forgetting the group)

    def _make_rewriter(self) -> Rewriter:
        config = self.cfg.tasks.rewriter
        if not isinstance(config, LLMRewriterConfig):  # builtin ("off" builds no rewriter)
            return BuiltinRewriter()
        from coevo.algorithm.rewriter import LLMRewriter
        from coevo.inference.clients import make_client

        self.llm_client = make_client(self.cfg, "rewriter")
        return LLMRewriter(self.llm_client, retries=config.retries)

    async def run(self) -> None:
        if self.llm_client is None:
            await super().run()
            return
        if isinstance(self.llm_client, CachesCalls):
            self.llm_client.attach_cache(await self.bus.kv(f"llmcache_{self.role}"))
        async with self.llm_client:
            await super().run()

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription("tasks", (GroupScored,), self.on_scored, concurrency=1),
            Subscription(
                "tasks-weights", (WeightsPublished,), self.on_weights, concurrency=1, shared=False, deliver="last"
            ),
            Subscription(  # the backlog gate counts the policy's steps
                "tasks-steps",
                (LearnerStepped,),
                self.on_stepped,
                concurrency=1,
                shared=False,
                deliver="last",
                scope="policy",
            ),
        ]

    # ---- state -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Resume the pool from KV, or seed it when the bucket holds nothing. Any KV error propagates
        (the supervisor restarts ``main``): seeding over saved slots would lose them."""
        await self.load_versions()
        self._kv = await self.bus.kv("tasks")
        for key in await self._kv.keys():  # [] only for an empty bucket (coevo.runtime.kv)
            raw = await self._kv.get(key)
            if raw is None:  # deleted since the listing
                continue
            if key == "inflight":
                self.inflight = InFlight.model_validate_json(raw)
                if "eval_rounds" not in self.inflight.model_fields_set:  # saved by a version that numbered
                    k = self.inflight.train_groups_scheduled // self.cfg.tasks.eval_every  # rounds by groups
                    self.inflight.eval_rounds, self.inflight.eval_clock_at = k + 1, time.time()
                for group_id in self.inflight.groups:  # saved by a version without times: count from now
                    self.inflight.scheduled_at.setdefault(group_id, time.time())
            elif key.startswith("slot."):
                slot = Slot.model_validate_json(raw)
                self.slots[slot.slot_id] = slot
        if self.slots:
            self.log.info("tasks.resumed", slots=len(self.slots), inflight=len(self.inflight.groups))
            return
        for t in self.family.initial_tasks(self.cfg.env.n_train, self.cfg.env.n_heldout, self.cfg.env.seed):
            slot = Slot(slot_id=f"{t.split}-{t.task_id}", split=t.split, active=t)
            self.slots[slot.slot_id] = slot
            await self.save(slot)
        self.queue_round()  # the "before" numbers
        await self.save_inflight()

    async def save(self, slot: Slot) -> None:
        await self._loaded().put(f"slot.{slot.slot_id}", slot.model_dump_json().encode())

    async def save_inflight(self) -> None:
        await self._loaded().put("inflight", self.inflight.model_dump_json().encode())

    def _loaded(self) -> Bucket:
        if self._kv is None:
            raise RuntimeError("task pool not loaded yet")  # a handler naks: redelivered once main() loaded it
        return self._kv

    # ---- scheduling --------------------------------------------------------------------------

    def admitted(self) -> bool:
        if len(self.inflight.groups) >= self.cfg.tasks.max_groups_in_flight:
            return False
        # held-out groups are never trained on: however long their episodes, they hold back no sample
        trained = (v for g, v in self.inflight.groups.items() if not is_eval(g))
        oldest = min(trained, default=self.policy_version)
        lc, now = self.cfg.learner, time.monotonic()
        queued = self.backlog.oldest(now) if lc.max_staleness > 0 else None
        if queued is not None:
            oldest = min(oldest, queued)
            if queue_full(*self.backlog.queued(now), lc.max_staleness, lc.batch_samples, lc.batch_groups):
                return False
        if self.policy_version - oldest > lc.max_staleness:
            return False
        versions = {"policy": self.policy_version, "judge": self.judge_version}
        return lc.max_staleness > 0 or self.lockstep.admits(len(self.inflight.groups) + self.scoring, versions, now)

    def next_group(self) -> tuple[Slot, TaskSpec, Literal["train", "candidate", "eval"]]:
        """Candidates first, then a due held-out evaluation round (within its share of the groups in
        flight: ``eval_turn``), then a train slot by stride scheduling (round-robin while none is
        saturated, a saturated one `tasks.saturated_share` as often)."""
        for slot in self.slots.values():
            if slot.candidate is not None and not slot.candidate_scheduled:
                return slot, slot.candidate, "candidate"
        train = [s for s in self.slots.values() if s.split == "train"]
        if not self.inflight.eval_queue and not train:
            self.queue_round()
        if eval_turn(self.inflight, self.cfg.tasks.max_groups_in_flight, bool(train)):
            slot = self.slots[self.inflight.eval_queue.pop(0)]
            return slot, slot.active, "eval"
        tc = self.cfg.tasks
        weights = {
            s.slot_id: saturation.weight(s.saturated_streak, tc.saturated_after, tc.saturated_share) for s in train
        }
        slot = self.slots[self.stride.pick(weights)]
        if weights[slot.slot_id] < 1:
            self.counters["scheduled.train_saturated"] += 1
        return slot, slot.active, "train"

    async def train_world(self, slot: Slot) -> TaskSpec:
        """What the next train group of ``slot`` plays: its active task, or (``tasks.train_worlds = "fresh"``)
        the active task's knobs in a world drawn for this group, never a held-out one, that passes the
        family's precheck; the active task where the family has no other world or the drawn one fails."""
        if self.cfg.tasks.train_worlds == "slot":
            return slot.active
        salt = f"train{self.inflight.train_groups_scheduled}"  # one per train group, kept across a resume
        world = self.family.fresh_world(slot.active, salt, self.heldout())
        if world is None or not (await self.family.precheck(world)).ok:
            self.counters["scheduled.fresh_world_refused" if world else "scheduled.no_fresh_world"] += 1
            return slot.active
        return world

    async def schedule(self, slot: Slot, task: TaskSpec, purpose: Literal["train", "candidate", "eval"]) -> None:
        """Publish the group (stored before anything records it), then record it in KV: a crash in
        between leaves a group that is scored but never counted, never one counted but never scored."""
        prefix = (
            f"eval{self.inflight.eval_rounds - 1}-"
            if purpose == "eval"
            else ("cand-" if purpose == "candidate" else "g-")
        )
        group_id = f"{prefix}{new_id()[:16]}"
        self.model_version = self.policy_version  # the version this group is scheduled at (its source)
        event = self.event(
            TaskScheduled,
            task=task,
            slot_id=slot.slot_id,
            group_id=group_id,
            n_rollouts=self.cfg.policy.n,
            purpose=purpose,
            round_size=len(self.heldout_slots()) if purpose == "eval" else None,
            correlation_id=group_id,
        )
        await self.emit(event, confirm=True)
        self.inflight.groups[group_id] = self.policy_version
        self.inflight.scheduled_at[group_id] = time.time()
        self.lockstep.scheduled()
        if purpose == "train":
            self.inflight.train_groups_scheduled += 1
            if task.task_id != slot.active.task_id:  # a fresh world: scored as the slot's active task
                self.inflight.world_of[group_id] = slot.active.task_id
            if round_due(self.inflight, self.cfg.tasks, time.time()) and not self.inflight.eval_queue:
                self.queue_round()
        if purpose == "candidate":
            self.inflight.slot_of[group_id] = slot.slot_id
            slot.candidate_scheduled = True
            await self.save(slot)
        await self.save_inflight()
        self.counters[f"scheduled.{purpose}"] += 1

    def heldout_slots(self) -> list[str]:
        """The held-out slots: one group each makes an evaluation round."""
        return [s.slot_id for s in self.slots.values() if s.split == "heldout"]

    def queue_round(self) -> None:
        """Queue a held-out evaluation round: one group per held-out task, numbered (``eval{k}-…``)
        and timed in the in-flight state (saved with the group that follows)."""
        self.inflight.eval_queue = self.heldout_slots()
        if self.inflight.eval_queue:
            self.inflight.eval_rounds += 1
            self.inflight.eval_clock_at = time.time()

    async def expire(self) -> None:
        """Forget groups whose scheduling or score was lost; a lost candidate is scheduled again."""
        lost = self.inflight.expired(time.time(), self.cfg.tasks.inflight_timeout_s)
        for group_id in lost:
            slot = self.slots.get(self.inflight.slot_of.get(group_id, ""))
            if slot is not None and slot.candidate is not None:
                slot.candidate_scheduled = False
                await self.save(slot)
            self.inflight.forget(group_id)
            self.counters["groups.expired"] += 1
            self.log.warning("tasks.group_expired", group_id=group_id)
        if lost:
            self.inflight.round_ended(lost, time.time())
            await self.save_inflight()

    async def main(self) -> None:
        await self.load()
        while await self.wait_resumed():
            await self.expire()
            while self.admitted() and not self.stopping.is_set():
                slot, task, purpose = self.next_group()
                await self.schedule(slot, await self.train_world(slot) if purpose == "train" else task, purpose)
            self.changed.clear()
            await wait_event(self.changed, 1.0)

    # ---- reacting to scores ------------------------------------------------------------------

    async def load_versions(self) -> None:
        """The lanes' versions as the stream last announced them, before anything is scheduled: a
        restarted tasks agent labels its groups with the version being served, not 0 (its weights
        subscription delivers only the newest announcement, of either lane, and only later)."""
        last: dict[str, int] = {}
        async for _, event, _m in self.bus.history(["weights.published"]):
            if isinstance(event, WeightsPublished):
                last[event.role] = event.version  # stream order: a restored learner's later, lower one wins
        self.policy_version = last.get("policy", self.policy_version)
        self.judge_version = last.get("judge", self.judge_version)

    async def on_weights(self, event: WeightsPublished, _d: Delivery) -> None:
        if event.role == "policy" and event.version > self.policy_version:
            self.policy_version = event.version
            self.changed.set()
        elif event.role == "judge" and event.version > self.judge_version:
            self.judge_version = event.version
            self.changed.set()

    async def on_stepped(self, event: LearnerStepped, _d: Delivery) -> None:
        if event.role == "policy":  # trained or not: every group it names is done with the learner
            self.backlog.trained(event.disposed_group_ids)
            self.changed.set()

    async def on_scored(self, event: GroupScored, _d: Delivery) -> None:
        self._loaded()
        version = self.inflight.groups.get(event.group_id)
        played = self.inflight.world_of.get(event.group_id, event.task_id)  # the slot task a fresh world stood for
        if version is not None and event.purpose == "train" and event.policy_samples and not event.flagged:
            self.backlog.scored(event.group_id, version, time.monotonic(), len(event.policy_samples))
        self.inflight.forget(event.group_id)
        self.inflight.round_ended([event.group_id], time.time())
        self.scoring += 1  # lock-step: still in flight until what it trains is known
        try:
            slot = self.slots.get(event.slot_id or "")
            if slot is not None:
                await self.score_slot(slot, event, played)
        finally:
            self.scoring -= 1
        await self.save_inflight()
        self.changed.set()

    async def score_slot(self, slot: Slot, event: GroupScored, played: str) -> None:
        """``played``: the slot task the group stood for (its own, or the active task of a fresh world's)."""
        if event.purpose == "candidate":
            await self.decide(slot, event)
        elif event.purpose == "train" and played == slot.active.task_id:
            slot.last_accuracy = event.accuracy
            slot.groups_since_rewrite += 1
            slot.saturated_streak = saturation.streak_after(slot.saturated_streak, event.accuracy)
            if event.flagged is None:
                await self.maybe_rewrite(slot, event)
        elif event.purpose == "eval":
            slot.last_accuracy = event.accuracy
        await self.save(slot)
        trained = not event.flagged and (
            event.purpose == "train" or (event.purpose == "candidate" and slot.active.task_id == event.task_id)
        )  # accepted
        self.lockstep.scored(
            [
                lane
                for lane, samples in (("policy", event.policy_samples), ("judge", event.judge_samples))
                if trained and samples
            ]
        )

    def rewrite_moves(self, slot: Slot, direction: saturation.Direction) -> tuple[int, int]:
        """Knob moves of the slot's next rewrite, and how many its saturation wanted before an overshoot
        capped them: more while it is saturated, fewer than an overshoot."""
        tc = self.cfg.tasks
        wide = saturation.moves(slot.saturated_streak, tc.saturated_after, tc.saturated_moves)
        moves = saturation.capped(wide, direction, slot.overshoot)
        if moves < wide:
            self.counters["rewrites_proposed_capped"] += 1
        return moves, wide

    async def propose(
        self, rewriter: Rewriter, slot: Slot, direction: saturation.Direction, event: GroupScored, moves: int
    ) -> Proposal:
        """The rewriter's candidate ``moves`` knob steps away; where no knob step can help (one step
        overshot, or none is left), the same knobs in another world instead, whatever the rewriter (drawn
        from ``event``'s id, so replays agree; never a held-out task)."""
        if wants_fresh_world(self.family, slot.active, direction, slot.overshoot):
            summaries = [critic_summary(f) for f in event.failures]
            world = fresh_world(self.family, slot.active, summaries, event.event_id, rewriter.name, self.heldout())
            if world.candidate is not None:
                return world
        return await rewriter.propose(self.family, slot.active, direction, event.failures, moves)

    def heldout(self) -> set[str]:
        """``spec_hash`` of every held-out slot's task: what no fresh world may become."""
        return {
            spec_hash(t.family, t.params, t.knobs)
            for t in (s.active for s in self.slots.values())
            if t.split == "heldout"
        }

    async def maybe_rewrite(self, slot: Slot, event: GroupScored) -> None:
        low, high = self.cfg.tasks.band
        direction = scoring.rewrite_direction(event.accuracy, low, high)
        if (
            self.rewriter is None
            or slot.split != "train"
            or direction is None
            or slot.candidate is not None
            or slot.groups_since_rewrite < self.cfg.tasks.min_groups_between_rewrites
        ):
            return
        moves, wanted = self.rewrite_moves(slot, direction)
        proposal = await self.propose(self.rewriter, slot, direction, event, moves)
        ok, why = False, proposal.error
        if proposal.candidate is not None:
            check = await self.family.precheck(proposal.candidate)
            ok, why = check.ok, (None if check.ok else check.reason)
        slot.rewrites_proposed += 1
        await self.emit(
            self.event(
                TaskRewritten,
                cause=event,
                slot_id=slot.slot_id,
                parent=slot.active,
                candidate=proposal.candidate,
                direction=direction,
                summaries=proposal.summaries,
                rewriter=proposal.rewriter,
                moves=moves,
                moves_wanted=wanted,
                precheck_ok=ok,
                precheck_error=why,
            )
        )
        self.counters["rewrites_proposed"] += 1
        if moves > 1:
            self.counters["rewrites_proposed_wide"] += 1
        if ok and proposal.candidate is not None:
            slot.candidate, slot.candidate_direction, slot.candidate_moves = proposal.candidate, direction, moves
            slot.candidate_scheduled, slot.parent_accuracy = False, event.accuracy
        else:  # rejected before any rollout: the decision says why
            slot.groups_since_rewrite = 0  # back off before trying again
            candidate_id = proposal.candidate.task_id if proposal.candidate else f"{slot.active.task_id}__invalid"
            await self.emit(
                self.event(
                    TaskDecided,
                    cause=event,
                    slot_id=slot.slot_id,
                    parent_id=slot.active.task_id,
                    candidate_id=candidate_id,
                    direction=direction,
                    accepted=False,
                    reason=f"{'pre-check failed' if proposal.candidate else 'invalid proposal'}: {why}",
                    parent_accuracy=event.accuracy,
                    candidate_accuracy=None,
                    rewriter=proposal.rewriter,
                )
            )

    async def decide(self, slot: Slot, event: GroupScored) -> None:
        if slot.candidate is None or event.task_id != slot.candidate.task_id:
            return  # decided already (redelivery)
        assert slot.candidate_direction is not None
        low, high = self.cfg.tasks.band
        parent_acc = slot.parent_accuracy if slot.parent_accuracy is not None else 0.0
        if event.flagged:
            accepted, reason = False, f"candidate group flagged: {event.flagged}"
        else:
            accepted, reason = scoring.accept_rewrite(slot.candidate_direction, parent_acc, event.accuracy, low, high)
        await self.emit(
            self.event(
                TaskDecided,
                cause=event,
                slot_id=slot.slot_id,
                parent_id=slot.active.task_id,
                candidate_id=slot.candidate.task_id,
                group_id=event.group_id,
                direction=slot.candidate_direction,
                accepted=accepted,
                reason=reason,
                parent_accuracy=parent_acc,
                candidate_accuracy=event.accuracy,
                rewriter=self.rewriter.name if self.rewriter else "none",
            )
        )
        if accepted:
            slot.history.append(slot.active.task_id)
            slot.active = slot.candidate
            slot.rewrites_accepted += 1
            slot.last_accuracy = event.accuracy
            slot.saturated_streak, slot.overshoot = 0, None
            self.counters["rewrites_accepted"] += 1
        elif not event.flagged and slot.candidate_moves is not None:
            slot.overshoot = saturation.overshoot_after(
                slot.overshoot, slot.candidate_moves, slot.candidate_direction, event.accuracy
            )
        slot.candidate, slot.candidate_direction, slot.candidate_moves = None, None, None
        slot.candidate_scheduled, slot.parent_accuracy = False, None
        slot.groups_since_rewrite = 0
