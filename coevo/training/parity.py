"""Sampling parity at start: does each vLLM server the learner trains for sample the distribution
the learner computes?

A server applies what a request leaves out from the model's ``generation_config.json``, may return
raw instead of processed log-probs, may serve another dtype: then every importance ratio the
learner forms is off, silently (an instruct model's defaults gave 0.39 nats per token against
0.003). coevo states every sampling parameter (``coevo.inference.sampling``); this probe checks the
outcome: fresh samples from the server, their behaviour log-probs against the lane's, on the
same weights (the probe is skipped while the server serves another version, and on a sharded
learner, whose ranks would have to run the forward pass together).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

import structlog

from coevo.config import CoevoConfig, VllmEndpoint
from coevo.errors import ConfigError, VLLMError
from coevo.schemas import TrainingSample
from coevo.schemas.events import Role
from coevo.training.lane import Lane

if TYPE_CHECKING:
    from coevo.inference.vllm_client import VLLMClient

log = structlog.get_logger("coevo.parity")

PROMPTS = (
    "The quick brown fox",
    "goal: take the coin. room: hall. items: coin. exits: north attic.",
    "def add(a, b):\n",
    "Once upon a time, in a",
    "1, 2, 3, 4,",
)


def as_sample(
    c: Any, sample_id: str, role: Role, *, grammar: str | None = None, advantage: float = 0.0
) -> TrainingSample:
    """A completion as a training sample: its tokens and the sampler's log-probs, at the version that
    sampled it, among the tokens it could choose (a constrained choice) and drawn under ``grammar``
    when it was (structured outputs)."""
    return TrainingSample(
        sample_id=sample_id,
        role=role,
        prompt_token_ids=c.prompt_token_ids,
        response_token_ids=c.response_token_ids,
        logprobs=c.logprobs,
        allowed_token_ids=c.allowed_token_ids,
        grammar=grammar,
        advantage=advantage,
        model_version=c.model_version,
        step_event_id=sample_id,
    )


async def fresh_samples(client: Any, lane: Lane, *, rollouts: int = 20, max_tokens: int = 16) -> list[TrainingSample]:
    """``rollouts`` fresh completions of the probe prompts at the lane's temperature, as samples
    (advantage 0) with the server's behaviour log-probs."""
    done = await asyncio.gather(
        *(
            client.complete(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=lane.temperature, index=i)
            for i in range(rollouts)
        )
    )
    return [as_sample(c, f"probe-{i}", lane.role) for i, c in enumerate(done) if c.response_token_ids]


async def probe(client: Any, lane: Lane, *, rollouts: int = 20, max_tokens: int = 16) -> tuple[float, int]:
    """(KL per token from the server's sampling to the lane's, tokens compared) on fresh samples."""
    samples = await fresh_samples(client, lane, rollouts=rollouts, max_tokens=max_tokens)
    if not samples:
        return 0.0, 0
    return await asyncio.to_thread(lane.mismatch_kl, samples), sum(len(s.response_token_ids) for s in samples)


def served_version(raw: str) -> int | None:
    """The version a server reports as one of the learner's: none set yet (vLLM says "default") is
    the base weights (0); one that is not a number was set by someone else (None: not comparable)."""
    if raw in ("", "None", "default"):
        return 0
    return int(raw) if raw.isdigit() else None


def served_roles(cfg: CoevoConfig) -> dict[str, str]:
    """The lanes whose weights a vLLM server serves: role -> URL."""
    out = {"policy": cfg.policy.url} if cfg.policy.url else {}
    if isinstance(cfg.judge, VllmEndpoint):
        out["judge"] = cfg.judge.url
    return out


async def check(cfg: CoevoConfig, lane: Lane) -> float | None:
    """Probe the server of ``lane``'s role (None: none, or not comparable now); ``ConfigError`` when
    it samples another distribution than the lane computes."""
    from coevo.inference.clients import make_client

    bound, url = cfg.learner.parity_max_kl, served_roles(cfg).get(lane.role)
    if bound is None or url is None:
        return None
    if lane.world > 1:
        log.info("parity.skipped", role=lane.role, reason=f"a sharded learner ({lane.world} ranks)")
        return None
    # a role a vLLM server serves (served_roles) gets a VLLMClient
    async with cast("VLLMClient", make_client(cfg, lane.role)) as client:
        served = served_version(await client.weight_version())
        if served != lane.version:
            log.info(
                "parity.skipped",
                role=lane.role,
                reason=f"the server serves version {served} "
                f"(None: not one of this learner's), the learner holds {lane.version}",
            )
            return None
        try:
            kl, tokens = await probe(client, lane)
        except VLLMError as exc:
            if exc.status != 404 or exc.param != "model":  # vLLM: "The model `...` does not exist."
                raise
            field = "policy.served_name" if lane.role == "policy" else "judge.model"
            raise ConfigError(
                f"the {lane.role} server at {url} does not serve model {client.model!r} ({field}): {exc}", field=field
            ) from None
    log.info("parity.probed", role=lane.role, url=url, mismatch_kl=round(kl, 5), tokens=tokens, bound=bound)
    if kl > bound:
        raise ConfigError(
            f"the {lane.role} server at {url} samples another distribution than the learner computes: KL "
            f"{kl:.3f} nats per token on {tokens} fresh tokens, above learner.parity_max_kl = {bound}. What is "
            f"trained would not be what was sampled. Is it applying sampling defaults coevo does not compute "
            f"(coevo states {lane.role}.sampling on every request; start vLLM with --generation-config vllm to "
            f"be sure), returning raw log-probs (start it with --logprobs-mode processed_logprobs), or serving "
            f"another dtype or model than {lane.base_model}?",
            field="learner.parity_max_kl",
        )
    return kl
