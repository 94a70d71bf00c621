"""bf16 where the hardware multiplies in it (``learner.dtype``): which dtype ``auto`` picks; a LoRA lane
holds its frozen base in bf16 and its adapter and optimiser state in fp32; a bf16 engine serves what
the bf16 lane computes, before and after an adapter version, within bf16's rounding."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt
from coevo.config import LearnerConfig, LoraConfig, load_config
from coevo.errors import ConfigError
from coevo.inference.engine import LocalEngine
from coevo.inference.models import ensure_default_model
from coevo.inference.precision import BF16_MIN_HIDDEN, compute_dtype, cpu_has_bf16, model_dtype
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane
from coevo.training.parity import as_sample

BF16_LORA = LearnerConfig(lora=LoraConfig(rank=4, alpha=8.0), lr=0.05, dtype="bfloat16")
PROMPT = policy_prompt("goal: take the coin. room: hall. items: coin. exits: north attic.", ["go north", "take coin"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))


def test_auto_is_bf16_where_the_hardware_multiplies_in_it_and_the_model_is_wide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from coevo.inference import precision

    # a GPU of compute capability 8 or more (Ampere on) multiplies bf16; a Turing one only emulates it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, has in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        assert precision.gpu_has_bf16("cuda:0") is has
        assert compute_dtype("auto", "cuda:0", 4096) == (torch.bfloat16 if has else torch.float32)
    assert compute_dtype("auto", "cuda:0", 128) == torch.float32  # the tiny models: exact, as fast
    assert compute_dtype("auto", "cuda:0", BF16_MIN_HIDDEN) == torch.bfloat16
    assert compute_dtype("auto", "cuda", None) == torch.bfloat16
    monkeypatch.undo()
    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert compute_dtype("auto", "cpu", 576) == expected  # SmolLM2-135M's width
    assert compute_dtype("auto", "cpu", 128) == torch.float32
    assert compute_dtype("bfloat16", "cpu", 128) == torch.bfloat16  # named: whatever the width
    assert compute_dtype("float32", "cuda", 4096) == torch.float32


def test_the_tiny_model_runs_in_fp32_under_auto_and_a_named_dtype_wins(tiny: Path) -> None:
    assert model_dtype("auto", "cpu", tiny) == torch.float32
    assert model_dtype("bfloat16", "cpu", tiny) == torch.bfloat16


def test_learner_dtype_config_names_the_field_and_reads_the_old_bf16_switch() -> None:
    assert load_config(overrides={"learner.bf16": False}).learner.dtype == "float32"
    assert load_config(overrides={"learner.bf16": "false"}).learner.dtype == "float32"  # --set, the environment
    assert load_config(overrides={"learner.bf16": True}).learner.dtype == "auto"
    assert load_config(overrides={"learner.bf16": False, "learner.dtype": "bfloat16"}).learner.dtype == "bfloat16"
    with pytest.raises(ConfigError) as bad:
        load_config(overrides={"learner.bf16": "sometimes"})
    assert "learner.bf16" in str(bad.value)
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"learner.dtype": "float8"})
    assert "learner.dtype" in str(err.value)


def _sampled(engine_dir: Path, n: int = 32, *, version_from: LocalEngine | None = None) -> list[TrainingSample]:
    async def go() -> list[TrainingSample]:
        async with LocalEngine(engine_dir, seed=3, device="cpu", dtype="bfloat16") as eng:
            assert next(eng.model.parameters()).dtype == torch.bfloat16
            cs = await asyncio.gather(*(eng.complete(PROMPT, choices=list(INDEX_LABELS[:2])) for _ in range(n)))
        return [as_sample(c, f"s{i}", "policy", advantage=1.0 if c.choice == 1 else -1.0) for i, c in enumerate(cs)]

    return asyncio.run(go())


def test_a_bf16_lora_lane_keeps_its_adapter_and_optimiser_in_fp32_and_the_bf16_engine_serves_what_it_computes(
    tiny: Path, tmp_path: Path
) -> None:
    lane = Lane("policy", tiny, tmp_path, BF16_LORA, device="cpu")
    assert lane.dtype == torch.bfloat16
    base = {n: p.dtype for n, p in lane.model.named_parameters() if "lora_" not in n}
    assert set(base.values()) == {torch.bfloat16}
    assert {p.dtype for p in lane.trainable()} == {torch.float32} and lane.trainable()
    samples = _sampled(tiny)
    assert {s.response_token_ids[0] for s in samples} and len({s.logprobs[0] for s in samples}) == 2
    # version 0: the bf16 engine and the bf16 lane compute the same weights, up to bf16's rounding of
    # different kernels (the fp32 path agrees to 1e-6: tests/test_training.py)
    assert lane.mismatch_kl(samples) < 1e-3
    p_before = {s.response_token_ids[0]: s.logprobs[0] for s in samples}
    assert lane.step(samples, ["g0"]).mismatch_kl < 1e-3  # the step sees the same
    for i in (1, 2):
        assert lane.step(samples, [f"g{i}"]).version == i + 1
    state = lane.optimizer.state_dict()["state"]
    assert state and {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    ckpt, _, _ = lane.checkpoint()
    after = _sampled(ckpt)  # a LoRA checkpoint served in bf16: its base, the adapter beside it
    # the sampled choice ("take coin", advantage +1) gained probability in the engine that serves the adapter
    take = next(s.response_token_ids[0] for s in samples if s.advantage > 0)
    p_after = {s.response_token_ids[0]: s.logprobs[0] for s in after}
    assert p_after[take] > p_before[take] + 0.05
    # and it serves what the lane computes, within the same bound
    assert lane.mismatch_kl(after) < 1e-3
    lane.close()


def test_bench_precision_reports_every_dtype_pair_and_fp32_agrees_exactly(tiny: Path) -> None:
    from coevo.bench.precision import bench_precision

    out = asyncio.run(bench_precision(tiny, rollouts=6, max_tokens=4, matmul_n=256))
    rows = out["dtypes"]
    assert set(rows) == {"float32", "bfloat16"}
    for row in rows.values():
        assert row["matmul_peak_gflops"] > 0 and row["sampled_tokens_per_s"] > 0 and row["learner_tokens"] > 0
        assert 0 < row["prefill_share_of_peak"] and row["adapter_apply_ms"] > 0
        assert set(row["adapter"]) == {"beside", "merge"}
        for mode in row["adapter"].values():
            assert mode["apply_ms_median"] > 0 and mode["prefill_gflops"] > 0 and mode["sampled_tokens_per_s"] > 0
    # beside the base, the fp32 engine serves what the lane computes; merged, within fp32's rounding
    assert rows["float32"]["adapter"]["beside"]["mismatch_kl"] < 1e-6
    assert rows["float32"]["adapter"]["merge"]["mismatch_kl"] < 1e-6
    kl = out["mismatch_kl"]
    assert len(kl) == 6  # 4 pairs at version 0, each dtype with itself after a step
    assert kl["sampler float32 -> learner float32, version 0"] < 1e-6
    assert kl["sampler float32 -> learner float32, after a step"] < 1e-6
    assert all(0 <= v < 1e-2 for v in kl.values())


def test_two_adapters_of_one_bf16_base_are_fp32_and_a_bf16_lane_resumes(tiny: Path, tmp_path: Path) -> None:
    from coevo.training.lora import SharedBase

    shared = SharedBase(tiny, BF16_LORA.lora, torch.bfloat16)  # type: ignore[arg-type]
    lanes = [Lane(role, tiny, tmp_path / "one", BF16_LORA, device="cpu", shared=shared) for role in ("policy", "judge")]
    base = {p.dtype for n, p in shared.model.named_parameters() if "lora_" not in n}
    assert base == {torch.bfloat16}
    for lane in lanes:  # the second adapter (PEFT's add_adapter) is upcast as the first is
        assert lane.trainable() and {p.dtype for p in lane.trainable()} == {torch.float32}
    samples = _sampled(tiny, 8)
    lanes[0].step(samples, ["g"])
    ckpt, _, _ = lanes[0].checkpoint()
    kept = set(lanes[0].optimizer.state_dict()["state"])
    for lane in lanes:
        lane.close()
    resumed = Lane("policy", tiny, tmp_path / "one", BF16_LORA, device="cpu")
    assert resumed.resumed_from == ckpt and resumed.version == 1 and resumed.dtype == torch.bfloat16
    assert {p.dtype for p in resumed.trainable()} == {torch.float32}
    state = resumed.optimizer.state_dict()["state"]
    assert set(state) == kept and kept
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    resumed.close()
