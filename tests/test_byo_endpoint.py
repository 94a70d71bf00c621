"""The policy endpoint on a real NATS server: OpenAI-compatible calls inside episodes become
``StepTaken`` events with exact tokens (token-in/token-out across turns), episodes become
``TrajectoryCompleted``, own task ids form groups, the pool is handed out, errors are OpenAI-shaped."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coevo.agents.policy import PolicyAgent
from coevo.agents.scorer import ScorerAgent
from coevo.config import CoevoConfig, load_config
from coevo.errors import ApiError, ConfigError
from coevo.runtime.agent import Agent, run_agents
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored, StepTaken, TaskScheduled, TrajectoryCompleted
from tests.conftest import LOOP_OVERRIDES


def need(module: str) -> None:
    """Skip without ``module`` (an optional extra), except in CI, where the dev extra has it."""
    import importlib.util
    import os

    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is part of the dev extra: CI must have it")
        pytest.skip(f"{module} not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def endpoint_cfg(loop_cfg: CoevoConfig, **overrides: Any) -> CoevoConfig:
    base = json.loads(loop_cfg.model_dump_json())
    flat = {
        "run.runs_dir": base["run"]["runs_dir"],
        "run.run_id": base["run"]["run_id"],
        "env.cache_dir": base["env"]["cache_dir"],
        "nats.url": base["nats"]["url"],
        **LOOP_OVERRIDES,
        "bus.fetch_timeout_s": 0.2,
        "agent.heartbeat_s": 1.0,
        "env.family": "external",
        "policy.serve_port": free_port(),
        "scorer.reward": "outcome-only",
        **overrides,
    }
    return load_config(overrides=flat)


@contextlib.asynccontextmanager
async def running(agents: list[Agent], url: str) -> AsyncIterator[aiohttp.ClientSession]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_agents(agents, handle_signals=False, until=stop))
    keys = [a.endpoint.key for a in agents if getattr(a, "endpoint", None) is not None and a.endpoint.key]
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    try:
        async with aiohttp.ClientSession(url, headers=headers) as http:
            async with asyncio.timeout(60):
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get("/v1/models") as r:
                            if r.status in (200, 401):
                                break
                    assert not task.done(), task.exception()
                    await asyncio.sleep(0.2)
            yield http
    finally:
        stop.set()
        await task


async def post(http: aiohttp.ClientSession, path: str, body: Any, status: int = 200, **kw: Any) -> dict[str, Any]:
    async with http.post(path, json=body, **kw) as r:
        data = await r.json()
        assert r.status == status, data
        return data


async def chat(
    http: aiohttp.ClientSession, episode: str | None, messages: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    body = {"model": "any", "messages": messages, "max_tokens": 6, **extra}
    if episode:
        body["user"] = episode
    return await post(http, "/v1/chat/completions", body)


async def test_own_task_episodes_become_groups_steps_and_trajectories(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg)
    policy = PolicyAgent(bus, cfg)
    async with running([policy, ScorerAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        episodes = [
            await post(http, "/coevo/v1/episodes", {"task_id": "walk-1", "goal": "reach the end"})
            for _ in range(cfg.policy.n + 1)
        ]
        assert len({e["group_id"] for e in episodes[:-1]}) == 1 and episodes[-1]["group_id"] != episodes[0]["group_id"]
        assert [e["rollout_index"] for e in episodes] == [0, 1, 2, 3, 0]
        for k, ep in enumerate(episodes[: cfg.policy.n]):
            messages = [{"role": "system", "content": "you walk."}, {"role": "user", "content": "you are in room 0."}]
            for turn in range(3):
                out = await chat(http, ep["episode_id"], messages)
                # the sampled tokens are kept; a random model often samples ones a fresh tokenisation splits otherwise
                assert out["coevo"]["tokens"] in (("fresh",) if turn == 0 else ("reused", "mismatch"))
                messages += [out["choices"][0]["message"], {"role": "user", "content": f"you are in room {turn + 1}."}]
            await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"reward": 1.0 if k % 2 else 0.0})
        events = await wait_events(bus, lambda ev: any(isinstance(e, GroupScored) for e in ev))
    steps = [e for e in events if isinstance(e, StepTaken)]
    trajs = [e for e in events if isinstance(e, TrajectoryCompleted)]
    (group,) = [e for e in events if isinstance(e, TaskScheduled) and e.group_id == episodes[0]["group_id"]]
    assert group.task.family == "external" and group.task.params == {"goal": "reach the end"} and group.n_rollouts == 4
    assert sorted(t.outcome for t in trajs) == ["lost", "lost", "won", "won"]
    for t in trajs:
        mine = sorted((s for s in steps if s.trajectory_id == t.trajectory_id), key=lambda s: s.step_index)
        assert [s.event_id for s in mine] == t.step_event_ids and [s.step_index for s in mine] == [0, 1, 2]
        assert [s.done for s in mine] == [False, False, True]
        assert mine[1].observation == mine[0].next_observation == "you are in room 1."
        for a, b in itertools.pairwise(mine):  # token-in/token-out: the next prompt starts with these ids
            assert (
                b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.response_token_ids)]
                == a.prompt_token_ids + a.response_token_ids
            )
        assert all(len(s.logprobs) == len(s.response_token_ids) > 0 and s.objective == "reach the end" for s in mine)
    (scored,) = [e for e in events if isinstance(e, GroupScored) and e.group_id == group.group_id]
    assert scored.accuracy == 0.5 and scored.policy_samples
    c = policy.counters
    assert c["endpoint.tokens.reused"] + c["endpoint.tokens.mismatch"] == 8 and c["endpoint.tokens.diverged"] == 0


async def wait_events(bus: NatsBus, predicate: Any, timeout: float = 60.0) -> list[Any]:
    async with asyncio.timeout(timeout):
        while True:
            events = await bus.events()
            if predicate(events):
                return events
            await asyncio.sleep(0.3)


async def test_errors_are_openai_shaped_and_episodes_are_guarded(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg)
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        err = await post(
            http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "user": "ep-nope"},
            status=404,
        )
        assert err["error"]["code"] == "episode_not_found" and err["error"]["type"] == "invalid_request_error"
        assert (await post(http, "/v1/chat/completions", {"messages": []}, status=400))["error"]["param"] == "messages"
        assert (await post(http, "/coevo/v1/episodes", {}, status=409))["error"]["code"] == "no_pool"
        bad = await post(http, "/coevo/v1/episodes", {"task_id": "has space"}, status=400)
        assert bad["error"]["param"] == "task_id"
        ep = (await post(http, "/coevo/v1/episodes", {"task_id": "t1", "goal": "g"}))["episode_id"]
        two = await post(
            http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": 2},
            headers={"X-Coevo-Episode": ep},
            status=400,
        )
        assert two["error"]["param"] == "n"
        free = await chat(http, None, [{"role": "user", "content": "hi"}], n=3)  # outside episodes: served, n > 1
        assert len(free["choices"]) == 3 and "episode_id" not in free["coevo"]
        await post(http, f"/coevo/v1/episodes/{ep}/finish", {"outcome": "maybe"}, status=400)
        await post(http, f"/coevo/v1/episodes/{ep}/finish", {"outcome": "lost"})
        again = await post(http, f"/coevo/v1/episodes/{ep}/finish", {"outcome": "won"}, status=409)
        assert again["error"]["code"] == "episode_ended"
        async with http.get("/nowhere") as r:
            assert r.status == 404 and "error" in await r.json()


async def test_the_endpoint_requires_a_key_unless_explicitly_insecure_on_loopback(
    bus: NatsBus, loop_cfg: CoevoConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="serve_insecure_loopback") as err:  # no key beyond loopback, ever
        async with PolicyAgent(
            bus, endpoint_cfg(loop_cfg, **{"policy.serve_host": "0.0.0.0", "policy.serve_insecure_loopback": True})
        ).endpoint.serving():
            pass
    assert err.value.field == "policy.serve_insecure_loopback"
    cfg = endpoint_cfg(loop_cfg)
    agent = PolicyAgent(bus, cfg)  # no key in the environment: one is generated for the run
    key_file = cfg.run.runs_dir / bus.run_id / "policy-endpoint.key"
    assert agent.endpoint.key == key_file.read_text().strip() and len(agent.endpoint.key) >= 32
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert PolicyAgent(bus, cfg).endpoint.key == agent.endpoint.key  # a restarted agent keeps it
    url = f"http://127.0.0.1:{cfg.policy.serve_port}"
    async with running([agent], url), aiohttp.ClientSession(url) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {agent.endpoint.key}x"}):
            denied = await post(anonymous, "/v1/completions", {"prompt": "hi"}, status=401, headers=headers)
            assert denied["error"]["code"] == "invalid_api_key"
        for path, body in (("/coevo/v1/episodes", {"task_id": "t", "goal": "g"}), ("/v1/chat/completions", {})):
            await post(anonymous, path, body, status=401)
        ok = await post(
            anonymous,
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 2},
            headers={"Authorization": f"Bearer {agent.endpoint.key}"},
        )
        assert ok["object"] == "text_completion"
    monkeypatch.setenv("COEVO_POLICY_API_KEY", "s3cret")  # a key of the user's own
    cfg = endpoint_cfg(loop_cfg, **{"policy.serve_host": "0.0.0.0"})
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        assert (await post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))["object"] == "text_completion"
        await post(http, "/v1/completions", {"prompt": "hi"}, status=401, headers={"Authorization": "Bearer x"})
    monkeypatch.delenv("COEVO_POLICY_API_KEY")
    cfg = endpoint_cfg(loop_cfg, **{"policy.serve_insecure_loopback": True})
    insecure = PolicyAgent(bus, cfg)
    assert insecure.endpoint.key is None
    async with running([insecure], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        assert (await post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))["object"] == "text_completion"


async def test_the_openai_sdk_streams_and_completions_reuse_tokens(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    need("openai")
    import openai

    cfg = endpoint_cfg(loop_cfg)
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    agent = PolicyAgent(bus, cfg)
    async with running([agent], base) as http:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=agent.endpoint.key)
        ep = (await post(http, "/coevo/v1/episodes", {"task_id": "s1", "goal": "g"}))["episode_id"]
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "go"}],
            max_tokens=5,
            stream=True,
            user=ep,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        first = await client.completions.create(model="m", prompt="room 0.", max_tokens=4, user=ep, logprobs=0)
        again = await client.completions.create(
            model="m", prompt="room 0." + first.choices[0].text + " room 1.", max_tokens=4, user=ep
        )
        assert first.model_extra["coevo"]["tokens"] == "fresh"
        assert again.model_extra["coevo"]["tokens"] in ("reused", "mismatch")
        assert len(first.choices[0].logprobs.token_logprobs) >= 1
        await post(http, f"/coevo/v1/episodes/{ep}/finish", {"outcome": "won", "observation": "done."})
        await client.close()
        events = await wait_events(bus, lambda ev: any(isinstance(e, TrajectoryCompleted) for e in ev))
    steps = sorted((e for e in events if isinstance(e, StepTaken)), key=lambda s: s.step_index)
    assert [s.step_index for s in steps] == [0, 1, 2] and steps[0].response_text == text
    assert (
        steps[2].prompt_token_ids[: len(steps[1].prompt_token_ids) + len(steps[1].response_token_ids)]
        == steps[1].prompt_token_ids + steps[1].response_token_ids
    )
    assert steps[-1].done and steps[-1].next_observation == "done."


async def test_the_pool_is_handed_out_and_groups_are_scored(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    """family external + tasks_from quickgame: an outside agent (here: this test, with coevo's own game)
    plays the pool's rollouts; the group is acknowledged once all n ended, then scored."""
    from coevo.agents.tasks import TasksAgent
    from coevo.envs.quickgame import QuickGame
    from coevo.schemas import TaskSpec

    cfg = endpoint_cfg(loop_cfg, **{"env.tasks_from": "quickgame", "tasks.rewriter": "off"})
    agents = [TasksAgent(bus, cfg), PolicyAgent(bus, cfg), ScorerAgent(bus, cfg)]
    async with running(agents, f"http://127.0.0.1:{cfg.policy.serve_port}") as http:

        async def play() -> None:
            ep = await post(http, "/coevo/v1/episodes", {"wait_s": 30})
            env = QuickGame().make_env()
            obs = await env.reset(TaskSpec.model_validate(ep["task"]))
            assert obs.text == ep["goal"] and obs.candidates == ep["candidates"]
            messages = [{"role": "user", "content": obs.text}]
            for _ in range(9):
                out = await chat(http, ep["episode_id"], messages)
                reply = out["choices"][0]["message"]["content"]
                result = await env.step(obs.candidates[len(reply) % len(obs.candidates)])
                if result.done:
                    await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": result.outcome})
                    return
                obs = result.observation
                messages += [out["choices"][0]["message"], {"role": "user", "content": obs.text}]

        await asyncio.gather(*(play() for _ in range(2 * cfg.policy.n)))
        events = await wait_events(bus, lambda ev: sum(isinstance(e, GroupScored) for e in ev) >= 2)
    scheduled = {e.group_id: e for e in events if isinstance(e, TaskScheduled)}
    scored = [e for e in events if isinstance(e, GroupScored)]
    assert all(scheduled[g.group_id].source.role == "tasks" and g.n_trajectories == cfg.policy.n for g in scored)
    trajs = [e for e in events if isinstance(e, TrajectoryCompleted) and e.group_id == scored[0].group_id]
    assert sorted(t.rollout_index for t in trajs) == list(range(cfg.policy.n))


def test_a_pool_needs_family_external() -> None:
    with pytest.raises(ConfigError, match=r"env\.tasks_from is for env\.family = 'external'"):
        load_config(overrides={"env.tasks_from": "quickgame"})
    with pytest.raises(ConfigError, match="unknown family 'nope'"):
        load_config(overrides={"env.family": "external", "env.tasks_from": "nope"})


def test_chat_tokens_reuse_the_sampled_ids_and_count_a_mismatch(model_cache: Path) -> None:
    from transformers import AutoTokenizer

    from coevo.inference.chat import ChatTokens, Turn, normalize
    from coevo.inference.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model("policy", model_cache))
    ct = ChatTokens(tok)
    msgs = normalize([{"role": "user", "content": "room: hall."}])
    ids, how = ct.prompt(msgs)
    assert how == "fresh" and ids[0] == tok.bos_token_id and ct.render(msgs).endswith("assistant:")
    go = tok.encode(" go", add_special_tokens=False)
    odd = [tok.convert_tokens_to_ids(t) for t in ("Ġ", "g", "o")]  # " go" spelled in pieces: not the BPE merge
    for sampled, expect in (
        ([*go, tok.eos_token_id], "reused"),
        ([*odd, tok.eos_token_id], "mismatch"),
        (go, "reused"),
    ):
        text = tok.decode(sampled, skip_special_tokens=True)
        turn = Turn(msgs, normalize([{"role": "assistant", "content": text}])[0], ids, sampled)
        nxt = normalize([*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "ok."}])
        ids2, how2 = ct.prompt(nxt, previous=turn)
        assert how2 == expect and ids2[: len(ids) + len(sampled)] == ids + sampled
        edited = normalize([*msgs, {"role": "assistant", "content": "other"}, {"role": "user", "content": "ok."}])
        assert ct.prompt(edited, previous=turn)[1] == "diverged"


def test_tool_calls_stops_and_prompts_in_the_wire_format() -> None:
    from coevo.serve import openai_api as oa

    text = 'let me look. <tool_call>{"name": "look", "arguments": {"at": "door"}}</tool_call>'
    rest, calls = oa.parse_tool_calls(text)
    assert rest == "let me look." and calls[0]["function"] == {"name": "look", "arguments": '{"at": "door"}'}
    assert oa.parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    pieces = ["go", " north", ".", " then"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert oa.cut_at_stop(decode, [0, 1, 2, 3], ["."]) == (3, "go north")
    assert oa.cut_at_stop(decode, [0, 1], ["."]) == (2, None)
    assert oa.CompletionRequest(prompt=[[1, 2, 3]]).single() == [1, 2, 3]
    with pytest.raises(ApiError, match="one prompt per request"):
        oa.CompletionRequest(prompt=["a", "b"]).single()
    body = oa.envelope("chat.completion", "m", [oa.chat_choice(0, "", calls, "tool_calls", None)], oa.usage(3, 2), {})
    chunks = oa.stream_chunks(body, [[]], include_usage=True)
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["usage"]["total_tokens"] == 5
    assert any("tool_calls" in c["choices"][0]["delta"] for c in chunks[:-1])
