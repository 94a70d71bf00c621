"""On CUDA only (``pytest -m gpu``; skipped without a device): bf16 learner steps, and weights pushed
over vLLM's own NCCL transfer.

The NCCL test needs two GPUs (NCCL refuses two ranks of one group on one device: the learner takes
GPU 0, the vLLM server GPU 1) and vLLM's GPU build importable here (the learner's NCCL end uses
vLLM's communicator). ``scripts/gpu-check.sh`` runs this file on such a machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from coevo.config import LearnerConfig, PushSync
from coevo.schemas import TrainingSample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def samples(n: int = 16) -> list[TrainingSample]:
    out = []
    for i in range(n):
        out.append(
            TrainingSample(
                sample_id=f"s{i}",
                role="policy",
                prompt_token_ids=[5, 6, 7, 8 + i % 3],
                response_token_ids=[40 + i % 2],
                logprobs=[-0.7],
                allowed_token_ids=[40, 41],
                advantage=1.0 if i % 2 else -1.0,
                model_version=0,
                step_event_id=f"e{i}",
            )
        )
    return out


def test_lane_steps_in_bf16_autocast_on_cuda_like_fp32_on_cpu(model_cache: Path, tmp_path: Path) -> None:
    from coevo.inference.models import ensure_default_model
    from coevo.training.lane import Lane

    model = ensure_default_model("policy", model_cache)
    cpu = Lane("policy", model, tmp_path / "cpu", LearnerConfig(lr=1e-3), device="cpu")
    gpu = Lane("policy", model, tmp_path / "gpu", LearnerConfig(lr=1e-3, dtype="bfloat16"), device="cuda")
    m_cpu, m_gpu = cpu.step(samples(), ["g"]), gpu.step(samples(), ["g"])
    assert m_gpu.version == m_cpu.version == 1 and m_gpu.samples == m_cpu.samples
    assert abs(m_gpu.loss - m_cpu.loss) < 2e-2 and abs(m_gpu.mismatch_kl - m_cpu.mismatch_kl) < 2e-2
    assert next(gpu.model.parameters()).dtype == torch.float32  # master weights stay fp32
    path, _, _ = gpu.checkpoint()
    from coevo.weights.transfer import load_checkpoint_tensors

    saved = load_checkpoint_tensors(path)
    cpu_state = cpu.model.state_dict()
    name = "model.embed_tokens.weight"
    assert torch.allclose(saved[name], cpu_state[name], atol=5e-3)  # same update, up to bf16 rounding


@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or importlib.util.find_spec("vllm") is None,
    reason="needs 2 GPUs and vLLM's GPU build",
)
async def test_weights_pushed_over_vllm_nccl_equal_the_checkpoint(bus, model_cache: Path, tmp_path: Path) -> None:
    from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt
    from coevo.inference.models import ensure_default_model
    from coevo.inference.vllm_client import SERVER_ENV, VLLMClient, server_command
    from coevo.schemas import TransferConnect, TransferEndpoint, TransferOffer, TransferRequest, transfer_subject
    from coevo.training.lane import Lane
    from coevo.weights.server import WeightServer

    model = ensure_default_model("policy", model_cache)
    torch.cuda.set_device(0)
    lane = Lane("policy", model, tmp_path / "ckpt", LearnerConfig(lr=5e-2), device="cuda:0")
    lane.step(samples(), ["g"])
    path, sha, _ = lane.checkpoint()
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen(
        server_command(sys.executable, model, port, transfer_backend="nccl", extra=("--gpu-memory-utilization", "0.3")),
        env={**os.environ, **SERVER_ENV, "CUDA_VISIBLE_DEVICES": "1"},
        start_new_session=True,
    )
    server = WeightServer(bus, PushSync(transport="nccl", timeout_s=120.0))
    await server.serve("policy", lambda: (1, path, sha))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                await asyncio.to_thread(urllib.request.urlopen, url + "/v1/models", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "vLLM did not start"
                await asyncio.sleep(2)
        prompt = policy_prompt("goal: take the coin. room: hall. items: coin.", ["take coin", "go north"])
        async with VLLMClient(url + "/v1", str(model), tokenizer_dir=model) as client:
            ep = await bus.request(
                transfer_subject(bus.run_id, "policy", "connect"),
                TransferConnect(server="gpu-vllm", workers=await client.workers()),
                TransferEndpoint,
                timeout_s=30,
            )
            await client.init_transfer(ep.init_info(), 120.0)
            offer = await bus.request(
                transfer_subject(bus.run_id, "policy", "push"),
                TransferRequest(server="gpu-vllm", version=1, token=ep.token),
                TransferOffer,
                timeout_s=120,
            )
            await client.receive_weights(offer, 120.0)
            assert await client.weight_version() == "1"
            c = await client.complete(prompt, choices=list(INDEX_LABELS[:2]))
            ids = torch.tensor([client.encode(prompt)], device="cuda:0")
            with torch.no_grad():
                logits = lane.model(input_ids=ids).logits[0, -1].float()
            expected = torch.log_softmax(logits[c.allowed_token_ids], -1).tolist()
            assert c.logprobs[0] == pytest.approx(expected[c.choice], abs=1e-3)
    finally:
        await server.aclose()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
