"""The Responses and Messages APIs, episode keys, step rewards, backpressure and the endpoint's
honesty, on a real NATS server with the official SDKs (``openai``, ``anthropic``): each call is a
``StepTaken`` with the exact tokens, prompts reuse the sampled ids across turns whichever way the
client sends the conversation, and what the endpoint cannot do is refused, never ignored."""

from __future__ import annotations

import asyncio
import itertools
import string
from typing import Any

import aiohttp
import pytest

from coevo.agents.policy import PolicyAgent
from coevo.config import CoevoConfig
from coevo.errors import ApiError
from coevo.inference.chat import ChatTokens, Turn, completion_prompt, normalize
from coevo.runtime.bus import NatsBus
from coevo.schemas import LearnerStepped, StepTaken, TrajectoryCompleted
from coevo.schemas.base import Source
from coevo.serve import messages_api as ma
from coevo.serve import responses_api as ra
from tests.test_byo_endpoint import endpoint_cfg, need, post, running, wait_events

STOPS = list(string.ascii_letters + string.digits + string.punctuation + " ")
"""nearly every token the tiny model samples holds one of these"""
TOOL = {
    "type": "function",
    "name": "move",
    "description": "walk one room",
    "parameters": {"type": "object", "properties": {"direction": {"type": "string"}}, "required": ["direction"]},
}


def chained(steps: list[StepTaken]) -> bool:
    """Token-in/token-out: each prompt starts with the previous prompt and response ids, bit for bit."""
    return all(
        b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.response_token_ids)]
        == a.prompt_token_ids + a.response_token_ids
        for a, b in itertools.pairwise(steps)
    )


async def steps_of(bus: NatsBus, trajectory_id: str) -> list[StepTaken]:
    events = await wait_events(
        bus, lambda ev: any(isinstance(e, TrajectoryCompleted) and e.trajectory_id == trajectory_id for e in ev)
    )
    return sorted(
        (e for e in events if isinstance(e, StepTaken) and e.trajectory_id == trajectory_id), key=lambda s: s.step_index
    )


async def test_the_responses_api_with_the_openai_sdk(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    need("openai")
    import openai

    cfg = endpoint_cfg(loop_cfg)
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    async with running([PolicyAgent(bus, cfg)], base) as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "resp-1", "goal": "walk"})
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=ep["key"], max_retries=0)  # the episode's own key
        ask = {"model": "m", "instructions": "you walk.", "tools": [TOOL], "max_output_tokens": 6}
        r1 = await client.responses.create(input="you are in room 0.", **ask)
        assert r1.object == "response" and r1.output and r1.usage.output_tokens >= 1
        assert (
            r1.model_extra["coevo"]["episode_id"] == ep["episode_id"] and r1.model_extra["coevo"]["tokens"] == "fresh"
        )
        r2 = await client.responses.create(previous_response_id=r1.id, input="you are in room 1.", **ask)  # stateful
        history = [
            {"role": "user", "content": "you are in room 0."},
            *[i.model_dump() for i in r1.output],
            {"role": "user", "content": "you are in room 1."},
            *[i.model_dump() for i in r2.output],
            {"type": "function_call_output", "call_id": "call_x", "output": "you are in room 2."},
        ]
        r3 = await client.responses.create(input=history, **ask)  # stateless: the whole conversation again
        for r in (r2, r3):
            assert r.model_extra["coevo"]["tokens"] in ("reused", "mismatch")
        async with client.responses.stream(previous_response_id=r3.id, input="room 3.", **ask) as stream:
            events = [e async for e in stream]  # the SDK's stream state checks each event against the last
        kinds, final = [e.type for e in events], events[-1].response  # incomplete at max_output_tokens, as OpenAI's
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
            "response.completed",
            "response.incomplete",
        )
        assert "response.output_item.done" in kinds and final.status in ("completed", "incomplete")
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert final.output_text == deltas and final.model_extra["coevo"]["tokens"] in ("reused", "mismatch")
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(previous_response_id="resp_nope", input="x", **ask)
        with pytest.raises(openai.BadRequestError, match="fly"):  # a tool it was not offered
            await client.responses.create(input="x", tool_choice={"type": "function", "name": "fly"}, **ask)
        await post(
            http,
            f"/coevo/v1/episodes/{ep['episode_id']}/finish",
            {"outcome": "won"},
            headers={"Authorization": f"Bearer {ep['key']}"},
        )
        with pytest.raises(openai.AuthenticationError):  # the key died with its episode
            await client.responses.create(input="x", **ask)
        await client.close()
        steps = await steps_of(bus, ep["trajectory_id"])
    assert [s.step_index for s in steps] == [0, 1, 2, 3] and chained(steps)
    assert [s.response_text for s in steps[:3]] == [r1.output_text, r2.output_text, r3.output_text]
    assert steps[1].next_observation == steps[2].observation == "tool: you are in room 2."
    assert steps[2].next_observation == steps[3].observation == "room 3."
    assert steps[3].response_text == final.output_text and steps[3].done


