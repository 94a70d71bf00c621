"""The policy-gradient loss shared by both lanes (ALGORITHM.md §3), with off-policy correction.

Per response token t of a sample with advantage A:
    r_t   = exp(logπ_θ − logπ_prox)                         (π_prox: the learner before this step)
    w_t   = exp(logπ_prox − logπ_behav)                      (π_behav: the sampler, recorded)
            truncated at ``tis_cap`` ("tis"), or capped at a large bound ("decoupled")
    pg_t  = −w_t · min(r_t·A, clip(r_t, 1−ε, 1+ε)·A)
    kl_t  = exp(−d) − 1 + d,  d = logπ_θ − logπ_prox         (k3, weighted by β)
loss = mean over samples of (token-mean of pg_t + β·kl_t).

When the sampler and the learner agree (zero staleness, identical log-probs) every w_t is 1 and
the loss is plain PPO: the correction is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DECOUPLED_CAP = 100.0


@dataclass(frozen=True)
class LossOut:
    loss: torch.Tensor
    kl: float
    clip_fraction: float
    mismatch_kl: float
    """k3 estimate of KL(sampler ‖ learner before the step) per token."""
    mean_is_weight: float


def ppo_loss(new_logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, clip_eps: float = 0.2, kl_beta: float = 0.01,
             correction: Literal["tis", "decoupled", "none"] = "tis", tis_cap: float = 2.0) -> LossOut:
    """All tensors are [batch, tokens] except ``advantages`` [batch]; ``mask`` marks response tokens."""
    mask = mask.to(new_logp.dtype)
    adv = advantages.to(new_logp.dtype).unsqueeze(-1)
    ratio = torch.exp(new_logp - prox_logp)
    if correction == "none":
        weight = torch.ones_like(ratio)
    else:
        cap = tis_cap if correction == "tis" else DECOUPLED_CAP
        weight = torch.exp(prox_logp - behav_logp).clamp(max=cap).detach()
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    pg = -weight * torch.minimum(unclipped, clipped)
    d = new_logp - prox_logp
    kl = torch.exp(-d) - 1 + d
    per_token = pg + kl_beta * kl
    tokens = mask.sum(-1).clamp(min=1)
    per_sample = (per_token * mask).sum(-1) / tokens
    loss = per_sample.mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped_tokens = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).to(mask.dtype) * mask
        return LossOut(
            loss=loss,
            kl=float((kl * mask).sum() / n),
            clip_fraction=float(clipped_tokens.sum() / n),
            mismatch_kl=float((_k3(prox_logp - behav_logp) * mask).sum() / n),
            mean_is_weight=float((weight * mask).sum() / n),
        )


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(sampler || learner) from log(p_learner / p_sampler) on sampled tokens (≥ 0)."""
    return torch.exp(log_ratio) - 1 - log_ratio


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   response_mask: torch.Tensor, allowed: torch.Tensor | None, temperature: float = 1.0) -> torch.Tensor:
    """log π(token_t | prefix) for every position (0 where ``response_mask`` is 0).

    ``allowed`` ([batch, vocab] bool or None per batch) restricts the distribution to the tokens a
    constrained sampler could choose, so the log-probs match what was sampled from.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1, :].float() / max(temperature, 1e-5)
    targets = input_ids[:, 1:]
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    resp = response_mask[:, 1:].to(logp.dtype)
    logp = torch.where(resp > 0, logp, torch.zeros_like(logp))
    return torch.nn.functional.pad(logp, (1, 0))
