"""The learner's options (issue 13, items 1-3): the staleness bound at the learner, a KL against the
sampler or the initial weights that acts, and PPO with minibatches and epochs whose clip acts."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from coevo.config import CoevoConfig, LearnerConfig, load_config
from coevo.runtime.bus import NatsBus
from coevo.schemas import LearnerStepped, TrainingSample
from coevo.training.batch import minibatches, split_stale, to_tensors
from coevo.training.entropy import EntropyControl
from coevo.training.lane import Lane
from coevo.training.learner import Batching, LaneQueue, LearnerAgent, QueuedGroup
from coevo.training.loss import ppo_loss, token_logprobs
from tests.test_training import choice_samples, tiny  # noqa: F401  (the module-scoped model fixture)


def _sample(i: int, version: int) -> TrainingSample:
    return TrainingSample(
        sample_id=f"s{i}",
        role="policy",
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        logprobs=[-1.0],
        advantage=1.0,
        model_version=version,
        step_event_id=f"e{i}",
    )


# ---- pure functions ------------------------------------------------------------------------------


def test_split_stale_bounds_the_lag() -> None:
    samples = [_sample(0, 0), _sample(1, 3), _sample(2, 5), _sample(3, 2)]
    fresh, stale = split_stale(samples, version=5, max_staleness=2)
    assert [s.sample_id for s in fresh] == ["s1", "s2"] and [s.sample_id for s in stale] == ["s0", "s3"]


def test_minibatches_partition_the_batch_deterministically() -> None:
    samples = [_sample(i, 0) for i in range(10)]
    assert minibatches(samples, 1, seed=7) == [samples]  # the default keeps the batch whole and in order
    parts = minibatches(samples, 3, seed=7)
    assert [len(p) for p in parts] == [4, 3, 3] and parts == minibatches(samples, 3, seed=7)  # same on every rank
    assert sorted(s.sample_id for p in parts for s in p) == sorted(s.sample_id for s in samples)
    assert len(minibatches(samples[:2], 4, seed=0)) == 2 and minibatches([], 3, seed=0) == []


def _queued(sizes: list[int]) -> list[QueuedGroup]:
    loop = asyncio.new_event_loop()
    try:
        return [
            QueuedGroup(f"g{i}", [_sample(i * 100 + k, 0) for k in range(n)], loop.create_future())
            for i, n in enumerate(sizes)
        ]
    finally:
        loop.close()


def test_batching_by_samples_by_groups_and_by_waves() -> None:
    by_samples = Batching.of(load_config(overrides={"learner.batch_samples": 10}), flush_after_s=2.0)
    assert by_samples.ready(held=9, scored=7, idle=0.5) == (False, 7)
    assert by_samples.ready(held=10, scored=0, idle=0.0) == (True, 0)
    assert by_samples.ready(held=3, scored=0, idle=2.0) == (True, 0)  # arrivals paused: what is held
    q = _queued([4, 4, 4, 4])
    assert [p.group_id for p in by_samples.take(q)] == ["g0", "g1"]  # whole groups, as close to 10 as they get
    assert [p.group_id for p in by_samples.take(_queued([4, 4, 3, 4]))] == ["g0", "g1", "g2"]  # 11 is closer
    assert [p.group_id for p in by_samples.take(_queued([25, 4]))] == ["g0"]  # at least one group
    assert [p.group_id for p in by_samples.take(_queued([2, 3]))] == ["g0", "g1"]  # all, when less is held

    by_groups = Batching.of(load_config(overrides={"learner.batch_groups": 3, "learner.batch_samples": 1}), 2.0)
    assert by_groups.ready(held=50, scored=2, idle=0.1) == (False, 2)  # samples do not count
    assert by_groups.ready(held=2, scored=3, idle=0.1) == (True, 3)  # groups with no sample counted too
    assert by_groups.ready(held=0, scored=4, idle=9.0) == (False, 1)  # a batch that gave nothing: forgotten
    assert by_groups.ready(held=2, scored=1, idle=2.0) == (True, 1)
    q = _queued([1, 9, 2, 5])
    assert [p.group_id for p in by_groups.take(q)] == ["g0", "g1", "g2"] and len(q) == 1
    assert by_groups.after_step(scored=5) == 2  # a backlog steps again at once
    q[0].alone = True
    assert [p.group_id for p in by_groups.take(q + _queued([1]))] == ["g3"]

    wave = Batching.of(
        load_config(overrides={"learner.max_staleness": 0, "learner.batch_groups": 2, "tasks.max_groups_in_flight": 4}),
        2.0,
    )
    assert wave.groups == 4 and wave.take_all  # lock-step: the wave, whatever batch_groups says
    assert wave.ready(held=7, scored=3, idle=5.0) == (False, 3)
    assert wave.ready(held=0, scored=4, idle=0.0) == (False, 0)
    assert [p.group_id for p in wave.take(_queued([1, 30, 2, 5, 8]))] == ["g0", "g1", "g2", "g3", "g4"]
    assert wave.after_step(scored=6) == 0


def test_loss_reference_and_row_cap() -> None:
    new = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    prox = new.detach().clone()
    ref = torch.tensor([[-1.5, -0.5]])
    # the KL against the proximal log-probs is 0 with no gradient; against another reference it acts
    at_prox = ppo_loss(new, prox, prox, torch.tensor([0.0]), torch.ones(1, 2), kl_beta=1.0)
    (g_prox,) = torch.autograd.grad(at_prox.loss, new)
    assert at_prox.kl == 0.0 and float(g_prox.abs().sum()) == 0.0
    at_ref = ppo_loss(new, prox, prox, torch.tensor([0.0]), torch.ones(1, 2), kl_beta=1.0, ref_logp=ref)
    (g_ref,) = torch.autograd.grad(at_ref.loss, new)
    assert at_ref.kl == pytest.approx((math.exp(-0.5) - 1 + 0.5) / 2) and float(g_ref[0, 0]) != 0.0
    # a row cap truncates the importance weight of that row whatever the correction says
    behav = prox - math.log(5.0)
    capped = ppo_loss(
        new,
        prox,
        behav,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        kl_beta=0.0,
        correction="decoupled",
        row_cap=torch.tensor([2.0]),
    )
    assert capped.mean_is_weight == pytest.approx(2.0)
    assert ppo_loss(
        new, prox, behav, torch.tensor([1.0]), torch.ones(1, 2), kl_beta=0.0, correction="decoupled"
    ).mean_is_weight == pytest.approx(5.0)


def test_an_entropy_bonus_subtracts_the_weighted_token_mean_entropy() -> None:
    new = torch.tensor([[-1.0, -0.5, -0.2]], requires_grad=True)
    prox = new.detach().clone()
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not a response token
    ent = torch.tensor([[0.3, 0.5, 9.0]], requires_grad=True)
    plain = ppo_loss(new, prox, prox, torch.tensor([1.0]), mask, kl_beta=0.0)
    bonus = ppo_loss(new, prox, prox, torch.tensor([1.0]), mask, kl_beta=0.0, entropy=ent, entropy_coef=0.1)
    assert float(bonus.loss.detach()) == pytest.approx(float(plain.loss.detach()) - 0.1 * (0.3 + 0.5) / 2)
    (g,) = torch.autograd.grad(bonus.loss, ent)
    assert g[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])  # more entropy, lower loss; padding untouched
    assert torch.equal(ppo_loss(new, prox, prox, torch.tensor([1.0]), mask, entropy=ent).loss, plain.loss)
    with pytest.raises(ValueError, match="needs the entropy"):
        ppo_loss(new, prox, prox, torch.tensor([1.0]), mask, entropy_coef=0.1)


# ---- the lane ------------------------------------------------------------------------------------


def _lane(tiny: Path, root: Path, **kw: Any) -> Lane:  # noqa: F811
    return Lane("policy", tiny, root, LearnerConfig(**{"lr": 1e-2, **kw}), device="cpu")


def test_a_slow_group_is_dropped_or_corrected(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    slow = choice_samples(tiny, 8)  # sampled at version 0
    drop = _lane(tiny, tmp_path / "drop", max_staleness=1, stale="drop")
    drop.version = 3  # the lane has moved on: the slow group lags 3 > 1 versions
    m = drop.step(slow, ["slow"])
    assert (m.samples, m.stale_dropped, m.optimizer_steps, m.version) == (0, 8, 0, 3)
    assert not drop.has_consumed("slow")  # nothing trained: the learner releases the group untrained
    fresh = [s.model_copy(update={"model_version": 2}) for s in slow[:4]]
    mixed = drop.step(slow[4:] + fresh, ["slow", "fresh"])
    assert (mixed.samples, mixed.stale_dropped, mixed.version) == (4, 4, 4)
    assert mixed.staleness_histogram == {"1": 4}

    keep = _lane(tiny, tmp_path / "correct", max_staleness=1, stale="correct", correction="decoupled")
    keep.version = 3
    row_cap = keep._row_cap(to_tensors(slow, keep.vocab, keep.pad_id))
    assert row_cap is not None and torch.all(row_cap == keep.cfg.tis_cap)  # truncated IS, not the decoupled cap
    m = keep.step(slow, ["slow"])
    assert (m.samples, m.stale_dropped, m.version) == (8, 0, 4) and m.staleness_histogram == {"3": 8}
    assert keep.has_consumed("slow")


@pytest.mark.parametrize("reference", ["behavior", "initial"])
def test_the_kl_acts_once_the_policy_has_moved(tiny: Path, tmp_path: Path, reference: str) -> None:  # noqa: F811
    samples = choice_samples(tiny, 8)
    lane = _lane(tiny, tmp_path, kl_beta=1.0, kl_reference=reference)
    assert (lane.reference is None) == (reference == "behavior")
    first = lane.step(samples, ["g1"])
    assert first.kl < 1e-6  # before the first update the reference and the policy agree
    second = lane.step(samples, ["g2"])
    assert second.kl > 1e-6, second
    # the KL term's gradient on the moved policy: the loss with β > 0 and with β = 0 differ in gradient
    t = to_tensors(samples, lane.vocab, lane.pad_id)
    with torch.no_grad():
        prox = token_logprobs(lane.model, t.input_ids, t.attention_mask, t.response_mask, t.allowed)
        ref = (
            t.behav_logp
            if lane.reference is None
            else token_logprobs(lane.reference, t.input_ids, t.attention_mask, t.response_mask, t.allowed)
        )
    grads = []
    for beta in (0.0, 1.0):
        lane.model.zero_grad(set_to_none=True)
        new = token_logprobs(lane.model, t.input_ids, t.attention_mask, t.response_mask, t.allowed)
        out = ppo_loss(new, prox, t.behav_logp, t.advantages, t.response_mask, kl_beta=beta, ref_logp=ref)
        out.loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in lane.model.parameters() if p.grad is not None]))
    assert out.kl > 1e-6 and float((grads[1] - grads[0]).norm()) > 1e-6


def test_a_lora_lanes_kl_reference_is_its_base_with_the_adapter_off(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    """``kl_reference = "initial"`` on a LoRA lane: no second model; the reference is the base without the
    adapter (version 0), so the KL is 0 before the first update and grows once the adapter has moved."""
    from coevo.config import LoraConfig

    samples = choice_samples(tiny, 8)
    lane = _lane(tiny, tmp_path, kl_beta=1.0, kl_reference="initial", lora=LoraConfig(rank=4))
    assert lane.reference is None  # nothing loaded twice
    t = to_tensors(samples, lane.vocab, lane.pad_id)
    before = lane._reference_logprobs(t)
    with torch.no_grad():
        own = token_logprobs(lane.model, t.input_ids, t.attention_mask, t.response_mask, t.allowed)
    assert torch.allclose(before, own, atol=1e-6)  # B = 0: the adapter adds nothing yet
    assert lane.step(samples, ["g1"]).kl < 1e-6
    assert lane.step(samples, ["g2"]).kl > 1e-6  # the adapter moved away from its base
    assert torch.allclose(lane._reference_logprobs(t), before, atol=1e-6)  # the reference did not


def test_an_entropy_bonus_keeps_steps_from_collapsing_the_choice(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    """One prompt, two choices, one rewarded (advantages ±1), the same batch again and again: plain steps
    drive the choice's entropy to 0 (every later group would be unanimous); a bonus of the advantages'
    scale holds it where the two pulls balance. (At ln 2 the entropy's gradient is 0: the first step
    is the same.) Measured: plain 0.69 -> 0.014 in 8 steps, with the bonus 0.69 -> 0.40."""
    samples = choice_samples(tiny, 8)
    curves = {}
    for coef in (0.0, 1.0):
        lane = _lane(tiny, tmp_path / str(coef), lr=3e-3, kl_beta=0.0, entropy_coef=coef)
        steps = [lane.step(samples, [f"g{i}"]) for i in range(8)]
        assert {m.entropy_coef for m in steps} == ({None} if coef == 0 else {coef})  # what LearnerStepped reports
        curves[coef] = [m.entropy for m in steps]
    plain, bonus = curves[0.0], curves[1.0]
    assert plain[0] == bonus[0]  # the same weights before the first step
    assert plain[-1] < 0.05, plain
    assert bonus[-1] > 0.2 and min(bonus[2:]) > 0.2, bonus


def test_an_adaptive_coefficient_acts_only_below_its_target_and_stays_bounded() -> None:
    fixed = EntropyControl(target=None, step=0.05, most=1.0)
    assert fixed.decide(0.3, 0.0) == (0.3, 0.3) and fixed.decide(0.3, 5.0) == (0.3, 0.3)
    ctl = EntropyControl(target=0.2, step=0.25, most=0.6)
    coef, applied = 0.0, []
    for h in (0.5, 0.1, 0.1, 0.1, 0.15, 0.3, 0.3, 0.3, 0.05):
        eta, coef = ctl.decide(coef, h)
        applied.append(eta)
    # above the target: no bonus, the coefficient shrinks (not below 0); below: it grows (not above the bound)
    assert applied == pytest.approx([0.0, 0.25, 0.5, 0.6, 0.6, 0.0, 0.0, 0.0, 0.25])
    assert coef == pytest.approx(0.25)
    assert ctl.decide(0.4, 0.2) == pytest.approx((0.0, 0.15))  # at the target counts as at or above


def test_an_adaptive_start_beyond_its_bound_names_the_fields() -> None:
    with pytest.raises(ValueError, match=r"learner.entropy_coef \(2\).*learner.entropy_coef_max \(1\)"):
        LearnerConfig(entropy_target=0.2, entropy_coef=2.0)
    assert LearnerConfig(entropy_coef=2.0).entropy_coef == 2.0  # a fixed coefficient has no bound


def test_an_adaptive_bonus_holds_the_choice_near_its_target_and_resumes(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    """The collapse of the test above, with a target instead of a fixed coefficient: steps above the
    target train without a bonus (the first one exactly as a plain lane's), the coefficient grows
    while the entropy stays below, and the entropy comes back up; a resumed lane goes on with the
    coefficient it had. Measured over 12 steps: plain 0.69 -> 0.004; adaptive 0.69, 0.22, 0.12, 0.21,
    0.68, 0.49, 0.34, 0.23, 0.17, 0.15, 0.17, 0.23 with coefficients 0, 0.5, 1, 1.5, 0, 0, 0, 0.5, 1,
    1.5, 2, 2."""
    samples = choice_samples(tiny, 8)
    kw: dict[str, Any] = {"lr": 3e-3, "kl_beta": 0.0, "checkpoint_every_steps": 1}
    lane = _lane(tiny, tmp_path / "adaptive", **kw, entropy_target=0.3, entropy_coef_step=0.5, entropy_coef_max=2.0)
    steps = [lane.step(samples, [f"g{i}"]) for i in range(12)]
    entropy, coef = [m.entropy for m in steps], [m.entropy_coef for m in steps]
    assert entropy[0] is not None and entropy[0] > 0.3 and coef[0] == 0.0  # ln 2 > target: trained plainly
    below = [i for i, h in enumerate(entropy) if h is not None and h < 0.3]
    assert below, entropy  # the plain steps do push it under the target ...
    first = below[0]
    assert coef[first] == 0.5 and all(c in (0.0, 0.5, 1.0, 1.5, 2.0) for c in coef), coef
    assert sum(1 for e in entropy[first:] if e is not None and e >= 0.3) >= 1, entropy  # ... and the bonus
    last = [e for e in entropy[-6:] if e is not None]  # brings it back (plain steps: 0.03 to 0.004 here)
    assert min(e for e in entropy[first:] if e is not None) > 0.05 and sum(last) / len(last) > 0.1, entropy
    assert lane.entropy_coef > 0
    lane.checkpoint()
    resumed = _lane(tiny, tmp_path / "adaptive", **kw, entropy_target=0.3, entropy_coef_step=0.5, entropy_coef_max=2.0)
    assert resumed.version == lane.version and resumed.entropy_coef == lane.entropy_coef


def test_epochs_and_minibatches_make_the_clip_act(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    samples = choice_samples(tiny, 8)
    one = _lane(tiny, tmp_path / "one")
    m1 = one.step(samples, ["g"])
    assert (m1.optimizer_steps, m1.clip_fraction, m1.version, one.steps_total) == (1, 0.0, 1, 1)
    ppo = _lane(tiny, tmp_path / "ppo", minibatches=2, epochs=2)
    m = ppo.step(samples, ["g"])
    assert m.optimizer_steps == 4 and ppo.steps_total == 4
    assert m.version == 1 and ppo.version == 1  # one version per batch, whatever the optimiser steps
    assert m.clip_fraction > 0.0, m  # proximal log-probs fixed for the batch: later steps leave the trust region


# ---- the learner ---------------------------------------------------------------------------------


async def test_the_learner_counts_and_reports_stale_drops(bus: NatsBus, tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    """A real lane behind the learner agent, on the real server: a group sampled too long ago is
    released untrained and named at once (a LearnerStepped that trained nothing, with its count); a
    later step counts the stale samples of its own batch."""
    cfg = CoevoConfig(run={"runs_dir": tmp_path}, learner={"max_staleness": 1, "stale": "drop"})
    learner = LearnerAgent(bus, cfg)
    q = LaneQueue(_lane(tiny, tmp_path / "ckpt", max_staleness=1, stale="drop"))
    learner.lanes["policy"] = q
    base = await asyncio.to_thread(choice_samples, tiny, 6)  # sampled at version 0

    def at(version: int, group: str, rows: list[TrainingSample]) -> list[TrainingSample]:
        return [
            r.model_copy(update={"model_version": version, "sample_id": f"{group}-{i}"}) for i, r in enumerate(rows)
        ]

    for warm in ("w0", "w1"):  # the lane moves to version 2
        learner.enqueue("policy", q, warm, at(q.lane.version, warm, base[:2]))
        await learner.train("policy", q)
    old = learner.enqueue("policy", q, "old", at(0, "old", base[:3]))  # lag 2 > 1: every sample stale
    await learner.train("policy", q)
    new = learner.enqueue("policy", q, "new", at(2, "new", base[:2]) + at(0, "new-old", base[2:3]))
    await learner.train("policy", q)
    assert old.done() and old.exception() is None  # all stale: released untrained
    assert not new.done()  # trained: waits for a durable checkpoint
    stepped = [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped)]
    assert [(e.version, e.samples, e.stale_dropped) for e in stepped] == [(1, 2, 0), (2, 2, 0), (2, 0, 3), (3, 2, 1)]
    assert stepped[2].stale_group_ids == ["old"] and stepped[3].group_ids == ["new"]
    assert learner.counters["samples.stale_dropped.policy"] == 4
    assert not q.lane.has_consumed("old") and q.lane.has_consumed("new")


async def test_the_learner_reports_a_rejected_step_on_the_next_learner_stepped(
    bus: NatsBus,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """On the real server: a batch the KL guard undoes is released untrained (no version, no
    publication) and named at once, with its count, by a LearnerStepped that trained nothing; the
    lane's next step carries its own KL."""
    cfg = CoevoConfig(run={"runs_dir": tmp_path}, learner={"max_step_kl": 1.0})
    learner = LearnerAgent(bus, cfg)
    q = LaneQueue(_lane(tiny, tmp_path / "ckpt", lr=1e-3, max_step_kl=1.0))
    learner.lanes["policy"] = q
    base = await asyncio.to_thread(choice_samples, tiny, 4)
    q.lane.cfg = q.lane.cfg.model_copy(update={"max_step_kl": 1e-12})  # this batch's step is too far
    far = learner.enqueue("policy", q, "far", base)
    await learner.train("policy", q)
    assert far.done() and far.exception() is None and q.lane.version == 0
    assert learner.counters["steps.kl_rejected.policy"] == 1
    (report,) = [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped)]
    assert (report.version, report.samples, report.kl_rejected, report.kl_rejected_group_ids) == (0, 0, 1, ["far"])
    q.lane.cfg = q.lane.cfg.model_copy(update={"max_step_kl": 1e9})
    near = learner.enqueue(
        "policy", q, "near", [s.model_copy(update={"sample_id": f"n{i}"}) for i, s in enumerate(base)]
    )
    await learner.train("policy", q)
    assert not near.done()  # trained: waits for a durable checkpoint
    _, stepped = [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped)]
    assert (stepped.version, stepped.kl_rejected) == (1, 0) and stepped.step_kl is not None and stepped.step_kl > 0


