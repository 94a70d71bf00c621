"""The learner agent: consumes scored groups as a stream and trains the policy and judge lanes.

Invariants:
- a ``GroupScored`` is acknowledged only after every lane that trains on it has taken an optimiser
  step on its samples *and* a resume checkpoint that includes them is durable (or has nothing to
  train); until then its handler waits (the consumer keeps the message with ``in_progress``). So a
  kill -9 at any point loses no sample: the groups trained since the last checkpoint are redelivered
  and trained again on the restored weights, and the checkpoint's consumed-group list makes sure
  an acknowledged group is never trained twice into the surviving weights;
- checkpoints are written off the critical path every ``learner.checkpoint_every_steps`` steps, or
  ``checkpoint_every_s`` after the previous one, or when half of ``bus.max_ack_pending`` (the
  subscription's concurrency) waits for one, and once more when the learner stops: held groups
  never exhaust the consumer;
- weights are published (``WeightsPublished``) after every ``learner.publish_every``-th step, in
  the serving dtype, before the next step starts;
- a lane steps on whole groups (``Batching``): when it holds ``batch_samples`` samples, or holds some
  and no new group arrived for ``flush_after_s``; with ``learner.batch_groups`` set, once that many
  groups were scored since its last step (groups that gave it nothing count), on at most that many;
  one batch is one version (``learner.minibatches`` × ``learner.epochs`` optimiser steps) and one
  ``LearnerStepped``. At ``learner.max_staleness = 0`` (lock-step, with the tasks agent's waves) a
  lane steps once a whole wave is scored (``tasks.max_groups_in_flight`` groups since its last
  step), on all of it, whatever its size;
- staleness is bounded at the learner too, per lane (``Lane.step``): samples more than
  ``learner.max_staleness`` versions behind are dropped (``learner.stale = "drop"``: counted, and
  reported in ``LearnerStepped.stale_dropped``) or kept with truncated IS (``"correct"``); a batch
  left with no sample takes no step and its groups are done untrained;
- every group a lane is done with is named by a ``LearnerStepped`` at once, stored whatever the bus does
  meanwhile (retried until it is: ``name_groups``): trained (``group_ids``),
  or, by a report that trained nothing (``samples`` 0, version unchanged), undone by the KL guard,
  all stale, without signal (a train group that gave the policy lane no sample) or dead-lettered.
  So the backlog gate (``coevo.algorithm.admission``) never waits for a group no step will train;
- candidate groups wait for the ``TaskDecided`` of *their* group (verdicts are per proposal: a
  candidate rejected once and re-proposed is trained if its new group is accepted); rejected ones
  are never trained, and one left without a verdict is retried, then dropped (counted), never held
  for ever. Verdicts are read from the whole stream at every start, so a restart loses none;
  held-out (eval) and flagged groups are never trained;
- the learner cannot hang or double-train: a group redelivered while queued or being trained joins
  that entry; a lane that stops or crashes (its own failure, the other lane's, ``main``'s) fails its
  queued groups and those waiting for a checkpoint (redelivered), after the step running then has
  ended in its thread and its batch went where its outcome puts it (trained: waiting for a
  checkpoint; not: queued), so no group is left in neither; a sample the lane cannot train is
  dropped alone with its reason; a step that fails on a batch of several groups is retried group
  by group, and only a group that fails alone is rejected (dead-lettered with the error); a step whose
  loss or gradient norm is not finite (``NonFiniteStep``) is such a failure, counted in
  ``LearnerStepped.not_finite``, and leaves the weights and optimiser state untouched.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevo.algorithm.recent import put_newest
from coevo.config import CoevoConfig, PushSync, checkpoint_root
from coevo.errors import NonFiniteStep, Reject, Retry
from coevo.inference.clients import model_dir
from coevo.inference.precision import model_dtype
from coevo.runtime import outbox
from coevo.runtime.agent import Agent
from coevo.runtime.aio import outlast, wait_event
from coevo.runtime.consumer import Delivery, Subscription
from coevo.schemas import GroupScored, LearnerStepped, TaskDecided, TrainingSample, WeightsPublished
from coevo.schemas.events import Role, WeightsFormat
from coevo.training.checkpoint import Checkpoint
from coevo.training.lane import Lane, StepMetrics
from coevo.training.lora import SharedBase
from coevo.weights.server import WeightServer


def trained_roles(cfg: CoevoConfig) -> list[Role]:
    return ["policy", "judge"] if cfg.trains_judge else ["policy"]


def build_lane(cfg: CoevoConfig, role: Role, ckpt_root: Path, shared: SharedBase | None = None) -> Lane:
    """A lane as every rank of the learner builds it (same model, lr, temperature, checkpoints)."""
    lr = cfg.learner.judge_lr if role == "judge" else None
    how = cfg.policy if role == "policy" else cfg.judge
    return Lane(
        role,
        model_dir(cfg, role),
        ckpt_root,
        cfg.learner,
        temperature=how.temperature,
        sampling=how.sampling,
        lr=lr,
        device=cfg.learner.device,
        shared=shared,
        grammar=cfg.policy.grammar,
    )


def build_lanes(cfg: CoevoConfig, roles: list[Role], ckpt_root: Path) -> Iterator[Lane]:
    """The lanes of ``roles``, one at a time; LoRA lanes of one base directory share one base model."""
    shared = one_base(cfg, roles)
    for role in roles:
        yield build_lane(cfg, role, ckpt_root, shared)


def one_base(cfg: CoevoConfig, roles: list[Role]) -> SharedBase | None:
    """Policy and judge as two adapters of one base (``learner.lora``, one model directory for both):
    the base held once. None otherwise."""
    lc = cfg.learner.lora
    if lc is None or len(roles) < 2:
        return None
    dirs = {model_dir(cfg, role).resolve() for role in roles}
    if len(dirs) != 1:
        return None
    base = dirs.pop()
    return SharedBase(base, lc, model_dtype(cfg.learner.dtype, cfg.learner.device, base))


@dataclass
class QueuedGroup:
    group_id: str
    samples: list[TrainingSample]
    done: asyncio.Future[None]
    alone: bool = False
    """train this group in a batch of its own (its batch failed once)"""


@dataclass(frozen=True)
class Batching:
    """When a lane steps, and on which of its queued groups (pure: the learner's config and counts).

    By samples (the default): ``samples`` held, or some held and ``idle_s`` without a new group. By
    groups (``learner.batch_groups``, and lock-step's waves): ``groups`` scored since the lane's last
    step, counting groups that gave the lane no sample (as trainers that batch rollouts do), or some
    held and ``idle_s`` without a new group; a count that reached ``groups`` with nothing held is
    forgotten (a batch that gave the lane nothing takes no step).
    """

    samples: int
    """by samples: the batch size (``learner.batch_samples``); unused when ``groups`` is set"""
    groups: int | None
    idle_s: float
    take_all: bool = False
    """lock-step: a step trains the whole wave, whatever its size"""

    @classmethod
    def of(cls, cfg: CoevoConfig, flush_after_s: float) -> Batching:
        lc = cfg.learner
        if lc.max_staleness == 0:
            return cls(lc.batch_samples, cfg.tasks.max_groups_in_flight, cfg.scorer.group_timeout_s, take_all=True)
        if lc.batch_groups is not None:
            return cls(lc.batch_samples, lc.batch_groups, flush_after_s)
        return cls(lc.batch_samples, None, flush_after_s)

    def ready(self, held: int, scored: int, idle: float) -> tuple[bool, int]:
        """(step now?, the scored count to keep) for a lane holding ``held`` samples."""
        if self.groups is None:
            return held >= self.samples or (held > 0 and idle >= self.idle_s), scored
        if scored >= self.groups and not held:
            scored = 0 if self.take_all else scored - self.groups
        return held > 0 and (scored >= self.groups or idle >= self.idle_s), scored

    def after_step(self, scored: int) -> int:
        """The scored count once a batch was taken: the groups of the next batch scored already."""
        return max(0, scored - self.groups) if self.groups is not None and not self.take_all else 0

    def take(self, queued: list[QueuedGroup]) -> list[QueuedGroup]:
        """The next batch, removed from ``queued``: whole groups (at least one), all of a wave, up to
        ``groups`` groups, or as close to ``samples`` samples as whole groups get; a group marked
        ``alone`` by itself."""
        if queued[0].alone:
            return [queued.pop(0)]
        take: list[QueuedGroup] = []
        n = 0
        while queued and not queued[0].alone and (not take or self.take_all or self.fits(len(take), n, queued[0])):
            p = queued.pop(0)
            take.append(p)
            n += len(p.samples)
        return take

    def fits(self, groups: int, samples: int, nxt: QueuedGroup) -> bool:
        """Whether the next group joins a batch of ``groups`` groups holding ``samples`` samples."""
        if self.groups is not None:
            return groups < self.groups
        return samples + len(nxt.samples) - self.samples < self.samples - samples  # it brings the batch closer


class Verdicts:
    """Rewrite verdicts per candidate group; the oldest are forgotten beyond ``limit`` (bounded memory)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.by_group: OrderedDict[str, bool] = OrderedDict()
        self.limit = limit
        self.changed = asyncio.Event()

    def add(self, event: TaskDecided) -> None:
        if event.group_id is None:
            return  # refused before any rollout (pre-check, invalid proposal): no group's verdict
        put_newest(self.by_group, event.group_id, event.accepted, self.limit)
        self.changed.set()

    def of(self, event: GroupScored) -> bool | None:
        return self.by_group.get(event.group_id)


@dataclass
class LaneQueue:
    lane: Lane
    queued: list[QueuedGroup] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    last_arrival: float = 0.0
    training: list[QueuedGroup] = field(default_factory=list)
    """the batch of the step running now (a redelivery of one of its groups joins it)"""
    undurable: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    """groups trained into the weights, waiting for a durable checkpoint (their handlers wait on these)"""
    writes: asyncio.Queue[tuple[asyncio.Future[Checkpoint], dict[str, asyncio.Future[None]]] | None] = field(
        default_factory=asyncio.Queue
    )
    checkpoint_at: float = field(default_factory=time.monotonic)
    stale_pending: int = 0
    """samples dropped as stale in batches that took no step, not yet reported by a ``LearnerStepped``"""
    kl_rejected_pending: int = 0
    """batches undone by ``learner.max_step_kl``, not yet reported by a ``LearnerStepped``"""
    not_finite_pending: int = 0
    """batches refused for a loss or gradient norm that was not finite, not yet reported by a ``LearnerStepped``"""
    scored: int = 0
    """groups scored since the lane's last step (lock-step: a wave is complete at tasks.max_groups_in_flight)"""

    @property
    def held(self) -> int:
        return sum(len(p.samples) for p in self.queued)


class LearnerAgent(Agent):
    role = "learner"
    emits = (LearnerStepped, WeightsPublished)
    flush_after_s = 2.0

    def __init__(self, *a: Any, on_step: Callable[[Role, StepMetrics], None] | None = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.on_step = on_step
        self.lanes: dict[Role, LaneQueue] = {}
        self.verdicts = Verdicts()
        self.train_judge = self.cfg.trains_judge
        self.ckpt_root = checkpoint_root(self.cfg, self.bus.run_id)
        self.published: dict[Role, tuple[int, Path, str]] = {}
        self.batching = Batching.of(self.cfg, self.flush_after_s)

    def subscriptions(self) -> list[Subscription]:
        # a handler waits until its group is durable: as many handlers as the server lets us hold, one
        # group each (its durability can take the groups after it, which must not wait behind it)
        return [
            Subscription("learner", (GroupScored,), self.on_scored, concurrency=self.cfg.bus.max_ack_pending, batch=1),
            # per instance, from the stream's start: every verdict ever given is known after a restart
            Subscription("learner-decisions", (TaskDecided,), self.on_decided, concurrency=1, shared=False),
        ]

    async def run(self) -> None:
        from coevo.training import parity
        from coevo.training.distributed import RankZeroLane, stop_followers

        roles = trained_roles(self.cfg)
        if not self.train_judge:
            self.log.info(
                "learner.judge_lane_off",
                reason=f"loop={self.cfg.loop}"
                if self.cfg.loop == "policy-only"
                else f"{self.cfg.judge.backend} judge {self.cfg.judge.model!r} is not a local model dir",
            )
        weight_server = await self.serve_weights(roles)  # before the first WeightsPublished: followers ask at once
        try:
            building = build_lanes(self.cfg, roles, self.ckpt_root)
            for role in roles:
                lane: Any = await asyncio.to_thread(next, building)
                await parity.check(self.cfg, lane)  # a server sampling another distribution is refused
                if lane.world > 1:
                    lane = RankZeroLane(lane)
                self.lanes[role] = LaneQueue(lane)
                self.log.info(
                    "learner.lane", role=role, dtype=str(lane.dtype).removeprefix("torch."), device=str(lane.device)
                )
                if lane.resumed_from is not None:
                    self.log.info("learner.resumed", role=role, version=lane.version)
                await self.publish_weights(lane)  # every server starts from this run's current weights
            self.model_version = self.lanes["policy"].lane.version
            await super().run()
        finally:
            if weight_server is not None:
                await weight_server.aclose()
            for q in self.lanes.values():
                await asyncio.to_thread(q.lane.close)
            policy = self.lanes.get("policy")
            if policy is not None and isinstance(policy.lane, RankZeroLane):
                try:
                    await asyncio.to_thread(stop_followers)
                except Exception as exc:  # the followers may be gone already (torchrun stops all ranks)
                    self.log.warning("learner.followers_not_stopped", error=repr(exc)[:200])

    async def on_decided(self, event: TaskDecided, _d: Delivery) -> None:
        self.verdicts.add(event)

    async def verdict(self, event: GroupScored, delivery: Delivery) -> bool:
        """Whether a candidate group is trained; waits a while for its verdict, then lets the
        group be redelivered, and gives up (not trained) on the last delivery."""
        deadline = time.monotonic() + self.cfg.learner.verdict_wait_s
        while (accepted := self.verdicts.of(event)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                if delivery.num_delivered + 1 < self.cfg.bus.max_deliver:
                    raise Retry(f"no verdict yet for candidate group {event.group_id}", self.cfg.learner.verdict_wait_s)
                self.counters["groups.candidate_without_verdict"] += 1
                self.log.warning("learner.no_verdict", group_id=event.group_id, candidate_id=event.task_id)
                return False
            self.verdicts.changed.clear()
            await wait_event(self.verdicts.changed, left)
        return accepted

    async def on_scored(self, event: GroupScored, delivery: Delivery) -> None:
        if event.purpose == "eval" or event.flagged:
            self.count_scored()
            if event.purpose == "train":
                await self.no_signal(event.group_id)
            return
        if event.purpose == "candidate" and not await self.verdict(event, delivery):
            self.counters["groups.rejected_candidate"] += 1
            self.count_scored()
            return
        waits = []
        signal = False
        for role, q in self.lanes.items():
            samples = event.policy_samples if role == "policy" else event.judge_samples
            if not samples:
                continue
            problems = await q.lane.sample_problems(samples)  # grammar replays off the loop, before the checks
            if q.lane.is_durable(event.group_id):
                signal |= role == "policy"
                continue
            if q.lane.has_consumed(event.group_id):  # trained, not durable yet (a redelivery): wait for it
                waits.append(q.undurable.setdefault(event.group_id, asyncio.get_running_loop().create_future()))
                signal |= role == "policy"
                continue
            queued = self.enqueue(role, q, event.group_id, samples, problems)
            waits.append(queued)
            signal |= role == "policy" and not queued.done()  # done at once: every sample refused
        self.count_scored()  # after its samples are queued: the wave they complete includes them
        if event.purpose == "train" and not signal:
            await self.no_signal(event.group_id)
        if waits:  # shielded: the futures are shared with redeliveries of the same group
            await asyncio.gather(*(asyncio.shield(w) for w in waits))
        self.counters["groups.trained"] += 1

    async def no_signal(self, group_id: str) -> None:
        """A train group gave the policy lane nothing to train: name it now (no step will)."""
        q = self.lanes.get("policy")
        if q is not None:
            self.counters["groups.no_signal"] += 1
            await self.report("policy", q, no_signal_group_ids=[group_id])

    async def report(self, role: Role, q: LaneQueue, **named: list[str]) -> None:
        """A ``LearnerStepped`` that trained nothing (``samples`` 0, the lane's version): it names the
        groups the lane disposed of without a step and carries the counts not reported yet."""
        counts: dict[str, Any] = {**self.unreported(q), **named}
        await self.name_groups(
            self.event(
                LearnerStepped,
                role=role,
                version=q.lane.version,
                samples=0,
                tokens=0,
                loss=0.0,
                kl=0.0,
                clip_fraction=0.0,
                mismatch_kl=0.0,
                tokens_per_second=0.0,
                **counts,
            )
        )

    async def name_groups(self, event: LearnerStepped) -> None:
        """Store a ``LearnerStepped``: in a handler through its outbox (a failure redelivers the input,
        which names the groups again); from the lanes' loop, retried until stored, as nothing else would
        name its groups again (a lost one leaves the backlog gate waiting for them, and the stream
        without the version they went into)."""
        if outbox.current() is not None:
            await self.emit(event, confirm=True)
        else:
            await self.emit_durable(event)

    @staticmethod
    def unreported(q: LaneQueue) -> dict[str, Any]:
        """The lane's counts not reported yet, for the ``LearnerStepped`` being built (and reset)."""
        counts = {
            "stale_dropped": q.stale_pending,
            "kl_rejected": q.kl_rejected_pending,
            "not_finite": q.not_finite_pending,
        }
        q.stale_pending = q.kl_rejected_pending = q.not_finite_pending = 0
        return counts

    def count_scored(self) -> None:
        """One more group of the wave is scored, trained or not (lock-step counts them)."""
        for q in self.lanes.values():
            q.scored += 1
            q.arrived.set()

    def enqueue(
        self,
        role: Role,
        q: LaneQueue,
        group_id: str,
        samples: list[TrainingSample],
        problems: list[str | None] | None = None,
    ) -> asyncio.Future[None]:
        """Queue a group's trainable samples; a group already queued or in the running step (a
        redelivery) joins that entry. The future ends when the group is trained and durable.
        ``problems``: each sample's ``Lane.sample_problem``, found off the loop (``sample_problems``)."""
        for queued in (*q.queued, *q.training):
            if queued.group_id == group_id:
                return queued.done
        fine = []
        if problems is None:
            problems = [q.lane.sample_problem(s) for s in samples]
        for s, problem in zip(samples, problems, strict=True):
            if problem is None:
                fine.append(s)
            else:
                self.counters[f"samples.rejected.{role}"] += 1
                self.log.warning(
                    "learner.sample_rejected", role=role, group_id=group_id, sample_id=s.sample_id, reason=problem
                )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not fine:
            fut.set_result(None)
            return fut
        q.queued.append(QueuedGroup(group_id, fine, fut))
        q.last_arrival = time.monotonic()
        q.arrived.set()
        return fut

    async def main(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for role, q in self.lanes.items():
                    q.writes = asyncio.Queue()
                    tg.create_task(self.lane_loop(role, q), name=f"learner:{role}")
                    tg.create_task(self.durability(role, q), name=f"learner:{role}:checkpoints")
        finally:  # stopped, crashed or cancelled: the waiting handlers nak, their groups come back
            for role, q in self.lanes.items():
                self.release(role, q)

    async def lane_loop(self, role: Role, q: LaneQueue) -> None:
        try:
            while not self.stopping.is_set():
                if self.checkpoint_due(q):
                    await self.start_checkpoint(q)
                if self.batch_ready(q):
                    await self.train(role, q)
                else:
                    q.arrived.clear()
                    await wait_event(q.arrived, self.flush_after_s if q.held else 1.0)
            await self.last_checkpoint(q)
        finally:
            q.writes.put_nowait(None)  # the durability task ends after the checkpoints queued before

    def batch_ready(self, q: LaneQueue) -> bool:
        ready, q.scored = self.batching.ready(q.held, q.scored, time.monotonic() - q.last_arrival)
        return ready

    def checkpoint_due(self, q: LaneQueue) -> bool:
        lc = self.cfg.learner
        if not q.undurable or q.lane.checkpoint_busy:
            return False
        return (
            q.lane.version - q.lane.checkpointed_version >= lc.checkpoint_every_steps
            or time.monotonic() - q.checkpoint_at >= lc.checkpoint_every_s
            or len(q.undurable) >= max(1, self.cfg.bus.max_ack_pending // 2)
        )

    async def start_checkpoint(self, q: LaneQueue) -> None:
        """Start a resume checkpoint of the lane as it is now: it covers every group trained so far."""
        covered = dict(q.undurable)
        q.checkpoint_at = time.monotonic()
        written = await asyncio.to_thread(q.lane.begin_checkpoint)
        q.writes.put_nowait((asyncio.wrap_future(written), covered))

    async def last_checkpoint(self, q: LaneQueue) -> None:
        """On stop: one more checkpoint if groups wait for one (their handlers ack within the drain)."""
        if q.lane.checkpoint_busy:
            await asyncio.to_thread(q.lane.wait_checkpoint)
        if any(q.lane.has_consumed(g) for g in q.undurable):
            await self.start_checkpoint(q)

    async def durability(self, role: Role, q: LaneQueue) -> None:
        """As each checkpoint becomes durable, the groups it covers are released (acknowledged)."""
        while (item := await q.writes.get()) is not None:
            written, covered = item
            ckpt = await written  # a failed write crashes the lanes: their groups are redelivered
            for group_id, done in covered.items():
                if q.undurable.get(group_id) is done:
                    del q.undurable[group_id]
                if not done.done():
                    done.set_result(None)
            self.counters[f"checkpoints.{role}"] += 1
            self.log.info(
                "learner.checkpoint",
                role=role,
                version=ckpt.version,
                seconds=round(ckpt.seconds, 3),
                bytes=ckpt.bytes,
                groups=len(covered),
            )
            q.arrived.set()

    def release(self, role: Role, q: LaneQueue) -> None:
        """Every group still queued or waiting for a checkpoint is nak'd (redelivered)."""
        waiting = [p.done for p in q.queued] + list(q.undurable.values())
        q.queued, q.undurable = [], {}
        released = 0
        for done in waiting:
            if not done.done():
                done.set_exception(Retry(f"{role} lane stopped before the group was trained and durable"))
                # read here: a handler still waiting gets it (and naks); one the stop cancelled already
                # (drain timeout) is gone, and its group comes back by redelivery: not an error to report
                done.exception()
                released += 1
        if released:
            self.counters[f"groups.released.{role}"] += released
            self.log.info("learner.released", role=role, groups=released, reason="stopped before trained and durable")

    async def train(self, role: Role, q: LaneQueue) -> None:
        take = self.batching.take(q.queued)
        q.scored = self.batching.after_step(q.scored)
        samples = [s for p in take for s in p.samples]
        q.training = take
        step = asyncio.ensure_future(asyncio.to_thread(q.lane.step, samples, [p.group_id for p in take]))
        try:
            metrics = await asyncio.shield(step)
        except asyncio.CancelledError:  # the thread goes on: where its groups belong is known once it ends
            await outlast(step)
            trained = not step.cancelled() and step.exception() is None and step.result().samples > 0
            if trained:
                q.undurable.update((p.group_id, p.done) for p in take)
            else:
                q.queued[:0] = take
            raise
        except Exception as exc:
            q.training = []
            rejected = self.step_failed(role, q, take, exc)
            if rejected:
                await self.report(role, q, dead_lettered_group_ids=rejected)
            return
        finally:
            q.training = []
        self.count_untrained(role, q, take, metrics)
        q.stale_pending += metrics.stale_dropped
        if metrics.samples == 0:  # every sample stale, or the step undone: the groups are done, nothing trained
            for p in take:
                if not p.done.done():
                    p.done.set_result(None)
            ids = [p.group_id for p in take]
            await self.report(
                role, q, **({"kl_rejected_group_ids": ids} if metrics.kl_rejected else {"stale_group_ids": ids})
            )
            return
        await self.stepped(role, q, take, metrics)

    async def stepped(self, role: Role, q: LaneQueue, take: list[QueuedGroup], metrics: StepMetrics) -> None:
        """A batch trained: its groups wait for a durable checkpoint; ``LearnerStepped``, then weights."""
        for p in take:  # acknowledged once a checkpoint including them is durable
            q.undurable[p.group_id] = p.done
        if role == "policy":
            self.model_version = metrics.version
        await self.name_groups(
            self.event(
                LearnerStepped,
                role=role,
                version=metrics.version,
                samples=metrics.samples,
                tokens=metrics.tokens,
                loss=metrics.loss,
                kl=metrics.kl,
                clip_fraction=metrics.clip_fraction,
                mismatch_kl=metrics.mismatch_kl,
                mismatch_kl_current=metrics.mismatch_kl_current,
                staleness_histogram=metrics.staleness_histogram,
                tokens_per_second=metrics.tokens_per_second,
                group_ids=[p.group_id for p in take],
                step_kl=metrics.step_kl,
                entropy=metrics.entropy,
                entropy_coef=metrics.entropy_coef,
                **self.unreported(q),
            )
        )
        if metrics.version % self.cfg.learner.publish_every == 0:
            await self.publish_weights(q.lane)
        self.counters[f"steps.{role}"] += 1
        if self.on_step is not None:
            self.on_step(role, metrics)

    def count_untrained(self, role: Role, q: LaneQueue, take: list[QueuedGroup], metrics: StepMetrics) -> None:
        """Count and log what a step left untrained: samples dropped as stale, a batch the KL guard undid."""
        if metrics.stale_dropped:
            self.counters[f"samples.stale_dropped.{role}"] += metrics.stale_dropped
            self.log.info(
                "learner.stale_dropped",
                role=role,
                samples=metrics.stale_dropped,
                version=q.lane.version,
                max_staleness=self.cfg.learner.max_staleness,
            )
        if metrics.kl_rejected:
            q.kl_rejected_pending += 1
            self.counters[f"steps.kl_rejected.{role}"] += 1
            self.log.warning(
                "learner.step_rejected",
                role=role,
                step_kl=round(metrics.step_kl or 0.0, 4),
                bound=self.cfg.learner.max_step_kl,
                version=q.lane.version,
                groups=[p.group_id for p in take],
            )

    def step_failed(self, role: Role, q: LaneQueue, take: list[QueuedGroup], exc: Exception) -> list[str]:
        """A batch of several groups goes back, each to be tried alone; a group failing alone is rejected
        (its id returned, to be named). A loss or gradient norm that was not finite is counted."""
        self.log.warning("learner.step_failed", role=role, groups=[p.group_id for p in take], error=repr(exc)[:500])
        if isinstance(exc, NonFiniteStep):
            q.not_finite_pending += 1
            self.counters[f"steps.not_finite.{role}"] += 1
        if all(p.alone for p in take):  # failed again by itself: this group is the problem
            for p in take:
                if not p.done.done():
                    p.done.set_exception(Reject(f"{role} lane cannot train group {p.group_id}: {exc!r}"[:1000]))
            return [p.group_id for p in take]
        for p in reversed(take):
            p.alone = True
            q.queued.insert(0, p)
        return []

    async def publish_weights(self, lane: Any) -> None:
        """The lane's current weights in the serving dtype, then ``WeightsPublished`` (the digest
        field carries the manifest's digest)."""
        path, digest, size = await asyncio.to_thread(lane.publish)
        await self.announce(lane.role, lane.version, path, digest, size, lane.format)

    async def announce(
        self, role: Role, version: int, path: Path, sha: str, size: int, format: WeightsFormat = "full"
    ) -> None:
        self.published[role] = (version, path, sha)
        await self.emit_durable(  # stored before training goes on: no input guards it, a lost one is lost for good
            self.event(
                WeightsPublished, role=role, version=version, path=str(path), sha256=sha, bytes=size, format=format
            )
        )

    async def serve_weights(self, roles: list[Role]) -> WeightServer | None:
        """With ``learner.weight_sync`` gloo or nccl, answer the servers' followers' transfer requests."""
        sync = self.cfg.learner.weight_sync
        if not isinstance(sync, PushSync):
            return None
        server = WeightServer(self.bus, sync)
        for role in roles:

            def newest(role: Role = role) -> tuple[int, Path, str]:
                return self.published[role]

            await server.serve(role, newest)
        return server
