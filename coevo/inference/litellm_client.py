"""External LLM APIs (OpenAI, Anthropic, Gemini, a gateway, a remote vLLM) through LiteLLM.

Invariants:
- keys come from the environment only; they are handed to LiteLLM and never logged or stored;
- a failed call is retried with jittered exponential backoff (rate limits, timeouts, 5xx); a call
  that still fails raises ``ExternalCallFailed``: callers turn it into an ``error`` vote, never a −1;
- responses are cached in JetStream KV by (model, prompt hash, sampling parameters, vote index), so a
  re-run or a replay does not pay twice; every call records tokens, cost and latency;
- once ``max_usd`` has been spent no further call is made (``OverBudget``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from typing import Any

from coevo.config import ApiConfig
from coevo.errors import ExternalCallFailed, OverBudget
from coevo.inference.engine import Completion

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download at import

RETRYABLE = (
    "RateLimitError",
    "Timeout",
    "APIConnectionError",
    "ServiceUnavailableError",
    "InternalServerError",
    "APIError",
)


def provider_keys_missing(model: str, api_base: str | None = None) -> list[str]:
    """The environment variables LiteLLM reads for ``model``'s provider when none of them is set (any
    one of several will do); an ``*_API_BASE`` variable does not count when ``api_base`` is given."""
    import litellm

    found = litellm.validate_environment(model=model)
    if found.get("keys_in_environment"):
        return []
    return [k for k in found.get("missing_keys", []) if not (api_base and k.endswith("_API_BASE"))]


class LiteLLMClient:
    """One model (with fallbacks) behind a LiteLLM Router; no token ids, version 0 (not trained)."""

    def __init__(self, model: str, api: ApiConfig, *, api_base: str | None = None, name: str = "litellm") -> None:
        import litellm
        from litellm import Router

        litellm.suppress_debug_info = True
        self.name = name
        self.model = model
        self.api = api
        self.version = 0
        self._sem = asyncio.Semaphore(api.max_concurrency)
        self._cache: Any = None
        self.spent_usd = 0.0
        self.calls = self.errors = self.cache_hits = 0
        self._attempts = 0
        deployments = []
        for i, m in enumerate([model, *api.fallbacks]):
            params: dict[str, Any] = {"model": m}
            if api_base and i == 0:
                params["api_base"] = api_base
            if api.api_key_env:
                key = os.environ.get(api.api_key_env)
                if not key:
                    raise ExternalCallFailed(model, f"environment variable {api.api_key_env} is not set")
                params["api_key"] = key
            if api.rpm:
                params["rpm"] = api.rpm
            if api.tpm:
                params["tpm"] = api.tpm
            deployments.append({"model_name": f"m{i}", "litellm_params": params})
        fallbacks = [{"m0": [f"m{i}" for i in range(1, len(deployments))]}] if len(deployments) > 1 else []
        # retries are ours (deterministic, jittered, observable); the router gives fallbacks and limits
        self.router = Router(model_list=deployments, fallbacks=fallbacks, num_retries=0, timeout=api.timeout_s)

    async def __aenter__(self) -> LiteLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        return None

    def attach_cache(self, kv: Any) -> None:
        self._cache = kv if self.api.cache else None

    def cache_key(self, prompt: str, max_tokens: int, temperature: float, index: int) -> str:
        blob = json.dumps(
            {
                "model": self.model,
                "prompt": hashlib.sha256(prompt.encode()).hexdigest(),
                "max_tokens": max_tokens,
                "temperature": temperature,
                "index": index,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    async def _cached(self, key: str) -> dict[str, Any] | None:
        if self._cache is None:
            return None
        try:
            entry = await self._cache.get(key)  # None: not cached
        except Exception:  # the bucket is unreachable: the call is made (the cache is an optimisation)
            return None
        return json.loads(entry) if entry else None

    def _mock(self) -> Any:
        """Offline testing: the n-th attempt of this client gets the n-th mock (the last one repeats)."""
        m = self.api.mock_response
        self._attempts += 1
        if isinstance(m, list):
            return m[min(self._attempts - 1, len(m) - 1)] if m else None
        return m

    def supports_schema(self) -> bool:
        import litellm

        try:
            return bool(litellm.supports_response_schema(model=self.model))
        except Exception:  # unknown to LiteLLM's model map: validate the JSON ourselves
            return False

    async def complete(
        self,
        prompt: str,
        *,
        choices: list[str] | None = None,
        max_tokens: int = 256,
        temperature: float = 1.0,
        index: int = 0,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        response_format: Any = None,
        grammar: str | None = None,
    ) -> Completion:
        # stop: not sent (the text is the caller's to cut at every stop string, as InferenceClient says)
        if grammar is not None:
            raise ExternalCallFailed(self.model, "a grammar needs a local model or a vLLM server (use response_format)")
        if choices:
            raise ExternalCallFailed(self.model, "constrained choices need a local model (use a reasoned prompt)")
        if prompt_ids is not None:
            raise ExternalCallFailed(self.model, "token-in prompts (prompt_ids) need a local model or a vLLM server")
        key = self.cache_key(prompt, max_tokens, temperature, index)
        hit = await self._cached(key)
        if hit is not None:
            self.cache_hits += 1
            return Completion(
                hit["text"],
                [],
                [],
                [],
                0,
                latency_ms=0.0,
                cost_usd=0.0,
                cached=True,
                prompt_tokens=hit.get("prompt_tokens", 0),
                completion_tokens=hit.get("completion_tokens", 0),
            )
        async with self._sem:  # checked inside: at most max_concurrency calls can overshoot the cap
            if self.api.max_usd is not None and self.spent_usd >= self.api.max_usd:
                raise OverBudget(self.model, f"spent ${self.spent_usd:.4f} of max_usd ${self.api.max_usd}")
            fmt = response_format if response_format is not None and self.supports_schema() else None
            response, latency = await self._call(prompt, max_tokens, temperature, fmt)
            cost = self._cost(response)
            self.spent_usd += cost
        text = response.choices[0].message.content or ""
        usage = getattr(response, "usage", None)
        pt, ct = int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0)
        self.calls += 1
        if self._cache is not None:
            await self._cache.put(
                key, json.dumps({"text": text, "prompt_tokens": pt, "completion_tokens": ct}).encode()
            )
        return Completion(
            text, [], [], [], 0, latency_ms=latency, cost_usd=cost, prompt_tokens=pt, completion_tokens=ct
        )

    async def _call(
        self, prompt: str, max_tokens: int, temperature: float, response_format: Any = None
    ) -> tuple[Any, float]:
        last = "no attempt"
        for attempt in range(self.api.retries + 1):
            kwargs: dict[str, Any] = {
                "model": "m0",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "timeout": self.api.timeout_s,
            }
            if response_format is not None:
                kwargs["response_format"] = response_format
            mock = self._mock()
            if mock is not None:
                kwargs["mock_response"] = mock
                if self.api.mock_delay_s is not None:
                    kwargs["mock_delay"] = self.api.mock_delay_s
            t0 = time.perf_counter()
            try:
                response = await self.router.acompletion(**kwargs)
                return response, (time.perf_counter() - t0) * 1e3
            except Exception as exc:
                name = type(exc).__name__
                last = f"{name}: {str(exc)[:200]}"
                if not any(r in name for r in RETRYABLE) or attempt == self.api.retries:
                    break
                delay = self.api.backoff_s * 2**attempt
                await asyncio.sleep(delay * (0.5 + random.random()))
        self.errors += 1
        raise ExternalCallFailed(self.model, last)

    @staticmethod
    def _cost(response: Any) -> float:
        import litellm

        try:
            return float(litellm.completion_cost(completion_response=response) or 0.0)
        except Exception:  # unknown model in the price map: the call happened, its price is unknown
            return 0.0
