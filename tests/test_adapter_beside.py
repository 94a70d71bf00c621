"""A local engine serves a LoRA adapter beside its base layers (``adapters.Beside``): bit for bit what the
LoRA lane computes, in fp32 and in bf16 (where merging the adapter into the weights rounds it); a new
version replaces the last whole; an adapter that does not fit is refused whole and what was served stays
served; whole weights swapped in are served without an adapter. ``auto`` merges in fp32, where both ways
are exact and a merged engine samples faster, and serves beside in bf16."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch

from coevo.config import LearnerConfig, LoraConfig
from coevo.inference import adapters
from coevo.inference.engine import LocalEngine
from coevo.inference.models import ensure_default_model
from coevo.training.lane import Lane
from tests.test_delivery import _samples

IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 16, 17, 18]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))


def _lane(tiny: Path, where: Path, dtype: Literal["float32", "bfloat16"]) -> Lane:
    return Lane(
        "policy", tiny, where, LearnerConfig(lora=LoraConfig(rank=4, alpha=8.0), lr=0.05, dtype=dtype), device="cpu"
    )


def _logits(model: torch.nn.Module, autocast: bool = False) -> torch.Tensor:
    """``autocast``: as a bf16 lane computes (its passes run under autocast, the adapter's matmuls too)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model.eval()(input_ids=IDS).logits.float()


def _published(lane: Lane, step: int) -> Path:
    lane.step(_samples(f"g{step}"), [f"g{step}"])
    path, _, _ = lane.publish()
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_an_adapter_beside_the_base_serves_bit_for_bit_what_the_lane_computes(
    tiny: Path, tmp_path: Path, dtype: Literal["float32", "bfloat16"]
) -> None:
    lane = _lane(tiny, tmp_path, dtype)
    bf16 = dtype == "bfloat16"
    v1, v2 = _published(lane, 1), _published(lane, 2)  # the lane now computes version 2
    async with (
        LocalEngine(tiny, device="cpu", dtype=dtype, adapter_apply="beside") as beside,
        LocalEngine(tiny, device="cpu", dtype=dtype, adapter_apply="merge") as merged,
    ):
        base = _logits(beside.model)
        weights = {k: v.clone() for k, v in beside.model.state_dict().items()}
        for engine in (beside, merged):
            await engine.load_adapter(v1, 1)
            await engine.load_adapter(v2, 2)  # replaces version 1: never on top of it
        assert torch.equal(_logits(beside.model), _logits(lane.model, autocast=bf16))
        assert all(torch.equal(weights[k], v) for k, v in beside.model.state_dict().items())  # never written
        assert (_logits(beside.model) - base).abs().max() > 1e-2  # the adapter is served
        # merged into the weights, the same adapter is only close: in bf16 the sum W + s B A is rounded
        gap = (_logits(merged.model) - _logits(lane.model, autocast=bf16)).abs().max().item()
        assert 0 < gap < (0.1 if bf16 else 1e-4)
        assert set(beside.beside.tensors) == {
            f"{m.removesuffix('.weight')}.lora_{n}"
            for m in adapters.adapted_weights(adapters.read(v2)[0])
            for n in "AB"
        }
    lane.close()


async def test_an_adapter_that_does_not_fit_is_refused_whole_and_the_served_version_stays(
    tiny: Path, tmp_path: Path
) -> None:
    lane = _lane(tiny, tmp_path, "float32")
    path = _published(lane, 1)
    tensors, _ = adapters.read(path)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    unknown = {**tensors, "base_model.model.model.nowhere.lora_A.weight": tensors[f"{q}.lora_A.weight"]}
    unknown["base_model.model.model.nowhere.lora_B.weight"] = tensors[f"{q}.lora_B.weight"]
    misshapen = {**tensors, f"{q}.lora_A.weight": tensors[f"{q}.lora_A.weight"][:, :-1]}
    not_linear = {**tensors, "base_model.model.model.norm.lora_A.weight": tensors[f"{q}.lora_A.weight"]}
    not_linear["base_model.model.model.norm.lora_B.weight"] = tensors[f"{q}.lora_B.weight"]
    async with LocalEngine(tiny, device="cpu", adapter_apply="beside") as engine:
        await engine.load_adapter(path, 1)
        served = _logits(engine.model)
        for bad, why in ((unknown, "not in the base model"), (misshapen, "do not fit"), (not_linear, "not a linear")):
            with pytest.raises(ValueError, match=why):
                await engine.load_adapter(path, 2, tensors=bad)
            assert engine.version == 1 and torch.equal(_logits(engine.model), served)
    lane.close()


async def test_whole_weights_swapped_in_are_served_without_the_adapter(tiny: Path, tmp_path: Path) -> None:
    lane = _lane(tiny, tmp_path, "float32")
    path = _published(lane, 1)
    async with LocalEngine(tiny, device="cpu", adapter_apply="beside") as engine:
        base = _logits(engine.model)
        weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        await engine.load_adapter(path, 1)
        assert not torch.equal(_logits(engine.model), base)
        await engine.swap_tensors(weights, 2)
        assert engine.beside.tensors == {} and torch.equal(_logits(engine.model), base)
        await engine.load_adapter(path, 3)  # and an adapter after them applies to them
        assert torch.equal(_logits(engine.model), _logits(lane.model))
    lane.close()


def test_auto_merges_in_fp32_where_both_are_exact_and_serves_beside_in_bf16(tiny: Path) -> None:
    assert LocalEngine(tiny, device="cpu", dtype="float32").adapter_apply == "merge"
    assert LocalEngine(tiny, device="cpu", dtype="bfloat16").adapter_apply == "beside"
    assert LocalEngine(tiny, device="cpu", dtype="float32", adapter_apply="beside").adapter_apply == "beside"
