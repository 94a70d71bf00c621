"""Integration with a real vLLM server (CPU build): generation, weight swaps, failures, a run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt
from coevo.config import LearnerConfig, PushSync, load_config
from coevo.errors import VLLMError
from coevo.inference.engine import LocalEngine
from coevo.inference.vllm_client import VLLMClient
from coevo.schemas import (
    LearnerStepped,
    TrainingSample,
    TransferConnect,
    TransferEndpoint,
    TransferOffer,
    TransferRequest,
    WeightsApplied,
    transfer_subject,
)
from coevo.training.lane import Lane
from coevo.weights.server import WeightServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = policy_prompt(
    "goal: take the coin. room: hall. items: coin. exits: north attic.", ["go north", "take coin", "take red key"]
)
CHOICES = list(INDEX_LABELS[:3])


def local_choice_logprobs(model_dir: Path, client: VLLMClient) -> list[float]:
    eng = LocalEngine(model_dir)
    ids = torch.tensor([eng._encode(PROMPT)])
    with torch.no_grad():
        logits = eng.model(input_ids=ids).logits[0, -1]
    return torch.log_softmax(logits[client.choice_token_ids(CHOICES)].float(), -1).tolist()


def train_towards(lane: Lane, completion, choice: int) -> tuple[Path, str, int]:
    """One learner step rewarding ``choice`` at the prompt of ``completion``; its checkpoint."""
    good = TrainingSample(
        sample_id="s",
        role="policy",
        prompt_token_ids=completion.prompt_token_ids,
        response_token_ids=[completion.allowed_token_ids[choice]],
        logprobs=[-1.0],
        allowed_token_ids=completion.allowed_token_ids,
        advantage=1.0,
        model_version=0,
        step_event_id="e",
    )
    lane.step([good] * 8, ["g"])
    return lane.checkpoint()


async def test_generation_returns_token_ids_and_sampling_logprobs(vllm_server) -> None:
    url, model = vllm_server
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        c = await client.complete(PROMPT, choices=CHOICES, temperature=1.0)
        assert c.choice is not None and c.response_token_ids == [c.allowed_token_ids[c.choice]]
        assert c.prompt_token_ids == client.encode(PROMPT)
        expected = local_choice_logprobs(model, client) if client.version == 0 else None
        if expected is not None:  # the constrained (processed) log-prob is the one the sampler used
            assert c.logprobs[0] == pytest.approx(expected[c.choice], abs=1e-4)
        g = await client.complete(PROMPT, max_tokens=12, temperature=1.0)
        assert len(g.response_token_ids) == len(g.logprobs) > 0
        assert all(lp <= 0 for lp in g.logprobs)


async def test_a_stop_string_ends_generation_on_the_server(vllm_server) -> None:
    """``stop`` reaches vLLM: greedy generation with the text of two of its own tokens as a stop
    string ends at the first token whose text completes it, those tokens and their log-probs come back
    as sampled, and the text keeps the stop string for the caller to cut (``include_stop_str_in_output``).
    More stop strings than vLLM takes are not an error (the client sends its first 4)."""
    url, model = vllm_server
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        free = await client.complete(PROMPT, max_tokens=16, temperature=0.0)
        ids = free.response_token_ids
        assert len(ids) == 16 and free.finish_reason == "length"

        def text(xs: list[int]) -> str:
            return client.tokenizer.decode(xs, skip_special_tokens=True)

        stop = text(ids[4:6])
        assert stop.strip(), ids
        k = next(k for k in range(1, 17) if stop in text(ids[:k]))  # where it first completes: 6 at the latest
        cut = await client.complete(PROMPT, max_tokens=16, temperature=0.0, stop=[stop, *"\x00\x01\x02\x03\x04"])
        assert cut.finish_reason == "stop"
        assert cut.response_token_ids == ids[:k] and len(cut.logprobs) == k
        assert cut.text.endswith(stop) and stop not in cut.text[:-1]


async def test_a_model_the_server_does_not_serve_is_a_404_naming_the_model(vllm_server) -> None:
    url, model = vllm_server
    async with VLLMClient(url, "not-served", tokenizer_dir=model) as client:
        with pytest.raises(VLLMError, match="does not exist") as caught:
            await client.complete(PROMPT, max_tokens=2)
    assert caught.value.status == 404 and caught.value.param == "model"  # what parity.check branches on


async def test_learner_update_is_pushed_and_outputs_change(vllm_server, tmp_path: Path) -> None:
    url, model = vllm_server
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        before = await client.complete(PROMPT, choices=CHOICES)
        lane = Lane("policy", model, tmp_path, LearnerConfig(lr=5e-2), device="cpu")
        path, _, _ = train_towards(lane, before, 1)
        version = client.version + 7
        pause_ms = await client.swap_weights(path, version)
        assert pause_ms > 0
        assert await client.weight_version() == str(version) and client.version == version
        after = await client.complete(PROMPT, choices=CHOICES)
        assert after.model_version == version
        expected = local_choice_logprobs(path, client)
        assert after.logprobs[0] == pytest.approx(expected[after.choice], abs=1e-4)  # the new weights, all of them


async def test_request_in_flight_during_swap_completes(vllm_server, tmp_path: Path) -> None:
    url, model = vllm_server
    lane = Lane("policy", model, tmp_path, LearnerConfig(), device="cpu")
    path, _, _ = lane.checkpoint()
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        old = client.version
        long = asyncio.ensure_future(client.complete(PROMPT, max_tokens=150, temperature=1.0))
        await asyncio.sleep(0.1)
        await client.swap_weights(path, old + 1)
        done = await long
        assert len(done.response_token_ids) == 150 and done.model_version == old
        assert (await client.complete(PROMPT, choices=CHOICES)).model_version == old + 1


async def test_bad_checkpoint_path_is_refused_and_server_survives(vllm_server, tmp_path: Path) -> None:
    url, model = vllm_server
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        version = client.version
        with pytest.raises(VLLMError, match=r"no \*\.safetensors"):
            await client.swap_weights(tmp_path / "missing", version + 1)
        (tmp_path / "empty").mkdir()
        with pytest.raises(VLLMError):
            await client.swap_weights(tmp_path / "empty", version + 1)
        assert client.version == version
        c = await client.complete(PROMPT, choices=CHOICES)  # the server still serves
        assert c.model_version == version


async def test_learner_pushes_weights_into_vllm_over_gloo(vllm_server, bus, tmp_path: Path) -> None:
    """vLLM's native weight-transfer endpoints, the bytes over gloo (the coevo_gloo backend)."""
    url, model = vllm_server
    lane = Lane("policy", model, tmp_path, LearnerConfig(lr=5e-2), device="cpu")
    base_path, base_sha, _ = lane.checkpoint()
    server = WeightServer(bus, PushSync(transport="gloo", timeout_s=60.0))
    published: dict[str, tuple[int, Path, str]] = {}
    await server.serve("policy", lambda: published["policy"])
    try:
        async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
            before = await client.complete(PROMPT, choices=CHOICES)
            path, sha, _ = train_towards(lane, before, 2)
            version = client.version + 11
            published["policy"] = (version, path, sha)
            ep = await bus.request(
                transfer_subject(bus.run_id, "policy", "connect"),
                TransferConnect(server="vllm-test", workers=await client.workers()),
                TransferEndpoint,
            )
            await client.init_transfer(ep.init_info(), 60.0)

            old = client.version
            long = asyncio.ensure_future(client.complete(PROMPT, max_tokens=150, temperature=1.0))
            await asyncio.sleep(0.1)
            offer = await bus.request(
                transfer_subject(bus.run_id, "policy", "push"),
                TransferRequest(server="vllm-test", version=version, token=ep.token),
                TransferOffer,
                timeout_s=60.0,
            )
            assert offer.version == version and offer.sha256 == sha
            pause_ms = await client.receive_weights(offer, 60.0)
            done = await long  # in flight during the transfer: finished, on the weights that produced it
            assert done.response_token_ids and done.model_version == old  # (EOS may end it before 150)
            assert pause_ms > 0 and await client.weight_version() == str(version) and client.version == version
            after = await client.complete(PROMPT, choices=CHOICES)
            assert after.model_version == version
            expected = local_choice_logprobs(path, client)
            assert after.logprobs[0] == pytest.approx(expected[after.choice], abs=1e-4)  # every tensor arrived
            assert expected != pytest.approx(local_choice_logprobs(model, client), abs=1e-3)  # and it moved

            # the same group serves the next version: back to the base weights, exactly
            published["policy"] = (version + 1, base_path, base_sha)
            offer = await bus.request(
                transfer_subject(bus.run_id, "policy", "push"),
                TransferRequest(server="vllm-test", version=version + 1, token=ep.token),
                TransferOffer,
                timeout_s=60.0,
            )
            await client.receive_weights(offer, 60.0)
            again = await client.complete(PROMPT, choices=CHOICES)
            expected = local_choice_logprobs(model, client)
            assert again.model_version == version + 1
            assert again.logprobs[0] == pytest.approx(expected[again.choice], abs=1e-4)
            async with asyncio.timeout(10):  # the sender records the version once its side of the send returns
                while server.sent != {"vllm-test": version + 1}:
                    await asyncio.sleep(0.01)
    finally:
        await server.aclose()


