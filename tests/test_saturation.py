"""Saturated train slots: the pure decisions, the built-in rewriter's larger moves, and the tasks agent
scheduling and rewriting against a real NATS server (coevo.algorithm.saturation)."""

from __future__ import annotations

from collections import Counter

import pytest

from coevo.agents.tasks import TasksAgent
from coevo.algorithm import saturation
from coevo.algorithm.rewriter import BuiltinRewriter, fresh_world, wants_fresh_world
from coevo.config import CoevoConfig
from coevo.envs import make_family
from coevo.envs.base import spec_hash
from coevo.observe.tally import RunTally
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored, Source, TaskRewritten
from coevo.tools.replay import replay_rewriter

# ---- the decisions, without I/O --------------------------------------------------------------------


def test_the_streak_counts_groups_without_outcome_signal_and_a_mixed_group_restarts_it() -> None:
    streak = 0
    for acc in (1.0, 1.0, 0.0):
        streak = saturation.streak_after(streak, acc)
    assert streak == 3
    assert saturation.streak_after(streak, 0.5) == 0
    assert saturation.streak_after(0, 0.125) == 0


@pytest.mark.parametrize(
    ("streak", "after", "most", "moves", "weight"),
    [
        (0, 3, 3, 1, 1.0),
        (2, 3, 3, 1, 1.0),
        (3, 3, 3, 2, 0.25),
        (5, 3, 3, 2, 0.25),
        (6, 3, 3, 3, 0.25),
        (30, 3, 3, 3, 0.25),
        (30, 3, 1, 1, 0.25),
        (30, 0, 3, 1, 1.0),
    ],
)
def test_moves_grow_with_the_streak_up_to_the_bound_and_after_zero_turns_it_off(
    streak: int, after: int, most: int, moves: int, weight: float
) -> None:
    assert saturation.moves(streak, after, most) == moves
    assert saturation.weight(streak, after, 0.25) == weight


def test_a_move_that_overshot_caps_the_next_ones_below_it_in_its_direction() -> None:
    over = saturation.overshoot_after(None, 3, "harder", 0.5)  # rejected for another reason: no cap
    assert over is None and saturation.capped(3, "harder", over) == 3
    over = saturation.overshoot_after(over, 3, "harder", 0.0)  # unsolved: 3 moves went too far
    assert over == ("harder", 3) and saturation.capped(3, "harder", over) == 2
    assert saturation.capped(1, "harder", over) == 1 and saturation.capped(3, "easier", over) == 3
    assert saturation.overshoot_after(over, 1, "harder", 1.0) == over  # all won below the cap: it stays
    assert saturation.overshoot_after(over, 2, "harder", 0.875) == over  # not harder, not all won
    assert saturation.overshoot_after(over, 2, "harder", 1.0) is None  # all won at the cap: too tight, lifted
    over = saturation.overshoot_after(over, 1, "harder", 0.0)  # even one move went too far: never below one
    assert over == ("harder", 1) and saturation.capped(3, "harder", over) == 1
    assert saturation.overshoot_after(over, 2, "easier", 1.0) == ("easier", 2)  # everybody won an easier one
    assert saturation.overshoot_after(None, 2, "easier", 0.0) is None  # nobody won it: not easier enough


def test_a_fresh_world_follows_when_even_one_knob_step_overshot_in_its_direction() -> None:
    assert not saturation.fresh("harder", None) and not saturation.fresh("harder", ("harder", 2))
    assert saturation.fresh("harder", ("harder", 1)) and not saturation.fresh("easier", ("harder", 1))
    # a fresh world (one move) that nobody won keeps the slot on fresh worlds; one still all won lifts the cap
    assert saturation.overshoot_after(("harder", 1), 1, "harder", 0.0) == ("harder", 1)
    assert saturation.overshoot_after(("harder", 1), 1, "harder", 1.0) is None


