"""Structured outputs trained exactly: what a grammar lets the sampler draw is what the learner's
log-probs are of (the masks replayed over the sampled tokens), on the real tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coevo.bench.parity import STRUCTURED_TOOLS
from coevo.config import LearnerConfig
from coevo.inference.engine import LocalEngine
from coevo.inference.grammar import GrammarError, Grammars, json_grammar, tool_call_grammar, unpack
from coevo.inference.models import ensure_default_model
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane
from coevo.training.parity import as_sample

TOOLS = STRUCTURED_TOOLS  # two tools: an enum, a boolean, a bounded integer, and one boolean
ANSWER = TOOLS[0]["function"]["parameters"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("grammar-models"))


def check_answer(value: dict) -> None:
    assert set(value) == {"move", "sure", "steps"}
    assert value["move"] in ("north", "south", "take coin") and isinstance(value["sure"], bool)
    assert isinstance(value["steps"], int) and 0 <= value["steps"] <= 99


async def _sampled(policy: Path, grammar: str, n: int = 8) -> list[TrainingSample]:
    async with LocalEngine(policy, device="cpu", seed=3) as engine:
        done = [
            await engine.complete("answer:", max_tokens=120, temperature=1.0, index=i, grammar=grammar)
            for i in range(n)
        ]
    return [as_sample(c, f"g{i}", "policy", grammar=grammar) for i, c in enumerate(done)]


async def test_a_random_model_held_to_a_json_schema_writes_only_json_that_satisfies_it(policy: Path) -> None:
    samples = await _sampled(policy, json_grammar(ANSWER))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    for s in samples:
        assert s.response_token_ids[-1] == tok.eos_token_id, "the grammar ended and the sampler stopped there"
        check_answer(json.loads(tok.decode(s.response_token_ids, skip_special_tokens=True)))


async def test_the_learner_computes_log_probs_under_the_masks_the_sampler_drew_from(
    policy: Path, tmp_path: Path
) -> None:
    """On the same weights: with the replayed masks the learner's log-probs are the sampler's (KL per
    token ~0); without them it would train another distribution (the KL every RL system that ignores the
    grammar has at the tokens it forced)."""
    grammar = tool_call_grammar(TOOLS)
    samples = await _sampled(policy, grammar)
    lane = Lane("policy", policy, tmp_path / "lane", LearnerConfig(), temperature=1.0, device="cpu")
    assert all(lane.sample_problem(s) is None for s in samples)
    masked = lane.mismatch_kl(samples)
    unmasked = lane.mismatch_kl([s.model_copy(update={"grammar": None}) for s in samples])
    assert masked < 1e-4, masked
    assert unmasked > 1.0, unmasked  # a random model puts most of its mass outside the grammar
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    for s in samples:
        text = tok.decode(s.response_token_ids, skip_special_tokens=True)
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        if call["name"] == "go":
            check_answer(call["arguments"])
        else:
            assert call["name"] == "look" and isinstance(call["arguments"]["far"], bool)


def test_replay_refuses_what_the_grammar_does_not_allow_and_names_the_position(policy: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    grammars = Grammars(tok, int(json.loads((policy / "config.json").read_text())["vocab_size"]))
    grammar = json_grammar(ANSWER)
    good = [*tok.encode('{"move": "north", "sure": true, "steps": 7}', add_special_tokens=False), tok.eos_token_id]
    masks = unpack(grammars.replay(grammar, good), grammars.vocab_size)
    assert masks.shape == (len(good), grammars.vocab_size)
    assert all(masks[i, t] for i, t in enumerate(good))
    assert masks[-1].nonzero().flatten().tolist() == [tok.eos_token_id]  # complete: only the end is allowed
    forged = tok.encode('{"move": "west"', add_special_tokens=False)
    with pytest.raises(GrammarError, match="response position"):
        grammars.replay(grammar, forged)
    lane = Lane("policy", policy, tmp_path / "lane", LearnerConfig(), temperature=1.0, device="cpu")
    sample = TrainingSample(
        sample_id="forged",
        role="policy",
        prompt_token_ids=tok.encode("answer:"),
        response_token_ids=forged,
        logprobs=[-1.0] * len(forged),
        grammar=grammar,
        advantage=1.0,
        model_version=0,
        step_event_id="forged",
    )
    assert "not allowed by the sample's grammar" in (lane.sample_problem(sample) or "")


def test_a_tool_call_grammar_for_a_tool_that_is_not_offered_names_it() -> None:
    with pytest.raises(GrammarError, match="'fly'"):
        tool_call_grammar(TOOLS, "fly")
    with pytest.raises(GrammarError, match=r"tools\[1\] has no function name"):
        tool_call_grammar([TOOLS[0], {"type": "function", "function": {"parameters": {}}}])
    with pytest.raises(GrammarError, match="JSON schema"):
        json_grammar({"type": "no-such-type"})