async def test_a_call_the_stop_cuts_short_answers_503_endpoint_stopping(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    """A call waiting on its episode while the endpoint stops, and every call after, is told coevo is
    stopping (503 ``endpoint_stopping``), not that its episode ended: an agent tells coevo's stop from
    its own mistakes (the examples stop cleanly on it)."""
    need("anthropic")
    import anthropic
    import openai

    cfg = endpoint_cfg(loop_cfg)
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    policy = PolicyAgent(bus, cfg)
    async with running([policy], base) as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "stop-1", "goal": "walk"})
        endpoint, episode = policy.endpoint, policy.endpoint.book.get(ep["episode_id"])
        claude = anthropic.AsyncAnthropic(base_url=base, api_key=ep["key"], max_retries=0)
        first = [{"role": "user", "content": "you are in room 0."}]
        async with episode.lock:  # the call waits on its episode (an ignored temperature marks it arrived)
            call = asyncio.create_task(
                claude.messages.create(model="m", max_tokens=6, messages=first, extra_body={"temperature": 0.3})
            )
            async with asyncio.timeout(30):
                while not endpoint.counters["endpoint.knobs_ignored.temperature"]:
                    assert not call.done(), call.exception()
                    await asyncio.sleep(0.05)
            endpoint.stopping = True  # what the endpoint's stop does before it ends the open episodes
            await endpoint.end(episode, "aborted", "the policy endpoint stopped")
        with pytest.raises(anthropic.InternalServerError, match="coevo is stopping") as cut:
            await call
        assert cut.value.status_code == 503 and cut.value.body["error"]["type"] == "overloaded_error"
        assert ep["episode_id"] in str(cut.value)
        gpt = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=endpoint.key or "none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as later:  # a new call, even with the run's key
            await gpt.chat.completions.create(model="m", max_tokens=6, messages=first)
        assert later.value.status_code == 503 and later.value.code == "endpoint_stopping"
        # no Retry-After: what tells an agent the run is over from "try again" (429, 503 no_task_available)
        assert "retry-after" not in later.value.response.headers
        await claude.close()
        await gpt.close()
        (end,) = [
            e
            for e in await wait_events(bus, lambda ev: any(isinstance(e, TrajectoryCompleted) for e in ev))
            if isinstance(e, TrajectoryCompleted)
        ]
    assert end.trajectory_id == ep["trajectory_id"] and end.outcome == "aborted"


