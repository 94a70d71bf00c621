"""examples/openai_agent.py, an agent that knows nothing of coevo, is trained by `coevo run --family
external`: it runs as its own process with only OPENAI_BASE_URL pointing at coevo; the learner steps on
groups made of its trajectories, with the sampling log-probs the learner itself computes for them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coevo.schemas import GroupScored, LearnerStepped, TaskScheduled, TrajectoryCompleted, WeightsPublished
from tests.conftest import PYTHON, REPO, subprocess_env
from tests.test_byo_endpoint import free_port, need
from tests.test_byo_plugin import RUN_FLAGS

EXAMPLE = REPO / "examples" / "openai_agent.py"
pytestmark = pytest.mark.slow


def recompute(model_dir: Path, samples: list, temperature: float) -> list[float]:
    """The learner's own log-probs of the samples' response tokens under the weights in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    from coevo.training.batch import to_tensors
    from coevo.training.loss import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    t = to_tensors(samples, int(model.config.vocab_size), int(model.config.pad_token_id or 0))
    with torch.no_grad():
        logp = token_logprobs(model, t.input_ids, t.attention_mask, t.response_mask, t.allowed, temperature)
    return logp[t.response_mask.bool()].tolist()


def test_the_example_agent_is_trained_through_the_endpoint(tmp_path: Path, model_cache: Path) -> None:
    need("openai")
    source = EXAMPLE.read_text()
    assert "import coevo" not in source and "from coevo" not in source
    from coevo.inference.models import ensure_default_model
    from coevo.tools.events import open_run

    port, runs = free_port(), tmp_path / "runs"
    run = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "coevo",
            "run",
            "--family",
            "external",
            "--serve-policy",
            str(port),
            "--steps",
            "2",
            "--minutes",
            "6",
            "--run-id",
            "byo",
            "--run.runs_dir",
            str(runs),
            "--env.cache_dir",
            str(model_cache),
            "--learner.device",
            "cpu",
            *RUN_FLAGS,
        ],  # fp32 sampling and training: log-probs compared at 1e-4
        env={**subprocess_env(), "COEVO_POLICY_API_KEY": "byo-key"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    agent_env = {
        "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
        "OPENAI_API_KEY": "byo-key",
        "PATH": os.environ.get("PATH", ""),
    }
    agent = subprocess.Popen(
        [sys.executable, "-I", str(EXAMPLE)],
        env=agent_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        out, err = run.communicate(timeout=480)
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)
        agent_out = agent.communicate(timeout=60)[0]
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, (out[-2000:], err[-3000:], agent_out[-2000:])
    assert "corridor-0:" in agent_out, agent_out[-2000:]

    async def read() -> list:
        async with open_run("byo", runs) as bus:
            return await bus.events()

    events = asyncio.run(read())
    theirs = {e.group_id for e in events if isinstance(e, TaskScheduled) and e.task.task_id.startswith("corridor-")}
    assert theirs and all(
        e.source.role == "policy" and e.task.family == "external" for e in events if isinstance(e, TaskScheduled)
    )
    steps = [e for e in events if isinstance(e, LearnerStepped) and e.role == "policy" and e.is_step]
    assert len(steps) >= 2 and all(set(s.group_ids) <= theirs and s.group_ids for s in steps)
    trained = {g for s in steps for g in s.group_ids}
    trajectories = {e.trajectory_id for e in events if isinstance(e, TrajectoryCompleted) and e.group_id in trained}
    scored = [e for e in events if isinstance(e, GroupScored) and e.group_id in trained]
    samples = [s for g in scored for s in g.policy_samples]
    assert samples and {g for g in trained} == {g.group_id for g in scored}
    assert all(tid in trajectories for g in scored for tid in g.trajectory_ids)
    # log-probs as sampled == log-probs the learner computes, for tokens of a version we hold the weights of
    weights = {0: ensure_default_model("policy", model_cache)}
    weights |= {
        e.version: Path(e.path)
        for e in events
        if isinstance(e, WeightsPublished) and e.role == "policy" and Path(e.path).is_dir()
    }
    checked = 0
    for version, where in weights.items():
        mine = [s for s in samples if s.model_version == version]
        if not mine:
            continue
        sampled = [lp for s in mine for lp in s.logprobs]
        assert recompute(where, mine, 1.0) == pytest.approx(sampled, abs=1e-4)
        checked += len(sampled)
    assert checked > 0