async def test_policy_agent_falls_back_to_the_checkpoint_when_no_learner_pushes(
    vllm_server, bus, loop_cfg, tmp_path: Path
) -> None:
    """weight_sync gloo: with nobody serving transfers the follower reloads from disk (and says so);
    once a learner serves, the next version is pushed over the group it connects."""
    from coevo.agents.policy import PolicyAgent
    from coevo.runtime.agent import run_agents
    from coevo.schemas import Source, WeightsPublished

    url, model = vllm_server
    cfg = load_config(
        overrides={
            **_dump(loop_cfg),
            "policy.url": url,
            "policy.model": str(model),
            "learner.weight_sync": {"transport": "gloo", "timeout_s": 60.0},
            "learner.publication_root": str(tmp_path),
        }
    )  # where this test publishes
    lane = Lane("policy", model, tmp_path, LearnerConfig(), device="cpu")
    published: dict[str, tuple[int, Path, str]] = {}
    src = Source(agent_id="learner-test", role="learner", model_version=0)

    async def publish(version: int) -> WeightsApplied:
        lane.version = version
        path, sha, size = lane.checkpoint()
        published["policy"] = (version, path, sha)
        await bus.publish_sync(
            WeightsPublished(
                run_id=bus.run_id, source=src, role="policy", version=version, path=str(path), sha256=sha, bytes=size
            )
        )
        async with asyncio.timeout(120):
            while True:
                for e in await bus.events(["weights.applied"]):
                    if isinstance(e, WeightsApplied) and e.version == version and e.server.startswith("policy"):
                        return e
                await asyncio.sleep(0.5)

    stop = asyncio.Event()
    agent = PolicyAgent(bus, cfg)
    server = WeightServer(bus, PushSync(transport="gloo", timeout_s=60.0))

    async def drive() -> None:
        try:
            fallback = await publish(101)
            assert fallback.ok and fallback.transport == "disk" and fallback.error is None
            await server.serve("policy", lambda: published["policy"])
            pushed = await publish(102)
            assert pushed.ok and pushed.transport == "gloo" and server.sent == {agent.agent_id: 102}
            async with VLLMClient(url, str(model), tokenizer_dir=model) as probe:
                assert await probe.weight_version() == "102"
        finally:
            stop.set()

    try:
        await asyncio.gather(run_agents([agent], handle_signals=False, until=stop), drive())
    finally:
        await server.aclose()


