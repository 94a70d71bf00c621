"""``coevo bench async``: the pure measurement, and a short run of both modes as pinned processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coevo.bench.asynchrony import (
    AsyncPlan,
    bench_async,
    idle_fraction,
    measure,
    overlap_fraction,
    scheduled_versions,
    trajectory_versions,
)
from coevo.schemas import (
    GroupScored,
    LearnerStepped,
    Source,
    TaskScheduled,
    TaskSpec,
    TrajectoryCompleted,
    WeightsPublished,
)

SRC = Source(agent_id="a", role="t")
TASK = TaskSpec(task_id="t1", family="quickgame")


def _published(v: int, ts: float) -> WeightsPublished:
    return WeightsPublished(
        run_id="r", source=SRC, role="policy", version=v, path="/w", sha256="0" * 64, bytes=1, ts=ts
    )


def _traj(group: str, versions: list[int], ts: float) -> TrajectoryCompleted:
    return TrajectoryCompleted(
        run_id="r",
        source=SRC,
        trajectory_id=f"{group}-{ts}",
        task_id="t1",
        group_id=group,
        rollout_index=0,
        outcome="won",
        num_steps=len(versions),
        policy_versions=versions,
        ts=ts,
    )


def _stepped(v: int, ts: float, hist: dict[str, int]) -> LearnerStepped:
    return LearnerStepped(
        run_id="r",
        source=SRC,
        role="policy",
        version=v,
        samples=sum(hist.values()),
        tokens=100,
        loss=0.0,
        kl=0.0,
        clip_fraction=0.0,
        mismatch_kl=0.0,
        staleness_histogram=hist,
        tokens_per_second=200.0,
        ts=ts,
    )


def _scored(group: str, acc: float, ts: float) -> GroupScored:
    return GroupScored(
        run_id="r",
        source=SRC,
        task_id="t1",
        group_id=group,
        accuracy=acc,
        policy_band_ok=True,
        judge_band_ok=True,
        n_trajectories=8,
        ts=ts,
    )


def test_lockstep_schedules_waves_and_waits_for_the_steps_that_train_them() -> None:
    from coevo.agents.tasks import Lockstep

    lock = Lockstep(size=2, timeout_s=60.0)
    assert lock.admits(0, {"policy": 3, "judge": 1}, now=0.0)
    lock.scheduled()
    assert lock.admits(1, {"policy": 3, "judge": 1}, now=0.0)  # the wave is scheduled whole
    lock.scheduled()
    assert not lock.admits(2, {"policy": 3, "judge": 1}, now=1.0)
    assert not lock.admits(1, {"policy": 3, "judge": 1}, now=1.0)
    lock.scored(["policy", "judge"])
    lock.scored([])
    assert not lock.admits(0, {"policy": 3, "judge": 1}, now=2.0)  # scored, not trained yet
    assert not lock.admits(0, {"policy": 4, "judge": 1}, now=2.5)  # the judge's step is not out yet
    assert lock.admits(0, {"policy": 4, "judge": 2}, now=3.0)  # both steps' weights are out: next wave
    lock.scheduled()
    lock.scheduled()
    lock.scored([])
    lock.scored(["judge"])
    assert lock.admits(0, {"policy": 4, "judge": 3}, now=4.0)  # only the judge trained: its step suffices
    lock.scheduled()
    lock.scheduled()
    lock.scored([])
    lock.scored([])
    assert lock.admits(0, {"policy": 4, "judge": 3}, now=5.0)  # nothing to train: no step will come, go on
    lock.scheduled()
    lock.scheduled()
    lock.scored(["policy"])
    assert not lock.admits(0, {"policy": 4, "judge": 3}, now=6.0)
    assert lock.admits(0, {"policy": 4, "judge": 3}, now=67.0)  # the step never came: not stuck for ever


def test_backlog_holds_scored_groups_until_a_step_names_them() -> None:
    from coevo.algorithm.admission import Backlog

    b = Backlog(timeout_s=100.0, remember=2)
    assert b.oldest(now=0.0) is None
    b.scored("g1", 3, now=0.0)
    b.scored("g2", 5, now=1.0)
    assert b.oldest(now=2.0) == 3
    b.trained(["g1", "x"])
    assert b.oldest(now=2.0) == 5
    b.scored("g1", 3, now=3.0)  # a score handled after the step that trained it: not waiting
    assert b.oldest(now=3.0) == 5
    b.trained(["y", "z"])  # only the last `remember` trained ids are kept
    b.scored("g1", 3, now=4.0)
    assert b.oldest(now=4.0) == 3
    assert b.oldest(now=102.0) == 3 and b.oldest(now=104.5) is None  # never named: stops counting


def test_backlog_counts_its_groups_and_samples_and_is_full_at_max_staleness_steps_of_work() -> None:
    from coevo.algorithm.admission import Backlog, queue_full

    b = Backlog(timeout_s=100.0)
    b.scored("g1", 0, now=0.0, samples=5)
    b.scored("g2", 0, now=50.0, samples=6)
    assert b.queued(now=60.0) == (2, 11)
    assert b.queued(now=101.0) == (1, 6)  # g1 stopped counting
    # by samples: max_staleness 2 of batches of 8 is 16 samples
    assert queue_full(3, 15, 2, 8, None) is None
    why = queue_full(2, 16, 2, 8, None)
    assert why is not None and "16 samples" in why and "2.0 steps' work" in why and "max_staleness = 2" in why
    # by groups (learner.batch_groups): what the samples say does not count
    assert queue_full(3, 500, 2, 8, 2) is None
    assert queue_full(4, 0, 2, 8, 2) is not None
    assert queue_full(1, 1, 1, 1, None) is not None  # one batch at max_staleness 1


def _sample() -> object:
    from coevo.schemas import TrainingSample

    return TrainingSample(
        sample_id="s",
        role="policy",
        prompt_token_ids=[1],
        response_token_ids=[2],
        logprobs=[-1.0],
        advantage=1.0,
        model_version=0,
        step_event_id="e",
    )


async def _gate_scenario(bus, cfg, samples: int, versions: tuple[int, ...]) -> None:
    """A train group scheduled at version 0 and scored with ``samples`` policy samples, then the
    policy ``versions`` published: scheduling must pause, and go on once a policy step names the group."""
    import asyncio

    from coevo.agents.tasks import TasksAgent
    from coevo.runtime.agent import run_agents

    agent = TasksAgent(bus, cfg)
    await agent.load()
    slot = next(s for s in agent.slots.values() if s.split == "train")
    await agent.schedule(slot, slot.active, "train")
    (group,) = agent.inflight.groups
    src = Source(agent_id="learner", role="learner")
    stop = asyncio.Event()

    async def until(check) -> None:
        async with asyncio.timeout(30):
            while not check():
                await asyncio.sleep(0.05)

    async def scenario() -> None:
        try:
            await bus.publish(
                GroupScored(
                    run_id=bus.run_id,
                    source=SRC,
                    task_id=slot.active.task_id,
                    group_id=group,
                    slot_id=slot.slot_id,
                    accuracy=0.5,
                    policy_band_ok=True,
                    judge_band_ok=True,
                    n_trajectories=8,
                    policy_samples=[_sample()] * samples,
                )
            )
            await until(lambda: group not in agent.inflight.groups and agent.backlog.groups)
            for v in versions:
                await bus.publish(
                    WeightsPublished(
                        run_id=bus.run_id, source=src, role="policy", version=v, path="/w", sha256="0" * 64, bytes=1
                    )
                )
            await until(lambda: agent.policy_version == (versions[-1] if versions else 0))
            assert not agent.admitted()
            assert group not in agent.inflight.groups and len(agent.inflight.groups) < 4
            await bus.publish(
                LearnerStepped(
                    run_id=bus.run_id,
                    source=src,
                    role="policy",
                    version=len(versions) + 1,
                    samples=1,
                    tokens=2,
                    loss=0.0,
                    kl=0.0,
                    clip_fraction=0.0,
                    mismatch_kl=0.0,
                    tokens_per_second=1.0,
                    group_ids=[group],
                )
            )
            await until(lambda: not agent.backlog.groups)
            assert agent.admitted()  # trained: scheduling goes on
        finally:
            stop.set()

    agent.main = agent.stopping.wait  # the test schedules; the agent only consumes
    await asyncio.gather(run_agents([agent], handle_signals=False, until=stop), scenario())


async def test_a_slow_learner_pauses_scheduling_until_it_trains_the_old_groups(bus, cfg) -> None:
    """Async (max_staleness 2): a scored train group whose step has not come holds scheduling back
    once the policy is more than 2 versions past the version it was scheduled at (one sample: the
    queue is far from full)."""
    await _gate_scenario(bus, cfg, samples=1, versions=(1, 2, 3))


async def test_a_queue_of_max_staleness_steps_of_work_pauses_scheduling_at_the_same_version(bus, cfg) -> None:
    """Rollouts faster than the learner: no group is too old yet (the policy is still at version 0), but
    the queue holds max_staleness (2) batches of samples, so a group scheduled now would be trained
    more than 2 versions late; scheduling pauses until the learner names the group."""
    assert cfg.learner.max_staleness == 2
    await _gate_scenario(bus, cfg, samples=2 * cfg.learner.batch_samples, versions=())


def test_versions_at_scheduling_come_from_stream_order() -> None:
    events = [
        _published(0, 0.0),
        TaskScheduled(run_id="r", source=SRC, task=TASK, group_id="g1", n_rollouts=2, ts=1),
        _published(1, 2.0),
        TaskScheduled(run_id="r", source=SRC, task=TASK, group_id="g2", n_rollouts=2, ts=3),
        _traj("g1", [0, 0], 4.0),
        _traj("g1", [0, 1], 4.1),
        _traj("g2", [0, 1], 5.0),
        _traj("g2", [1], 5.1),
    ]
    at = scheduled_versions(events)
    assert at == {"g1": 0, "g2": 1}
    assert trajectory_versions(events, at) == {"on_version": 2, "behind": 1, "ahead": 1}


def test_idle_and_overlap_fractions_read_the_spans_with_a_group_in_flight() -> None:
    def sched(g: str, ts: float) -> TaskScheduled:
        return TaskScheduled(run_id="r", source=SRC, task=TASK, group_id=g, n_rollouts=2, ts=ts)

    events = [
        sched("a", 5.0),
        sched("b", 6.0),
        _scored("a", 0.5, 20.0),
        _scored("b", 0.5, 30.0),
        sched("c", 40.0),
        _scored("c", 0.5, 90.0),
        sched("d", 95.0),
    ]
    # window 10..110: idle 30..40 and 90..95
    assert idle_fraction(events, 10.0, 100.0) == 0.15
    # steps computing 15..25 (all in flight), 35..45 (half), 91..93 (none); one untimed
    steps = [_stepped(1, 25.0, {"0": 1}), _stepped(2, 45.0, {"0": 1}), _stepped(3, 93.0, {"0": 1})]
    steps = [
        s.model_copy(update={"tokens": t, "tokens_per_second": 1.0}) for s, t in zip(steps, (10, 10, 2), strict=True)
    ]
    untimed = _stepped(4, 99.0, {"0": 1}).model_copy(update={"tokens_per_second": 0.0})
    assert overlap_fraction(events, [*steps, untimed]) == round(15 / 22, 4)
    assert overlap_fraction(events, [untimed]) is None
    assert overlap_fraction(events, [steps[2].model_copy(update={"ts": 96.0})]) == 0.5  # d is still in flight


def test_measure_rates_staleness_and_time_to_target() -> None:
    t0 = 1000.0
    events = [_stepped(v, t0 + 10 * v, {"0": 6, "1": 2} if v % 2 else {"0": 8}) for v in range(1, 7)]
    events += [_scored(f"g{i}", 0.25 if i < 4 else 0.9, t0 + 5 * i) for i in range(12)]
    events.append(_stepped(7, t0 + 200, {"0": 8}))  # after the window: not counted
    m = measure(events, t0, 60.0, target=0.8, window=4)
    assert m["learner_steps"] == 6 and m["learner_steps_per_minute"] == 6.0
    assert m["trained_staleness"] == {"0": 42, "1": 6} and m["stale_fraction"] == round(6 / 48, 4)
    assert m["seconds_to_target"] == 35.0  # groups 4..7 are the first window at 0.9
    assert m["steps_to_target"] == 3
    assert m["policy_step_s"] == 0.5 and m["learner_busy_fraction"] == 0.05


@pytest.mark.slow
@pytest.mark.alone  # pins the run to cores 0 and 1: a neighbour test on them starves it
@pytest.mark.timeout(600)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
async def test_sync_waits_for_weights_and_async_overlaps(model_cache: Path, tmp_path: Path) -> None:
    plan = AsyncPlan(minutes=0.6, seeds=1, window=4)
    result = await bench_async(plan, cache=model_cache, workdir=tmp_path)
    assert set(result) >= {"sync", "async", "ratios", "runs", "cores", "met"}
    (sync,), (asyn,) = result["runs"]["sync"], result["runs"]["async"]
    rollout, learner = result["cores"]["rollouts"], result["cores"]["learner"]
    assert set(rollout).isdisjoint(learner)
    for run in (sync, asyn):
        assert run["agents_exited"] == {}
        assert run["affinity"]["learner"]["cores"] == learner
        for role in ("tasks", "policy", "judge", "scorer"):
            assert run["affinity"][role]["cores"] == rollout, (role, run["affinity"])
        assert run["learner_steps"] >= 2 and run["trajectories"] > 0
    # synchronous: every trajectory played with exactly the weights current when its group was scheduled,
    # and the learner trained only on samples of its own version
    assert sync["trajectory_versions"]["behind"] == sync["trajectory_versions"]["ahead"] == 0, sync
    assert set(sync["trained_staleness"]) == {"0"}, sync["trained_staleness"]
    # in sync, generation waits while the learner computes; async overlaps the two (its rollouts may still
    # idle, with the learner's queue full: measured 0.08 to 0.18 against sync's 0.15 to 0.17 here)
    assert sync["learner_overlap_fraction"] <= 0.05 < 0.5 <= asyn["learner_overlap_fraction"], (sync, asyn)
    # asynchronous: groups run on while the learner steps, so some samples are older than the weights
    assert asyn["trajectory_versions"]["ahead"] > 0 or asyn["stale_fraction"] > 0, asyn
