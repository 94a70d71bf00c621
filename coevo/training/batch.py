"""Turning training samples into padded tensors, and batches into token-bounded micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coevo.schemas import TrainingSample


def pack_by_tokens(samples: Sequence[TrainingSample], max_tokens: int) -> list[list[TrainingSample]]:
    """Consecutive micro-batches whose padded size (rows × longest row) stays within ``max_tokens``
    (a single longer sample gets a micro-batch of its own)."""
    out: list[list[TrainingSample]] = []
    current: list[TrainingSample] = []
    longest = 0
    for s in samples:
        n = len(s.prompt_token_ids) + len(s.response_token_ids)
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            out.append(current)
            current, longest = [], 0
        current.append(s)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


@dataclass
class Tensors:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    allowed: torch.Tensor | None
    versions: list[int]

    def to(self, device: str | torch.device) -> Tensors:
        return Tensors(self.input_ids.to(device), self.attention_mask.to(device), self.response_mask.to(device),
                       self.behav_logp.to(device), self.advantages.to(device),
                       None if self.allowed is None else self.allowed.to(device), self.versions)


def to_tensors(samples: Sequence[TrainingSample], vocab_size: int, pad_id: int = 0) -> Tensors:
    width = max(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    resp = torch.zeros((n, width), dtype=torch.long)
    behav = torch.zeros((n, width), dtype=torch.float32)
    allowed = None
    if any(s.allowed_token_ids for s in samples):
        allowed = torch.ones((n, vocab_size), dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = list(s.prompt_token_ids) + list(s.response_token_ids)
        p, r = len(s.prompt_token_ids), len(s.response_token_ids)
        if len(s.logprobs) != r:
            raise ValueError(f"sample {s.sample_id}: {len(s.logprobs)} log-probs for {r} response tokens")
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        resp[i, p: p + r] = 1
        behav[i, p: p + r] = torch.tensor(s.logprobs)
        if allowed is not None and s.allowed_token_ids:
            allowed[i] = False
            allowed[i, s.allowed_token_ids] = True
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return Tensors(ids, attn, resp, behav, adv, allowed, [s.model_version for s in samples])