def test_stride_with_equal_weights_is_round_robin_in_the_given_order() -> None:
    stride = saturation.Stride()
    picks = [stride.pick({"a": 1.0, "b": 1.0, "c": 1.0}) for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


def test_stride_gives_a_low_weight_key_its_share_and_never_starves_it() -> None:
    stride = saturation.Stride()
    weights = {"a": 1.0, "b": 1.0, "c": 1.0, "s": 0.25}
    picks = Counter(stride.pick(weights) for _ in range(130))  # 10 rounds of 13 = 4·1 + 4·1 + 4·1 + 1
    assert picks == {"a": 40, "b": 40, "c": 40, "s": 10}


def test_a_key_joining_late_starts_level_with_the_others() -> None:
    stride = saturation.Stride()
    for _ in range(20):
        stride.pick({"a": 1.0, "b": 1.0})
    picks = Counter(stride.pick({"a": 1.0, "b": 1.0, "new": 1.0}) for _ in range(6))
    assert picks == {"a": 2, "b": 2, "new": 2}  # neither a burst of 20 "new" picks nor a wait


def test_stride_rejects_nothing_to_pick_and_non_positive_weights() -> None:
    with pytest.raises(ValueError, match="nothing"):
        saturation.Stride().pick({})
    with pytest.raises(ValueError, match="> 0"):
        saturation.Stride().pick({"a": 0.0})


# ---- the built-in rewriter's larger moves ------------------------------------------------------------


@pytest.mark.parametrize("direction", ["harder", "easier"])
async def test_a_wide_rewrite_is_one_child_several_knob_steps_away(cfg: CoevoConfig, direction: str) -> None:
    family = make_family(cfg.env)
    task = family.initial_tasks(4, 0, 0)[1]
    one = await BuiltinRewriter().propose(family, task, direction, [])  # type: ignore[arg-type]
    wide = await BuiltinRewriter().propose(family, task, direction, [], moves=3)  # type: ignore[arg-type]
    assert one.candidate is not None and wide.candidate is not None
    assert one.candidate == family.apply(task, one.rewriter.split(":")[1])  # one move: as before
    steps = sum(abs(wide.candidate.knobs.get(k.name, k.low) - task.knobs.get(k.name, k.low)) for k in family.knobs)
    assert steps == 3 and len(wide.rewriter.split(":")[1].split(",")) == 3
    assert (wide.candidate.parent_id, wide.candidate.version) == (task.task_id, task.version + 1)
    moved = family.difficulty(wide.candidate) - family.difficulty(task)
    assert (
        moved > family.difficulty(one.candidate) - family.difficulty(task)
        if direction == "harder"
        else moved < family.difficulty(one.candidate) - family.difficulty(task)
    )


async def test_a_fresh_world_keeps_the_knobs_lineage_and_parity_and_differs_per_salt(cfg: CoevoConfig) -> None:
    family = make_family(cfg.env)
    task = family.initial_tasks(4, 0, 0)[1]
    first, again, other = (family.fresh_world(task, salt) for salt in ("e-3", "e-3", "e-4"))
    assert first is not None and other is not None and first == again  # replays agree
    assert first.knobs == task.knobs and first.split == "train" and first.params["seed"] != task.params["seed"]
    assert first.params["seed"] % 2 == task.params["seed"] % 2 and other.params["seed"] != first.params["seed"]
    assert (first.parent_id, first.version) == (task.task_id, task.version + 1)
    assert {k: v for k, v in first.params.items() if k != "seed"} == {
        k: v for k, v in task.params.items() if k != "seed"
    }
    # never a task to avoid (a held-out one): the next draw instead, the same one on every replay
    avoided = family.fresh_world(task, "e-3", {spec_hash(family.name, first.params, first.knobs)})
    assert avoided is not None and avoided.params["seed"] not in (first.params["seed"], task.params["seed"])
    assert avoided == family.fresh_world(task, "e-3", {spec_hash(family.name, first.params, first.knobs)})
    for params in ({}, {"seed": "7"}, {"seed": None}, {"seed": True}):  # no integer seed: no other world
        assert family.fresh_world(task.model_copy(update={"params": params}), "e-3") is None


async def test_a_slot_wants_a_fresh_world_when_no_knob_step_can_help(cfg: CoevoConfig) -> None:
    family = make_family(cfg.env)
    top = family.initial_tasks(1, 0, 0)[0]
    assert not wants_fresh_world(family, top, "harder", None)
    assert wants_fresh_world(family, top, "harder", ("harder", 1))  # one step overshot
    assert not wants_fresh_world(family, top, "harder", ("harder", 2)) and not wants_fresh_world(
        family, top, "easier", ("harder", 1)
    )
    for _ in range(100):  # harder and harder, one knob step at a time, until no knob can move
        nxt = await BuiltinRewriter().propose(family, top, "harder", [])
        if nxt.candidate is None:
            break
        top = nxt.candidate
    assert nxt.error == "every knob is at its harder bound" and wants_fresh_world(family, top, "harder", None)
    world = fresh_world(family, top, [], "e-1", "builtin")
    assert world.rewriter == "builtin:world" and world.candidate is not None and world.candidate.knobs == top.knobs
    seedless = fresh_world(family, top.model_copy(update={"params": {}}), [], "e-1", "builtin")
    assert seedless.candidate is None and seedless.error == "quickgame has no other world of these knobs"


# ---- the tasks agent on a real server -----------------------------------------------------------------


def _scored(agent: TasksAgent, slot_id: str, accuracy: float, k: int) -> GroupScored:
    slot = agent.slots[slot_id]
    return GroupScored(
        run_id=agent.bus.run_id,
        source=Source(agent_id="scorer-t", role="scorer"),
        task_id=slot.active.task_id,
        group_id=f"g-{slot_id}-{k}",
        slot_id=slot_id,
        purpose="train",
        accuracy=accuracy,
        n_trajectories=8,
        policy_band_ok=False,
        judge_band_ok=False,
    )


async def test_a_saturated_slot_is_scheduled_a_quarter_as_often_until_a_mixed_group(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    cfg = cfg.model_copy(update={"loop": "policy-only"})  # no rewriter: scheduling alone
    agent = TasksAgent(bus, cfg)
    await agent.load()
    agent.inflight.eval_queue = []
    train = [s.slot_id for s in agent.slots.values() if s.split == "train"]
    won = train[2]
    for k in range(3):
        await agent.on_scored(_scored(agent, won, 1.0, k), None)  # type: ignore[arg-type]
    assert agent.slots[won].saturated_streak == 3
    rounds = 4 * (len(train) - 1) + 1
    picks = Counter(agent.next_group()[0].slot_id for _ in range(4 * rounds))
    assert picks[won] == 4 and all(picks[s] == 16 for s in train if s != won)
    assert agent.counters["scheduled.train_saturated"] == 4
    await agent.on_scored(_scored(agent, won, 0.5, 3), None)  # type: ignore[arg-type]
    picks = Counter(agent.next_group()[0].slot_id for _ in range(3 * len(train)))
    assert set(picks.values()) == {3}  # round-robin again
    kv = await bus.kv("tasks")
    saved = await kv.get(f"slot.{won}")
    assert saved is not None and b'"saturated_streak":0' in saved


async def _rewriting_agent(bus: NatsBus, cfg: CoevoConfig) -> tuple[TasksAgent, str]:
    """The full loop's tasks agent, rewriting after 3 groups, and its first train slot."""
    cfg = cfg.model_copy(
        update={"loop": "full", "tasks": cfg.tasks.model_copy(update={"min_groups_between_rewrites": 3})}
    )
    agent = TasksAgent(bus, cfg)
    await agent.load()
    return agent, next(s.slot_id for s in agent.slots.values() if s.split == "train")


async def test_a_saturated_slot_is_rewritten_with_a_larger_move_and_the_event_says_so(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    agent, slot_id = await _rewriting_agent(bus, cfg)
    parent = agent.slots[slot_id].active
    for k in range(3):  # the third all-won group triggers the rewrite, at a streak of 3
        await agent.on_scored(_scored(agent, slot_id, 1.0, k), None)  # type: ignore[arg-type]
    await bus.flush()
    rewritten = [e async for _, e, _m in bus.history(["task.rewritten"]) if isinstance(e, TaskRewritten)]
    assert len(rewritten) == 1 and rewritten[0].moves == 2 and rewritten[0].direction == "harder"
    candidate = agent.slots[slot_id].candidate
    assert candidate is not None and candidate == rewritten[0].candidate
    family = make_family(agent.cfg.env)
    assert sum(abs(candidate.knobs.get(k.name, k.low) - parent.knobs.get(k.name, k.low)) for k in family.knobs) == 2
    assert agent.counters["rewrites_proposed_wide"] == 1


async def test_an_unsolved_wide_candidate_makes_the_next_rewrite_smaller_until_one_is_accepted(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    agent, slot_id = await _rewriting_agent(bus, cfg)
    k = 0

    async def saturate_and_judge(candidate_accuracy: float) -> int:
        nonlocal k
        for _ in range(3):  # three all-won groups since the last decision: a rewrite
            await agent.on_scored(_scored(agent, slot_id, 1.0, k), None)  # type: ignore[arg-type]
            k += 1
        candidate = agent.slots[slot_id].candidate
        assert candidate is not None
        moves = agent.slots[slot_id].candidate_moves
        assert moves is not None
        judged = _scored(agent, slot_id, candidate_accuracy, k).model_copy(
            update={"task_id": candidate.task_id, "purpose": "candidate"}
        )
        k += 1
        await agent.on_scored(judged, None)  # type: ignore[arg-type]
        assert agent.slots[slot_id].candidate is None  # decided
        return moves

    assert await saturate_and_judge(0.0) == 2  # streak 3: two moves, and nothing won: too far
    assert agent.slots[slot_id].overshoot == ("harder", 2)
    assert await saturate_and_judge(0.0) == 1  # streak 6 would move 3: capped below the overshoot
    assert agent.counters["rewrites_proposed_capped"] == 1
    assert await saturate_and_judge(0.5) == 1  # in the band: accepted, and the cap is lifted
    slot = agent.slots[slot_id]
    assert slot.rewrites_accepted == 1 and slot.overshoot is None and slot.candidate_moves is None
    await bus.flush()
    rewritten = [e async for _, e, _m in bus.history(["task.rewritten"]) if isinstance(e, TaskRewritten)]
    assert [e.moves for e in rewritten] == [2, 1, 1]
    wanted = [e.moves_wanted for e in rewritten]
    assert wanted[:2] == [2, 3] and wanted[2] is not None and wanted[2] >= 1, wanted  # the second was capped
    tally = RunTally()
    for e in rewritten:
        tally.add(e)
    capped = sum(w is not None and e.moves < w for e, w in zip(rewritten, wanted, strict=True))
    assert capped >= 1 and tally.capped == capped  # counted from the events alone (summary: rewrites_proposed_capped)


async def test_when_one_knob_step_overshoots_the_next_candidates_are_fresh_worlds_until_one_is_accepted(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    """A memorised slot (all won) whose smallest knob step comes back unsolved: another world of the same
    knobs, another again while nobody wins it, accepted once it lands in the band; then knob steps again."""
    agent, slot_id = await _rewriting_agent(bus, cfg)
    parent = agent.slots[slot_id].active
    k = 0
    fed: list[GroupScored] = []

    async def rewrite_and_judge(candidate_accuracy: float) -> TaskRewritten:
        nonlocal k
        for _ in range(3):
            fed.append(_scored(agent, slot_id, 1.0, k))
            await agent.on_scored(fed[-1], None)  # type: ignore[arg-type]
            k += 1
        candidate = agent.slots[slot_id].candidate
        assert candidate is not None
        judged = _scored(agent, slot_id, candidate_accuracy, k).model_copy(
            update={"task_id": candidate.task_id, "purpose": "candidate"}
        )
        k += 1
        fed.append(judged)
        await agent.on_scored(judged, None)  # type: ignore[arg-type]
        await bus.flush()
        rewritten = [e async for _, e, _m in bus.history(["task.rewritten"]) if isinstance(e, TaskRewritten)]
        return rewritten[-1]

    assert (await rewrite_and_judge(0.0)).moves == 2  # two knob steps: unsolved
    one = await rewrite_and_judge(0.0)  # one knob step: unsolved too
    assert one.moves == 1 and not one.rewriter.endswith(":world")
    assert agent.slots[slot_id].overshoot == ("harder", 1)
    worlds = [await rewrite_and_judge(0.0), await rewrite_and_judge(0.375)]  # unsolved, then in the band
    for w in worlds:
        assert w.rewriter == "builtin:world" and w.moves == 1 and w.candidate is not None
        assert w.candidate.knobs == parent.knobs and w.candidate.parent_id == parent.task_id
    assert worlds[0].candidate.params["seed"] != worlds[1].candidate.params["seed"]  # type: ignore[union-attr]
    slot = agent.slots[slot_id]
    assert slot.active == worlds[1].candidate and slot.rewrites_accepted == 1 and slot.overshoot is None
    after = await rewrite_and_judge(0.5)
    assert not after.rewriter.endswith(":world") and after.candidate is not None
    assert after.candidate.knobs != parent.knobs  # the cap lifted: knob steps again
    # coevo replay --into rewriter reproduces every proposal, the fresh worlds included, and every decision
    decisions = [e async for _, e, _m in bus.history(["task.rewritten", "task.decided"])]
    report = await replay_rewriter(list(enumerate([*fed, *decisions])), agent.cfg)
    assert report.divergence is None and report.compared == 2 * 5, report.as_dict()


async def test_a_task_without_another_world_falls_back_to_the_rewriters_knob_steps(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    agent, slot_id = await _rewriting_agent(bus, cfg)
    slot = agent.slots[slot_id]
    slot.active, slot.overshoot = slot.active.model_copy(update={"params": {}}), ("harder", 1)
    proposal = await agent.propose(BuiltinRewriter(), slot, "harder", _scored(agent, slot_id, 1.0, 0), 1)
    assert proposal.candidate is not None and not proposal.rewriter.endswith(":world")
    assert proposal.candidate.knobs != slot.active.knobs  # a knob step, as before fresh worlds existed


# ---- fresh train worlds (tasks.train_worlds = "fresh") --------------------------------------------------


async def test_fresh_train_worlds_differ_per_group_and_are_scored_as_the_slots_task_after_a_restart(
    bus: NatsBus, cfg: CoevoConfig
) -> None:
    """Every train group of a slot plays the active task's knobs in a world of its own, never a held-out
    one; its score counts for the slot (streak, accuracy), also when a restarted agent receives it."""
    fresh = cfg.model_copy(
        update={"loop": "policy-only", "tasks": cfg.tasks.model_copy(update={"train_worlds": "fresh"})}
    )
    agent = TasksAgent(bus, fresh)
    await agent.load()
    slot = next(s for s in agent.slots.values() if s.split == "train")
    worlds = []
    for _ in range(3):
        worlds.append(await agent.train_world(slot))
        await agent.schedule(slot, worlds[-1], "train")
    seeds = {w.params["seed"] for w in worlds}
    assert len(seeds) == 3 and slot.active.params["seed"] not in seeds
    assert all(w.knobs == slot.active.knobs and w.split == "train" for w in worlds)
    assert not {spec_hash(w.family, w.params, w.knobs) for w in worlds} & agent.heldout()
    scheduled = {e.task.task_id: e.group_id async for _, e, _m in bus.history(["task.scheduled"])}  # type: ignore[attr-defined]
    assert set(scheduled) == {w.task_id for w in worlds}

    again = TasksAgent(bus, fresh)  # a restart: what each group stood for was saved with the in-flight state
    await again.load()
    for k, world in enumerate(worlds[:2]):
        won = _scored(again, slot.slot_id, 1.0, k).model_copy(
            update={"task_id": world.task_id, "group_id": scheduled[world.task_id]}
        )
        await again.on_scored(won, None)  # type: ignore[arg-type]
    assert again.slots[slot.slot_id].saturated_streak == 2 and again.slots[slot.slot_id].last_accuracy == 1.0
    assert scheduled[worlds[0].task_id] not in again.inflight.world_of  # forgotten once scored
    # a group of a world the slot no longer stands for (its active task was replaced since): not counted
    again.slots[slot.slot_id].active = worlds[0]
    stale = _scored(again, slot.slot_id, 0.5, 2).model_copy(
        update={"task_id": worlds[2].task_id, "group_id": scheduled[worlds[2].task_id]}
    )
    await again.on_scored(stale, None)  # type: ignore[arg-type]
    assert again.slots[slot.slot_id].last_accuracy == 1.0

    same = TasksAgent(bus, cfg)  # the default: the slot's own task every time
    await same.load()
    assert await same.train_world(slot) == slot.active
