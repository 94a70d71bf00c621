"""Which inference client an agent uses, from config: local engine (default) or a vLLM server."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from coevo.config import CoevoConfig
from coevo.inference.engine import InferenceClient, LocalEngine


def cache_dir(cfg: CoevoConfig) -> Path:
    from coevo.envs.textworld_env import default_cache_dir

    return Path(cfg.env.cache_dir) if cfg.env.cache_dir else default_cache_dir()


def model_dir(cfg: CoevoConfig, role: Literal["policy", "judge"]) -> Path:
    """The configured local model directory of ``role``, or the tiny default (built on first use)."""
    from coevo.inference.models import ensure_default_model

    configured = cfg.policy.model if role == "policy" else cfg.judge.model
    if configured:
        return Path(configured)
    return ensure_default_model(role, cache_dir(cfg), seed=cfg.run.seed)


def make_client(cfg: CoevoConfig, role: Literal["policy", "judge", "rewriter"], *, seed: int = 0) -> InferenceClient:
    """The client ``role`` uses, from config; the one place a client is chosen."""
    if role == "rewriter":
        return _rewriter_client(cfg)
    if role == "policy" and cfg.policy.url:
        from coevo.inference.vllm_client import VLLMClient

        local = model_dir(cfg, "policy")
        return VLLMClient(cfg.policy.url, cfg.policy.served_name or str(local), name="policy", tokenizer_dir=local,
                          sampling=cfg.policy.sampling)
    if role == "judge" and cfg.judge.backend == "vllm":
        from coevo.inference.vllm_client import VLLMClient

        if not cfg.judge.url:
            raise ValueError("judge.backend = 'vllm' needs judge.url")
        return VLLMClient(cfg.judge.url, cfg.judge.model or "judge", name="judge", sampling=cfg.judge.sampling)
    if role == "judge" and cfg.judge.backend == "litellm":
        from coevo.inference.litellm_client import LiteLLMClient

        assert cfg.judge.model is not None
        return LiteLLMClient(cfg.judge.model, cfg.judge.api, api_base=cfg.judge.url, name="judge")
    return LocalEngine(model_dir(cfg, role), name=role, device=cfg.learner.device, seed=seed,
                       sampling=cfg.policy.sampling if role == "policy" else cfg.judge.sampling)


def _rewriter_client(cfg: CoevoConfig) -> InferenceClient:
    tc = cfg.tasks
    if not tc.llm_model:
        raise ValueError("tasks.llm_model is needed when tasks.rewriter = 'llm'")
    if tc.llm_backend == "litellm":
        from coevo.inference.litellm_client import LiteLLMClient

        return LiteLLMClient(tc.llm_model, tc.api, api_base=tc.llm_url, name="rewriter")
    if tc.llm_backend == "vllm":
        from coevo.inference.vllm_client import VLLMClient

        return VLLMClient(tc.llm_url or "", tc.llm_model, name="rewriter")
    return LocalEngine(Path(tc.llm_model), name="rewriter")
