"""Pause of a weight swap by model size: local engine (from disk, from memory, a LoRA adapter merged), vLLM
reload from disk, vLLM pushed over gloo, a LoRA adapter loaded into vLLM at runtime; and the bytes of a
full publication next to an adapter's."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from coevo.observe.progress import tracked

LORA_RANK = 16


async def bench_weights(
    vllm_python: str | None = None, sizes: tuple[str, ...] = ("tiny", "small", "medium"), repeats: int = 5
) -> dict[str, Any]:
    """Pause of a weight swap into the local engine (and a vLLM server when ``vllm_python`` is given)."""
    import statistics

    from coevo.config import LearnerConfig, LoraConfig
    from coevo.inference.engine import LocalEngine
    from coevo.inference.models import build_tokenizer
    from coevo.training.lane import Lane
    from coevo.weights.manifest import HELD, weights_bytes

    shapes = {"tiny": (2, 128), "small": (4, 256), "medium": (8, 512), "large": (12, 768)}
    out: dict[str, Any] = {"sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tok"
        build_tokenizer(tok_dir)
        for size in tracked(sizes, "bench weights", unit="sizes"):
            layers, width = shapes[size]
            d = _random_model(Path(tmp) / size, layers, width)
            lane = Lane("policy", d, Path(tmp) / f"ckpt-{size}", LearnerConfig(), device="cpu")
            path, digest, _ = lane.publish_alone()  # the published weights: what every server loads
            params = sum(p.numel() for p in lane.model.parameters())
            lane.close()
            adapter_lane = Lane(
                "policy", d, Path(tmp) / f"lora-{size}", LearnerConfig(lora=LoraConfig(rank=LORA_RANK)), device="cpu"
            )
            adapter, _, adapter_bytes = adapter_lane.publish_alone()
            adapter_lane.close()
            local, memory, merged = [], [], []
            async with LocalEngine(d) as eng:
                for i in range(repeats):
                    local.append(await eng.swap_weights(path, i + 1))
                    memory.append(await eng.swap_tensors(HELD.get(path, digest) or {}, i + 1))
                    merged.append(await eng.load_adapter(adapter, i + 1))
            entry: dict[str, Any] = {
                "parameters": params,
                "bytes": weights_bytes(path),
                "adapter_rank": LORA_RANK,
                "adapter_bytes": adapter_bytes,
                "local_pause_ms_median": round(statistics.median(local), 2),
                "local_memory_pause_ms_median": round(statistics.median(memory), 2),
                "local_adapter_pause_ms_median": round(statistics.median(merged), 2),
            }
            if vllm_python:
                pauses = await _vllm_pauses(vllm_python, d, path, repeats)
                entry["vllm_pause_ms_median"] = pauses["disk"]  # reload_weights from the checkpoint path
                entry["vllm_gloo_pause_ms_median"] = pauses["gloo"]  # pushed by the learner (coevo_gloo)
                # a runtime LoRA load, on a server started with --enable-lora (no server pause: this
                # client's own requests wait, other adapters go on)
                entry["vllm_adapter_pause_ms_median"] = await _vllm_adapter_pause(vllm_python, d, adapter, repeats)
            out["sizes"][size] = entry
    return out


def _random_model(d: Path, layers: int, width: int) -> Path:
    """A Qwen2-shaped model of ``layers`` × ``width`` with random weights (seed 0) and the tiny tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coevo.inference.models import build_tokenizer

    build_tokenizer(d)
    cfg = Qwen2Config(
        vocab_size=1024,
        hidden_size=width,
        intermediate_size=width * 4,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


async def _vllm_pauses(python: str, model: Path, ckpt: Path, repeats: int) -> dict[str, float]:
    """Median pause of a swap into a fresh vLLM server: reloaded from disk, and pushed over gloo."""
    import statistics
    import threading

    from coevo.bench.vllm import served
    from coevo.inference.vllm_client import VLLMClient
    from coevo.schemas import TransferEndpoint, TransferOffer
    from coevo.weights.transfer import GlooCollective, Plan, load_checkpoint_tensors, send

    async with served(python, model) as url:
        disk, gloo = [], []
        async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
            for i in range(repeats):
                disk.append(await client.swap_weights(ckpt, i + 1))
            store = GlooCollective.host_store("127.0.0.1", 2, 120.0)
            opening = asyncio.ensure_future(asyncio.to_thread(GlooCollective, store, 0, 2, 120.0))
            endpoint = TransferEndpoint(
                backend="gloo", master_address="127.0.0.1", master_port=int(store.port), world_size=2
            )
            await client.init_transfer(endpoint.init_info(), 120.0)
            group = await opening
            tensors = load_checkpoint_tensors(ckpt)
            plan = Plan.of(tensors)
            for i in range(repeats):
                offer = TransferOffer(version=repeats + i + 1, sha256="", **plan.update_info())
                sender = threading.Thread(target=send, args=(group, tensors, plan))
                sender.start()
                gloo.append(await client.receive_weights(offer, 120.0))
                await asyncio.to_thread(sender.join)
        return {"disk": round(statistics.median(disk), 2), "gloo": round(statistics.median(gloo), 2)}


async def _vllm_adapter_pause(python: str, model: Path, adapter: Path, repeats: int) -> float:
    """Median time a client waits to serve a new adapter version on a server with LoRA enabled."""
    import statistics

    from coevo.bench.vllm import served
    from coevo.inference.vllm_client import VLLMClient

    async with served(python, model, lora_rank=LORA_RANK) as url:
        async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
            pauses = [await client.load_adapter(adapter, i + 1) for i in range(repeats)]
            await client.complete("ping", max_tokens=2)  # the adapter serves
    return round(statistics.median(pauses), 2)
