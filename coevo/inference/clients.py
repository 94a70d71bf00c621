"""Which inference client an agent uses, from config: local engine (default) or a vLLM server."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from coevo.config import (
    CoevoConfig,
    ComputeDtype,
    LitellmEndpoint,
    LLMRewriterConfig,
    LocalJudge,
    LocalRewriter,
    SamplingConfig,
    VllmEndpoint,
)
from coevo.inference.engine import InferenceClient, LocalEngine


def cache_dir(cfg: CoevoConfig) -> Path:
    from coevo.envs.textworld_env import default_cache_dir

    return Path(cfg.env.cache_dir) if cfg.env.cache_dir else default_cache_dir()


def model_dir(cfg: CoevoConfig, role: Literal["policy", "judge"]) -> Path:
    """The configured local model directory of ``role`` (a GGUF file or a shipped model's short name
    converted once, ``coevo.inference.gguf``), or the tiny default (built on first use)."""
    from coevo.inference.gguf import resolve_model
    from coevo.inference.models import ensure_default_model

    configured = cfg.policy.model if role == "policy" else cfg.judge.model
    if configured:
        return resolve_model(configured, cache_dir(cfg), flag=f"{role}.model")
    return ensure_default_model(role, cache_dir(cfg), seed=cfg.run.seed)


def make_client(cfg: CoevoConfig, role: Literal["policy", "judge", "rewriter"], *, seed: int = 0) -> InferenceClient:
    """The client ``role`` uses, from config; the one place a client is chosen (on the section's tag)."""
    if role == "rewriter":
        rewriter = cfg.tasks.rewriter
        if not isinstance(rewriter, LLMRewriterConfig):
            raise ValueError(f"tasks.rewriter.backend = {rewriter.backend!r} uses no model")
        return endpoint_client(rewriter, "rewriter", dtype=cfg.learner.dtype)
    if role == "policy" and cfg.policy.url:
        from coevo.inference.vllm_client import VLLMClient

        local = model_dir(cfg, "policy")
        return VLLMClient(
            cfg.policy.url,
            cfg.policy.served_name or str(local),
            name="policy",
            tokenizer_dir=local,
            sampling=cfg.policy.sampling,
        )
    if role == "judge" and not isinstance(cfg.judge, LocalJudge):
        return endpoint_client(cfg.judge, "judge", sampling=cfg.judge.sampling)
    return LocalEngine(
        model_dir(cfg, role),
        name=role,
        device=cfg.learner.device,
        seed=seed,
        sampling=cfg.policy.sampling if role == "policy" else cfg.judge.sampling,
        grammar=cfg.policy.grammar,
        dtype=cfg.learner.dtype,
    )


def endpoint_client(
    ep: LitellmEndpoint | VllmEndpoint | LocalRewriter,
    name: str,
    sampling: SamplingConfig | None = None,
    dtype: ComputeDtype = "auto",
) -> InferenceClient:
    """The client of a judge's or rewriter's endpoint section, by its ``backend`` tag (a local model
    served in ``dtype``, ``learner.dtype``)."""
    if isinstance(ep, LitellmEndpoint):
        from coevo.inference.litellm_client import LiteLLMClient

        return LiteLLMClient(ep.model, ep.api, api_base=ep.url, name=name)
    if isinstance(ep, VllmEndpoint):
        from coevo.inference.vllm_client import VLLMClient

        return VLLMClient(ep.url, ep.model or name, name=name, sampling=sampling)
    return LocalEngine(Path(ep.model), name=name, dtype=dtype)
