"""Published weights and resume checkpoints, without NATS: memory-bounded log-probs equal to the full
computation, safetensors written and hashed in one pass, manifests followers verify, the serving
dtype, in-memory swaps, and checkpoints that leave the critical path."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coevo.config import LearnerConfig
from coevo.inference.engine import LocalEngine
from coevo.training.lane import Lane, latest_checkpoint
from coevo.training.loss import token_logprobs, token_logprobs_and_entropy
from coevo.weights import tensorfiles
from coevo.weights.manifest import HELD, manifest_of, verify
from tests.test_training import choice_samples


def full_vocab_logprobs(model, input_ids, attention_mask, response_mask, allowed, temperature=1.0):
    """The learner's log-probs before they were chunked: fp32 logits over the whole vocabulary at
    every position (kept here as the reference)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1, :].float() / max(temperature, 1e-5)
    targets = input_ids[:, 1:]
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(response_mask[:, 1:] > 0, logp, torch.zeros_like(logp))
    return torch.nn.functional.pad(logp, (1, 0))


@pytest.fixture(scope="module")
def small_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("chunk_elements", [300, 1000, 1 << 25])  # one position per chunk, a few, all at once
def test_chunked_logprobs_equal_the_full_computation(
    small_model, temperature: float, constrained: bool, chunk_elements: int
) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (3, 12))
    attn = torch.ones(3, 12, dtype=torch.long)
    attn[2, 8:] = 0  # right padding
    resp = torch.zeros(3, 12, dtype=torch.long)
    resp[0, 6:] = 1
    resp[1, 11] = 1
    resp[2, 4:8] = 1
    allowed = None
    if constrained:  # row 1 sampled among three tokens (a choice), the others unconstrained
        allowed = torch.ones(3, 300, dtype=torch.bool)
        allowed[1] = False
        allowed[1, [int(ids[1, 11]), 5, 6]] = True
    ref = full_vocab_logprobs(small_model, ids, attn, resp, allowed, temperature)
    out = token_logprobs(small_model, ids, attn, resp, allowed, temperature, chunk_elements=chunk_elements)
    assert out.shape == ref.shape and torch.equal(out == 0, ref == 0)
    assert (out - ref).abs().max() < 1e-5
    small_model.zero_grad()
    ref.sum().backward()
    grads = [p.grad.clone() for p in small_model.parameters()]
    small_model.zero_grad()
    token_logprobs(small_model, ids, attn, resp, allowed, temperature, chunk_elements=chunk_elements).sum().backward()
    for g, p in zip(grads, small_model.parameters(), strict=True):
        assert (g - p.grad).abs().max() < 1e-5


@pytest.mark.parametrize("chunk_elements", [300, 1 << 25])
def test_entropy_is_that_of_the_distribution_each_response_token_was_drawn_from(
    small_model, chunk_elements: int
) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, 300, (2, 10))
    attn = torch.ones(2, 10, dtype=torch.long)
    resp = torch.zeros(2, 10, dtype=torch.long)
    resp[0, 5:] = 1
    resp[1, 9] = 1
    allowed = torch.ones(2, 300, dtype=torch.bool)
    allowed[1] = False
    allowed[1, [int(ids[1, 9]), 5, 6]] = True  # row 1: a choice among three tokens
    with torch.no_grad():
        logp, ent = token_logprobs_and_entropy(
            small_model, ids, attn, resp, allowed, 0.7, chunk_elements=chunk_elements, entropy=True
        )
        logits = small_model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.7
    # the same log-probs as the plain path (not bit for bit: with and without grad the CPU may pick other kernels)
    plain = token_logprobs(small_model, ids, attn, resp, allowed, 0.7).detach()
    assert ent is not None and (logp - plain).abs().max() < 1e-5 and torch.equal(logp == 0, plain == 0)
    want = torch.distributions.Categorical(logits=logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))).entropy()
    want = torch.nn.functional.pad(torch.where(resp[:, 1:] > 0, want, torch.zeros_like(want)), (1, 0))
    assert (ent - want).abs().max() < 1e-4 and torch.equal(ent == 0, resp == 0)
    assert 0 < float(ent[1, 9]) <= math.log(3) + 1e-6 < float(ent[0, 5:].min())  # three choices, not 300 tokens
    # under grad the entropy carries Categorical's gradient (the loss's entropy bonus trains on it)
    grads = []
    for ours in (True, False):
        small_model.zero_grad()
        if ours:
            _, h = token_logprobs_and_entropy(
                small_model, ids, attn, resp, allowed, 0.7, chunk_elements=chunk_elements, entropy=True
            )
            assert h is not None and h.requires_grad and (h.detach() - ent).abs().max() < 1e-5
            h.sum().backward()
        else:
            logits = small_model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.7
            h = torch.distributions.Categorical(logits=logits.masked_fill(~allowed.unsqueeze(1), float("-inf")))
            (h.entropy() * resp[:, 1:]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in small_model.parameters() if p.grad is not None]))
    assert torch.isfinite(grads[0]).all() and float(grads[0].norm()) > 1e-3
    assert float((grads[0] - grads[1]).abs().max()) < 1e-4