@pytest.mark.parametrize("weight_sync", ["disk", "gloo"])
async def test_run_trains_against_vllm_and_its_weight_version_advances(
    vllm_server, bus, loop_cfg, weight_sync: str
) -> None:
    from coevo.loop import build_agents
    from coevo.runtime.agent import run_agents

    url, model = vllm_server
    cfg = load_config(
        overrides={
            **{k: v for k, v in _dump(loop_cfg).items()},
            "policy.url": url,
            "policy.model": str(model),
            "learner.batch_samples": 8,
            "learner.weight_sync": weight_sync,
        }
    )
    async with VLLMClient(url, str(model), tokenizer_dir=model) as probe:  # the server is shared by tests
        await probe._call("POST", "/update_weight_version", json={"new_version": "before-this-run"})
        start = _version(await probe.weight_version())
    stop = asyncio.Event()

    async def until() -> None:
        async with asyncio.timeout(300):
            while True:
                applied = [
                    e
                    for e in await bus.events(["weights.applied"])
                    if isinstance(e, WeightsApplied) and e.role == "policy" and e.ok
                ]
                served = [e for e in await bus.events(["step.taken"]) if e.policy_version >= 1]
                if len(applied) >= 2 and served:  # trained weights applied, and tokens sampled from them
                    break
                await asyncio.sleep(1)
        stop.set()

    await asyncio.gather(run_agents(build_agents(bus, cfg), handle_signals=False, until=stop), until())
    steps = [
        e
        for e in await bus.events(["learner.stepped"])
        if isinstance(e, LearnerStepped) and e.role == "policy" and e.is_step
    ]
    async with VLLMClient(url, str(model), tokenizer_dir=model) as probe:
        now = _version(await probe.weight_version())
    applied = [
        e.version
        for e in await bus.events(["weights.applied"])
        if isinstance(e, WeightsApplied) and e.role == "policy" and e.ok and e.server.startswith("policy")
    ]
    assert applied == sorted(applied) and len(set(applied)) >= 2  # the server moved through this run's versions
    transports = {
        e.transport
        for e in await bus.events(["weights.applied"])
        if isinstance(e, WeightsApplied) and e.server.startswith("policy")
    }
    assert transports == {weight_sync}  # pushed by the learner when asked to, with no fallback to disk
    assert now != start and now == applied[-1] and now in {0} | {s.version for s in steps}
    taken = [e for e in await bus.events(["step.taken"])]
    assert {t.policy_version for t in taken} >= {0} and max(t.policy_version for t in taken) >= 1


