"""Held-out evaluation rounds: when one is due (by train groups, and by the clock where set), how rounds
are numbered, and the clock a run of a named model gets by default (coevo.agents.tasks)."""

from __future__ import annotations

import time

from coevo.agents.tasks import InFlight, TasksAgent, eval_turn, round_due
from coevo.config import PRETRAINED_EVAL_EVERY_S, CoevoConfig, TasksConfig, load_config
from coevo.observe.tally import eval_round
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored, Source, TaskScheduled

# ---- the decision, without I/O ---------------------------------------------------------------------


def test_a_round_is_due_every_n_train_groups_or_seconds_after_the_last_whichever_comes_first() -> None:
    by_groups = TasksConfig(eval_every=4)
    both = TasksConfig(eval_every=4, eval_every_s=60.0)
    due = [k for k in range(1, 13) if round_due(InFlight(train_groups_scheduled=k, eval_clock_at=0.0), by_groups, 1e9)]
    assert due == [4, 8, 12]  # no clock: however long ago the last round was
    fresh = InFlight(train_groups_scheduled=5, eval_clock_at=1000.0)
    assert not round_due(fresh, both, 1059.0) and round_due(fresh, both, 1060.0)
    assert round_due(InFlight(train_groups_scheduled=8, eval_clock_at=1000.0), both, 1001.0)  # the groups' turn
    assert not round_due(InFlight(train_groups_scheduled=5), both, 1e9)  # no round queued yet: the first is at load
    running = InFlight(train_groups_scheduled=5, eval_clock_at=1000.0, groups={"eval2-a": 3, "g-b": 3})
    assert running.evaluating() and not round_due(running, both, 1e9)  # the clock stands still while a round runs
    running.round_ended(["g-b"], 2000.0)  # a train group: nothing
    running.forget("eval2-a")
    running.round_ended(["eval2-a"], 3000.0)  # the round's last group, scored or lost: the clock starts
    assert running.eval_clock_at == 3000.0 and round_due(running, both, 3060.0) and not round_due(running, both, 3059.0)


def test_a_round_leaves_one_group_in_flight_to_training() -> None:
    queued = InFlight(eval_queue=["heldout-0", "heldout-1"], groups={"eval0-a": 0, "eval0-b": 0, "g-c": 0})
    assert eval_turn(queued, 4, training=True)  # 2 of 4 held: a third may go
    queued.groups["eval0-d"] = 0
    assert not eval_turn(queued, 4, training=True)  # 3 of 4: the last is training's
    assert eval_turn(queued, 4, training=False)  # no train slot: the round takes all
    assert not eval_turn(InFlight(groups={"g-a": 0}), 4, training=True)  # nothing queued
    assert eval_turn(InFlight(eval_queue=["heldout-0"]), 1, training=True)  # one slot: the round first
    assert not eval_turn(InFlight(eval_queue=["heldout-0"], groups={"eval0-a": 0}), 1, training=True)


def test_a_named_model_without_a_cadence_gets_rounds_by_the_clock_too() -> None:
    named = load_config(overrides={"policy.model": "smollm2-135m-instruct"})
    assert named.tasks.eval_every_s == PRETRAINED_EVAL_EVERY_S and named.tasks.eval_every == 16
    for given in ({"tasks.eval_every": 100000}, {"tasks.eval_every_s": 30.0}):
        chosen = load_config(overrides={"policy.model": "smollm2-135m-instruct", **given})
        assert chosen.tasks.eval_every_s == given.get("tasks.eval_every_s")  # a cadence given is kept as given
    assert load_config().tasks.eval_every_s is None  # the built-in tiny models: by train groups only
    reloaded = CoevoConfig.model_validate_json(named.model_dump_json())  # config.json, read back by replay
    assert reloaded.tasks.eval_every_s == PRETRAINED_EVAL_EVERY_S


# ---- the tasks agent on a real server --------------------------------------------------------------


def _eval_scored(agent: TasksAgent, group_id: str) -> GroupScored:
    slot_id = next(s.slot_id for s in agent.slots.values() if s.split == "heldout")
    return GroupScored(
        run_id=agent.bus.run_id,
        source=Source(agent_id="scorer-t", role="scorer"),
        task_id=agent.slots[slot_id].active.task_id,
        group_id=group_id,
        slot_id=slot_id,
        purpose="eval",
        accuracy=0.5,
        n_trajectories=4,
        policy_band_ok=False,
        judge_band_ok=False,
    )


