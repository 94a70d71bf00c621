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
- with ``--lora RANK`` the lane trains an adapter; ``lora`` then compares: the full model's
  publication against the adapter's (``publish_fraction``), and what the learner holds (parameters
  and optimiser state) for policy and judge as two full models against two adapters of one base;
- ``train_tokens_per_s``, ``mfu`` (6 · parameters · tokens/s over the peak in the lane's compute dtype:
  on GPU the device's dense bf16 datasheet peak, on CPU the square-matmul rate measured after the steps,
  ``peak_tflops`` and ``peak_source`` say which), ``peak_memory_gib`` (CUDA: allocated; CPU: the process's peak RSS) and ``publish_share``
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
    cfg = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=shape.tied,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)


def random_batch(vocab: int, samples: int, prompt: int, response: int, version: int, seed: int) -> list[Any]:
    import torch

    from coevo.schemas import FloatArray, IntArray, TrainingSample

    g = torch.Generator().manual_seed(seed)
    return [
        TrainingSample(
            sample_id=f"{seed}-{i}",
            role="policy",
            prompt_token_ids=IntArray(torch.randint(4, vocab, (prompt,), generator=g).tolist()),
            response_token_ids=IntArray(torch.randint(4, vocab, (response,), generator=g).tolist()),
            logprobs=FloatArray([-7.0] * response),
            advantage=1.0 if i % 2 else -1.0,
            model_version=version,
            step_event_id=f"e{seed}",
        )
        for i in range(samples)
    ]


def bench_learner(
    size: str,
    device: str = "cpu",
    *,
    steps: int | None = None,
    samples: int | None = None,
    tokens: int | None = None,
    checkpoint_every: int = 1,
    lora_rank: int | None = None,
) -> dict[str, Any]:
    """Step, publish and checkpoint costs of one lane at ``size`` on ``device`` (a LoRA lane of rank
    ``lora_rank``: then also the full model's publication and what two roles hold, for comparison)."""
    from coevo.config import LearnerConfig, LoraConfig
    from coevo.inference.precision import model_dtype
    from coevo.training.lane import Lane

    lc = LearnerConfig(lr=1e-5, lora=LoraConfig(rank=lora_rank) if lora_rank else None)

    gpu = device.startswith("cuda")
    steps = steps or (5 if gpu else 3)
    samples = samples or (64 if gpu else 16)
    tokens = tokens or (512 if gpu else 128)
    response = max(1, tokens // 4)
    shape = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="coevo-bench-learner-") as tmp:
        build_model(shape, Path(tmp) / "model")
        lane = Lane("policy", Path(tmp) / "model", Path(tmp) / "ckpt", lc, device=device)
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
        report = _report(size, device, params, lane.publish_dtype, samples, tokens, steps, rows)
        compute = model_dtype(lc.dtype, device, Path(tmp) / "model")
        report.update(_utilisation(device, compute, 6 * params * report["train_tokens_per_s"]))
        report["trainable_parameters"] = sum(p.numel() for p in lane.trainable())
        if lora_rank:
            report["lora"] = _lora_comparison(
                Path(tmp),
                lc,
                device,
                report["publish_bytes"],
                lambda ln: random_batch(shape.vocab, samples, tokens - response, response, ln.version, 0),
            )
    return report


def _lora_comparison(tmp: Path, lc: Any, device: str, adapter_bytes: int, batch: Any) -> dict[str, Any]:
    """The full model's publication next to the adapter's, and what the learner holds for policy and
    judge as two full models or as two adapters of one base (parameters and optimiser state, after a
    step of each: bytes of distinct tensor storage)."""
    from coevo.config import LearnerConfig
    from coevo.inference.precision import model_dtype
    from coevo.schemas.events import Role
    from coevo.training.lane import Lane
    from coevo.training.lora import SharedBase

    full = Lane("policy", tmp / "model", tmp / "full", LearnerConfig(lr=1e-5), device=device)
    full.step(batch(full), ["g"])
    full_bytes = full.publish_alone()[2]
    two_full = 2 * _held_bytes([full])
    full.close()
    shared = SharedBase(tmp / "model", lc.lora, model_dtype(lc.dtype, device, tmp / "model"))
    roles: tuple[Role, ...] = ("policy", "judge")
    lanes = [Lane(role, tmp / "model", tmp / "one-base", lc, device=device, shared=shared) for role in roles]
    for lane in lanes:
        lane.step(batch(lane), ["g"])
    one_base = _held_bytes(lanes)
    for lane in lanes:
        lane.close()
    return {
        "rank": lc.lora.rank,
        "full_publish_bytes": full_bytes,
        "adapter_publish_bytes": adapter_bytes,
        "publish_fraction": round(adapter_bytes / full_bytes, 4),
        "two_roles_full_held_bytes": two_full,
        "two_roles_one_base_held_bytes": one_base,
        "two_roles_held_fraction": round(one_base / two_full, 4),
    }


def _held_bytes(lanes: list[Any]) -> int:
    """Bytes of the distinct storages of the lanes' parameters and optimiser states."""
    import torch

    seen: dict[int, int] = {}
    for lane in lanes:
        tensors = [p.detach() for p in lane.model.parameters()]
        tensors += [v for st in lane.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure(lane: Any, batch: Any, steps: int, checkpoint_every: int) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {
        k: [] for k in ("step_s", "publish_s", "publish_bytes", "blocking_s", "checkpoint_s", "checkpoint_bytes")
    }
    pending = None
    for k in range(steps):
        data = batch(k)
        t0 = time.perf_counter()
        metrics = lane.step(data, [f"g{k}"])
        _sync(lane.device)
        t1 = time.perf_counter()
        _, _, size = lane.publish_alone()
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


def _report(
    size: str, device: str, params: int, dtype: Any, samples: int, tokens: int, steps: int, rows: dict[str, list[float]]
) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(rows[key]) if rows[key] else 0.0

    step_s, publish_s = med("step_s"), med("publish_s")
    tokens_per_s = samples * tokens / step_s if step_s else 0.0
    return {
        "size": size,
        "device": device,
        "parameters": params,
        "publish_dtype": str(dtype).removeprefix("torch."),
        "samples": samples,
        "tokens_per_sample": tokens,
        "steps": steps,
        "step_s": round(step_s, 4),
        "publish_s": round(publish_s, 4),
        "publish_bytes": int(med("publish_bytes")),
        "checkpoint_s": round(med("checkpoint_s"), 4),
        "checkpoint_bytes": int(med("checkpoint_bytes")),
        "checkpoint_blocking_s": round(max(rows["blocking_s"], default=0.0), 4),
        "train_tokens_per_s": round(tokens_per_s, 1),
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


def _utilisation(device: str, compute: Any, flops_per_s: float) -> dict[str, Any]:
    """``mfu``: ``flops_per_s`` over the peak in ``compute`` dtype: a GPU's datasheet dense bf16 peak, or
    this CPU's square-matmul rate measured now (after the timed steps, which it must not share cores with)."""
    if str(device).startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name()
        peak, source = next((v for k, v in BF16_PEAK_FLOPS.items() if k in name), None), "datasheet bf16"
    else:
        from coevo.bench.precision import matmul_rate

        peak, source = matmul_rate(compute), f"measured {str(compute).removeprefix('torch.')} matmul"
    return {
        "compute_dtype": str(compute).removeprefix("torch."),
        "peak_tflops": round(peak / 1e12, 3) if peak else None,
        "peak_source": source if peak else None,
        "mfu": round(flops_per_s / peak, 4) if peak else None,
    }
