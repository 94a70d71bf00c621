"""Turning training samples into padded tensors, and batches into minibatches (one optimiser step
each) and token-bounded micro-batches; the learner's staleness bound.

Every function here is deterministic in its arguments: under data parallel every rank gets the same
batch and the same lane version, so every rank plans the same minibatches and the same number of
micro-batches per minibatch (``rank_plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def padding_row(like: TrainingSample) -> TrainingSample:
    """A row that runs through the model but weighs nothing: no response tokens, advantage 0."""
    return like.model_copy(
        update={"sample_id": f"pad-{like.sample_id}", "response_token_ids": [], "logprobs": [], "advantage": 0.0}
    )


def rank_plan(samples: Sequence[TrainingSample], rank: int, world: int, max_tokens: int) -> list[list[TrainingSample]]:
    """This rank's micro-batches of a batch that every rank plans identically.

    The batch is packed once (``pack_by_tokens``) and each micro-batch's rows are dealt round-robin
    over the ranks; a rank left without a row gets one ``padding_row``. So every rank runs the same
    number of micro-batches, hence the same collectives, whatever the batch (fewer samples than
    ranks, uneven micro-batches): data parallel never hangs on the plan."""
    return [mb[rank::world] or [padding_row(mb[0])] for mb in pack_by_tokens(samples, max_tokens)]


def staleness(s: TrainingSample, version: int) -> int:
    """Versions ``s`` lags behind a lane at ``version`` (the version being trained from)."""
    return version - s.model_version


def split_stale(
    samples: Sequence[TrainingSample], version: int, max_staleness: int
) -> tuple[list[TrainingSample], list[TrainingSample]]:
    """(fresh, stale): stale samples lag more than ``max_staleness`` versions behind ``version``."""
    fresh = [s for s in samples if staleness(s, version) <= max_staleness]
    return fresh, [s for s in samples if staleness(s, version) > max_staleness]


def minibatches(samples: Sequence[TrainingSample], count: int, seed: int) -> list[list[TrainingSample]]:
    """The batch split into ``count`` minibatches of near-equal size (fewer if there are fewer
    samples): with ``count`` > 1 the samples are shuffled first, deterministically in ``seed``, so
    a minibatch mixes groups; ``count`` = 1 keeps the batch whole and in order."""
    import random

    order = list(samples)
    if count > 1:
        random.Random(seed).shuffle(order)
    n = min(count, len(order))
    if n <= 1:
        return [order] if order else []
    size, extra = divmod(len(order), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(order[start:end])
        start = end
    return out


def sample_problem(s: TrainingSample, vocab_size: int, max_positions: int) -> str | None:
    """Why ``s`` cannot be trained on (None: it can). Checked per sample, so one bad sample is
    rejected alone instead of failing the batch it would be packed into."""
    if not s.response_token_ids:
        return "no response tokens"
    if len(s.logprobs) != len(s.response_token_ids):
        return f"{len(s.logprobs)} log-probs for {len(s.response_token_ids)} response tokens"
    if len(s.prompt_token_ids) + len(s.response_token_ids) > max_positions:
        return f"{len(s.prompt_token_ids) + len(s.response_token_ids)} tokens exceed the model's {max_positions}"
    ids = [*s.prompt_token_ids, *s.response_token_ids, *(s.allowed_token_ids or [])]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"token id {bad} outside the vocabulary (0..{vocab_size - 1})"
    if not finite32([s.advantage]):
        return f"advantage {s.advantage!r} is not finite in float32"
    if not finite32(s.logprobs):
        return "a log-prob is not finite in float32"
    return None


def finite32(values: Sequence[float]) -> bool:
    """Whether every value stays finite as the float32 the loss computes with (1e39 is finite as a
    Python float and ``inf`` in float32)."""
    return bool(torch.isfinite(torch.tensor(list(values), dtype=torch.float32)).all()) if len(values) else True


@dataclass
class PositionMasks:
    """Per-position allowed tokens of the rows sampled under a grammar: each row's masks replayed
    over its sampled tokens (``coevo.inference.grammar``), packed 32 tokens to an int32 until used."""

    packed: dict[int, torch.Tensor]
    """row -> [response tokens, ceil(vocab/32)] int32"""
    starts: dict[int, int]
    """row -> the column of its first response token"""

    def restrict(
        self, rows: torch.Tensor, cols: torch.Tensor, allowed: torch.Tensor | None, vocab: int
    ) -> torch.Tensor:
        """``allowed`` ([k, vocab] bool, or everything) narrowed, for the positions (``rows``, ``cols``:
        column ``cols`` predicts token ``cols + 1``) of grammar rows, to what their grammar allowed."""
        from coevo.inference.grammar import unpack

        out = allowed.clone() if allowed is not None else torch.ones((len(rows), vocab), dtype=torch.bool)
        out = out.to(rows.device)
        for row, packed in self.packed.items():
            sel = (rows == row).nonzero(as_tuple=True)[0]
            if sel.numel():
                at = (cols[sel] + 1 - self.starts[row]).to(packed.device)
                out[sel] &= unpack(packed[at], vocab).to(out.device)
        return out

    def to(self, device: str | torch.device) -> PositionMasks:
        return PositionMasks({r: p.to(device) for r, p in self.packed.items()}, self.starts)


@dataclass
class Tensors:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    allowed: torch.Tensor | None
    versions: list[int]
    positions: PositionMasks | None = None

    def to(self, device: str | torch.device) -> Tensors:
        return Tensors(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.response_mask.to(device),
            self.behav_logp.to(device),
            self.advantages.to(device),
            None if self.allowed is None else self.allowed.to(device),
            self.versions,
            None if self.positions is None else self.positions.to(device),
        )


def to_tensors(
    samples: Sequence[TrainingSample],
    vocab_size: int,
    pad_id: int = 0,
    masks: Callable[[TrainingSample], torch.Tensor] | None = None,
) -> Tensors:
    """The samples as padded tensors; ``masks(sample)`` gives a grammar sample's packed per-position
    masks (the lane's replay), required when a sample carries a grammar."""
    width = max(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    resp = torch.zeros((n, width), dtype=torch.long)
    behav = torch.zeros((n, width), dtype=torch.float32)
    allowed = None
    positions = PositionMasks({}, {})
    if any(s.allowed_token_ids for s in samples):
        allowed = torch.ones((n, vocab_size), dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = list(s.prompt_token_ids) + list(s.response_token_ids)
        p, r = len(s.prompt_token_ids), len(s.response_token_ids)
        if len(s.logprobs) != r:
            raise ValueError(f"sample {s.sample_id}: {len(s.logprobs)} log-probs for {r} response tokens")
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        resp[i, p : p + r] = 1
        behav[i, p : p + r] = torch.tensor(list(s.logprobs))  # arrays or lists: plain numbers for torch
        if allowed is not None and s.allowed_token_ids:
            allowed[i] = False
            allowed[i, list(s.allowed_token_ids)] = True
        if s.grammar is not None:
            if masks is None:
                raise ValueError(f"sample {s.sample_id} was sampled under a grammar: its masks are needed")
            positions.packed[i], positions.starts[i] = masks(s), p
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return Tensors(
        ids,
        attn,
        resp,
        behav,
        adv,
        allowed,
        [s.model_version for s in samples],
        positions if positions.packed else None,
    )
