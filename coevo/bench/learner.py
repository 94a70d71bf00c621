"""`coevo bench learner`: what one learner step costs by model size, and what publishing and
checkpointing add to it.

One lane (the learner's own code) trains a randomly initialised Qwen2-shaped model on random
samples, like the learner does: step, publish the weights in the serving dtype (step end →
``WeightsPublished``: the critical path), and start a resume checkpoint every
``checkpoint_every`` steps off the critical path. Reported (medians over the measured steps):

- ``step_s``: one optimiser step (with the wait for a checkpoint's snapshot, if any);
- ``publish_s`` and ``publish_bytes``: step end → the weights are published, and the bytes written
  on that path;
- ``checkpoint_s`` (background: snapshot, write, fsync) and ``checkpoint_blocking_s`` (how long the
  training waited for it, per checkpoint);
- ``train_tokens_per_s``, ``mfu`` on GPU (6 · parameters · tokens/s over the device's dense bf16
  peak), ``peak_memory_gib`` (CUDA: allocated; CPU: the process's peak RSS) and ``publish_share``
  = publish_s / (step_s + publish_s).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool


SIZES = {
    "tiny": Shape(2, 128, 512, 2, 2, 1024, False),
    "small": Shape(4, 256, 1024, 4, 4, 1024, False),
    "medium": Shape(8, 512, 2048, 8, 8, 1024, False),
    "large": Shape(12, 768, 3072, 12, 12, 1024, False),
    "0.5B": Shape(24, 896, 4864, 14, 2, 151936, True),  # Qwen2.5-0.5B's shape
    "1.5B": Shape(28, 1536, 8960, 12, 2, 151936, True),  # Qwen2.5-1.5B's shape
}
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}
"""dense bf16 peak by device name fragment"""


def build_model(shape: Shape, folder: Path) -> None:
    """A randomly initialised Qwen2 model with a local tokenizer, saved the normal way."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coevo.inference.models import build_tokenizer

    build_tokenizer(folder)
    cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=shape.tied)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)


def random_batch(vocab: int, samples: int, prompt: int, response: int, version: int, seed: int) -> list[Any]:
    import torch

    from coevo.schemas import TrainingSample

    g = torch.Generator().manual_seed(seed)
    return [TrainingSample(sample_id=f"{seed}-{i}", role="policy",
                           prompt_token_ids=torch.randint(4, vocab, (prompt,), generator=g).tolist(),
                           response_token_ids=torch.randint(4, vocab, (response,), generator=g).tolist(),
                           logprobs=[-7.0] * response, advantage=1.0 if i % 2 else -1.0, model_version=version,
                           step_event_id=f"e{seed}") for i in range(samples)]


def bench_learner(size: str, device: str = "cpu", *, steps: int | None = None, samples: int | None = None,
                  tokens: int | None = None, checkpoint_every: int = 1) -> dict[str, Any]:
    """Step, publish and checkpoint costs of one lane at ``size`` on ``device``."""
    from coevo.config import LearnerConfig
    from coevo.training.lane import Lane

    gpu = device.startswith("cuda")
    steps = steps or (5 if gpu else 3)
    samples = samples or (64 if gpu else 16)
    tokens = tokens or (512 if gpu else 128)
    response = max(1, tokens // 4)
    shape = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="coevo-bench-learner-") as tmp:
        build_model(shape, Path(tmp) / "model")
        lane = Lane("policy", Path(tmp) / "model", Path(tmp) / "ckpt", LearnerConfig(lr=1e-5), device=device)
        try:
            def batch(seed: int) -> list[Any]:
                return random_batch(shape.vocab, samples, tokens - response, response, lane.version, seed)

            lane.step(batch(-1), ["warmup"])  # first-step allocations, kernels and buffers
            lane.publish()
            lane.begin_checkpoint().result()
            _reset_peak(device)
            rows = _measure(lane, batch, steps, checkpoint_every)
        finally:
            lane.close()
        params = sum(p.numel() for p in lane.model.parameters())
    return _report(size, device, params, lane.publish_dtype, samples, tokens, steps, rows)


def _measure(lane: Any, batch: Any, steps: int, checkpoint_every: int) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {k: [] for k in ("step_s", "publish_s", "publish_bytes", "blocking_s",
                                                    "checkpoint_s", "checkpoint_bytes")}
    pending = None
    for k in range(steps):
        data = batch(k)
        t0 = time.perf_counter()
        metrics = lane.step(data, [f"g{k}"])
        _sync(lane.device)
        t1 = time.perf_counter()
        _, _, size = lane.publish()
        rows["publish_s"].append(time.perf_counter() - t1)
        rows["step_s"].append(t1 - t0)
        rows["publish_bytes"].append(size)
        if k:
            rows["blocking_s"].append(metrics.checkpoint_wait_s)
        if pending is not None and pending.done():
            _checkpointed(rows, pending.result())
            pending = None
        if pending is None and k % checkpoint_every == 0 and k < steps - 1:  # its wait lands in a later step
            pending = lane.begin_checkpoint()
    if pending is not None:
        _checkpointed(rows, pending.result())
    return rows


def _checkpointed(rows: dict[str, list[float]], ckpt: Any) -> None:
    rows["checkpoint_s"].append(ckpt.seconds)
    rows["checkpoint_bytes"].append(ckpt.bytes)


def _report(size: str, device: str, params: int, dtype: Any, samples: int, tokens: int, steps: int,
            rows: dict[str, list[float]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(rows[key]) if rows[key] else 0.0

    step_s, publish_s = med("step_s"), med("publish_s")
    tokens_per_s = samples * tokens / step_s if step_s else 0.0
    peak = _peak_flops(device)
    return {
        "size": size, "device": device, "parameters": params, "publish_dtype": str(dtype).removeprefix("torch."),
        "samples": samples, "tokens_per_sample": tokens, "steps": steps,
        "step_s": round(step_s, 4), "publish_s": round(publish_s, 4), "publish_bytes": int(med("publish_bytes")),
        "checkpoint_s": round(med("checkpoint_s"), 4), "checkpoint_bytes": int(med("checkpoint_bytes")),
        "checkpoint_blocking_s": round(max(rows["blocking_s"], default=0.0), 4),
        "train_tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(6 * params * tokens_per_s / peak, 4) if peak else None,
        "peak_memory_gib": round(_peak_memory(device) / 2**30, 3),
        "publish_share": round(publish_s / (step_s + publish_s), 4) if step_s + publish_s else 0.0,
    }


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> float:
    if str(device).startswith("cuda"):
        import torch

        return float(torch.cuda.max_memory_allocated())
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _peak_flops(device: str) -> float | None:
    if not str(device).startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name()
    return next((v for k, v in BF16_PEAK_FLOPS.items() if k in name), None)
