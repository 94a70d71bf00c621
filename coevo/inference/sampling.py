"""The distribution a token is sampled from, stated whole on every request and computed alike by
the learner.

Invariant: every request coevo sends to vLLM states every parameter its sampler reads
(``request_fields``): a model's ``generation_config.json`` (instruct models ship top_k, top_p,
repetition penalties) never fills one in, and penalties are neutral. The truncations coevo
configures (``policy.sampling``, ``judge.sampling``) are applied by the in-process engine when it
samples and by the learner when it computes log-probs (``truncate``), in vLLM's order: temperature,
then min_p, then top_k, then top_p. So the behaviour log-probs a server returns (with
``--logprobs-mode processed_logprobs``) and the learner's are of one distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coevo.config import SamplingConfig

if TYPE_CHECKING:
    import torch

NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}
"""what coevo never applies: the learner does not compute penalties, so no request may ask for them"""


def request_fields(sampling: SamplingConfig, temperature: float) -> dict[str, Any]:
    """Every sampling field of a vLLM completions request (top_k 0: off)."""
    return {
        "temperature": temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        **NEUTRAL,
    }


def truncate(logits: torch.Tensor, sampling: SamplingConfig, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` (already divided by the temperature, [rows, vocab]) with every token the sampler
    would not consider at -inf, as vLLM's sampler masks them. ``keep`` ([rows] token ids) is never
    masked: a token that was sampled stays possible when rounding puts it just past a cut."""
    import torch

    if sampling.is_neutral:
        return logits
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if sampling.min_p > 0:
        probs = torch.softmax(logits, -1)
        drop |= probs < sampling.min_p * probs.max(-1, keepdim=True).values
    masked = logits.masked_fill(drop, float("-inf"))
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = masked.topk(sampling.top_k, -1).values[..., -1:]
        drop |= masked < kth
        masked = logits.masked_fill(drop, float("-inf"))
    if sampling.top_p < 1.0:
        ascending, order = masked.sort(-1)
        cumulative = torch.softmax(ascending, -1).cumsum(-1)
        cut = cumulative <= 1 - sampling.top_p
        cut[..., -1] = False  # at least one token
        drop |= torch.zeros_like(drop).scatter(-1, order, cut)
    if keep is not None:
        drop = drop.scatter(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, float("-inf"))
