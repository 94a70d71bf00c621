"""``coevo bench precision``: what bf16 buys and what it costs, on one model, local engine and LoRA lane.

Per compute dtype (``learner.dtype``): the machine's matmul rate in it (the peak the phases are read
against), the engine's prefill and sampling rates, a LoRA learner step, an adapter version applied to the
engine, each way it can serve one (beside the base layers or merged into them: its cost per version and
per forward pass, and its mismatch to the lane); and the mismatch KL per token from the engine's
sampling to the lane's log-probs, at version 0 and after a step (the adapter served as the engine serves
it by default), for every pair of sampler and learner dtypes: what a bf16 server costs an fp32 learner,
and the reverse. With ``vllm_python``, the same for vLLM's CPU build serving the base in each dtype
(``--dtype``): its sampling rate and its mismatch against the lane of every dtype at version 0.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coevo.config import ComputeDtype, LearnerConfig, LoraConfig
from coevo.inference.engine import LocalEngine
from coevo.inference.precision import compute_dtype
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane
from coevo.training.parity import fresh_samples


def matmul_rate(dtype: Any, n: int = 2048, repeats: int = 5) -> float:
    """The machine's square-matmul rate in ``dtype``, FLOP/s (median of ``repeats``): its peak, as
    measured here and now."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def prefill_rate(engine: LocalEngine, batch: int = 8, tokens: int = 128) -> float:
    """FLOP/s of one forward over ``batch`` × ``tokens`` (2 · parameters · tokens)."""
    import torch

    ids = torch.randint(100, engine.tokenizer.vocab_size - 1, (batch, tokens))
    params = sum(p.numel() for p in engine.model.parameters())
    with torch.no_grad():
        engine.model(ids)
        t = time.perf_counter()
        engine.model(ids)
        return 2 * params * batch * tokens / (time.perf_counter() - t)


async def timed_samples(
    client: Any, lane: Lane, *, rollouts: int, max_tokens: int
) -> tuple[list[TrainingSample], float]:
    """``fresh_samples`` from ``client`` for ``lane``, and the response tokens they took a second."""
    t = time.perf_counter()
    got = await fresh_samples(client, lane, rollouts=rollouts, max_tokens=max_tokens)
    return got, round(sum(len(s.response_token_ids) for s in got) / (time.perf_counter() - t), 1)


async def adapter_modes(
    base: Path, dtype: ComputeDtype, lane: Lane, adapter: Path, *, rollouts: int, max_tokens: int, repeats: int = 3
) -> dict[str, dict[str, float]]:
    """The lane's published ``adapter`` served each way a local engine can (``adapter_apply``): a version's
    apply time (median of ``repeats``), the prefill and sampling rates with it served (what each way costs
    per forward pass), and the mismatch KL of its samples to the lane."""
    out: dict[str, dict[str, float]] = {}
    for mode in ("beside", "merge"):
        async with LocalEngine(base, seed=1, device="cpu", dtype=dtype, adapter_apply=mode) as engine:
            applied = [await engine.load_adapter(adapter, lane.version) for _ in range(repeats)]
            row = {"apply_ms_median": round(statistics.median(applied), 1)}
            row["prefill_gflops"] = round(prefill_rate(engine) / 1e9, 1)
            got, row["sampled_tokens_per_s"] = await timed_samples(
                engine, lane, rollouts=rollouts, max_tokens=max_tokens
            )
            row["mismatch_kl"] = round(lane.mismatch_kl(got), 6)
        out[mode] = row
    return out


async def _vllm(
    python: str, base: Path, lanes: Mapping[str, Lane], rollouts: int, max_tokens: int
) -> dict[str, dict[str, float]]:
    """vLLM serving ``base`` in each of the lanes' dtypes: tokens per second sampled, and the mismatch
    KL of its samples against every lane (version 0)."""
    from coevo.bench.vllm import served
    from coevo.inference.vllm_client import VLLMClient

    out: dict[str, dict[str, float]] = {}
    for d in lanes:
        async with served(python, base, extra=["--dtype", d]) as url:
            async with VLLMClient(url, str(base), name="policy", tokenizer_dir=base) as client:
                await fresh_samples(client, lanes[d], rollouts=2, max_tokens=max_tokens)  # warm
                got, rate = await timed_samples(client, lanes[d], rollouts=rollouts, max_tokens=max_tokens)
        row = {"sampled_tokens_per_s": rate}
        row |= {f"mismatch_kl against learner {k}": round(lane.mismatch_kl(got), 6) for k, lane in lanes.items()}
        out[f"vllm {d}"] = row
    return out


