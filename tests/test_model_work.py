"""The model work of the loop, on the tiny models (issue 37, items 3 and 7): requests that share a
prompt share one forward pass and still draw one sample each, as before; a stopped learner leaves
no future whose failure nobody reads; a GGUF file is hashed once per process. The real learner,
engines and server; the real model's loop is in tests/test_smollm2.py."""

from __future__ import annotations

import asyncio
import gc
import math
from pathlib import Path
from typing import Any

import pytest

from coevo.agents.judge import ask
from coevo.algorithm.prompts import INDEX_LABELS, VERDICT_LABELS, judge_prompt, policy_prompt
from coevo.config import CoevoConfig, LearnerConfig, LocalJudge
from coevo.errors import Retry
from coevo.inference import gguf
from coevo.inference.engine import LocalEngine, distinct_rows
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored, Source
from coevo.training.lane import Lane
from coevo.training.learner import LaneQueue, LearnerAgent
from tests.test_training import choice_samples, tiny  # noqa: F401  (the module-scoped model fixture)

PROMPT = judge_prompt("take the coin", "room: hall. items: coin.", "take coin", "you hold the coin.", "verdict")


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from coevo.inference.models import ensure_default_model

    return ensure_default_model("judge", tmp_path_factory.mktemp("judge"))


def test_distinct_rows_keeps_first_seen_order_and_maps_every_request() -> None:
    distinct, row = distinct_rows([[1, 2], [3], [1, 2], [3], [4, 5, 6], [1, 2]])
    assert distinct == [[1, 2], [3], [4, 5, 6]]
    assert row == [0, 1, 0, 1, 2, 0]
    assert distinct_rows([]) == ([], [])


async def test_m_verdict_votes_on_a_step_take_one_forward_and_draw_as_m_separate_rows_did(judge_model: Path) -> None:
    """The judge's ``m`` votes on one step (asked at once, as ``JudgeAgent.on_step`` does) run the
    prompt through the model once; each vote still draws its own sample from the same generator,
    in order: the same choices and log-probs as one forward pass per vote (asked one by one)."""
    cfg = LocalJudge(m=5)
    async with LocalEngine(judge_model, name="judge", device="cpu", seed=7) as together:
        votes = await asyncio.gather(*(ask(together, cfg, PROMPT, j) for j in range(cfg.m)))
        assert together.rows_computed == 1
    async with LocalEngine(judge_model, name="judge", device="cpu", seed=7) as alone:
        alone.choice_cache_size = 0  # as before: every request its own forward pass
        one_by_one = [await ask(alone, cfg, PROMPT, j) for j in range(cfg.m)]
        assert alone.rows_computed == cfg.m
    assert [c.choice for c, _, _ in votes] == [c.choice for c, _, _ in one_by_one]
    for (c, value, status), (c1, _, _) in zip(votes, one_by_one, strict=True):
        assert status == "ok" and value == (1 if c.choice == 0 else -1)  # parsed as before: '+' is +1
        assert c.text == VERDICT_LABELS[c.choice] and c.allowed_token_ids == c1.allowed_token_ids
        assert c.prompt_token_ids == c1.prompt_token_ids
        assert math.isclose(c.logprobs[0], c1.logprobs[0], abs_tol=1e-4)


async def test_votes_sharing_a_forward_follow_the_models_distribution(judge_model: Path) -> None:
    """Many votes on one prompt, over several batches: the share of '+' is the probability the model
    gives it (binomial bounds), from one forward pass in all."""
    cfg = LocalJudge(m=1, temperature=1.0)
    n = 400
    async with LocalEngine(judge_model, name="judge", device="cpu", seed=3, max_batch=64) as engine:
        votes = await asyncio.gather(*(ask(engine, cfg, PROMPT, j) for j in range(n)))
        assert engine.rows_computed == 1
    plus = [c for c, value, _ in votes if value == 1]
    minus = [c for c, value, _ in votes if value == -1]
    p = math.exp(plus[0].logprobs[0]) if plus else 1 - math.exp(minus[0].logprobs[0])
    assert all(math.isclose(math.exp(c.logprobs[0]), p, abs_tol=1e-5) for c in plus)
    assert all(math.isclose(math.exp(c.logprobs[0]), 1 - p, abs_tol=1e-5) for c in minus)
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(len(plus) / n - p) < 4 * sd + 1e-9, (len(plus) / n, p)


