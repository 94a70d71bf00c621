"""Numbers are bounded where they enter the policy endpoint (issue 36, items 1, 4, 11, 12): rewards
finite and within ``scorer.max_abs_env_reward`` (JSON's ``Infinity``/``NaN`` are not JSON), a step
kept until it is published, token ids inside the vocabulary, and a group with no learning signal
releasing the backlog gate. On the real server, with the real policy agent, scorer and learner."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from coevo.agents.policy import PolicyAgent
from coevo.agents.scorer import ScorerAgent
from coevo.config import CoevoConfig
from coevo.inference.engine import LocalEngine
from coevo.runtime.bus import NatsBus
from coevo.schemas import StepTaken, TrajectoryCompleted
from coevo.training.learner import LearnerAgent
from tests.test_byo_endpoint import endpoint_cfg, post, running


async def _raw(http: aiohttp.ClientSession, path: str, raw: str, status: int) -> dict[str, Any]:
    async with http.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
        data = await r.json()
        assert r.status == status, data
        return data


async def _steps(bus: NatsBus, trajectory_id: str) -> list[StepTaken]:
    return [
        e for e in await bus.events(["step.taken"]) if isinstance(e, StepTaken) and e.trajectory_id == trajectory_id
    ]


def _call(episode: str, text: str = "go") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "user": episode}


async def test_rewards_beyond_the_bound_or_not_finite_are_refused_naming_the_field(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    cfg = endpoint_cfg(loop_cfg, **{"scorer.max_abs_env_reward": 100.0})
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "r", "goal": "g"})
        path = f"/coevo/v1/episodes/{ep['episode_id']}/reward"
        await post(http, "/v1/chat/completions", _call(ep["episode_id"]))
        for body in ({"reward": 1e39}, {"reward": -101}, {"reward": 10**400}):
            refused = await post(http, path, body, 400)
            assert refused["error"]["param"] == "reward" and "scorer.max_abs_env_reward" in refused["error"]["message"]
        for raw in ('{"reward": Infinity}', '{"reward": -Infinity}', '{"reward": NaN}'):
            assert "not JSON" in (await _raw(http, path, raw, 400))["error"]["message"]
        assert (await post(http, path, {"reward": 60}))["env_reward"] == 60.0
        summed = await post(http, path, {"reward": 60}, 400)  # the step's total would leave the bound
        assert summed["error"]["param"] == "reward"
        finish = f"/coevo/v1/episodes/{ep['episode_id']}/finish"
        assert (await post(http, finish, {"reward": 1e39}, 400))["error"]["param"] == "reward"
        await _raw(http, finish, '{"reward": Infinity}', 400)
        await post(http, finish, {"reward": 1.0})
        steps = await _steps(bus, ep["trajectory_id"])
    assert [(s.step_index, s.env_reward) for s in steps] == [(0, 60.0)]


async def test_a_step_whose_publish_fails_is_kept_until_published(
    bus: NatsBus, loop_cfg: CoevoConfig, inject: Any
) -> None:
    """The endpoint cleared its pending step before publishing it: a failed publish lost it, and
    the episode went on with a gap in its step indices."""
    cfg = endpoint_cfg(loop_cfg)
    policy = PolicyAgent(bus, cfg)
    async with running([policy], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "p", "goal": "g"})
        await post(http, "/v1/chat/completions", _call(ep["episode_id"], "room 0"))
        inject({"endpoint.publish_step": {"times": 1}})
        await post(http, "/v1/chat/completions", _call(ep["episode_id"], "room 1"), 500)  # step 0's publish failed
        again = await post(http, "/v1/chat/completions", _call(ep["episode_id"], "room 1"))
        assert again["coevo"]["step_index"] == 1
        await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "won"})
        steps = await _steps(bus, ep["trajectory_id"])
        (done,) = [
            e
            for e in await bus.events(["trajectory.completed"])
            if isinstance(e, TrajectoryCompleted) and e.trajectory_id == ep["trajectory_id"]
        ]
    assert [s.step_index for s in steps] == [0, 1] and done.num_steps == 2
    assert done.step_event_ids == [s.event_id for s in steps]


async def test_out_of_vocabulary_token_ids_are_refused_where_they_enter(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg)
    policy = PolicyAgent(bus, cfg)
    async with running([policy], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        vocab = len(policy.client.tokenizer)
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "v", "goal": "g"})
        for prompt in ([1, vocab + 5], [-1, 2]):
            for user in (None, ep["episode_id"]):  # outside and inside an episode
                body = {"model": "m", "prompt": prompt, "max_tokens": 2, **({"user": user} if user else {})}
                refused = await post(http, "/v1/completions", body, 400)
                assert refused["error"]["param"] == "prompt" and "vocabulary" in refused["error"]["message"]
        ok = await post(http, "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
        assert ok["choices"][0]["text"] is not None


async def test_the_engine_refuses_out_of_vocabulary_prompt_ids(loop_cfg: CoevoConfig) -> None:
    from coevo.errors import InvalidTokens
    from coevo.inference.clients import model_dir

    async with LocalEngine(model_dir(loop_cfg, "policy"), seed=1) as eng:
        vocab = int(eng.model.config.vocab_size)
        for ids in ([1, vocab], [-3]):
            with pytest.raises(InvalidTokens) as err:
                await eng.complete("", prompt_ids=ids, max_tokens=2)
            assert (err.value.token_id, err.value.vocab_size) == (ids[-1], vocab)
        assert (await eng.complete("", prompt_ids=[1, 2], max_tokens=2)).response_token_ids


async def test_an_all_lost_group_releases_the_backlog_gate(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    """An agent whose first group was all lost: no sample, no learner step; the learner still names
    the group, so the next episode opens at once instead of after policy.serve_backlog_timeout_s."""
    cfg = endpoint_cfg(
        loop_cfg,
        **{
            "loop": "policy-only",
            "policy.n": 2,
            "tasks.max_groups_in_flight": 1,
            "policy.serve_backlog_timeout_s": 3600.0,
        },
    )
    policy = PolicyAgent(bus, cfg)
    released = asyncio.Event()
    named: list[str] = []
    trained = policy.endpoint.trained

    def observed(group_ids: list[str]) -> None:  # the gate's own method, watched
        trained(group_ids)
        named.extend(group_ids)
        released.set()

    policy.endpoint.trained = observed  # type: ignore[method-assign]
    agents = [policy, ScorerAgent(bus, cfg), LearnerAgent(bus, cfg)]
    async with running(agents, f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        eps = [await post(http, "/coevo/v1/episodes", {"task_id": "lost", "goal": "g"}) for _ in range(2)]
        for ep in eps:
            await post(http, "/v1/chat/completions", _call(ep["episode_id"]))
            await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "lost"})
        async with asyncio.timeout(60):
            while eps[0]["group_id"] not in named:
                released.clear()
                await released.wait()
        assert not policy.endpoint.backlog.groups
        await post(http, "/coevo/v1/episodes", {"task_id": "lost", "goal": "g"})  # admitted


async def test_concurrent_rotations_of_one_agent_key_leave_it_one_open_episode(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    """Each rotation read the episode its key held as the request arrived: concurrent ones each
    opened an episode that no key held (found by coevo bench hostile: 28 of 40), filling the
    endpoint's open slots until the episode timeout. One at a time, each ends the one before."""
    cfg = endpoint_cfg(loop_cfg)
    policy = PolicyAgent(bus, cfg)
    async with running([policy], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        agent = (await post(http, "/coevo/v1/agent-keys", {}))["agent_key"]
        body = {"task_id": "flood", "goal": "g", "outcome": "lost"}
        async with aiohttp.ClientSession(http._base_url, headers={"x-api-key": agent}) as harness:
            opened = await asyncio.gather(*(post(harness, "/coevo/v1/episodes/rotate", body) for _ in range(12)))
            call = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3}
            held = await post(harness, "/v1/chat/completions", call)
        book = policy.endpoint.book
        assert len({o["episode_id"] for o in opened}) == 12
        assert list(book.episodes) == [held["coevo"]["episode_id"]]  # the one it holds is the only one open
        assert sum(book.ended[o["episode_id"]] == "lost" for o in opened if o["episode_id"] in book.ended) == 11