def test_learner_stepped_decodes_without_the_count() -> None:
    fields = dict(
        run_id="r",
        source={"agent_id": "a", "role": "learner"},
        role="policy",
        version=1,
        samples=1,
        tokens=1,
        loss=0.0,
        kl=0.0,
        clip_fraction=0.0,
        mismatch_kl=0.0,
        tokens_per_second=1.0,
    )
    assert LearnerStepped.model_validate(fields).stale_dropped == 0


def test_a_step_that_moves_the_policy_too_far_is_undone_and_counted(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    batch = choice_samples(tiny, 8)
    lane = _lane(tiny, tmp_path / "guarded", lr=0.5, max_step_kl=1e-6)  # a big step against a tiny bound
    before = {k: v.clone() for k, v in lane.model.state_dict().items()}
    m = lane.step(batch, ["g"])
    assert m.kl_rejected and m.step_kl is not None and m.step_kl > 1e-6
    assert (m.samples, m.version, lane.version, lane.steps_total) == (0, 0, 0, 0)
    assert not lane.has_consumed("g")  # nothing trained: acknowledged untrained by the learner
    after = lane.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the weights of before the batch
    assert not lane.optimizer.state  # and the optimiser's (Adam moments of the undone step gone)
    loose = _lane(tiny, tmp_path / "loose", lr=0.5, max_step_kl=1e9)
    m = loose.step(batch, ["g"])
    assert not m.kl_rejected and m.samples == 8 and m.version == 1 and m.step_kl is not None and m.step_kl > 0
    unguarded = _lane(tiny, tmp_path / "unguarded", lr=0.5)
    assert unguarded.step(batch, ["g"]).step_kl is None  # no guard: no extra forward pass, nothing measured