async def _schedule_train(agent: TasksAgent, n: int) -> list[str]:
    """Schedule ``n`` train groups, and the eval groups that fall due between them; the eval group ids."""
    out = []
    while n:
        slot, task, purpose = agent.next_group()
        before = set(agent.inflight.groups)
        await agent.schedule(slot, task, purpose)
        if purpose == "eval":
            out += [g for g in agent.inflight.groups if g not in before]
        n -= purpose == "train"
    return out


async def test_rounds_are_numbered_in_order_by_groups_and_by_the_clock(bus: NatsBus, cfg: CoevoConfig) -> None:
    cfg = cfg.model_copy(update={"loop": "policy-only"})
    # room for a whole round in flight (a round leaves one group to training: below)
    rounds = {"eval_every": 4, "eval_every_s": 3600.0, "max_groups_in_flight": 64}
    cfg = cfg.model_copy(update={"tasks": cfg.tasks.model_copy(update=rounds)})
    agent = TasksAgent(bus, cfg)
    await agent.load()
    heldout = sum(s.split == "heldout" for s in agent.slots.values())
    assert heldout >= 2 and agent.inflight.eval_rounds == 1  # the "before" round, queued at load
    first = await _schedule_train(agent, 4)  # round 0 first, round 1 queued by the fourth train group
    assert [eval_round(g) for g in first] == ["eval0"] * heldout and len(agent.inflight.eval_queue) == heldout
    second = await _schedule_train(agent, 1)
    assert [eval_round(g) for g in second] == ["eval1"] * heldout
    agent.inflight.eval_clock_at = time.time() - 3600.0  # an hour since the clock started...
    # ...but rounds run: it stands still
    assert await _schedule_train(agent, 1) == [] and agent.inflight.eval_queue == []
    before = time.time()
    for group_id in first + second:  # the rounds end: the clock starts then
        await agent.on_scored(_eval_scored(agent, group_id), None)  # type: ignore[arg-type]
    assert agent.inflight.eval_clock_at is not None and agent.inflight.eval_clock_at >= before
    agent.inflight.eval_clock_at -= 3600.0  # an hour later, the seventh train group (not a fourth)
    assert await _schedule_train(agent, 1) == [] and len(agent.inflight.eval_queue) == heldout  # queued by the clock
    third = await _schedule_train(agent, 1)
    assert [eval_round(g) for g in third] == ["eval2"] * heldout and agent.inflight.train_groups_scheduled == 8
    # the eighth group's round, queued
    assert agent.inflight.eval_rounds == 4 and len(agent.inflight.eval_queue) == heldout
    # what was published says the same, with each round's size
    events = [e for e in await bus.events(["task.scheduled"]) if isinstance(e, TaskScheduled) and e.purpose == "eval"]
    assert [eval_round(e.group_id) for e in events] == [f"eval{k}" for k in range(3) for _ in range(heldout)]
    assert {e.round_size for e in events} == {heldout}
    # resumed from KV: the rounds go on from where they stood, not from eval0
    again = TasksAgent(bus, cfg)
    await again.load()
    # round 3, not lost
    assert again.inflight.eval_rounds == 4 and again.inflight.eval_queue == agent.inflight.eval_queue != []


async def test_a_long_round_shares_the_groups_in_flight_and_holds_back_no_train_sample(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    cfg = cfg.model_copy(update={"loop": "policy-only"})
    agent = TasksAgent(bus, cfg)
    await agent.load()  # the "before" round, queued
    capacity = cfg.tasks.max_groups_in_flight
    purposes = []
    while agent.admitted():
        slot, task, purpose = agent.next_group()
        await agent.schedule(slot, task, purpose)
        purposes.append(purpose)
    assert purposes == ["eval"] * (capacity - 1) + ["train"]  # the round's episodes have not ended
    # many policy versions later, its groups still in flight: they are never trained on, so they hold
    # back no scheduling; the train group of version 0 does
    agent.policy_version = cfg.learner.max_staleness + 5
    assert not agent.admitted()
    train_group = next(g for g in agent.inflight.groups if g.startswith("g-"))
    agent.inflight.forget(train_group)
    assert agent.admitted() and agent.next_group()[2] == "train"
