"""One trainable model (the policy or the judge): optimiser, version counter and checkpoints.

Invariants:
- ``version`` counts optimiser steps since the initial weights (version 0) and survives restarts;
- a checkpoint is written to a temporary directory, fsynced, renamed into place, then marked
  ``COMPLETE``; only complete checkpoints are ever loaded or published;
- a checkpoint records the groups whose samples it has trained, so a resumed learner never trains
  an acknowledged sample twice.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from coevo.config import LearnerConfig
from coevo.schemas import TrainingSample
from coevo.training.batch import rank_plan, sample_problem, to_tensors
from coevo.training.loss import ppo_loss, token_logprobs

MARKER = "COMPLETE"
KEEP = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json")


@dataclass(frozen=True)
class StepMetrics:
    version: int
    samples: int
    tokens: int
    loss: float
    kl: float
    clip_fraction: float
    mismatch_kl: float
    staleness_histogram: dict[str, int]
    tokens_per_second: float
    grad_norm: float


def latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("v*") if (p / MARKER).exists())
    return done[-1] if done else None


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Lane:
    def __init__(self, role: Literal["policy", "judge"], base_model: Path, ckpt_root: Path, cfg: LearnerConfig,
                 *, temperature: float = 1.0, lr: float | None = None, device: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        from coevo.inference.engine import quiet_transformers

        quiet_transformers()
        self.role = role
        self.cfg = cfg
        self.base_model = Path(base_model)
        self.root = Path(ckpt_root) / role
        self.root.mkdir(parents=True, exist_ok=True)
        self.temperature = temperature
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        resume = latest_checkpoint(self.root)
        self.model = AutoModelForCausalLM.from_pretrained(resume or self.base_model).to(self.device)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.rank, self.world = _rank_world()
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp"
        if self.fsdp:  # FSDP2: every decoder layer, then the root, sharded over the ranks
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer)
            fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr or cfg.lr)
        self.version = 0
        self.consumed: deque[str] = deque(maxlen=100_000)
        self.steps_total = 0
        if resume is not None:
            state = json.loads((resume / "state.json").read_text())
            self.version = state["version"]
            self.consumed.extend(state["consumed_groups"])
            shard = resume / f"optimizer.rank{self.rank}.pt"
            self.optimizer.load_state_dict(torch.load(shard if shard.exists() else resume / "optimizer.pt",
                                                      map_location=self.device))
        self.resumed_from = resume
        self._consumed_set = set(self.consumed)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.vocab = int(self.model.config.vocab_size)

    def has_consumed(self, group_id: str) -> bool:
        return group_id in self._consumed_set

    def sample_problem(self, s: TrainingSample) -> str | None:
        return sample_problem(s, self.vocab, int(getattr(self.model.config, "max_position_embeddings", 1 << 30)))

    def step(self, samples: list[TrainingSample], groups: list[str]) -> StepMetrics:
        """One optimiser step on the batch ``samples`` (all groups at once, the same list on every
        rank: each trains its rows of ``rank_plan``); returns this rank's metrics."""
        t0 = time.perf_counter()
        self.model.train()
        plan = rank_plan(samples, self.rank, self.world, self.cfg.max_batch_tokens)
        micro = [to_tensors(mb, self.vocab, self.pad_id).to(self.device) for mb in plan]
        autocast = torch.autocast("cuda", dtype=torch.bfloat16,
                                  enabled=self.cfg.bf16 and str(self.device).startswith("cuda"))
        with torch.no_grad(), autocast:
            prox = [token_logprobs(self.model, t.input_ids, t.attention_mask, t.response_mask, t.allowed,
                                   self.temperature) for t in micro]
        self.optimizer.zero_grad(set_to_none=True)
        total = len(samples)
        agg: Counter[str] = Counter()
        tokens = 0
        for t, px in zip(micro, prox, strict=True):
            with autocast:
                new = token_logprobs(self.model, t.input_ids, t.attention_mask, t.response_mask, t.allowed,
                                     self.temperature)
            out = ppo_loss(new, px, t.behav_logp, t.advantages, t.response_mask, clip_eps=self.cfg.clip_eps,
                           kl_beta=self.cfg.kl_beta, correction=self.cfg.correction, tis_cap=self.cfg.tis_cap)
            rows, real = t.input_ids.shape[0], int((t.response_mask.sum(-1) > 0).sum())
            # loss is the mean over rows (padding rows add 0): scaled to this rank's share of the global
            # mean, times world because gradients are averaged over ranks
            (out.loss * rows / total * self.world).backward()
            weight = real / total * self.world
            agg["loss"] += float(out.loss.detach()) * rows / max(real, 1) * weight
            agg["kl"] += out.kl * weight
            agg["clip_fraction"] += out.clip_fraction * weight
            agg["mismatch_kl"] += out.mismatch_kl * weight
            tokens += int(t.response_mask.sum()) + int(t.attention_mask.sum())
        self.all_reduce_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.version += 1
        self.steps_total += 1
        for g in groups:
            self.consumed.append(g)
            self._consumed_set.add(g)
        hist = Counter(str(self.version - 1 - s.model_version) for s in samples)
        dt = time.perf_counter() - t0
        return StepMetrics(self.version, total, tokens, agg["loss"], agg["kl"], agg["clip_fraction"],
                           agg["mismatch_kl"], dict(hist), tokens / dt if dt > 0 else 0.0, grad_norm)

    def all_reduce_grads(self) -> None:
        """Data parallel (torchrun, gloo or nccl): average gradients over ranks."""
        import torch.distributed as dist

        if self.world == 1 or self.fsdp:  # FSDP reduce-scatters (averages) gradients itself
            return
        world = dist.get_world_size()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world

    def checkpoint(self) -> tuple[Path, str, int]:
        """Write the current weights, optimiser state and counters atomically; (path, sha256, bytes)."""
        from coevo.inference.checkpoints import checkpoint_sha256

        final = self.root / f"v{self.version:06d}"
        if (final / MARKER).exists():
            return final, checkpoint_sha256(final), _size(final)
        tmp = self.root / f".tmp-v{self.version:06d}"
        if self.world > 1:
            return self._checkpoint_distributed(final, tmp)
        self._write_model(self.model, tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        self._finalize(tmp, final)
        return final, checkpoint_sha256(final), _size(final)

    def _write_model(self, model: Any, tmp: Path) -> None:
        """Weights (with an explicit lm_head for tied models), tokenizer files and counters."""
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        if getattr(model.config, "tie_word_embeddings", False):
            _write_lm_head(tmp)
        for name in TOKENIZER_FILES:
            if (self.base_model / name).exists():
                shutil.copy2(self.base_model / name, tmp / name)
        (tmp / "state.json").write_text(json.dumps({"version": self.version, "role": self.role,
                                                    "consumed_groups": list(self.consumed)}))

    def _finalize(self, tmp: Path, final: Path) -> None:
        """fsync, rename into place, then mark complete; older checkpoints beyond KEEP are removed."""
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        (final / MARKER).write_text(str(self.version))
        _fsync_dir(final)
        self._prune()

    def _checkpoint_distributed(self, final: Path, tmp: Path) -> tuple[Path, str, int]:
        """Every rank takes part: full weights gathered to rank 0, optimizer shards one file per rank."""
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from coevo.inference.checkpoints import checkpoint_sha256

        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
        else:
            full = self.model.state_dict()
        if self.rank == 0:
            plain = AutoModelForCausalLM.from_config(self.model.config)
            plain.load_state_dict(full)
            self._write_model(plain, tmp)
        dist.barrier()
        torch.save(self.optimizer.state_dict(), tmp / f"optimizer.rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            self._finalize(tmp, final)
        dist.barrier()
        return final, checkpoint_sha256(final), _size(final)

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("v*") if (p / MARKER).exists())
        for old in done[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _write_lm_head(path: Path) -> None:
    """Store the tied output head explicitly: vLLM's in-place ``reload_weights`` keeps its own copy of
    ``lm_head`` and would otherwise serve new layers with the old head (transformers ignores it)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(path.glob("*.safetensors")):
        state = load_file(str(f))
        if "model.embed_tokens.weight" in state and "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
            save_file(state, str(f), metadata={"format": "pt"})
            return


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))

