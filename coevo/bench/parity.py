"""``coevo bench parity``: is what the learner trains what vLLM sampled, on a model that ships
instruct-style sampling defaults (#23)?

The tiny policy is served twice by a real vLLM: as built, and with a ``generation_config.json`` of
instruct-style defaults (top_k, top_p, repetition penalty, temperature), which vLLM applies to
whatever a request leaves out. For each, the KL per token from the server's sampling to the
learner's log-probs on fresh samples (``coevo.training.parity.probe``): requests as coevo sent them
before (the temperature alone) and as it sends them now (every field stated), neutral and with a
configured truncation that the learner applies too. And under a grammar (structured outputs, #38):
samples vLLM drew under a forced tool call, against the learner with and without the replayed masks,
and what the masks cost a learner step.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from coevo.inference.engine import Completion
from coevo.inference.vllm_client import VLLMClient

INSTRUCT_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 5, "top_p": 0.7, "repetition_penalty": 1.5}
"""as published instruct models ship them (the values vary; the kinds are these)"""

TRUNCATION = {"top_k": 5, "top_p": 0.7}

log = structlog.get_logger("coevo.bench.parity")


class UnstatedClient(VLLMClient):
    """The request coevo sent before: the temperature alone (the server fills in the rest from
    ``generation_config.json``). For measuring what that did, never for sampling."""

    async def complete(self, prompt: str, *, max_tokens: int = 64, temperature: float = 1.0, **_: object) -> Completion:
        ids = self.encode(prompt)
        data = await self._call(
            "POST",
            "/v1/completions",
            json={
                "model": self.model,
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "logprobs": 1,
                "return_token_ids": True,
            },
        )
        choice = data["choices"][0]
        return Completion(
            choice["text"],
            ids,
            list(choice["token_ids"]),
            [float(x) for x in choice["logprobs"]["token_logprobs"]],
            self.version,
        )


def with_instruct_defaults(model: Path, into: Path) -> Path:
    """A copy of ``model`` whose ``generation_config.json`` carries ``INSTRUCT_DEFAULTS``."""
    shutil.copytree(model, into)
    generation = into / "generation_config.json"
    config = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**config, **INSTRUCT_DEFAULTS}))
    return into


async def measure(url: str, model: Path, work: Path, rollouts: int, steps: int = 3) -> dict[str, Any]:
    """KL per token (nats) from the server's sampling to the learner's, by request and learner."""
    from coevo.config import LearnerConfig, SamplingConfig
    from coevo.training.lane import Lane
    from coevo.training.parity import probe

    truncation = SamplingConfig(**TRUNCATION)

    def lane(name: str, temperature: float, sampling: SamplingConfig | None = None) -> Lane:
        return Lane(
            "policy", model, work / name, LearnerConfig(), temperature=temperature, sampling=sampling, device="cpu"
        )

    plain, cut, uncut = lane("plain", 1.0), lane("cut", 0.6, truncation), lane("uncut", 0.6)
    out: dict[str, Any] = {}
    async with UnstatedClient(url, str(model), tokenizer_dir=model) as client:
        out["temperature_only"] = (await probe(client, plain, rollouts=rollouts))[0]
    async with VLLMClient(url, str(model), tokenizer_dir=model, sampling=truncation) as client:
        out["stated_truncated"] = (await probe(client, cut, rollouts=rollouts))[0]
        out["stated_truncated_learner_untold"] = (await probe(client, uncut, rollouts=rollouts))[0]
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        out["stated_neutral"] = (await probe(client, plain, rollouts=rollouts))[0]
        trained = []  # the same, on fresh samples after each of a few steps (weights swapped into the server)
        for _ in range(steps):
            await asyncio.to_thread(plain.step, await _samples(client, plain, rollouts), ["g"])
            published = await asyncio.to_thread(plain.publish)
            assert published is not None
            await client.swap_weights(published[0], plain.version)
            trained.append((await probe(client, plain, rollouts=rollouts))[0])
        out["stated_neutral_after_steps"] = trained
    return {k: [_nats(x) for x in v] if isinstance(v, list) else _nats(v) for k, v in out.items()}


STRUCTURED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "go",
            "parameters": {
                "type": "object",
                "properties": {
                    "move": {"enum": ["north", "south", "take coin"]},
                    "sure": {"type": "boolean"},
                    "steps": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["move", "sure", "steps"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "look",
            "parameters": {"type": "object", "properties": {"far": {"type": "boolean"}}, "required": ["far"]},
        },
    },
]
"""the forced tool call the structured measure samples under (#38): a wrapper, names, an enum, numbers"""


async def structured(url: str, model: Path, work: Path, rollouts: int) -> dict[str, Any]:
    """Samples vLLM drew under a grammar (a forced tool call): the KL per token from its sampling to
    the learner's log-probs with the replayed masks and without them, beside unconstrained sampling's,
    and the seconds of one learner step on those samples with and without the masks."""
    from coevo.config import LearnerConfig
    from coevo.inference.grammar import tool_call_grammar
    from coevo.training.lane import Lane
    from coevo.training.parity import PROMPTS, as_sample, probe

    grammar = tool_call_grammar(STRUCTURED_TOOLS)

    def lane(name: str) -> Lane:
        return Lane("policy", model, work / name, LearnerConfig(), temperature=1.0, device="cpu")

    masked_lane, bare_lane = lane("masks"), lane("bare")
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        done = await asyncio.gather(
            *(
                client.complete(PROMPTS[i % len(PROMPTS)], max_tokens=200, temperature=1.0, index=i, grammar=grammar)
                for i in range(2 * rollouts)
            )
        )
        free = (await probe(client, masked_lane, rollouts=rollouts))[0]
    held = [
        as_sample(c, f"held-{i}", "policy", grammar=grammar, advantage=1.0 if i % 2 else -1.0)
        for i, c in enumerate(done)
    ]
    bare = [s.model_copy(update={"grammar": None}) for s in held]
    out: dict[str, Any] = {
        "kl_masked": _nats(masked_lane.mismatch_kl(held[:rollouts])),
        "kl_unmasked": _nats(bare_lane.mismatch_kl(bare[:rollouts])),
        "kl_unconstrained_sampling": _nats(free),
        "tokens_per_sample": round(sum(len(s.response_token_ids) for s in held) / len(held), 1),
    }
    for name, one, samples in (("with_masks", masked_lane, held), ("without_masks", bare_lane, bare)):
        seconds = []
        for half in (samples[:rollouts], samples[rollouts:]):  # the first step warms up; the second is measured
            t0 = time.perf_counter()
            await asyncio.to_thread(one.step, half, ["g"])
            seconds.append(time.perf_counter() - t0)
        out[f"step_seconds_{name}"] = round(seconds[-1], 3)
    return out


def _nats(kl: float) -> float:
    return float(f"{max(kl, 0.0):.3g}")  # k3 is >= 0; rounding can leave -0.0


async def _samples(client: VLLMClient, lane: Any, rollouts: int) -> list[Any]:
    """Fresh completions as training samples with alternating advantages (a step that moves the weights)."""
    from coevo.training.parity import fresh_samples

    return [
        s.model_copy(update={"advantage": 1.0 if i % 2 else -1.0})
        for i, s in enumerate(await fresh_samples(client, lane, rollouts=rollouts))
    ]


async def bench_parity(python: str, *, cache: Path | None = None, rollouts: int = 40) -> dict[str, Any]:
    from coevo.bench.vllm import served
    from coevo.inference.models import ensure_default_model

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="coevo-parity-") as tmp:
        work = Path(tmp)
        base = ensure_default_model("policy", cache or work / "models")
        instruct = with_instruct_defaults(base, work / "instruct")
        results: dict[str, Any] = {}
        for name, model in (("without_defaults", base), ("instruct_defaults", instruct)):
            async with served(python, model) as url:
                if name == "without_defaults":  # first: ``measure`` swaps trained weights into the server
                    held = await structured(url, model, work / "structured", rollouts)
                    log.info("parity.structured", **{k: str(v) for k, v in held.items()})
                results[name] = await measure(url, model, work / name, rollouts)
                log.info("parity.measured", model=name, **{k: str(v) for k, v in results[name].items()})
    return {
        "bench": "parity",
        "model": "tiny default policy (fp32, vLLM CPU)",
        "rollouts_per_setting": rollouts,
        "max_tokens": 16,
        "instruct_defaults": INSTRUCT_DEFAULTS,
        "truncation": TRUNCATION,
        "kl_nats_per_token": results,
        "structured": held,
        "seconds": round(time.monotonic() - t0, 1),
    }