def _version(text: str) -> int:
    return int(text) if text.isdigit() else -1  # a fresh server says "default"


def _dump(cfg) -> dict:
    out = {}
    for section in ("run", "env", "policy", "judge", "tasks", "learner", "bus", "agent", "nats", "log"):
        for key, value in getattr(cfg, section).model_dump(mode="json").items():
            if value is not None:
                out[f"{section}.{key}"] = value
    return out


async def test_a_judge_served_by_vllm_is_trained_and_follows_the_judge_lane(vllm_server, bus, loop_cfg) -> None:
    """judge.backend vllm with judge.model the directory the server serves: the learner trains a judge
    lane from it and pushes each version into that server (the policy plays on a local engine)."""
    from coevo.loop import build_agents
    from coevo.runtime.agent import run_agents

    url, model = vllm_server
    cfg = load_config(
        overrides={
            **_dump(loop_cfg),
            "judge.backend": "vllm",
            "judge.url": url,
            "judge.model": str(model),
            "judge.mode": "verdict",
            "learner.batch_samples": 8,
            "learner.weight_sync": "gloo",
        }
    )
    assert cfg.trains_judge
    stop = asyncio.Event()

    def judge_applied(events: list) -> list[WeightsApplied]:
        return [e for e in events if isinstance(e, WeightsApplied) and e.role == "judge" and e.ok]

    async def until() -> None:
        try:
            async with asyncio.timeout(300):
                while len({e.version for e in judge_applied(await bus.events(["weights.applied"]))}) < 2:
                    await asyncio.sleep(1)
        finally:
            stop.set()

    await asyncio.gather(run_agents(build_agents(bus, cfg), handle_signals=False, until=stop), until())
    applied = judge_applied(await bus.events(["weights.applied"]))
    steps = [
        e
        for e in await bus.events(["learner.stepped"])
        if isinstance(e, LearnerStepped) and e.role == "judge" and e.is_step
    ]
    versions = sorted({e.version for e in applied})
    assert len(versions) >= 2, versions  # what until() waited for, else it timed out
    second = versions[1]
    # the versions the run waited for came by gloo; one the learner pushes as the agents stop may find
    # the judge's receiver gone (NoResponders) and go by disk, its documented fallback
    assert steps and second >= 1 and {e.transport for e in applied if e.version <= second} == {"gloo"}
    async with VLLMClient(url, str(model), tokenizer_dir=model) as probe:
        assert _version(await probe.weight_version()) == max(e.version for e in applied)


