"""Structured outputs through the policy endpoint, with the official SDKs on a real NATS server: a
forced tool call or a JSON schema is held by a grammar, the answer parses against its schema, the
recorded step carries the grammar, and the learner's log-probs of it are the sampler's."""

from __future__ import annotations

import json
import math
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, Field

from coevo.agents.policy import PolicyAgent
from coevo.agents.scorer import make_sample
from coevo.config import CoevoConfig
from coevo.inference.clients import model_dir
from coevo.runtime.bus import NatsBus
from coevo.schemas import StepTaken, TrainingSample
from coevo.training.lane import Lane
from tests.test_byo_apis import steps_of
from tests.test_byo_endpoint import endpoint_cfg, need, post, running
from tests.test_grammar import ANSWER, check_answer


class Move(BaseModel):
    """What the frameworks ask for (their users' pydantic model)."""

    move: Literal["north", "south", "take coin"]
    sure: bool
    steps: int = Field(ge=0, le=99)


class State(TypedDict):
    question: str
    answer: Move | None


BUDGET = 200
"""tokens: the tiny model writes a character a token or so, and an answer or a call is under 150"""


def as_samples(steps: list[StepTaken]) -> list[TrainingSample]:
    """The recorded steps as the scorer makes them samples (advantage 0: the test sets its own)."""
    return [make_sample(s.event_id, "policy", s, 0.0, s.policy_version, s.event_id) for s in steps]


async def json_then_a_forced_tool(oai: Any) -> None:
    """Through the openai SDK, in one conversation: an answer under ``response_format`` json_schema,
    then a call ``tool_choice="required"`` forces; each parses against ``ANSWER``."""
    go = {"type": "function", "function": {"name": "go", "description": "walk", "parameters": ANSWER}}
    msgs: list[Any] = [{"role": "user", "content": "where to?"}]
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r1 = await oai.chat.completions.create(model="m", messages=msgs, response_format=schema, max_tokens=BUDGET)
    check_answer(json.loads(r1.choices[0].message.content or ""))
    msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "now walk."}]
    r2 = await oai.chat.completions.create(
        model="m", messages=msgs, tools=[go], tool_choice="required", max_tokens=BUDGET
    )
    (call,) = r2.choices[0].message.tool_calls or []
    assert r2.choices[0].finish_reason == "tool_calls" and call.function.name == "go"
    check_answer(json.loads(call.function.arguments))


def trains(lane: Lane, samples: list[TrainingSample]) -> None:
    """A learner step on the samples (signed advantages): all of them trained, under their masks."""
    signed = [s.model_copy(update={"advantage": 1.0 if i % 2 else -1.0}) for i, s in enumerate(samples)]
    step = lane.step(signed, ["structured"])
    assert step.samples == len(samples) and step.optimizer_steps >= 1 and math.isfinite(step.loss)
    assert step.mismatch_kl < 1e-4, step  # the step's own measure: behaviour vs proximal log-probs


async def test_openai_and_anthropic_sdks_get_what_their_schemas_ask_and_it_is_trained_exactly(
    bus: NatsBus, loop_cfg: CoevoConfig, tmp_path: Any
) -> None:
    need("openai")
    need("anthropic")
    import anthropic
    import openai

    cfg = endpoint_cfg(loop_cfg)
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    async with running([PolicyAgent(bus, cfg)], base) as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "structured-1", "goal": "answer in JSON"})
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key=ep["key"], max_retries=0)
        await json_then_a_forced_tool(oai)
        r3 = await oai.responses.create(
            model="m",
            input="and then?",
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
            max_output_tokens=BUDGET,
        )
        check_answer(json.loads(r3.output_text))
        assert r3.text.format.type == "json_schema"
        claude = anthropic.AsyncAnthropic(base_url=base, api_key=ep["key"], max_retries=0)
        m4 = await claude.messages.create(
            model="m",
            max_tokens=BUDGET,
            messages=[{"role": "user", "content": "walk."}],
            tools=[{"name": "go", "description": "walk", "input_schema": ANSWER}],
            tool_choice={"type": "any"},
        )
        (use,) = [b for b in m4.content if b.type == "tool_use"]
        assert m4.stop_reason == "tool_use" and use.name == "go"
        check_answer(dict(use.input))  # type: ignore[arg-type]
        await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "won"})
        await oai.close()
        await claude.close()
        steps = await steps_of(bus, ep["trajectory_id"])
    assert len(steps) == 4 and all(s.grammar for s in steps)
    assert "<tool_call>" in steps[1].grammar and "<tool_call>" not in steps[0].grammar  # type: ignore[operator]
    policy = model_dir(cfg, "policy")
    lane = Lane("policy", policy, tmp_path / "lane", cfg.learner, temperature=cfg.policy.temperature, device="cpu")
    samples = as_samples(steps)
    assert all(lane.sample_problem(s) is None for s in samples)
    assert lane.mismatch_kl(samples) < 1e-4  # the learner computes the distribution each token was drawn from
    assert lane.mismatch_kl([s.model_copy(update={"grammar": None}) for s in samples]) > 0.5
    trains(lane, samples)


