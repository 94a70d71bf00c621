"""The learner's numbers: loss on hand-made batches, correction no-op, a real step, gloo data parallel."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt
from coevo.config import LearnerConfig
from coevo.inference.engine import LocalEngine
from coevo.inference.models import ensure_default_model
from coevo.schemas import TrainingSample
from coevo.training.batch import pack_by_tokens
from coevo.training.lane import Lane, latest_checkpoint
from coevo.training.loss import ppo_loss
from coevo.training.parity import as_sample
from tests.conftest import PYTHON, subprocess_env

NEW = torch.tensor([[-1.0, -0.5], [-2.0, -1.0]])
PROX = torch.tensor([[-1.2, -0.5], [-1.5, -1.0]])
ADV = torch.tensor([1.0, -1.0])
MASK = torch.ones(2, 2)


def test_ppo_loss_matches_hand_computation() -> None:
    out = ppo_loss(NEW, PROX, PROX, ADV, MASK, clip_eps=0.2, kl_beta=0.01, correction="tis")
    # sample 0 (A=+1): r = e^0.2 = 1.2214 > 1.2 -> clipped to 1.2; r = 1 -> 1.  k3(0.2) = e^-0.2 - 1 + 0.2
    k3_02 = math.exp(-0.2) - 1 + 0.2
    s0 = ((-1.2 + 0.01 * k3_02) + (-1.0)) / 2
    # sample 1 (A=-1): r = e^-0.5 = 0.6065 < 0.8 -> min(-0.6065, -0.8) = -0.8 -> +0.8; r = 1 -> +1
    k3_m05 = math.exp(0.5) - 1 - 0.5
    s1 = ((0.8 + 0.01 * k3_m05) + 1.0) / 2
    assert float(out.loss.detach()) == pytest.approx((s0 + s1) / 2, abs=1e-6)
    assert float(out.loss.detach()) == pytest.approx(-0.0995814, abs=1e-6)
    assert out.clip_fraction == pytest.approx(0.5)  # both first tokens left [0.8, 1.2]
    assert out.kl == pytest.approx((k3_02 + k3_m05) / 4, abs=1e-6)
    assert out.mismatch_kl == 0.0 and out.mean_is_weight == 1.0


def test_ratio_clipping_on_both_sides_only_when_it_lowers_the_objective() -> None:
    # A>0 and r<1-eps: unclipped term is smaller, so no clipping effect (gradient flows)
    new = torch.tensor([[-2.0]], requires_grad=True)
    out = ppo_loss(
        new, torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1), kl_beta=0.0
    )
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-math.exp(-1.0)) and new.grad is not None and float(new.grad) != 0
    # A>0 and r>1+eps: clipped, gradient is zero
    new = torch.tensor([[-0.5]], requires_grad=True)
    out = ppo_loss(
        new, torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1), kl_beta=0.0
    )
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-1.2) and float(new.grad) == 0.0
    # A<0 and r<1-eps: clipped at 0.8, gradient zero
    new = torch.tensor([[-2.0]], requires_grad=True)
    out = ppo_loss(
        new, torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([-1.0]), torch.ones(1, 1), kl_beta=0.0
    )
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(0.8) and float(new.grad) == 0.0


def test_clip_higher_lets_a_good_token_rise_further_and_clips_the_low_side_as_before() -> None:
    prox, adv, mask = torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1)
    for ratio, high, loss, moves in ((1.25, 0.28, -1.25, True), (1.35, 0.28, -1.28, False), (1.25, None, -1.2, False)):
        new = torch.tensor([[-1.0 + math.log(ratio)]], requires_grad=True)
        out = ppo_loss(new, prox, prox, adv, mask, kl_beta=0.0, clip_eps_high=high)
        out.loss.backward()
        assert float(out.loss.detach()) == pytest.approx(loss) and (float(new.grad) != 0) is moves
        assert out.clip_fraction == (0.0 if moves else 1.0)
    # a bad token: the low side stays at 1 - clip_eps whatever the high side is
    new = torch.tensor([[-1.0 + math.log(0.7)]], requires_grad=True)
    out = ppo_loss(new, prox, prox, torch.tensor([-1.0]), mask, kl_beta=0.0, clip_eps_high=0.28)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(0.8) and float(new.grad) == 0.0


def test_off_policy_weights_truncated_and_decoupled() -> None:
    behav = PROX.clone()
    behav[0, 0] = PROX[0, 0] - math.log(3.0)  # the sampler gave this token a third of the learner's prob
    tis = ppo_loss(NEW, PROX, behav, ADV, MASK, kl_beta=0.0, correction="tis", tis_cap=2.0)
    dec = ppo_loss(NEW, PROX, behav, ADV, MASK, kl_beta=0.0, correction="decoupled")
    plain = ppo_loss(NEW, PROX, PROX, ADV, MASK, kl_beta=0.0, correction="tis")
    # only token (0, 0) changes: its term -1.2 is weighted 2 (truncated) or 3 (decoupled)
    assert float(tis.loss.detach()) - float(plain.loss.detach()) == pytest.approx((-1.2 * 2 + 1.2) / 2 / 2)
    assert float(dec.loss.detach()) - float(plain.loss.detach()) == pytest.approx((-1.2 * 3 + 1.2) / 2 / 2)
    assert tis.mismatch_kl == pytest.approx((3 - 1 - math.log(3.0)) / 4)  # k3 with ratio 3 on 1 of 4 tokens
    mis = ppo_loss(NEW, PROX, behav, ADV, MASK, kl_beta=0.0, correction="mis", tis_cap=2.0)
    # masked: the weight 3 is past the cap, so the token counts 0 (its -1.2 leaves the sample's mean)
    assert float(mis.loss.detach()) - float(plain.loss.detach()) == pytest.approx((0 + 1.2) / 2 / 2)
    assert mis.mean_is_weight == pytest.approx(3 / 4)
    wide = ppo_loss(NEW, PROX, behav, ADV, MASK, kl_beta=0.0, correction="mis", tis_cap=4.0)
    assert float(wide.loss.detach()) == pytest.approx(float(dec.loss.detach()))  # within the cap: the full weight


def test_correction_is_a_no_op_with_identical_logprobs() -> None:
    for correction in ("tis", "mis", "decoupled"):
        a = ppo_loss(NEW, PROX, PROX, ADV, MASK, correction=correction)
        b = ppo_loss(NEW, PROX, PROX, ADV, MASK, correction="none")
        assert float(a.loss.detach()) == float(b.loss.detach())


def test_pack_by_tokens() -> None:
    def s(n: int) -> TrainingSample:
        return TrainingSample(
            sample_id=str(n),
            role="policy",
            prompt_token_ids=[1] * n,
            response_token_ids=[2],
            logprobs=[-1.0],
            advantage=1.0,
            model_version=0,
            step_event_id="x",
        )

    batches = pack_by_tokens([s(9), s(9), s(19), s(4), s(49)], max_tokens=40)
    assert [[len(x.prompt_token_ids) for x in b] for b in batches] == [
        [9, 9],
        [19, 4],
        [49],
    ]  # 2x10, 2x20 (= 40), 1x50 alone


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))


def choice_samples(tiny: Path, n: int = 16) -> list[TrainingSample]:
    async def go() -> list[TrainingSample]:
        prompt = policy_prompt(
            "goal: take the coin. room: hall. items: coin. exits: north attic.", ["go north", "take coin"]
        )
        async with LocalEngine(tiny, seed=1) as eng:
            cs = await asyncio.gather(*(eng.complete(prompt, choices=list(INDEX_LABELS[:2])) for _ in range(n)))
        return [as_sample(c, f"s{i}", "policy", advantage=1.0 if c.choice == 1 else -1.0) for i, c in enumerate(cs)]

    return asyncio.run(go())


def test_sampler_and_learner_agree_and_a_step_learns(tiny: Path, tmp_path: Path) -> None:
    samples = choice_samples(tiny)
    lane = Lane("policy", tiny, tmp_path, LearnerConfig(lr=1e-2), device="cpu")
    before = {k: v.clone() for k, v in lane.model.state_dict().items()}
    m = lane.step(samples, ["g1"])
    # at version 0 the learner recomputes the log-probs the engine sampled with, to fp32's rounding: the
    # step's figure (its training pass) and the current one (its no-grad pass) may round apart by ~1e-8
    assert m.mismatch_kl_current is not None and max(abs(m.mismatch_kl), abs(m.mismatch_kl_current)) < 1e-6
    # and reports the entropy of the distribution they were drawn from: one prompt, two choices
    p = {s.response_token_ids[0]: math.exp(s.logprobs[0]) for s in samples}
    assert len(p) == 2 and m.entropy == pytest.approx(-sum(q * math.log(q) for q in p.values()), abs=1e-5)
    assert m.staleness_histogram == {"0": 16} and m.version == 1
    changed = [k for k, v in lane.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the step did not change any parameter"
    # "take coin" (index 1) had positive advantage: its probability must have gone up
    p_before = math.exp(next(s.logprobs[0] for s in samples if s.advantage > 0))
    again = lane.step(samples, ["g2"])
    assert again.mismatch_kl > 1e-4  # the learner has moved away from the sampler
    assert again.mismatch_kl_current is None  # and that is drift: no sample was drawn by version 1
    path, sha, size = lane.checkpoint()
    assert latest_checkpoint(tmp_path / "policy") == path and len(sha) == 64 and size > 0
    resumed = Lane("policy", tiny, tmp_path, LearnerConfig(lr=1e-2), device="cpu")
    assert resumed.version == 2 and resumed.has_consumed("g1") and resumed.has_consumed("g2")
    assert all(torch.equal(v, lane.model.state_dict()[k]) for k, v in resumed.model.state_dict().items())
    assert p_before < 1.0


def test_a_steps_current_mismatch_counts_only_samples_of_the_lanes_version(tiny: Path, tmp_path: Path) -> None:
    samples = choice_samples(tiny)
    lane = Lane("policy", tiny, tmp_path, LearnerConfig(lr=1e-2), device="cpu")
    lane.step(samples, ["g1"])  # version 1: every sample, drawn by version 0, is now one version behind
    # half of them told as drawn by version 1: what the step calls current is what the probe measures on them
    told = [s.model_copy(update={"model_version": 1}) for s in samples[::2]]
    probe = lane.mismatch_kl(told)
    m = lane.step(told + samples[1::2], ["g2"])
    assert probe > 1e-4 and m.mismatch_kl_current == pytest.approx(probe, rel=1e-5)
    assert m.staleness_histogram == {"0": len(told), "1": len(samples) - len(told)}


@pytest.mark.parametrize(
    ("parallel", "n", "max_tokens"),
    [
        ("ddp", 8, 32768),
        ("fsdp", 8, 32768),
        ("fsdp", 1, 32768),  # fewer samples than ranks
        ("ddp", 1, 32768),
        ("fsdp", 5, 64),  # one sample per micro-batch: five micro-batches for two ranks
    ],
)
def test_two_gloo_processes_match_single_process(
    tiny: Path, tmp_path: Path, parallel: str, n: int, max_tokens: int
) -> None:
    """Data parallel (replicated, or FSDP2-sharded) over two gloo processes == one process, full batch;
    whatever the batch, both ranks run the same collectives (no hang)."""
    from transformers import AutoModelForCausalLM

    samples = choice_samples(tiny, 8)[:n]
    (tmp_path / "samples.json").write_text(json.dumps([s.model_dump() for s in samples]))
    single = Lane(
        "policy", tiny, tmp_path / "single", LearnerConfig(lr=1e-2, max_batch_tokens=max_tokens), device="cpu"
    )
    entropy = single.step(samples, ["g"]).entropy
    procs = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "tests.gloo_worker",
                str(r),
                "2",
                str(tmp_path / "init"),
                str(tiny),
                str(tmp_path / "samples.json"),
                str(tmp_path / "dist"),
                parallel,
                str(max_tokens),
            ],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    report = json.loads(outputs[0].strip().splitlines()[-1])
    ckpt = Path(report["path"])
    assert entropy is not None and report["entropy"] == pytest.approx(entropy, abs=1e-5)  # over both ranks' rows
    assert (
        (ckpt / "COMPLETE").exists()
        and (ckpt / "optimizer.rank0.pt").exists()
        and (ckpt / "optimizer.rank1.pt").exists()
    )
    gathered = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    # Adam's first step moves a weight by lr·g/(|g|+eps): where |g| is near eps (1e-8) it amplifies the
    # float32 rounding of summing the gradient in another order (~1e-11) up to lr·1e-11/eps = 1e-5 and,
    # for the rare |g| nearer eps, past 1e-4 (1.2e-4 on some CPUs); a rank that trained the wrong rows
    # would be off by ~lr = 1e-2 in many weights. So: every weight within 1e-3, nearly all within 1e-6.
    loose = total = 0
    for k, v in single.model.state_dict().items():
        diff = (v - gathered[k]).abs()
        assert float(diff.max()) < 1e-3, (k, float(diff.max()))
        loose, total = loose + int((diff > 1e-6).sum()), total + diff.numel()
    assert loose <= 1e-3 * total, f"{loose} of {total} weights differ by more than 1e-6"


# ---- sampling parity (#23): what the sampler truncated, the learner truncates ----------------------


def test_truncation_keeps_what_vllms_sampler_keeps() -> None:
    """Hand-computed on one row: probabilities .636 .234 .086 .032 .012 (logits 3, 2, 1, 0, -1)."""
    from coevo.config import SamplingConfig
    from coevo.inference.sampling import request_fields, truncate

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])

    def kept(**kw: float) -> list[int]:
        return (~truncate(logits, SamplingConfig(**kw)).isinf()).nonzero()[:, 1].tolist()

    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_k=2) == [0, 1] and kept(top_k=4) == [0, 1, 2, 3]
    assert kept(top_p=0.95) == [0, 1, 2]  # the smallest set holding 95 %: .636 + .234 + .086
    assert kept(top_p=0.5) == [0]  # the most likely token alone holds more
    assert kept(min_p=0.1) == [0, 1, 2]  # .086 >= .0636 > .032
    assert kept(top_k=3, top_p=0.9) == [0, 1]  # top-p renormalised over the top 3: .664 + .244 >= .9
    assert kept(min_p=0.3, top_k=4) == [0, 1]
    assert (~truncate(logits, SamplingConfig(top_k=1), keep=torch.tensor([3])).isinf()).nonzero()[:, 1].tolist() == [
        0,
        3,
    ]  # the sampled token stays possible
    fields = request_fields(SamplingConfig(top_k=5), 0.7)
    assert fields == {
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
    }


def generated_samples(tiny: Path, sampling: object, n: int = 12) -> list[TrainingSample]:
    async def go() -> list[TrainingSample]:
        prompt = policy_prompt(
            "goal: take the coin. room: hall. items: coin. exits: north attic.", ["go north", "take coin"], "generate"
        )
        async with LocalEngine(tiny, seed=3, sampling=sampling) as eng:  # type: ignore[arg-type]
            cs = [await eng.complete(prompt, max_tokens=12, temperature=0.7) for _ in range(n)]
        return [
            TrainingSample(
                sample_id=f"s{i}",
                role="policy",
                prompt_token_ids=c.prompt_token_ids,
                response_token_ids=c.response_token_ids,
                logprobs=c.logprobs,
                advantage=1.0 if i % 2 else -1.0,
                model_version=0,
                step_event_id=f"e{i}",
            )
            for i, c in enumerate(cs)
        ]

    return asyncio.run(go())


def test_a_truncated_sampler_and_the_learner_agree(tiny: Path, tmp_path: Path) -> None:
    """The engine samples with top-k, top-p and min-p at temperature 0.7; the learner told the same
    computes the same log-probs (mismatch 0 at version 0), and one not told is measurably off."""
    from coevo.config import SamplingConfig

    sampling = SamplingConfig(top_k=8, top_p=0.8, min_p=0.05)
    samples = generated_samples(tiny, sampling)
    assert max(len(s.response_token_ids) for s in samples) > 1
    told = Lane(
        "policy", tiny, tmp_path / "a", LearnerConfig(lr=1e-9), temperature=0.7, sampling=sampling, device="cpu"
    )
    assert told.step(samples, ["g1"]).mismatch_kl < 1e-6
    untold = Lane("policy", tiny, tmp_path / "b", LearnerConfig(lr=1e-9), temperature=0.7, device="cpu")
    assert untold.step(samples, ["g1"]).mismatch_kl > 1e-3
    plain = generated_samples(tiny, SamplingConfig())
    assert untold.step(plain, ["g2"]).mismatch_kl < 1e-6  # neutral sampling: nothing to apply
