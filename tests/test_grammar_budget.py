"""Structured outputs are bounded and never silently loose: a schema keyword the grammar cannot enforce
is refused naming it; a schema over ``policy.grammar``'s budgets is refused naming the limit before
anything compiles it; grammars compile on a worker thread, so neither the engine's other requests nor
the learner's event loop wait for one, and a compile past its time budget frees its request and is
discarded. Caches are bounded by bytes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from coevo.config import GrammarConfig, LearnerConfig
from coevo.errors import GrammarOverBudget, SchemaUnsupported
from coevo.inference.engine import LocalEngine
from coevo.inference.grammar import ByteCache, Grammars, json_grammar, tool_call_grammar
from coevo.inference.models import ensure_default_model
from coevo.inference.schema_rules import SchemaBudget, check_schema
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane
from tests.test_grammar import ANSWER

UNBOUNDED = SchemaBudget(1 << 30, 10**7, 64)
SLOW_VALUES = 5000
"""an enum whose grammar takes a visible time to compile on the tiny model (~0.1 s; 20k values: > 5 s)"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model("policy", tmp_path_factory.mktemp("budget-models"))


def slow_grammar(tag: str = "") -> str:
    return json_grammar({"enum": [f"value-{i}-{tag}" for i in range(SLOW_VALUES)]}, UNBOUNDED)


def vocab(policy: Path) -> int:
    return int(json.loads((policy / "config.json").read_text())["vocab_size"])


# ---- keywords the grammar cannot enforce (pure) --------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, "uniqueItems"),
        ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}, "else": {"maximum": 1}}, "if"),
        ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
        ({"type": "string", "pattern": "(?=a)a+"}, "lookaround"),
        ({"type": "string", "pattern": "a+(?<!b)"}, "lookaround"),
        ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"type": "number", "multipleOf": 3}, "multipleOf"),
        ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
        ({"type": "object", "properties": {"deep": {"items": {"no-such-keyword": 1}}}}, "no-such-keyword"),
    ],
)
def test_a_keyword_the_grammar_cannot_enforce_is_refused_naming_it(schema: dict, named: str) -> None:
    """Before, xgrammar compiled each of these with the keyword dropped: answers that violate the schema passed."""
    with pytest.raises(SchemaUnsupported, match=named.split()[0]) as err:
        json_grammar(schema)
    assert any(named in k for k in err.value.keywords), err.value.keywords
    tools = [
        {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {"x": schema}}}}
    ]
    with pytest.raises(SchemaUnsupported):
        tool_call_grammar(tools)


def test_supported_schemas_and_annotations_pass() -> None:
    check_schema(ANSWER, SchemaBudget())
    pydantic_like = {
        "$defs": {
            "Move": {"title": "Move", "type": "object", "properties": {"to": {"type": "string", "format": "uri"}}}
        },
        "title": "Answer",
        "description": "an answer",
        "type": "object",
        "properties": {
            "move": {"anyOf": [{"$ref": "#/$defs/Move"}, {"type": "null"}], "default": None},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}, "maxItems": 3},
            "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10, "examples": [1]},
        },
        "required": ["move"],
        "additionalProperties": False,
        "x-vendor": {"not": "an annotation"},
    }
    json_grammar(pydantic_like)


def test_a_schema_over_its_budgets_is_refused_naming_the_limit() -> None:
    with pytest.raises(GrammarOverBudget, match=r"policy\.grammar\.max_enum_values") as err:
        json_grammar({"enum": [f"v{i}" for i in range(2000)]})
    assert err.value.limit == "policy.grammar.max_enum_values" and err.value.value == 2000
    with pytest.raises(GrammarOverBudget, match=r"policy\.grammar\.max_schema_bytes"):
        json_grammar({"type": "string", "description": "x" * (70 << 10)})
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarOverBudget, match=r"policy\.grammar\.max_schema_depth"):
        json_grammar(deep)
    # the tools' schemas count together
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "parameters": {"enum": list(range(600))}}} for i in range(2)
    ]
    with pytest.raises(GrammarOverBudget, match="max_enum_values"):
        tool_call_grammar(tools)


def test_caches_are_bounded_by_bytes_not_entries() -> None:
    cache: ByteCache[str] = ByteCache(100, lambda k, v: len(k) + len(v))
    for i in range(10):
        cache.put(f"k{i}", "v" * 30)
    assert cache.bytes <= 100 and len(cache) == 3
    cache.put("huge", "v" * 1000)  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache) == 3
    assert cache.get("k9") is not None and cache.get("k0") is None


# ---- compiling off the hot paths, within a time budget ----------------------------------------------------


def test_a_compile_past_its_time_budget_frees_the_caller_and_is_refused_again_without_compiling(policy: Path) -> None:
    from transformers import AutoTokenizer

    grammars = Grammars(AutoTokenizer.from_pretrained(policy), vocab(policy), GrammarConfig(compile_timeout_s=0.001))
    grammar = slow_grammar("timeout")
    with pytest.raises(GrammarOverBudget, match=r"policy\.grammar\.compile_timeout_s"):
        grammars.compiled(grammar)
    grammars.settle()  # the compile ended on the worker, and was discarded
    with pytest.raises(GrammarOverBudget, match="refused without compiling again"):
        grammars.compiled(grammar)
    assert grammars.compiles == 1
    with pytest.raises(GrammarOverBudget, match=r"policy\.grammar\.max_grammar_bytes"):
        Grammars(AutoTokenizer.from_pretrained(policy), vocab(policy), GrammarConfig(max_grammar_bytes=1024)).compiled(
            grammar
        )
    grammars.close()


async def test_an_honest_request_is_served_while_another_requests_grammar_compiles(policy: Path) -> None:
    """Before, the engine compiled on its batch thread: every request of the batch waited for the compile."""
    async with LocalEngine(policy, device="cpu", seed=1) as engine:
        await engine.complete("warm up", max_tokens=1)
        constrained = asyncio.create_task(engine.complete("answer:", max_tokens=4, grammar=slow_grammar("engine")))
        await asyncio.sleep(0)  # the constrained request is asked first
        honest = asyncio.create_task(engine.complete("hello", max_tokens=2))
        done, _ = await asyncio.wait({constrained, honest}, return_when=asyncio.FIRST_COMPLETED)
        assert honest in done and constrained not in done
        assert (await constrained).response_token_ids


async def test_the_learner_replays_a_grammar_sample_without_blocking_its_event_loop(
    policy: Path, tmp_path: Path
) -> None:
    """``Lane.sample_problems`` compiles and replays off the loop: a coroutine scheduled meanwhile keeps
    running (before, ``sample_problem`` compiled on the learner's loop and nothing else ran)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    grammar = slow_grammar("lane")
    ids = [*tok.encode('"value-7-lane"', add_special_tokens=False), tok.eos_token_id]
    sample = TrainingSample(
        sample_id="s",
        role="policy",
        prompt_token_ids=tok.encode("answer:"),
        response_token_ids=ids,
        logprobs=[-1.0] * len(ids),
        grammar=grammar,
        advantage=1.0,
        model_version=0,
        step_event_id="s",
    )
    lane = Lane("policy", policy, tmp_path / "lane", LearnerConfig(), temperature=1.0, device="cpu")
    ticks = 0
    replayed = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not replayed.is_set():
            ticks += 1
            await asyncio.sleep(0.002)

    async def replay() -> list[str | None]:
        try:
            return await lane.sample_problems([sample])
        finally:
            replayed.set()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(ticker())
        problems = tg.create_task(replay())
    assert problems.result() == [None]
    assert ticks >= 5, f"the loop ran {ticks} times while the grammar compiled"