async def test_structured_output_requests_that_cannot_be_held_are_refused_naming_the_parameter(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    cfg = endpoint_cfg(loop_cfg)
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        chat = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}
        tools = [{"type": "function", "function": {"name": "go", "parameters": ANSWER}}]
        refused = [
            ("/v1/chat/completions", {**chat, "tool_choice": "required"}, "tool_choice", "no tools"),
            (
                "/v1/chat/completions",
                {**chat, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
                "tool_choice",
                "'fly'",
            ),
            ("/v1/chat/completions", {**chat, "tool_choice": "sometimes"}, "tool_choice", "expected"),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}, "response_format", "schema"),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}}, "response_format", "'xml'"),
            (
                "/v1/chat/completions",
                {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                "response_format",
                "not supported",
            ),
            ("/v1/responses", {"input": "a", "text": {"format": {"type": "json_schema"}}}, "text.format", "schema"),
            # keywords the grammar cannot enforce: refused naming them, never compiled with them dropped
            (
                "/v1/chat/completions",
                {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
                "response_format",
                "not (at #)",
            ),
            (
                "/v1/responses",
                {
                    "input": "a",
                    "text": {"format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}},
                },
                "text.format",
                "uniqueItems",
            ),
            (
                "/v1/chat/completions",
                {
                    **chat,
                    "tools": [{"type": "function", "function": {"name": "g", "parameters": {"contains": {}}}}],
                    "tool_choice": "required",
                },
                "tool_choice",
                "contains",
            ),
            # over a budget: refused naming the limit, before anything compiles it
            (
                "/v1/chat/completions",
                {
                    **chat,
                    "response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": list(range(5000))}}},
                },
                "response_format",
                "policy.grammar.max_enum_values",
            ),
            # accepted and ignored before: the legacy function calling, and response_format on Completions
            (
                "/v1/chat/completions",
                {**chat, "functions": [{"name": "go", "parameters": ANSWER}]},
                "functions",
                "tools",
            ),
            ("/v1/chat/completions", {**chat, "function_call": "auto"}, "function_call", "tool_choice"),
            (
                "/v1/completions",
                {"prompt": "a", "max_tokens": 2, "response_format": {"type": "json_object"}},
                "response_format",
                "/v1/completions",
            ),
            (
                "/v1/responses",
                {"input": "a", "tool_choice": {"type": "function", "name": "x"}},
                "tool_choice",
                "no tools",
            ),
        ]
        for path, body, param, says in refused:
            err = (await post(http, path, body, 400))["error"]
            assert err["param"] == param and says in err["message"], (path, body, err)
        async with http.post(
            "/v1/messages", json={**chat, "tool_choice": {"type": "tool", "name": "fly"}, "tools": []}
        ) as r:
            err = await r.json()
            assert r.status == 400 and "no tools" in err["error"]["message"], err