async def test_the_messages_api_with_the_anthropic_sdk(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    need("anthropic")
    import anthropic

    cfg = endpoint_cfg(loop_cfg)
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    async with running([PolicyAgent(bus, cfg)], base) as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "msg-1", "goal": "walk"})
        client = anthropic.AsyncAnthropic(base_url=base, api_key=ep["key"], max_retries=0)  # sent as x-api-key
        tools = [{"name": "move", "description": "walk one room", "input_schema": TOOL["parameters"]}]
        ask = {"model": "m", "max_tokens": 6, "system": "you walk.", "tools": tools}
        first = [{"role": "user", "content": "you are in room 0."}]
        m1 = await client.messages.create(messages=first, **ask)
        assert m1.type == "message" and m1.stop_reason in ("end_turn", "max_tokens") and m1.usage.output_tokens >= 1
        convo = [
            *first,
            {"role": "assistant", "content": [b.model_dump() for b in m1.content]},
            {"role": "user", "content": [{"type": "text", "text": "you are in room 1."}]},
        ]
        async with client.messages.stream(messages=convo, **ask) as stream:
            streamed = "".join([t async for t in stream.text_stream])
            m2 = await stream.get_final_message()
        assert streamed == "".join(b.text for b in m2.content if b.type == "text")
        assert m2.model_extra["coevo"]["tokens"] in ("reused", "mismatch")
        convo += [
            {
                "role": "assistant",
                "content": [
                    *[b.model_dump() for b in m2.content],
                    {"type": "tool_use", "id": "toolu_1", "name": "move", "input": {"direction": "n"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "you are in room 2."}],
            },
        ]
        m3 = await client.messages.create(messages=convo, stop_sequences=STOPS, **{**ask, "max_tokens": 30})
        assert m3.stop_reason == "stop_sequence" and m3.stop_sequence in STOPS
        with pytest.raises(anthropic.BadRequestError, match="fly"):  # a tool it was not offered
            await client.messages.create(messages=first, tool_choice={"type": "tool", "name": "fly"}, **ask)
        await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "lost"})
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(messages=first, **ask)
        await client.close()
        steps = await steps_of(bus, ep["trajectory_id"])
    assert [s.step_index for s in steps] == [0, 1, 2] and chained(steps[:2])
    assert steps[2].observation == "tool: you are in room 2."
    cut = steps[2]  # generation ended at the stop string: well before max_tokens, the stop's token kept
    assert len(cut.response_token_ids) < 30 and m3.stop_sequence not in cut.response_text


async def test_episode_keys_act_only_on_their_episode(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg)
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        a, b = [await post(http, "/coevo/v1/episodes", {"task_id": "keys", "goal": "g"}) for _ in range(2)]
        assert a["key"] != b["key"] and a["key"].startswith("ek-")
        mine = {"Authorization": f"Bearer {a['key']}"}
        async with aiohttp.ClientSession(http._base_url) as anon:  # no run key: only the episode's
            body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3}
            out = await post(anon, "/v1/chat/completions", body, headers=mine)
            assert out["coevo"]["episode_id"] == a["episode_id"]  # no user field, no header: the key says which
            for method, path in (
                ("GET", f"/coevo/v1/episodes/{b['episode_id']}"),
                ("POST", f"/coevo/v1/episodes/{b['episode_id']}/finish"),
                ("POST", "/coevo/v1/episodes"),
            ):
                async with anon.request(method, path, json={"outcome": "won", "task_id": "x"}, headers=mine) as r:
                    assert r.status == 403 and (await r.json())["error"]["code"] == "episode_key_scope"
            await post(anon, "/v1/chat/completions", {**body, "user": b["episode_id"]}, 403, headers=mine)
            await post(anon, "/v1/chat/completions", body, 401)  # neither key
            await post(anon, f"/coevo/v1/episodes/{a['episode_id']}/finish", {"outcome": "won"}, headers=mine)
            await post(anon, "/v1/chat/completions", body, 401, headers=mine)  # died with its episode


