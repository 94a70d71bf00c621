"""Numbers are bounded where they enter (issue 36, items 1, 4, 5, 11, 12): a reward or an advantage
that float32 cannot hold, a loss or a gradient that is not finite, a KL guard that meets NaN, an
out-of-vocabulary token id; and every group the learner disposes of is named, so the backlog gate
releases on it. The real learner on the tiny model, the real server."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from coevo.algorithm.scoring import StepRec, TrajRec, integrated_rewards, step_advantages
from coevo.config import CoevoConfig, LearnerConfig
from coevo.errors import InjectedFault, NonFiniteStep, Reject
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored, LearnerStepped, Source, TrainingSample
from coevo.training.batch import sample_problem
from coevo.training.lane import Lane, kl_rejects
from coevo.training.learner import LaneQueue, LearnerAgent
from tests.test_training import choice_samples, tiny  # noqa: F401  (the module-scoped model fixture)


def _lane(tiny: Path, root: Path, **kw: Any) -> Lane:  # noqa: F811
    return Lane("policy", tiny, root, LearnerConfig(**{"lr": 1e-2, **kw}), device="cpu")


def _state(lane: Lane) -> tuple[dict[str, torch.Tensor], dict[Any, dict[str, Any]]]:
    weights = {k: v.detach().clone() for k, v in lane.model.state_dict().items()}
    opt = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in enumerate(lane.optimizer.state.values())
    }
    return weights, opt


def _same(lane: Lane, before: tuple[dict[str, torch.Tensor], dict[Any, dict[str, Any]]]) -> bool:
    weights, opt = _state(lane)
    same_opt = opt.keys() == before[1].keys() and all(
        all(torch.equal(v, before[1][i][k]) if torch.is_tensor(v) else v == before[1][i][k] for k, v in s.items())
        for i, s in opt.items()
    )
    return same_opt and all(torch.equal(v, before[0][k]) for k, v in weights.items())


def _poisoned(rows: list[TrainingSample], advantage: float, tag: str) -> list[TrainingSample]:
    return [
        r.model_copy(update={"sample_id": f"{tag}{i}", "advantage": advantage if i == 0 else r.advantage})
        for i, r in enumerate(rows)
    ]


# ---- pure decisions -------------------------------------------------------------------------------


def test_the_kl_guard_treats_nan_as_a_rejection() -> None:
    assert kl_rejects(float("nan"), 1.0) and kl_rejects(float("inf"), 1.0) and kl_rejects(1.5, 1.0)
    assert not kl_rejects(0.5, 1.0) and not kl_rejects(1.0, 1.0)


def test_a_lone_step_advantage_is_clamped_and_env_rewards_are_bounded() -> None:
    lone = TrajRec("a", "won", (StepRec("s0", 0), StepRec("s1", 1, env_reward=50.0)))
    other = TrajRec("b", "lost", (StepRec("t0", 0),))
    rewards = integrated_rewards([lone, other], lam=1.0, env_bound=10.0)
    assert rewards == {"s0": 1.0, "s1": 11.0, "t0": -1.0}  # the env reward cut at the bound
    adv = step_advantages([lone, other], rewards, lam=1.0)
    assert adv["s1"] == 2.0  # alone at index 1: its raw R, clamped to 1 + λ
    assert (adv["s0"], adv["t0"]) == (1.0, -1.0)  # standardised across the group
    bounded = step_advantages([lone], {"s0": 1.0, "s1": -1.5}, lam=1.0)
    assert bounded == {"s0": 1.0, "s1": -1.5}  # within the reference's bound: its raw R, as before
    weird = integrated_rewards([TrajRec("c", "won", (StepRec("u", 0, env_reward=math.nan),))], env_bound=10.0)
    assert weird == {"u": 1.0}  # a NaN env reward adds nothing


def test_an_advantage_float32_cannot_hold_is_refused_per_sample(tiny: Path) -> None:  # noqa: F811
    (s,) = choice_samples(tiny, 1)
    assert sample_problem(s.model_copy(update={"advantage": 1e39}), 10_000, 1 << 30) is not None  # inf in float32
    assert sample_problem(s.model_copy(update={"logprobs": [-1e39] * len(s.logprobs)}), 10_000, 1 << 30) is not None
    assert sample_problem(s.model_copy(update={"advantage": 3e38}), 10_000, 1 << 30) is None  # finite in float32


# ---- the lane ----------------------------------------------------------------------------------


def test_a_step_whose_gradient_is_not_finite_leaves_weights_and_optimizer_untouched(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Reproduced on the code before: one step on an advantage of 3e38 (finite in float32) made the
    loss and the gradient norm NaN and every tensor of the model NaN."""
    base = choice_samples(tiny, 4)
    for minibatches in (1, 2):  # one optimiser step, and a batch of several (the undo point)
        lane = _lane(tiny, tmp_path / f"mb{minibatches}", minibatches=minibatches)
        lane.step(base, ["warm"])  # the optimiser has state to keep
        before = _state(lane)
        with pytest.raises(NonFiniteStep) as err:
            lane.step(_poisoned(base, 3e38, "p"), ["poisoned"])
        assert not (math.isfinite(err.value.loss) and math.isfinite(err.value.grad_norm))
        assert _same(lane, before), "the weights or the optimiser state moved"
        assert all(torch.isfinite(v).all() for v in lane.model.state_dict().values())
        assert (lane.version, lane.has_consumed("poisoned")) == (1, False)
        assert lane.step(base, ["again"]).version == 2  # and the lane trains on


