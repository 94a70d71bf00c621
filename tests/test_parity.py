"""Sampling parity with a real vLLM (CPU build) serving an instruct-style model (#23): a model whose
``generation_config.json`` carries sampling defaults, as published instruct models ship them.

vLLM applies those defaults to every field a request leaves out. coevo used to send only the
temperature: the learner then computed plain softmax log-probs of tokens sampled from a truncated,
penalised distribution. Now every request states every field, the learner applies the truncation
it configures, and a probe at start refuses a server that samples another distribution."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from coevo.bench.parity import UnstatedClient, with_instruct_defaults
from coevo.config import LearnerConfig, SamplingConfig, load_config
from coevo.errors import ConfigError
from coevo.inference.vllm_client import VLLMClient
from coevo.training import parity
from coevo.training.lane import Lane
from tests.conftest import serving

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def instruct(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The tiny policy with instruct-style sampling defaults, served by vLLM as a user would serve it
    (``--generation-config auto``, vLLM's default): (URL, model dir)."""
    from coevo.inference.models import ensure_default_model

    model = with_instruct_defaults(
        ensure_default_model("policy", model_cache), tmp_path_factory.mktemp("instruct") / "model"
    )
    with serving(model, model.parent) as url:
        yield url, model


async def test_what_is_sampled_from_an_instruct_model_is_what_the_learner_computes(instruct, tmp_path: Path) -> None:
    url, model = instruct
    plain = Lane("policy", model, tmp_path / "plain", LearnerConfig(), temperature=1.0, device="cpu")
    async with UnstatedClient(url, str(model), tokenizer_dir=model) as client:
        before, _ = await parity.probe(client, plain)
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        stated, tokens = await parity.probe(client, plain)
    assert tokens > 100
    assert before > 0.1, before  # the server's defaults applied: top-k, top-p and penalties unknown to the learner
    assert stated < 0.02, stated  # every field stated: one distribution

    sampling = SamplingConfig(top_k=5, top_p=0.7)  # the same truncation, chosen in coevo's config
    truncated = Lane(
        "policy", model, tmp_path / "trunc", LearnerConfig(), temperature=0.6, sampling=sampling, device="cpu"
    )
    async with VLLMClient(url, str(model), tokenizer_dir=model, sampling=sampling) as client:
        told, _ = await parity.probe(client, truncated)
        untold, _ = await parity.probe(
            client, Lane("policy", model, tmp_path / "untold", LearnerConfig(), temperature=0.6, device="cpu")
        )
    assert told < 0.02, told
    assert untold > 0.05, untold  # a learner that did not truncate would train another distribution


async def test_the_learner_refuses_a_server_sampling_another_distribution(instruct, tmp_path: Path) -> None:
    """The probe at start: the learner's base model is not the one served (a typo'd path, another
    checkpoint): refused with an error naming the bound, before anything is trained."""
    import torch
    from transformers import AutoModelForCausalLM

    url, model = instruct
    other = tmp_path / "other"
    shutil.copytree(model, other)
    m = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    m.save_pretrained(other)
    cfg = load_config(overrides={"policy.url": url, "policy.model": str(model), "run.runs_dir": str(tmp_path)})
    same = Lane("policy", model, tmp_path / "same", cfg.learner, device="cpu")
    kl = await parity.check(cfg, same)
    assert kl is not None and kl < 0.02
    wrong = Lane("policy", other, tmp_path / "wrong", cfg.learner, device="cpu")
    with pytest.raises(ConfigError, match="samples another distribution") as refused:
        await parity.check(cfg, wrong)
    assert refused.value.field == "learner.parity_max_kl"
    off = load_config(overrides={"policy.url": url, "policy.model": str(model), "learner.parity_max_kl": None})
    assert await parity.check(off, wrong) is None


async def test_a_learner_started_against_the_wrong_server_ends_with_one_line(
    instruct, nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """As a user meets it: ``coevo agent learner`` with a policy server serving other weights ends at
    start, exit 2, with the reason on one line instead of a traceback."""
    import asyncio

    from tests.conftest import PYTHON, subprocess_env

    url, model = instruct
    other = tmp_path / "other"
    shutil.copytree(model, other)
    (other / "generation_config.json").unlink()  # another model: its own config, and other weights
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(other)
    for p in m.parameters():
        p.data.mul_(-1.0)
    m.save_pretrained(other)
    proc = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        "coevo",
        "agent",
        "learner",
        "--nats",
        nats_url,
        "--run-id",
        run_id,
        "--run.runs_dir",
        str(tmp_path / "runs"),
        "--policy.url",
        url,
        "--policy.model",
        str(other),
        "--policy.served_name",
        str(model),
        "--loop",
        "policy-only",
        env=subprocess_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 2, (out + err).decode()[-3000:]
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("coevo: the policy server at ") and "learner.parity_max_kl" in last, err.decode()[-2000:]
