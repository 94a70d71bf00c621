"""Grammars a sampler is held to, and the token masks they impose, replayed exactly.

Invariants:
- a grammar travels as its EBNF text in xgrammar's dialect (what vLLM's xgrammar backend compiles from
  ``structured_outputs.grammar``), on the recorded step and on the training sample;
- the masks come from one place, ``Grammars``, built from the model's tokenizer with the model's
  vocabulary size and its end-of-sequence token as the only stop token: the local engine draws each
  token from the masked distribution it returns, and the learner replays the same grammar over the
  sampled tokens to get the same masks (``replay``), so its log-probs are those of the distribution
  the token was drawn from;
- a sampled sequence the grammar refuses is an error naming the position, never a silent mask.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from coevo.errors import InferenceError

if TYPE_CHECKING:
    import torch

WRAPPED_TOOL_CALL = ("<tool_call>\n", "\n</tool_call>")
"""how a chat template's model writes one tool call (the Hermes convention ``parse_tool_calls`` reads)"""


class GrammarError(InferenceError, ValueError):
    """A constraint that cannot be compiled, or a sequence its grammar refuses."""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarError(
            'structured outputs need xgrammar: pip install --no-deps "xgrammar==0.2.8" (scripts/setup.sh does)'
        ) from exc
    return xgrammar


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text that satisfies ``schema``, written as ``json.dumps`` writes it (no
    free whitespace: a model cannot pad its answer with spaces until its token budget runs out)."""
    return _json_grammar(json.dumps(schema))  # key order kept: properties are written in their order


@functools.lru_cache(maxsize=256)
def _json_grammar(schema: str) -> str:
    xgr = _xgrammar()

    try:
        return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    except Exception as exc:  # xgrammar's own errors: an unsupported keyword, a schema that is not one
        raise GrammarError(f"JSON schema not supported: {str(exc)[:300]}") from exc


def either(*grammars: str) -> str:
    """The grammar of text any one of ``grammars`` accepts."""
    xgr = _xgrammar()

    return str(xgr.Grammar.union(*(xgr.Grammar.from_ebnf(g) for g in grammars)))


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """The grammar of one wrapped tool call, ``{"name": …, "arguments": …}``, to one of ``tools``
    (chat tool definitions, ``{"type": "function", "function": {...}}``) or only to ``name``, with
    arguments that satisfy that tool's parameters schema."""
    return _tool_call_grammar(json.dumps(tools), name)  # an agent sends the same tools on every call


@functools.lru_cache(maxsize=256)
def _tool_call_grammar(tools_json: str, name: str | None) -> str:
    xgr = _xgrammar()
    tools: list[dict[str, Any]] = json.loads(tools_json)
    functions = [t.get("function", t) if isinstance(t, dict) else {} for t in tools]
    nameless = next((i for i, f in enumerate(functions) if not isinstance(f.get("name"), str)), None)
    if nameless is not None:
        raise GrammarError(f"tools[{nameless}] has no function name")
    chosen = [f for f in functions if name is None or f.get("name") == name]
    if not chosen:
        raise GrammarError(f"no tool named {name!r} among {[f.get('name') for f in functions]}")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    body = xgr.Grammar.from_ebnf(json_grammar(calls[0] if len(calls) == 1 else {"anyOf": calls}))
    head, tail = (xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in WRAPPED_TOOL_CALL)
    return str(xgr.Grammar.concat(head, body, tail))


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask ([..., ceil(vocab/32)], token i at bit i % 32 of word i // 32) as bools."""
    import torch

    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.bool().flatten(-2)[..., :vocab_size]


class Matcher:
    """One sequence under one grammar: the tokens allowed next, and the token taken."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = _xgrammar()

        self._m = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        self.fill(self._bitmask, 0)
        return unpack(self._bitmask[0], self.vocab_size)

    def fill(self, packed: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of a packed bitmask."""
        self._m.fill_next_token_bitmask(packed, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))


class Grammars:
    """Compiled grammars for one tokenizer (a bounded cache keyed by the grammar's text)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache: int = 64) -> None:
        xgr = _xgrammar()

        eos = tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[eos] if eos is not None else None
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache = cache

    def matcher(self, grammar: str) -> Matcher:
        compiled = self._compiled.get(grammar)
        if compiled is None:
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except Exception as exc:
                raise GrammarError(f"grammar does not compile: {exc}") from exc
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._cache:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return Matcher(compiled, self.vocab_size)

    def replay(self, grammar: str, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), ceil(vocab/32)] int32, packed as xgrammar fills it (``unpack`` reads it): the
        mask each token was drawn under, rebuilt by walking the grammar over the sampled tokens
        (``GrammarError`` at the first token it refuses)."""
        import torch

        xgr = _xgrammar()

        m = self.matcher(grammar)
        packed = xgr.allocate_token_bitmask(max(len(tokens), 1), self.vocab_size)[: len(tokens)]
        for i, tok in enumerate(tokens):
            m.fill(packed, i)
            allowed = 0 <= tok < self.vocab_size and bool((packed[i, tok // 32] >> (tok % 32)) & 1)
            if not (allowed and m.accept(tok)):
                raise GrammarError(f"token {tok} at response position {i} is not allowed by the sample's grammar")
        return packed.to(torch.int32)
