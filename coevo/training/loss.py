"""The policy-gradient loss shared by both lanes (docs/algorithm.md §3), with off-policy correction.

Per response token t of a sample with advantage A:
    r_t   = exp(logπ_θ − logπ_prox)                         (π_prox: the learner before this batch)
    w_t   = exp(logπ_prox − logπ_behav)                      (π_behav: the sampler, recorded)
            truncated at ``tis_cap`` ("tis"), or capped at a large bound ("decoupled"); a per-row
            ``row_cap`` overrides the cap (the lane truncates samples kept beyond ``max_staleness``)
    pg_t  = −w_t · min(r_t·A, clip(r_t, 1−ε, 1+ε)·A)
    kl_t  = exp(−d) − 1 + d,  d = logπ_θ − logπ_ref          (k3, weighted by β)
    H_t   = entropy of the distribution token t was drawn from, under π_θ (with gradient; weighted by η)
loss = mean over samples of (token-mean of pg_t + β·kl_t − η·H_t).

The entropy bonus η (``learner.entropy_coef``, 0 by default) pushes against a policy collapsing onto
one answer, which leaves every group unanimous and the learner without signal.

π_prox is taken once per batch (decoupled PPO): with several minibatches or epochs per batch the
ratio r_t leaves 1 after the first optimiser step and the clip acts. π_ref is the lane's
``learner.kl_reference``: the sampler (behaviour log-probs) or the frozen starting weights; when
``ref_logp`` is not given it is π_prox (a KL that is 0, with no gradient, on a batch's first step).

When the sampler and the learner agree (zero staleness, identical log-probs) every w_t is 1 and
the loss is plain PPO: the correction is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch

from coevo.config import SamplingConfig
from coevo.inference.sampling import truncate

if TYPE_CHECKING:
    from coevo.training.batch import PositionMasks

DECOUPLED_CAP = 100.0


@dataclass(frozen=True)
class LossOut:
    loss: torch.Tensor
    kl: float
    clip_fraction: float
    mismatch_kl: float
    """k3 estimate of KL(sampler ‖ learner before the step) per token."""
    mean_is_weight: float


def ppo_loss(
    new_logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.01,
    correction: Literal["tis", "mis", "decoupled", "none"] = "tis",
    tis_cap: float = 2.0,
    ref_logp: torch.Tensor | None = None,
    row_cap: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> LossOut:
    """All tensors are [batch, tokens] except ``advantages`` and ``row_cap`` [batch]; ``mask`` marks
    response tokens. ``ref_logp``: the KL's reference (default ``prox_logp``); ``row_cap``: the
    importance weight's cap per row (default: by ``correction``); ``entropy``: the per-token entropy
    under the current weights (``token_logprobs_and_entropy``, with gradient), required when
    ``entropy_coef`` > 0; ``clip_eps_high``: the ratio's upper clip is 1 + this (default ``clip_eps``)."""
    if entropy_coef > 0 and entropy is None:
        raise ValueError("an entropy bonus needs the entropy: token_logprobs_and_entropy(..., entropy=True)")
    mask = mask.to(new_logp.dtype)
    adv = advantages.to(new_logp.dtype).unsqueeze(-1)
    ratio = torch.exp(new_logp - prox_logp)
    if correction == "none" and row_cap is None:
        weight = torch.ones_like(ratio)
    else:
        cap: float | torch.Tensor = DECOUPLED_CAP if correction == "decoupled" else tis_cap
        if row_cap is not None:
            cap = row_cap.to(new_logp.dtype).unsqueeze(-1)
        raw = torch.exp(prox_logp - behav_logp).detach()
        # masked: a token the sampler and the learner disagree on by more than the cap teaches nothing
        weight = torch.where(raw <= cap, raw, torch.zeros_like(raw)) if correction == "mis" else raw.clamp(max=cap)
    unclipped = ratio * adv
    high = 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    clipped = ratio.clamp(1 - clip_eps, high) * adv
    pg = -weight * torch.minimum(unclipped, clipped)
    d = new_logp - (prox_logp if ref_logp is None else ref_logp)
    kl = torch.exp(-d) - 1 + d
    per_token = pg + kl_beta * kl
    if entropy_coef > 0 and entropy is not None:
        per_token = per_token - entropy_coef * entropy
    tokens = mask.sum(-1).clamp(min=1)
    per_sample = (per_token * mask).sum(-1) / tokens
    loss = per_sample.mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped_tokens = ((ratio < 1 - clip_eps) | (ratio > high)).to(mask.dtype) * mask
        return LossOut(
            loss=loss,
            kl=float((kl * mask).sum() / n),
            clip_fraction=float(clipped_tokens.sum() / n),
            mismatch_kl=float((_k3(prox_logp - behav_logp) * mask).sum() / n),
            mean_is_weight=float((weight * mask).sum() / n),
        )


