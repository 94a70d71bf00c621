"""Grammars a sampler is held to, and the token masks they impose, replayed exactly.

Invariants:
- a grammar travels as its EBNF text in xgrammar's dialect (what vLLM's xgrammar backend compiles from
  ``structured_outputs.grammar``), on the recorded step and on the training sample;
- the masks come from one place, ``Grammars``, built from the model's tokenizer with the model's
  vocabulary size and its end-of-sequence token as the only stop token: the local engine draws each
  token from the masked distribution it returns, and the learner replays the same grammar over the
  sampled tokens to get the same masks (``replay``), so its log-probs are those of the distribution
  the token was drawn from;
- a sampled sequence the grammar refuses is an error naming the position, never a silent mask;
- a schema reaches xgrammar only through ``coevo.inference.schema_rules.check_schema`` (keywords the
  grammar cannot enforce are refused, never dropped; sizes within ``policy.grammar``'s budgets);
- compiling is bounded and off the hot paths: ``Grammars`` compiles on its own worker thread (xgrammar
  releases the GIL while it compiles), never on an event loop or the engine's batch thread; a waiter
  gives up after ``compile_timeout_s`` (``GrammarOverBudget``), the compile finishes on the worker and is
  discarded, and the same grammar is refused at once afterwards; one compile per distinct grammar runs
  at a time, and what is kept is bounded by bytes (compiled: ``cache_bytes``; EBNF text: ``TEXT_CACHE_BYTES``).

Why a thread and not a process: a compiled grammar is only usable in the process that holds its
matcher, and shipping one back (``serialize_json``) costs as much as compiling for a large vocabulary.
The thread cannot be killed, so the first line of defence is the cheap size check before compiling
(``schema_rules``: schema bytes, enum values, depth; ``max_grammar_bytes`` for grammar text): what
passes it compiles in about a second on a 49k vocabulary, and the timeout only frees the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from coevo.errors import GrammarError, GrammarOverBudget
from coevo.inference.schema_rules import SchemaBudget, check_schema

if TYPE_CHECKING:
    import torch

    from coevo.config import GrammarConfig

__all__ = [
    "WRAPPED_TOOL_CALL",
    "ByteCache",
    "GrammarError",
    "GrammarOverBudget",
    "Grammars",
    "Matcher",
    "either",
    "json_grammar",
    "tool_call_grammar",
    "unpack",
]

WRAPPED_TOOL_CALL = ("<tool_call>\n", "\n</tool_call>")
"""how a chat template's model writes one tool call (the Hermes convention ``parse_tool_calls`` reads)"""


V = TypeVar("V")

TEXT_CACHE_BYTES = 32 << 20
"""EBNF texts kept, keyed by the schema or tools they were written from (keys and values counted)"""


class ByteCache(Generic[V]):
    """A least-recently-used map bounded by the bytes of what it holds (``size(key, value)``), not by
    its count of entries: a client cannot grow it by sending larger inputs. Thread-safe."""

    def __init__(self, max_bytes: int, size: Callable[[str, V], int]) -> None:
        self.max_bytes, self._size = max_bytes, size
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: str, value: V) -> None:
        n = self._size(key, value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if n > self.max_bytes:
                return  # larger than the whole cache: not kept
            self._items[key] = (value, n)
            self.bytes += n
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


def _text_size(key: str, value: str) -> int:
    return len(key) + len(value)


_TEXTS: ByteCache[str] = ByteCache(TEXT_CACHE_BYTES, _text_size)
"""schema or tools JSON -> EBNF text (pure and deterministic: shared by every caller in the process)"""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarError(
            'structured outputs need xgrammar: pip install --no-deps "xgrammar==0.2.8" (scripts/setup.sh does)'
        ) from exc
    return xgrammar


def json_grammar(schema: dict[str, Any], budget: SchemaBudget | None = None) -> str:
    """The grammar of JSON text that satisfies ``schema``, written as ``json.dumps`` writes it (no
    free whitespace: a model cannot pad its answer with spaces until its token budget runs out).
    ``schema`` is checked first (``check_schema``: supported keywords, within ``budget``)."""
    text = json.dumps(schema)  # key order kept: properties are written in their order
    check_schema(schema, budget or SchemaBudget(), len(text.encode()))
    return _json_grammar(text)


def _json_grammar(schema: str) -> str:
    hit = _TEXTS.get("s" + schema)
    if hit is not None:
        return hit
    xgr = _xgrammar()
    try:
        out = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    except Exception as exc:  # xgrammar's own errors: an unsupported keyword, a schema that is not one
        raise GrammarError(f"JSON schema not supported: {str(exc)[:300]}") from exc
    _TEXTS.put("s" + schema, out)
    return out


def either(*grammars: str) -> str:
    """The grammar of text any one of ``grammars`` accepts."""
    xgr = _xgrammar()

    return str(xgr.Grammar.union(*(xgr.Grammar.from_ebnf(g) for g in grammars)))


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None, budget: SchemaBudget | None = None) -> str:
    """The grammar of one wrapped tool call, ``{"name": …, "arguments": …}``, to one of ``tools``
    (chat tool definitions, ``{"type": "function", "function": {...}}``) or only to ``name``, with
    arguments that satisfy that tool's parameters schema (checked first, all tools within ``budget``)."""
    text = json.dumps(tools)  # an agent sends the same tools on every call
    key = f"t{name}\x00{text}"
    hit = _TEXTS.get(key)
    if hit is None:
        hit = _tool_call_grammar(tools, name, budget or SchemaBudget(), len(text.encode()))
        _TEXTS.put(key, hit)
    return hit


