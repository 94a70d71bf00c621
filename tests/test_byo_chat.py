"""``policy.mode = "chat"``: an episode is one conversation rendered with the model's chat template
(the tiny models have one), token-in/token-out across turns, on the quick game and on TextWorld; the
learner computes the sampled log-probs again from the recorded tokens."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from coevo.agents.policy import PolicyAgent
from coevo.config import CoevoConfig, load_config
from coevo.inference.models import ensure_default_model
from coevo.runtime.bus import NatsBus
from coevo.schemas import StepTaken, TaskScheduled, TrajectoryCompleted
from tests.test_byo_endpoint import need
from tests.test_byo_example import recompute


def chat_cfg(loop_cfg: CoevoConfig, family: str, **extra: object) -> CoevoConfig:
    return load_config(
        overrides={
            "run.runs_dir": str(loop_cfg.run.runs_dir),
            "run.run_id": loop_cfg.run.run_id,
            "env.cache_dir": str(loop_cfg.env.cache_dir),
            "nats.url": loop_cfg.nats.url,
            "env.family": family,
            "policy.mode": "chat",
            "policy.max_tokens": 8,
            "log.console": "off",
            "learner.device": "cpu",
            **extra,
        }
    )  # fp32 on CPU: the sampled log-probs are compared to an fp32 recompute


async def play_chat(bus: NatsBus, cfg: CoevoConfig, rollouts: int) -> tuple[PolicyAgent, list[StepTaken], list]:
    agent = PolicyAgent(bus, cfg)
    task = agent.family.initial_tasks(1, 0, 0)[0]
    sched = agent.event(TaskScheduled, task=task, group_id="g-chat", n_rollouts=rollouts)
    async with agent.client:  # type: ignore[attr-defined]
        for i in range(rollouts):
            await agent.rollout(sched, i, 1)
    await bus.flush()
    events = await bus.events()
    return (
        agent,
        [e for e in events if isinstance(e, StepTaken)],
        [e for e in events if isinstance(e, TrajectoryCompleted)],
    )


def check_token_in_token_out(steps: list[StepTaken], bos: int) -> None:
    for _, mine in itertools.groupby(
        sorted(steps, key=lambda s: (s.trajectory_id, s.step_index)), key=lambda s: s.trajectory_id
    ):
        mine = list(mine)
        assert mine[0].prompt_token_ids[0] == bos
        for a, b in itertools.pairwise(mine):
            assert (
                b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.response_token_ids)]
                == a.prompt_token_ids + a.response_token_ids
            )


async def test_chat_mode_plays_the_quick_game_as_one_conversation(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = chat_cfg(loop_cfg, "quickgame")
    agent, steps, trajs = await play_chat(bus, cfg, 2)
    assert len(trajs) == 2 and all(t.outcome in ("won", "lost", "truncated") for t in trajs)
    tok = agent.client.tokenizer  # type: ignore[attr-defined]
    check_token_in_token_out(steps, tok.bos_token_id)
    first = next(s for s in steps if s.step_index == 0)
    assert tok.decode(first.prompt_token_ids).startswith("<|bos|>user: goal: take the coin in the ")
    c = agent.counters
    assert c["chat.tokens.fresh"] == 2 and c["chat.tokens.reused"] + c["chat.tokens.mismatch"] == len(steps) - 2
    model = ensure_default_model("policy", Path(cfg.env.cache_dir))
    samples = [as_sample(s) for s in steps]
    assert recompute(model, samples, 1.0) == pytest.approx([lp for s in steps for lp in s.logprobs], abs=1e-4)


def as_sample(s: StepTaken):
    from coevo.schemas import TrainingSample

    return TrainingSample(
        sample_id=s.event_id,
        role="policy",
        prompt_token_ids=s.prompt_token_ids,
        response_token_ids=s.response_token_ids,
        logprobs=s.logprobs,
        advantage=1.0,
        model_version=s.policy_version,
        step_event_id=s.event_id,
    )


@pytest.mark.slow
async def test_textworld_runs_in_chat_mode(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    need("textworld")
    cfg = chat_cfg(loop_cfg, "textworld", **{"policy.max_tokens": 4})
    agent, steps, trajs = await play_chat(bus, cfg, 1)
    (traj,) = trajs
    assert traj.outcome != "aborted", traj.error
    assert len(steps) == traj.num_steps >= 2 and steps[0].candidates  # admissible commands were offered
    check_token_in_token_out(steps, agent.client.tokenizer.bos_token_id)  # type: ignore[attr-defined]
    model = ensure_default_model("policy", Path(cfg.env.cache_dir))
    sampled = torch.tensor([lp for s in steps for lp in s.logprobs])
    again = torch.tensor(recompute(model, [as_sample(s) for s in steps], 1.0))
    assert torch.allclose(again, sampled, atol=1e-4)