async def test_pydantic_ai_agents_sdk_and_langgraph_structured_modes_are_held_and_trained_exactly(
    bus: NatsBus, loop_cfg: CoevoConfig, tmp_path: Any
) -> None:
    """Each framework's own structured mode, as its users write it: pydantic-ai's ``output_type`` (a
    forced output tool), the Agents SDK's ``output_type`` (Responses ``text.format`` json_schema),
    LangChain's ``with_structured_output`` in a LangGraph node (``response_format`` json_schema). Each
    gets a validated ``Move`` from a random model, and every recorded step is trained exactly."""
    for module in ("pydantic_ai", "agents", "langgraph", "langchain_openai"):
        need(module)
    from agents import Agent as SdkAgent
    from agents import ModelSettings, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings as PaiSettings

    set_tracing_disabled(True)
    cfg = endpoint_cfg(loop_cfg)
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    trajectories: list[str] = []
    async with running([PolicyAgent(bus, cfg)], base) as http:

        async def episode(task: str) -> dict[str, Any]:
            ep = await post(http, "/coevo/v1/episodes", {"task_id": task, "goal": "move"})
            trajectories.append(ep["trajectory_id"])
            return ep

        async def finish(ep: dict[str, Any]) -> None:
            await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "won"})

        ep = await episode("pai")
        model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=f"{base}/v1", api_key=ep["key"]))
        pai = Agent(model, output_type=Move, instructions="choose a move", retries=0)
        result = await pai.run("where to?", model_settings=PaiSettings(max_tokens=BUDGET))
        assert isinstance(result.output, Move)
        await finish(ep)

        ep = await episode("sdk")
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key=ep["key"], max_retries=0)
        sdk = SdkAgent(name="mover", instructions="choose a move", output_type=Move)
        config = RunConfig(
            model=OpenAIResponsesModel("m", openai_client=client), model_settings=ModelSettings(max_tokens=BUDGET)
        )
        run = await Runner.run(sdk, "where to?", run_config=config, max_turns=1)
        assert isinstance(run.final_output, Move)
        await client.close()
        await finish(ep)

        ep = await episode("langgraph")
        chat = ChatOpenAI(model="m", base_url=f"{base}/v1", api_key=ep["key"], max_tokens=BUDGET, max_retries=0)
        structured = chat.with_structured_output(Move)

        async def decide(state: State) -> dict[str, Any]:
            return {"answer": await structured.ainvoke(state["question"])}

        graph = StateGraph(State)
        graph.add_node("decide", decide)
        graph.add_edge(START, "decide")
        graph.add_edge("decide", END)
        out = await graph.compile().ainvoke({"question": "where to?", "answer": None})
        assert isinstance(out["answer"], Move)
        await finish(ep)
        steps = [s for t in trajectories for s in await steps_of(bus, t)]
    assert len(steps) == 3 and all(s.grammar for s in steps), [s.grammar is not None for s in steps]
    assert "<tool_call>" in (steps[0].grammar or "")  # pydantic-ai: a forced output tool
    lane = Lane(
        "policy",
        model_dir(cfg, "policy"),
        tmp_path / "lane",
        cfg.learner,
        temperature=cfg.policy.temperature,
        device="cpu",
    )
    samples = as_samples(steps)
    assert all(lane.sample_problem(s) is None for s in samples)
    assert lane.mismatch_kl(samples) < 1e-4
    trains(lane, samples)


async def test_sampling_knobs_the_learner_would_not_reproduce_are_counted_or_refused_when_strict(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}
    lenient = endpoint_cfg(loop_cfg)
    policy = PolicyAgent(bus, lenient)
    async with running([policy], f"http://127.0.0.1:{lenient.policy.serve_port}") as http:
        await post(http, "/v1/chat/completions", {**chat, "temperature": 0.2, "presence_penalty": 1.5})
        await post(http, "/v1/chat/completions", {**chat, "temperature": lenient.policy.temperature, "seed": 3})
    assert policy.counters["endpoint.knobs_ignored.temperature"] == 1
    assert policy.counters["endpoint.knobs_ignored.presence_penalty"] == 1
    strict = endpoint_cfg(loop_cfg, **{"policy.serve_strict": True})
    async with running([PolicyAgent(bus, strict)], f"http://127.0.0.1:{strict.policy.serve_port}") as http:
        for path, body, param in [
            ("/v1/chat/completions", {**chat, "temperature": 0.2}, "temperature"),
            ("/v1/chat/completions", {**chat, "logit_bias": {"5": 10}}, "logit_bias"),
            ("/v1/completions", {"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty"),
            ("/v1/responses", {"input": "a", "top_p": 0.5}, "top_p"),
        ]:
            err = (await post(http, path, body, 400))["error"]
            assert err["param"] == param and "serve_strict" in err["message"], err
        async with http.post("/v1/messages", json={**chat, "top_k": 5}) as r:
            assert r.status == 400 and "top_k" in (await r.json())["error"]["message"]
        # what the policy samples with anyway is served, strict or not
        await post(http, "/v1/chat/completions", {**chat, "temperature": strict.policy.temperature, "top_p": 1.0})