async def test_a_grammar_vllm_holds_is_the_distribution_the_learner_computes(vllm_server, tmp_path: Path) -> None:
    """vLLM draws under the grammar (xgrammar, ``structured_outputs.grammar``); the learner, replaying it
    over the sampled tokens, computes the log-probs vLLM sampled with: mismatch KL per token within
    0.01 of unconstrained sampling's. Without the masks the learner would train another distribution."""
    import json

    from coevo.inference.grammar import tool_call_grammar
    from coevo.training.parity import as_sample
    from tests.test_grammar import TOOLS, check_answer
    from tests.test_structured import BUDGET

    url, model = vllm_server
    grammar = tool_call_grammar(TOOLS)
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        await client.swap_weights(model, 0)  # the server is shared: tests before this one pushed trained weights
        held = await asyncio.gather(
            *(
                client.complete("answer:", max_tokens=BUDGET, temperature=1.0, index=i, grammar=grammar)
                for i in range(12)
            )
        )
        free = await asyncio.gather(
            *(client.complete("answer:", max_tokens=40, temperature=1.0, index=i) for i in range(12))
        )
    for c in held:
        assert c.finish_reason == "stop", c
        call = json.loads(c.text.strip().removeprefix("<tool_call>").removesuffix("</tool_call>"))
        if call["name"] == "go":
            check_answer(call["arguments"])

    def samples(done, grammar: str | None) -> list[TrainingSample]:
        return [as_sample(c, f"v{i}", "policy", grammar=grammar) for i, c in enumerate(done)]

    lane = Lane("policy", model, tmp_path / "lane", LearnerConfig(), temperature=1.0, device="cpu")
    constrained = samples(held, grammar)
    assert all(lane.sample_problem(s) is None for s in constrained)
    masked, plain = lane.mismatch_kl(constrained), lane.mismatch_kl(samples(free, None))
    unmasked = lane.mismatch_kl(samples(held, None))
    print(f"vLLM mismatch KL per token: grammar+masks {masked:.2e}, grammar unmasked {unmasked:.3f}, free {plain:.2e}")
    assert masked < plain + 0.01, (masked, plain)
    assert unmasked > 0.5, unmasked


async def test_the_endpoint_of_a_vllm_served_policy_holds_structured_outputs_and_trains_them_exactly(
    vllm_server, bus, loop_cfg, tmp_path: Path
) -> None:
    """The policy endpoint in front of vLLM: the openai SDK's ``response_format`` and
    ``tool_choice="required"`` go to vLLM as its grammar, the answers parse, and the learner's
    log-probs of the recorded steps are vLLM's."""

    import openai

    from coevo.agents.policy import PolicyAgent
    from tests.test_byo_apis import steps_of
    from tests.test_byo_endpoint import endpoint_cfg, post, running
    from tests.test_structured import as_samples, json_then_a_forced_tool

    url, model = vllm_server
    async with VLLMClient(url, str(model), tokenizer_dir=model) as client:
        await client.swap_weights(model, 0)  # base weights, as the lane below starts from
    cfg = endpoint_cfg(loop_cfg, **{"policy.url": url, "policy.model": str(model)})
    base = f"http://127.0.0.1:{cfg.policy.serve_port}"
    async with running([PolicyAgent(bus, cfg)], base) as http:
        ep = await post(http, "/coevo/v1/episodes", {"task_id": "vllm-structured", "goal": "answer"})
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key=ep["key"], max_retries=0)
        await json_then_a_forced_tool(oai)
        await post(http, f"/coevo/v1/episodes/{ep['episode_id']}/finish", {"outcome": "won"})
        await oai.close()
        steps = await steps_of(bus, ep["trajectory_id"])
    assert len(steps) == 2 and all(s.grammar for s in steps)
    lane = Lane("policy", model, tmp_path / "lane", LearnerConfig(), temperature=cfg.policy.temperature, device="cpu")
    samples = as_samples(steps)
    assert all(lane.sample_problem(s) is None for s in samples)
    assert lane.mismatch_kl(samples) < 0.01