def mismatch_kl(new_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(sampler || learner) per response token (k3), from both log-probs of the sampled tokens; in
    float64, where k3 of a difference of 1e-7 is not lost to cancellation (≈ d²/2)."""
    n = mask.double().sum().clamp(min=1)
    return float((_k3(new_logp.double() - behav_logp.double()) * mask.double()).sum() / n)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(sampler || learner) from log(p_learner / p_sampler) on sampled tokens (≥ 0)."""
    return torch.exp(log_ratio) - 1 - log_ratio


LOGPROB_CHUNK_ELEMENTS = 1 << 25
"""positions per chunk × vocabulary: the largest fp32 logits block alive at once (128 MiB)"""


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    allowed: torch.Tensor | None,
    temperature: float = 1.0,
    chunk_elements: int = LOGPROB_CHUNK_ELEMENTS,
    sampling: SamplingConfig | None = None,
    positions: PositionMasks | None = None,
) -> torch.Tensor:
    """log π(token_t | prefix) for every position (0 where ``response_mask`` is 0), [batch, tokens]
    (``token_logprobs_and_entropy``, without the entropy)."""
    logp, _ = token_logprobs_and_entropy(
        model, input_ids, attention_mask, response_mask, allowed, temperature, chunk_elements, sampling, positions
    )
    return logp


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    allowed: torch.Tensor | None,
    temperature: float = 1.0,
    chunk_elements: int = LOGPROB_CHUNK_ELEMENTS,
    sampling: SamplingConfig | None = None,
    positions: PositionMasks | None = None,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(token_t | prefix) for every position (0 where ``response_mask`` is 0), [batch, tokens],
    and with ``entropy`` the entropy (nats) of the distribution each response token was drawn from
    (the same distribution: temperature, allowed tokens, grammar, truncation; tokens it could not
    draw count 0), else None; under grad both carry gradients (the loss's entropy bonus).

    Memory-bounded: the model runs without its output head, the head is applied only at the
    positions that predict a response token, in chunks of ``chunk_elements // vocab`` positions
    (recomputed in the backward pass), so no [batch, tokens, vocab] tensor ever exists.
    ``allowed`` ([batch, vocab] bool or None per batch) restricts the distribution to the tokens a
    constrained sampler could choose, ``positions`` narrows it per position for rows sampled under a
    grammar (the masks replayed over the sampled tokens), and ``sampling`` truncates it as the sampler did (top-k,
    top-p, min-p: ``coevo.inference.sampling``), so the log-probs match what was sampled from.
    """
    from torch.utils.checkpoint import checkpoint

    hidden = _shared_hidden(model, input_ids, attention_mask)
    head = _output_head(model)
    rows, cols = response_mask[:, 1:].nonzero(as_tuple=True)  # position cols predicts token cols + 1
    h = hidden[:, :-1][rows, cols]
    targets = input_ids[:, 1:][rows, cols]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    step = max(1, chunk_elements // max(int(head.weight.shape[0]), 1))
    parts: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    vocab = int(head.weight.shape[0])
    for s in range(0, int(rows.numel()), step):
        mask = None if allowed is None else allowed[rows[s : s + step]]
        if positions is not None:
            mask = positions.restrict(rows[s : s + step], cols[s : s + step], mask, vocab)
        args = (h[s : s + step], head.weight, head.bias, targets[s : s + step], mask, temperature, softcap, sampling)
        lp, ent = (
            checkpoint(_chunk_logprobs, *args, entropy, use_reentrant=False)
            if h.requires_grad
            else _chunk_logprobs(*args, entropy)
        )
        parts.append(lp)
        if ent is not None:
            ents.append(ent)
    logp = _scatter(parts, rows, cols, response_mask, hidden)
    if not parts and hidden.requires_grad:  # no response token (a padding row): every parameter still
        logp = logp + (hidden.sum() + head.weight.sum()) * 0  # gets a (zero) gradient, as every rank must
    return logp, _scatter(ents, rows, cols, response_mask, hidden) if entropy else None


def _scatter(
    parts: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, response_mask: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """Values per predicting position back to [batch, tokens] at the positions of the tokens they predict."""
    values = torch.cat(parts) if parts else like.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(response_mask[:, 1:].shape, dtype=torch.float32, device=like.device)
    return torch.nn.functional.pad(out.index_put((rows, cols), values), (1, 0))


def _chunk_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    allowed: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    sampling: SamplingConfig | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each target's log-prob and, with ``entropy``, the entropy of its distribution (one pass of the head)."""
    logp_all = torch.log_softmax(_chunk_logits(h, weight, bias, targets, allowed, temperature, softcap, sampling), -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logp, None
    plogp = (logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return logp, (-plogp).clamp(min=0.0)  # not -1e-9 from rounding at a one-hot


def _chunk_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    allowed: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    sampling: SamplingConfig | None = None,
) -> torch.Tensor:
    """The logits each target was drawn from: head, softcap, temperature, allowed tokens, truncation."""
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / max(temperature, 1e-5)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if sampling is not None:  # the tokens the sampler could not pick (a mask: no gradient flows through it)
        logits = truncate(logits, sampling, keep=targets)
    return logits


def _output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The causal LM's output head (transformers' ``get_output_embeddings``, reached through any wrapper)."""
    return cast(Callable[[], torch.nn.Linear], model.get_output_embeddings)()


def _shared_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``_final_hidden`` with each distinct row run once: the samples of a group's rollouts at one state
    (the same prompt and the same choice) are equal rows; their hidden states are computed once and
    indexed out to every row, so the backward pass sums their gradients as separate rows would."""
    rows = torch.cat([input_ids, attention_mask], dim=-1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if distinct.shape[0] == rows.shape[0]:
        return _final_hidden(model, input_ids, attention_mask)
    width = input_ids.shape[1]
    return _final_hidden(model, distinct[:, :width], distinct[:, width:])[inverse]


def _final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The hidden states the output head would see, [batch, tokens, hidden]: the model runs whole
    (so FSDP and any wrapping stay in charge) while a pre-hook hands its head an empty slice."""
    box: dict[str, torch.Tensor] = {}

    def grab(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        box["hidden"] = args[0]
        return (args[0][:, :0], *args[1:])

    handle = _output_head(model).register_forward_pre_hook(grab)
    try:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    return box["hidden"]