async def test_step_rewards_join_their_call(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg)
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "rw", "goal": "g"})
        path = f"/coevo/v1/episodes/{ep['episode_id']}/reward"
        await post(http, path, {"reward": 1.0}, 409)  # no call yet
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 3,
            "user": ep["episode_id"],
        }
        first = (await post(http, "/v1/chat/completions", body))["coevo"]["call_id"]
        assert (await post(http, path, {"reward": 0.5, "call_id": first}))["env_reward"] == 0.5
        assert (await post(http, path, {"reward": 0.25}))["env_reward"] == 0.75  # rewards of one call add up
        await post(http, path, {"reward": "high"}, 400)
        body["messages"] = [*body["messages"], {"role": "assistant", "content": "x"}, {"role": "user", "content": "on"}]
        await post(http, "/v1/chat/completions", body)
        late = await post(http, path, {"reward": 1.0, "call_id": first}, 409)  # that call's step is published
        assert late["error"]["code"] == "call_published"
        await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "won"})
        steps = await steps_of(bus, ep["trajectory_id"])
    assert [s.env_reward for s in steps] == [0.75, None]


def test_environment_step_rewards_add_to_the_integrated_reward() -> None:
    from coevo.algorithm.scoring import StepRec, TrajRec, VoteRec, integrated_rewards

    t = TrajRec("t", "won", (StepRec("a", 0, (VoteRec(1),), env_reward=0.5), StepRec("b", 1, (VoteRec(-1),))))
    assert integrated_rewards([t], lam=1.0) == {"a": 2.5, "b": 0.0}
    assert integrated_rewards([t], lam=1.0, env_weight=2.0) == {"a": 3.0, "b": 0.0}
    assert integrated_rewards([t], mode="outcome-only") == {"a": 1.5, "b": 1.0}


async def test_new_episodes_wait_while_the_learner_is_behind(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    """A group whose episodes all ended waits for a policy learner step: with
    tasks.max_groups_in_flight = 1 the next episode answers 429 + Retry-After until one names it."""
    cfg = endpoint_cfg(loop_cfg, **{"policy.n": 2, "tasks.max_groups_in_flight": 1, "policy.serve_retry_after_s": 3})
    policy = PolicyAgent(bus, cfg)
    async with running([policy], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        eps = [await post(http, "/coevo/v1/episodes", {"task_id": "bp", "goal": "g"}) for _ in range(2)]
        for ep in eps:
            await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "won"})
        async with http.post("/coevo/v1/episodes", json={"task_id": "bp", "goal": "g"}) as r:
            refused = await r.json()
            assert r.status == 429 and r.headers["Retry-After"] == "3", refused
        assert refused["error"]["code"] == "learner_behind" and "1 groups wait" in refused["error"]["message"]
        stepped = LearnerStepped(
            run_id=bus.run_id,
            source=Source(agent_id="learner-test", role="learner"),
            role="policy",
            version=1,
            samples=2,
            tokens=10,
            loss=0.0,
            kl=0.0,
            clip_fraction=0.0,
            mismatch_kl=0.0,
            tokens_per_second=1.0,
            group_ids=[eps[0]["group_id"]],
        )
        await (await bus.publish(stepped))
        async with asyncio.timeout(30):  # until the policy agent's LearnerStepped consumer delivered it
            while True:
                async with http.post("/coevo/v1/episodes", json={"task_id": "bp", "goal": "g"}) as r:
                    if r.status == 200:
                        break
                    assert r.status == 429, await r.text()
                await asyncio.sleep(0.1)


async def test_open_episodes_stay_bounded_under_concurrent_opens(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg, **{"policy.max_concurrent_trajectories": 2})
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:

        async def open_one(k: int) -> int:
            async with http.post("/coevo/v1/episodes", json={"task_id": f"c{k}", "goal": "g"}) as r:
                return r.status

        statuses = await asyncio.gather(*(open_one(k) for k in range(6)))  # each publishes its own group
    assert sorted(statuses) == [200, 200, 429, 429, 429, 429]


async def test_calls_outside_episodes_are_capped(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg, **{"policy.serve_max_unrecorded": 1})
    policy = PolicyAgent(bus, cfg)
    async with running([policy], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}
        async with policy.endpoint._unrecorded:  # the one slot is taken (as by a long call)
            async with http.post("/v1/chat/completions", json=body) as r:
                assert r.status == 429 and "Retry-After" in r.headers
                assert (await r.json())["error"]["code"] == "too_many_unrecorded_calls"
        await post(http, "/v1/chat/completions", body)
        assert policy.counters["endpoint.calls.unrecorded"] == 1