def test_the_kl_guard_undoes_a_batch_whose_extra_forward_pass_fails(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    inject: Any,
) -> None:
    """The KL measure runs after the optimiser stepped: failing there must undo the step, so a
    retried group is trained once, not twice."""
    base = choice_samples(tiny, 4)
    lane = _lane(tiny, tmp_path / "kl", max_step_kl=1e9)
    lane.step(base, ["warm"])
    before, steps = _state(lane), lane.steps_total
    inject({"lane.step_kl": {"times": 1}})
    with pytest.raises(InjectedFault):
        lane.step(base, ["g"])
    assert _same(lane, before) and (lane.version, lane.steps_total, lane.has_consumed("g")) == (1, steps, False)
    m = lane.step(base, ["g"])  # the retry trains it once
    assert (m.version, lane.steps_total) == (2, steps + 1)


# ---- the learner on the real server -------------------------------------------------------------


def _scored(bus: NatsBus, group_id: str, samples: list[TrainingSample], accuracy: float) -> GroupScored:
    return GroupScored(
        run_id=bus.run_id,
        source=Source(agent_id="scorer-test", role="scorer"),
        task_id="t",
        group_id=group_id,
        purpose="train",
        accuracy=accuracy,
        n_trajectories=4,
        policy_band_ok=bool(samples),
        judge_band_ok=False,
        policy_samples=samples,
    )


async def _stepped(bus: NatsBus) -> list[LearnerStepped]:
    return [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped)]


async def test_a_non_finite_step_is_counted_and_its_group_dead_lettered_alone(
    bus: NatsBus,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A batch whose gradient is not finite trains nothing: its groups are retried alone, the
    poisoned one is dead-lettered with the reason and named, the other trains; weights stay finite."""
    cfg = CoevoConfig(run={"runs_dir": tmp_path})
    learner = LearnerAgent(bus, cfg)
    q = LaneQueue(_lane(tiny, tmp_path / "ckpt"))
    learner.lanes["policy"] = q
    base = await asyncio.to_thread(choice_samples, tiny, 4)
    bad = learner.enqueue("policy", q, "bad", _poisoned(base, 3e38, "b"))
    good = learner.enqueue("policy", q, "good", _poisoned(base, 1.0, "g"))
    for _ in range(3):  # the batch of both fails; each is then tried alone
        await learner.train("policy", q)
    assert bad.done() and isinstance(bad.exception(), Reject) and "not finite" in str(bad.exception())
    assert not good.done() and q.lane.has_consumed("good") and q.lane.version == 1
    assert learner.counters["steps.not_finite.policy"] == 2
    assert all(torch.isfinite(v).all() for v in q.lane.model.state_dict().values())
    stepped = await _stepped(bus)
    released = [e for e in stepped if e.samples == 0]
    assert [e.dead_lettered_group_ids for e in released] == [["bad"]] and released[0].version == 0
    assert released[0].not_finite == 2  # both refused batches, counted on the first LearnerStepped after them
    (trained,) = [e for e in stepped if e.samples]
    assert trained.group_ids == ["good"] and trained.not_finite == 0 and trained.version == 1
    assert set(released[0].disposed_group_ids) == {"bad"}


async def test_groups_disposed_of_without_a_step_are_named(
    bus: NatsBus,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A group with no learning signal (all lost), one whose samples are all stale and one the KL
    guard rejects are each named by a LearnerStepped at once, so the backlog gate releases them."""
    cfg = CoevoConfig(run={"runs_dir": tmp_path}, learner={"max_staleness": 1, "stale": "drop", "max_step_kl": 1e-12})
    learner = LearnerAgent(bus, cfg)
    q = LaneQueue(_lane(tiny, tmp_path / "ckpt", max_staleness=1, stale="drop", max_step_kl=1e-12, lr=0.5))
    learner.lanes["policy"] = q
    base = await asyncio.to_thread(choice_samples, tiny, 4)
    await learner.on_scored(_scored(bus, "all-lost", [], 0.0), None)  # type: ignore[arg-type]  # no delivery needed
    far = learner.enqueue("policy", q, "far", _poisoned(base, 1.0, "f"))
    await learner.train("policy", q)  # the KL guard undoes it
    q.lane.version = 3  # the lane moved on: a group sampled at version 0 is stale
    old = learner.enqueue("policy", q, "old", _poisoned(base, 1.0, "o"))
    await learner.train("policy", q)
    assert far.done() and old.done()
    named = {g: e for e in await _stepped(bus) for g in e.disposed_group_ids}
    assert named["all-lost"].no_signal_group_ids == ["all-lost"]
    assert named["far"].kl_rejected_group_ids == ["far"] and named["far"].kl_rejected == 1
    assert named["old"].stale_group_ids == ["old"] and named["old"].stale_dropped == 4
    assert all(e.samples == 0 and not e.group_ids for e in named.values())