def _signed(samples: list[TrainingSample]) -> list[TrainingSample]:
    return [s.model_copy(update={"advantage": 1.0 if i % 2 else -1.0}) for i, s in enumerate(samples)]


async def bench_precision(
    base: Path,
    *,
    dtypes: Sequence[ComputeDtype] = ("float32", "bfloat16"),
    rollouts: int = 32,
    max_tokens: int = 16,
    vllm_python: str | None = None,
    matmul_n: int = 2048,
) -> dict[str, Any]:
    """See the module's docstring. ``base``: a model directory; ``matmul_n``: the peak matmul's side."""
    lora = LoraConfig()
    out: dict[str, Any] = {"base": str(base), "rollouts": rollouts, "max_tokens": max_tokens, "dtypes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lanes = {
            d: Lane("policy", base, Path(tmp) / d, LearnerConfig(lora=lora, lr=3e-4, dtype=d), device="cpu")
            for d in dtypes
        }
        samples: dict[str, dict[int, list[TrainingSample]]] = {d: {} for d in dtypes}
        for d in dtypes:
            torch_dtype = compute_dtype(d, "cpu")
            row: dict[str, Any] = {"torch_dtype": str(torch_dtype).removeprefix("torch.")}
            row["matmul_peak_gflops"] = round(matmul_rate(torch_dtype, matmul_n) / 1e9, 1)
            async with LocalEngine(base, seed=1, device="cpu", dtype=d) as engine:
                row["prefill_gflops"] = round(prefill_rate(engine) / 1e9, 1)
                row["prefill_share_of_peak"] = round(row["prefill_gflops"] / row["matmul_peak_gflops"], 3)
                first, row["sampled_tokens_per_s"] = await timed_samples(
                    engine, lanes[d], rollouts=rollouts, max_tokens=max_tokens
                )
                samples[d][0] = first
                t = time.perf_counter()
                metrics = await asyncio.to_thread(lanes[d].step, _signed(first), ["g0"])
                row["learner_step_s"] = round(time.perf_counter() - t, 2)
                row["learner_tokens"] = metrics.tokens
                path, _, _ = await asyncio.to_thread(lanes[d].publish_alone)
                row["adapter_apply_ms"] = round(await engine.load_adapter(path, lanes[d].version), 1)
                samples[d][1] = await fresh_samples(engine, lanes[d], rollouts=rollouts, max_tokens=max_tokens)
            row["adapter"] = await adapter_modes(base, d, lanes[d], path, rollouts=rollouts, max_tokens=max_tokens)
            out["dtypes"][d] = row
        # after the step: each lane against its own engine serving the adapter it published
        out["mismatch_kl"] = {
            f"sampler {d} -> learner {d}, after a step": round(lanes[d].mismatch_kl(samples[d][1]), 6) for d in dtypes
        }
        for d in dtypes:
            lanes[d].close()
        # version 0, every pair: each sampler's samples against a fresh lane of every dtype
        fresh: dict[str, Lane] = {
            d: Lane("policy", base, Path(tmp) / f"v0-{d}", LearnerConfig(lora=lora, dtype=d), device="cpu")
            for d in dtypes
        }
        for s in dtypes:
            for d in dtypes:
                out["mismatch_kl"][f"sampler {s} -> learner {d}, version 0"] = round(
                    fresh[d].mismatch_kl(samples[s][0]), 6
                )
        if vllm_python is not None:
            out["vllm"] = await _vllm(vllm_python, base, fresh, rollouts, max_tokens)
        for lane in fresh.values():
            lane.close()
    return out