async def test_what_cannot_be_honoured_is_refused(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg)
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        chat = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}
        refused = [
            ("/v1/chat/completions", {**chat, "tool_choice": "required"}, "tool_choice"),
            (
                "/v1/chat/completions",
                {**chat, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                "tool_choice",
            ),
            ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
            ("/v1/completions", {"prompt": "a", "logprobs": 2}, "logprobs"),
            ("/v1/responses", {"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
            ("/v1/responses", {"input": "a", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ]
        for path, body, param in refused:
            assert (await post(http, path, body, 400))["error"]["param"] == param, (path, body)
        async with http.post(
            "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 2,
                "messages": chat["messages"],
                "thinking": {"type": "enabled", "budget_tokens": 10},
            },
        ) as r:
            err = await r.json()
            assert r.status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        out = await post(http, "/v1/completions", {"prompt": "room", "max_tokens": 30, "stop": STOPS, "logprobs": 0})
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] < 30  # generation stopped
        assert len(choice["logprobs"]["token_logprobs"]) == out["usage"]["completion_tokens"]  # logprobs: 0


def test_output_items_and_content_blocks_convert_back_to_the_recorded_turn() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "move", "arguments": '{"direction": "n"}'}}]
    for text, cs in (("go north", []), ("", calls), ("thinking aloud", calls)):
        recorded = normalize([ra.assistant_message(text, cs)])
        assert normalize(ra.to_messages(ra.output_items(text, cs, None))) == recorded
        req = ma.MessagesRequest(max_tokens=1, messages=[{"role": "assistant", "content": ma.content_blocks(text, cs)}])
        assert normalize(ma.to_messages(req)) == recorded
    with pytest.raises(ApiError, match="not supported"):
        ma.to_messages(
            ma.MessagesRequest(max_tokens=1, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
        )


def test_a_template_that_drops_earlier_reasoning_makes_a_prefix_break(model_cache: Any) -> None:
    """Qwen3-style templates drop the <think> block of earlier assistant turns: the conversation no
    longer extends the tokens sampled, so the prompt is tokenised afresh (never the think tokens)."""
    from transformers import AutoTokenizer

    from coevo.inference.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model("policy", model_cache))
    tok.chat_template = (  # the tiny models' template, but an earlier assistant turn keeps only its answer
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{% set c = m['content'] if loop.last else m['content'].split('</think>')[-1] %}"
        "{{ 'assistant:' + c + eos_token + '\\n' }}{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    chat = ChatTokens(tok)
    first = normalize([{"role": "user", "content": "room 0"}])
    ids, _ = chat.prompt(first)
    sampled = chat.encode("<think>north is safe</think>go north")
    turn = Turn(first, normalize([{"role": "assistant", "content": chat.decode(sampled)}])[0], ids, sampled)
    again = [*first, turn.assistant, *normalize([{"role": "user", "content": "room 1"}])]
    rendered = chat.render(again)
    assert "north is safe" not in rendered and "go north" in rendered  # the template dropped the reasoning
    ids2, how = chat.prompt(again, previous=turn)
    assert how == "diverged" and ids2 == chat.encode(rendered)


def test_a_sampled_special_token_the_text_leaves_out_is_kept(model_cache: Any) -> None:
    """A model may sample a special token (pad) that the returned text leaves out: the next turn still
    builds on the exact sampled ids (a mismatch, counted), not on a fresh tokenisation without it."""
    from transformers import AutoTokenizer

    from coevo.inference.models import ensure_default_model

    chat = ChatTokens(AutoTokenizer.from_pretrained(ensure_default_model("policy", model_cache)))
    first = normalize([{"role": "user", "content": "room 0"}])
    ids, _ = chat.prompt(first)
    sampled = [*chat.encode("go north"), chat.tokenizer.pad_token_id]
    shown = chat.tokenizer.decode(sampled, skip_special_tokens=True)
    assert shown == "go north"
    turn = Turn(first, normalize([{"role": "assistant", "content": shown}])[0], ids, sampled)
    again = [*first, turn.assistant, *normalize([{"role": "user", "content": "room 1"}])]
    ids2, how = chat.prompt(again, previous=turn)
    assert how == "mismatch" and ids2[: len(ids) + len(sampled)] == ids + sampled
    assert ids2[len(ids) + len(sampled) :] == chat.encode(chat.render(again)[len(chat.render(first)) + len(shown) :])


def test_a_stop_string_cut_inside_the_sampled_tokens_makes_a_prefix_break(model_cache: Any) -> None:
    """/v1/completions: the sampled ids hold the start of a multi-token stop string the client never
    saw; the next prompt that extends the shown text is tokenised afresh, not glued to those ids."""
    from transformers import AutoTokenizer

    from coevo.inference.engine import encode_prompt
    from coevo.inference.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model("policy", model_cache))
    prompt = "Q: where?\nA:"
    ids = encode_prompt(tok, prompt)
    response = tok.encode(" north\n\nUser", add_special_tokens=False)  # stop "\n\nUser:" began inside these
    shown = " north"
    nxt = prompt + shown + "\n\nUser: and then?\nA:"
    out, how = completion_prompt(tok, nxt, (prompt, ids, shown, response))
    assert how == "diverged" and out == encode_prompt(tok, nxt)
    clean = tok.encode(" north", add_special_tokens=False)
    if tok.decode(clean, skip_special_tokens=True) == shown:  # the shown text is exactly the ids: reused
        out, how = completion_prompt(tok, nxt, (prompt, ids, shown, clean))
        assert how in ("reused", "mismatch") and out[: len(ids) + len(clean)] == ids + clean