def test_a_row_without_response_tokens_still_reaches_every_parameter(small_model) -> None:
    ids = torch.randint(0, 300, (1, 6))
    out = token_logprobs(small_model, ids, torch.ones_like(ids), torch.zeros_like(ids), None)
    small_model.zero_grad()
    out.sum().backward()  # a padding row of a data-parallel rank: a graph, zero gradients
    assert all(p.grad is not None and not p.grad.any() for p in small_model.parameters())


def test_safetensors_written_in_one_pass_load_back_and_match_their_manifest(tmp_path: Path) -> None:
    shared = torch.randn(4, 3)
    tensors = {
        "a": torch.randn(5, 7),
        "b": torch.arange(6, dtype=torch.int64),
        "c": torch.randn(3).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "tied1": shared,
        "tied2": shared,
    }
    info = tensorfiles.write_safetensors(tmp_path / "x.safetensors", list(tensors.items()))
    loaded = load_file(tmp_path / "x.safetensors")
    assert set(loaded) == set(tensors)
    assert all(loaded[k].dtype == t.dtype and torch.equal(loaded[k], t) for k, t in tensors.items())
    from coevo.weights.manifest import file_sha256

    assert info == {
        "bytes": (tmp_path / "x.safetensors").stat().st_size,
        "sha256": file_sha256(tmp_path / "x.safetensors"),
    }
    # above the shard size: shards written in parallel, with the index transformers reads
    files = tensorfiles.write_weights(
        tmp_path, {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, shard_bytes=64 * 64 * 4
    )
    assert sorted(files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def test_followers_verify_the_manifest_and_sizes_and_re_hash_only_when_asked(tmp_path: Path, tiny: Path) -> None:
    lane = Lane("policy", tiny, tmp_path, LearnerConfig(), device="cpu")
    path, digest, _ = lane.publish()
    assert verify(path, digest) is None and verify(path, digest, full=True) is None
    assert "does not match the announced digest" in verify(path, "0" * 64)
    weights = path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # same size, other bytes: only the full re-hash notices
    weights.write_bytes(bytes(raw))
    assert verify(path, digest) is None
    assert "does not match its sha256" in verify(path, digest, full=True)
    weights.write_bytes(bytes(raw[:-8]))  # truncated: the size check catches it without reading
    assert "bytes, the manifest says" in verify(path, digest)
    (path / "config.json").unlink()
    assert "missing" in verify(path, digest)
    assert verify(tmp_path / "nowhere", digest) == f"no weights at {tmp_path / 'nowhere'}"


def test_published_weights_are_the_serving_dtype_only_and_held_in_memory(tmp_path: Path, tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    samples = choice_samples(tiny, 8)
    lane = Lane("policy", tiny, tmp_path, LearnerConfig(lr=1e-2, publish_dtype="bfloat16"), device="cpu")
    lane.step(samples, ["g1"])
    path, digest, size = lane.publish()
    params = sum(p.numel() for p in lane.model.parameters())
    tensor_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # the tiny model ties its head: the explicit lm_head vLLM's reload needs is one embedding more
    head = lane.model.get_output_embeddings().weight.numel()
    assert tensor_bytes <= 1.01 * (params + head) * 2 and size <= tensor_bytes + 200_000  # + config, tokenizer
    assert not (path / "optimizer.pt").exists() and not list(tmp_path.glob("policy/v0*"))  # no resume checkpoint
    assert manifest_of(path)["digest"] == digest
    held = HELD.get(path, digest)
    assert held is not None and all(t.dtype == torch.bfloat16 for t in held.values() if t.is_floating_point())
    state = lane.model.state_dict()
    assert all(torch.equal(held[k], v.to(torch.bfloat16)) for k, v in state.items())
    reloaded = AutoModelForCausalLM.from_pretrained(path)  # a directory servers load: config, tokenizer, weights
    assert (path / "tokenizer.json").exists()
    assert torch.equal(
        reloaded.state_dict()["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16).float()
    )
    lane.step(samples, ["g2"])
    assert torch.equal(HELD.get(path, digest)["model.norm.weight"], held["model.norm.weight"])  # immutable copy
    assert HELD.get(path, "f" * 64) is None


def test_a_local_engine_takes_published_tensors_from_memory_like_from_disk(tmp_path: Path, tiny: Path) -> None:
    samples = choice_samples(tiny, 8)
    lane = Lane("policy", tiny, tmp_path, LearnerConfig(lr=5e-2), device="cpu")
    lane.step(samples, ["g1"])
    path, digest, _ = lane.publish()

    async def go() -> tuple[list[float], list[float]]:
        async with LocalEngine(tiny, seed=3) as a, LocalEngine(tiny, seed=3) as b:
            await a.swap_tensors(HELD.get(path, digest), 1)
            await b.swap_weights(path, 1)
            prompt = "goal: take the coin."
            ca, cb = await a.complete(prompt, choices=["1", "2"]), await b.complete(prompt, choices=["1", "2"])
            assert a.version == b.version == 1 and ca.model_version == 1
            return ca.logprobs, cb.logprobs

    in_memory, from_disk = asyncio.run(go())
    assert in_memory == from_disk


def test_a_checkpoint_snapshots_between_steps_and_training_goes_on(tmp_path: Path, tiny: Path) -> None:
    samples = choice_samples(tiny, 8)
    lane = Lane("policy", tiny, tmp_path, LearnerConfig(lr=1e-2), device="cpu")
    lane.step(samples, ["g1"])
    at_v1 = {k: v.clone() for k, v in lane.model.state_dict().items()}
    assert not lane.is_durable("g1") and lane.has_consumed("g1")
    written = lane.begin_checkpoint()
    metrics = lane.step(samples, ["g2"])  # trains while the checkpoint is written
    ckpt = written.result()
    lane.wait_checkpoint()
    assert metrics.version == 2 and ckpt.version == 1 and ckpt.consumed == ("g1",)
    assert lane.is_durable("g1") and not lane.is_durable("g2")
    assert latest_checkpoint(tmp_path / "policy") == ckpt.path and (ckpt.path / "optimizer.pt").exists()
    assert verify(ckpt.path, ckpt.digest, full=True) is None
    resumed = Lane("policy", tiny, tmp_path, LearnerConfig(lr=1e-2), device="cpu")
    assert resumed.version == 1 and resumed.is_durable("g1") and not resumed.has_consumed("g2")
    assert all(torch.equal(v, at_v1[k]) for k, v in resumed.model.state_dict().items())  # the state at begin
    # the restored optimizer continues exactly like the original one did from version 1
    again = resumed.step(samples, ["g2"])
    assert again.version == 2
    assert all(torch.allclose(v, lane.model.state_dict()[k], atol=1e-6) for k, v in resumed.model.state_dict().items())
    lane.close()
    resumed.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from coevo.inference.models import ensure_default_model

    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))