def _tool_call_grammar(tools: list[dict[str, Any]], name: str | None, budget: SchemaBudget, size: int) -> str:
    xgr = _xgrammar()
    functions = [t.get("function", t) if isinstance(t, dict) else {} for t in tools]
    nameless = next((i for i, f in enumerate(functions) if not isinstance(f.get("name"), str)), None)
    if nameless is not None:
        raise GrammarError(f"tools[{nameless}] has no function name")
    chosen = [f for f in functions if name is None or f.get("name") == name]
    if not chosen:
        raise GrammarError(f"no tool named {name!r} among {[f.get('name') for f in functions]}")
    check_schema([f.get("parameters") or {"type": "object"} for f in functions], budget, size)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    body = xgr.Grammar.from_ebnf(_json_grammar(json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})))
    head, tail = (xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in WRAPPED_TOOL_CALL)
    return str(xgr.Grammar.concat(head, body, tail))


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask ([..., ceil(vocab/32)], token i at bit i % 32 of word i // 32) as bools."""
    import torch

    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.bool().flatten(-2)[..., :vocab_size]


def _compiled_size(key: str, compiled: Any) -> int:
    return len(key) + int(compiled.memory_size_bytes)


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
    """Compiled grammars for one tokenizer: compiled on this object's worker thread within
    ``cfg``'s budgets (``policy.grammar``), kept by their bytes in memory (``cache_bytes``)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cfg: GrammarConfig | None = None) -> None:
        from coevo.config import GrammarConfig

        xgr = _xgrammar()

        eos = tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self.cfg = cfg or GrammarConfig()
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[eos] if eos is not None else None
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._compiled: ByteCache[Any] = ByteCache(self.cfg.cache_bytes, _compiled_size)
        self._refused: ByteCache[str] = ByteCache(1 << 20, _text_size)
        """digests of grammars whose compile ran past the budget: refused at once (key and reason)"""
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.compiles = 0
        """compiles started (a grammar met again is not compiled again)"""

    def close(self) -> None:
        """Stop taking compiles; one running finishes on the worker (it cannot be interrupted)."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _future(self, grammar: str) -> tuple[str, concurrent.futures.Future[Any]]:
        size = len(grammar.encode())
        if size > self.cfg.max_grammar_bytes:
            raise GrammarOverBudget(
                "policy.grammar.max_grammar_bytes", size, self.cfg.max_grammar_bytes, "the grammar's size in bytes"
            )
        key = hashlib.sha256(grammar.encode()).hexdigest()
        hit = self._compiled.get(key)
        if hit is not None:
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(hit)
            return key, done
        if self._refused.get(key) is not None:
            raise self._over("seconds its compile took before (refused without compiling again)")
        with self._lock:
            fut = self._pending.get(key)
            if fut is None:
                fut = self._worker.submit(self._compile, key, grammar)
                self._pending[key] = fut
        return key, fut

    def _compile(self, key: str, grammar: str) -> Any:
        """On the worker: compile; a compile that took longer than ``compile_timeout_s`` (its waiters
        gave up) is discarded and its grammar refused from then on, one within it is kept."""
        import time

        t0 = self._started[key] = time.monotonic()
        self.compiles += 1
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(f"grammar does not compile: {str(exc)[:300]}") from exc
        finally:
            with self._lock:
                self._pending.pop(key, None)
                self._started.pop(key, None)
        if time.monotonic() - t0 > self.cfg.compile_timeout_s:
            self._refused.put(key, "over budget")
        else:
            self._compiled.put(key, compiled)
        return compiled

    def _over(self, what: str, seconds: float | None = None) -> GrammarOverBudget:
        t = self.cfg.compile_timeout_s
        return GrammarOverBudget("policy.grammar.compile_timeout_s", t if seconds is None else seconds, t, what)

    def _gave_up(self, key: str, t0: float) -> GrammarOverBudget:
        import time

        waited = time.monotonic() - t0
        if key in self._started:
            return self._over("seconds spent compiling the grammar (it is discarded when done)", waited)
        return self._over("seconds waiting for the grammar compile worker (busy with other grammars)", waited)

    def settle(self) -> None:
        """Wait until the compiles queued so far have ended (kept or discarded)."""
        self._worker.submit(lambda: None).result()

    def compiled(self, grammar: str) -> Any:
        """The compiled grammar, waiting at most ``compile_timeout_s`` (call it off any event loop)."""
        import time

        t0 = time.monotonic()
        key, fut = self._future(grammar)
        try:
            return fut.result(timeout=self.cfg.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._gave_up(key, t0) from None

    async def compiled_async(self, grammar: str) -> Any:
        """``compiled`` for an event loop: the loop goes on while the worker compiles."""
        import time

        t0 = time.monotonic()
        key, fut = self._future(grammar)
        if fut.done():
            return fut.result()
        try:
            async with asyncio.timeout(self.cfg.compile_timeout_s):
                return await asyncio.shield(asyncio.wrap_future(fut))
        except TimeoutError:
            raise self._gave_up(key, t0) from None

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(self.compiled(grammar), self.vocab_size)

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