async def test_an_agent_key_rotates_through_episodes(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    """A closed harness keeps one key: its calls belong to that key's current episode, and
    /coevo/v1/episodes/rotate ends that episode and opens the next."""
    cfg = endpoint_cfg(loop_cfg)
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        agent = (await post(http, "/coevo/v1/agent-keys", {}))["agent_key"]
        assert agent.startswith("ak-")
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3}
        async with aiohttp.ClientSession(http._base_url, headers={"x-api-key": agent}) as harness:
            assert (await post(harness, "/v1/chat/completions", body, 409))["error"]["code"] == "no_open_episode"
            first = await post(harness, "/coevo/v1/episodes/rotate", {"task_id": "fixed", "goal": "g"})
            assert (await post(harness, "/v1/chat/completions", body))["coevo"]["episode_id"] == first["episode_id"]
            await post(harness, "/coevo/v1/episodes/rotate", {"task_id": "fixed", "goal": "g"}, 400)  # its outcome?
            second = await post(
                harness, "/coevo/v1/episodes/rotate", {"outcome": "won", "task_id": "fixed", "goal": "g"}
            )
            assert second["episode_id"] != first["episode_id"] and second["group_id"] == first["group_id"]
            assert (await post(harness, "/v1/chat/completions", body))["coevo"]["episode_id"] == second["episode_id"]
            await post(harness, "/coevo/v1/agent-keys", {}, 403)
            await post(harness, f"/coevo/v1/episodes/{second['episode_id']}/finish", {"outcome": "lost"})
            assert (await post(harness, "/v1/chat/completions", body, 409))["error"]["code"] == "no_open_episode"
        events = await wait_events(bus, lambda ev: sum(isinstance(e, TrajectoryCompleted) for e in ev) >= 2)
    ends = {e.trajectory_id: e for e in events if isinstance(e, TrajectoryCompleted)}
    assert ends[first["trajectory_id"]].outcome == "won" and ends[first["trajectory_id"]].num_steps == 1
    assert ends[second["trajectory_id"]].outcome == "lost" and ends[second["trajectory_id"]].num_steps == 1