async def test_generating_requests_run_as_one_batch_and_each_row_is_what_the_learner_computes(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Prompts of different lengths (left-padded together), budgets and stop strings: one forward pass per
    token of the longest response, and every row's log-probs are the learner's on its own, unpadded row."""
    from coevo.inference.grammar import json_grammar
    from coevo.training.parity import PROMPTS, as_sample

    grammar = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    lane = Lane("policy", tiny, tmp_path / "lane", LearnerConfig(), temperature=0.9, device="cpu")
    async with LocalEngine(tiny, seed=5) as engine:
        # compiled first: a request whose grammar is still compiling joins a later batch (the others do not wait)
        await engine.grammars.compiled_async(grammar)
        done = await asyncio.gather(
            *(
                engine.complete(
                    PROMPTS[i % len(PROMPTS)],
                    max_tokens=6 + 4 * i,
                    temperature=0.9,
                    stop=["coin"] if i % 3 == 0 else None,
                    grammar=grammar if i == 4 else None,
                )
                for i in range(10)
            ),
            engine.complete(PROMPTS[0], max_tokens=0),  # no budget: no token, no forward pass of its own
        )
    *done, empty = done
    assert empty.response_token_ids == [] and empty.finish_reason == "length" and empty.prompt_token_ids
    lengths = [len(c.response_token_ids) for c in done]
    assert len({len(c.prompt_token_ids) for c in done}) >= 3 and sum(lengths) > 100  # left-padded together
    assert all(n <= 6 + 4 * i for i, n in enumerate(lengths))
    assert engine.generate_passes == max(lengths) < sum(lengths)  # together, not one request after another
    # counted: every prompt left-padded to the longest, then one position a row a pass, a finished row's padding
    width, n = max(len(c.prompt_token_ids) for c in done), len(done)
    rode_along = sum(n - sum(k >= p for k in lengths) for p in range(2, max(lengths) + 1))
    assert engine.work()["tokens"] == n * width + n * (max(lengths) - 1)
    assert engine.work()["padding"] == n * width - sum(len(c.prompt_token_ids) for c in done) + rode_along > 0
    assert engine.busy_s > 0 and engine.work()["rows"] == 0  # no constrained batch
    samples = [
        as_sample(c, f"g{i}", "policy", grammar=grammar if i == 4 else None)
        for i, c in enumerate(done)
        if c.response_token_ids
    ]
    assert lane.mismatch_kl(samples) < 1e-6


async def test_a_groups_rollouts_at_one_observation_share_its_forward(tiny: Path) -> None:  # noqa: F811
    """The ``n`` rollouts of a group start from one observation: one row, ``n`` draws; distinct
    observations in the same batch keep their own rows."""
    first = policy_prompt("goal: take the coin. room: hall. items: coin.", ["go north", "take coin"])
    other = policy_prompt("goal: take the coin. room: attic. items: none.", ["go south", "wait"])
    labels = list(INDEX_LABELS[:2])
    async with LocalEngine(tiny, name="policy", device="cpu", seed=1) as engine:
        done = await asyncio.gather(
            *(engine.complete(first, choices=labels) for _ in range(8)),
            *(engine.complete(other, choices=labels) for _ in range(3)),
        )
        assert engine.rows_computed == 2
    lengths = sorted({len(c.prompt_token_ids) for c in done})
    assert len(lengths) == 2 and engine.work() == {
        "busy_ms": round(engine.busy_s * 1e3),
        "rows": 2,
        "tokens": 2 * lengths[1],  # the shorter row padded to the longer
        "padding": lengths[1] - lengths[0],
    }
    assert {tuple(c.prompt_token_ids) for c in done[:8]} == {tuple(done[0].prompt_token_ids)}
    assert done[8].prompt_token_ids != done[0].prompt_token_ids


async def test_a_request_given_up_while_queued_costs_no_forward(tiny: Path) -> None:  # noqa: F811
    """One request a batch: the second waits in the queue while the first runs; its waiter is
    cancelled meanwhile (a judge whose group was scored), and the engine drops it unrun."""
    labels = list(INDEX_LABELS[:2])
    prompts = [policy_prompt(f"goal: take the coin. room: {room}.", ["go north", "take coin"]) for room in "abc"]
    async with LocalEngine(tiny, name="judge", device="cpu", seed=1, max_batch=1) as engine:
        first = asyncio.ensure_future(engine.complete(prompts[0], choices=labels))
        given_up = asyncio.ensure_future(engine.complete(prompts[1], choices=labels))
        await asyncio.sleep(0)  # both queued
        given_up.cancel()
        await first
        await engine.complete(prompts[2], choices=labels)
        assert engine.rows_computed == 2 and engine.requests_dropped == 1
    assert given_up.cancelled()


async def test_a_state_met_again_costs_no_forward_until_the_weights_change(tiny: Path) -> None:  # noqa: F811
    """A prompt asked again in a later batch (another trajectory reaching the same state) is served
    from the logits kept for the weights served now; a swap drops them: the new weights' are computed."""
    import torch

    prompt = policy_prompt("goal: take the coin. room: hall. items: coin.", ["go north", "take coin"])
    labels = list(INDEX_LABELS[:2])
    async with LocalEngine(tiny, name="policy", device="cpu", seed=1) as engine:
        before = await engine.complete(prompt, choices=labels)
        again = await engine.complete(prompt, choices=labels)
        assert engine.rows_computed == 1
        assert again.choice != before.choice or again.logprobs == before.logprobs  # the same distribution
        state = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
        await engine.swap_tensors(state, 1)
        after = [await engine.complete(prompt, choices=labels) for _ in range(2)]
        assert engine.rows_computed == 2 and {c.model_version for c in after} == {1}
    fresh = torch.log_softmax(_next_logits(engine, prompt, labels), -1)
    assert all(math.isclose(c.logprobs[0], float(fresh[c.choice]), abs_tol=1e-4) for c in after)


def _next_logits(engine: LocalEngine, prompt: str, labels: list[str]) -> Any:
    import torch

    ids = torch.tensor([engine._encode(prompt)])
    with torch.no_grad():
        return engine.model(input_ids=ids).logits[0, -1, engine.choice_token_ids(labels)].float()


def test_the_learner_runs_equal_rows_once_and_their_gradient_is_the_sum_of_the_rows(tiny: Path) -> None:  # noqa: F811
    """Samples of a group's rollouts at one state (one prompt, one choice) are equal rows: the model
    runs each distinct row once, and the log-probs and the gradient are those of every row run alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from coevo.training.batch import to_tensors
    from coevo.training.loss import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny)
    samples = choice_samples(tiny, 8)  # one prompt, two choices: at most two distinct rows
    t = to_tensors(samples, model.config.vocab_size)
    distinct = len({(tuple(s.prompt_token_ids), tuple(s.response_token_ids)) for s in samples})
    assert distinct < len(samples)
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    weights = torch.linspace(-1.0, 1.0, len(samples))[:, None]  # rows weigh differently, as advantages do
    together = token_logprobs(model, t.input_ids, t.attention_mask, t.response_mask, t.allowed, 0.7)
    (together * weights).sum().backward()
    hook.remove()
    assert rows == [distinct]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = torch.cat(
        [
            token_logprobs(
                model,
                t.input_ids[i : i + 1],
                t.attention_mask[i : i + 1],
                t.response_mask[i : i + 1],
                t.allowed[i : i + 1] if t.allowed is not None else None,
                0.7,
            )
            for i in range(len(samples))
        ]
    )
    (alone * weights).sum().backward()
    assert torch.allclose(together, alone, atol=1e-5)
    assert all(torch.allclose(grads[n], p.grad, atol=1e-5) for n, p in model.named_parameters() if n in grads)


# ---- item 7: a stopped learner leaves no unretrieved future -------------------------------------------


def _scored(bus: NatsBus, group_id: str, samples: list[Any]) -> GroupScored:
    return GroupScored(
        run_id=bus.run_id,
        source=Source(agent_id="scorer-test", role="scorer"),
        task_id="t",
        group_id=group_id,
        purpose="train",
        accuracy=0.5,
        n_trajectories=4,
        policy_band_ok=True,
        judge_band_ok=False,
        policy_samples=samples,
    )


async def test_a_lane_stopped_with_groups_queued_leaves_no_future_exception_unretrieved(
    bus: NatsBus,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """At stop the consumer cancels the handlers still waiting (drain timeout), then the lane
    releases their groups (Retry): a handler still waiting gets its Retry (it is nak'd), one cancelled
    already is not an error, and nothing reaches the loop's exception handler as "Future exception
    was never retrieved"; the release is logged once, with its count."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        learner = LearnerAgent(bus, CoevoConfig(run={"runs_dir": tmp_path}))
        q = LaneQueue(Lane("policy", tiny, tmp_path / "ckpt", LearnerConfig(), device="cpu"))
        learner.lanes["policy"] = q
        samples = await asyncio.to_thread(choice_samples, tiny, 4)
        cancelled = asyncio.create_task(learner.on_scored(_scored(bus, "g-cancelled", samples), None))  # type: ignore[arg-type]
        waiting = asyncio.create_task(learner.on_scored(_scored(bus, "g-waiting", samples), None))  # type: ignore[arg-type]
        while len(q.queued) < 2:
            q.arrived.clear()
            await q.arrived.wait()
        cancelled.cancel()  # the drain timeout ran out for this handler
        await asyncio.gather(cancelled, return_exceptions=True)
        learner.release("policy", q)
        with pytest.raises(Retry, match="policy lane stopped"):
            await waiting
        del cancelled, waiting
        gc.collect()
        await asyncio.sleep(0)  # a report scheduled by a finaliser runs now
    finally:
        loop.set_exception_handler(None)
    assert reported == []
    assert learner.counters["groups.released.policy"] == 2


# ---- a GGUF file is hashed once --------------------------------------------------------------------------


def test_a_gguf_files_digest_is_read_once_per_process_while_it_is_unchanged(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 4096)
    first = gguf.file_digest(f)
    hits = gguf._digest.cache_info().hits
    assert gguf.file_digest(f) == first and gguf._digest.cache_info().hits == hits + 1
    f.write_bytes(b"GGUF" + b"\1" * 4097)  # changed: read again
    assert gguf.file_digest(f) != first
