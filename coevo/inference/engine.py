"""Inference clients: one interface, a local transformers engine and a vLLM HTTP client.

Every ``Completion`` records the prompt and response token ids, the per-token log-probs of the
distribution actually sampled from (tempered, and restricted to ``choices`` when constrained),
and the model version that produced it.

Invariant (local engine): requests are served in batches by one owned task; a weight swap is
applied between batches, so a request never mixes two versions and reports the one it used.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast, runtime_checkable

import structlog

from coevo.config import ComputeDtype, GrammarConfig, SamplingConfig
from coevo.errors import InvalidTokens
from coevo.inference import adapters
from coevo.inference.grammar import GrammarError, Grammars, Matcher
from coevo.inference.precision import default_device, model_dtype
from coevo.inference.sampling import truncate

log = structlog.get_logger("coevo.inference")


def quiet_transformers() -> None:
    """No hub access, no progress bars: models here are local directories."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt token ids as every client and the learner see them: BOS, then the text (no template)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


def choice_token_ids(tokenizer: Any, choices: list[str], cache: dict[tuple[str, ...], list[int]]) -> list[int]:
    """The single token of each choice label (constrained sampling needs one token per choice)."""
    key = tuple(choices)
    if key not in cache:
        ids = []
        for c in choices:
            toks = tokenizer.encode(c, add_special_tokens=False)
            if len(toks) != 1:
                raise ValueError(f"choice {c!r} is not a single token")
            ids.append(toks[0])
        cache[key] = ids
    return cache[key]


def distinct_rows(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of a batch, in first-seen order, and each prompt's row among them: requests
    with the same prompt (the ``m`` votes on one step, the ``n`` rollouts of a group at its first
    step) share one forward pass, and each still draws its own sample, in request order."""
    rows: dict[tuple[int, ...], int] = {}
    index = [rows.setdefault(tuple(p), len(rows)) for p in prompts]
    return [list(p) for p in rows], index


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    model_version: int
    choice: int | None = None
    allowed_token_ids: list[int] | None = None
    choice_logprobs: list[float] | None = None
    """a constrained call's log-probability of every choice, in ``choices``' order, under the distribution
    it drew from (tempered and truncated): the exact expectation of an evaluation, not one draw"""
    finish_reason: str = "stop"
    latency_ms: float = 0.0
    cost_usd: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False


class InferenceClient(Protocol):
    name: str

    @property
    def version(self) -> int: ...

    async def complete(
        self,
        prompt: str,
        *,
        choices: list[str] | None = None,
        max_tokens: int = 64,
        temperature: float = 1.0,
        index: int = 0,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        grammar: str | None = None,
    ) -> Completion: ...

    # prompt_ids (token-in): sample after exactly these tokens; ``prompt`` is then only a label;
    # grammar: every token is drawn from the distribution masked by this grammar (its EBNF text,
    # ``coevo.inference.grammar``), and generation ends where the grammar does;
    # stop: generation ends once the text holds one of these (the tokens so far are returned, the
    # stop string's included: cutting the text is the caller's, and a client may end at fewer stop
    # strings than given, vLLM's 4 first, so the caller cuts at every one of them)

    async def aclose(self) -> None: ...


@runtime_checkable
class KnowsContext(Protocol):
    """A client that knows its model's context length (prompt plus completion tokens)."""

    @property
    def context_length(self) -> int | None: ...


@runtime_checkable
class CachesCalls(Protocol):
    """A client of a paid API that keeps its answers in the run's key-value store (replays cost nothing)."""

    def attach_cache(self, kv: Any) -> None: ...


@runtime_checkable
class CountsWork(Protocol):
    """A client whose model work runs here (a local engine), counting it: totals since it started."""

    def work(self) -> dict[str, int]: ...


def engine_counters(client: object) -> dict[str, int]:
    """An agent's ``engine.*`` heartbeat counters: its client's ``work`` (none for a remote server)."""
    return {f"engine.{k}": v for k, v in client.work().items()} if isinstance(client, CountsWork) else {}


@runtime_checkable
class Metered(Protocol):
    """A client that counts what its calls cost."""

    spent_usd: float


@dataclass(frozen=True)
class _Adapter:
    """A LoRA adapter to merge into the base weights: its directory, and its tensors when held in memory."""

    path: Path
    tensors: dict[str, Any] | None = None


_Swap = tuple[Path | dict[str, Any] | _Adapter, int, asyncio.Future[float]]
"""new weights (a directory, or tensors in memory), their version, the waiter of the pause in ms"""


@dataclass
class _Request:
    prompt: str
    choices: list[str] | None
    max_tokens: int
    temperature: float
    future: asyncio.Future[Completion] = field(repr=False)
    prompt_ids: list[int] | None = None
    """token-in: the exact prompt tokens (``prompt`` is not encoded)"""
    stop: list[str] | None = None
    grammar: str | None = None
    compiled: Any = None
    """the grammar compiled (before the request is queued: the batch thread never compiles)"""


class LocalEngine:
    """A transformers causal LM served in process (CPU or CUDA), with hot-swappable weights. ``model_dir``
    may be a LoRA adapter directory (a LoRA lane's checkpoint): its base, with the adapter applied.

    ``adapter_apply``: how a LoRA adapter is served. ``beside`` adds it beside the base layers
    (``adapters.Beside``: a version costs a copy of the adapter, a forward pass a few small matmuls per
    adapted layer, and the engine computes what the lane computes in any dtype); ``merge`` writes
    ``W + s B A`` into the adapted weights from the base each version (no cost per forward pass, but in
    bf16 the sum is rounded to the weights' precision). ``auto``: ``merge`` in fp32, where both are exact
    and merging samples faster; ``beside`` in a lower precision (``coevo bench precision``)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        name: str = "local",
        device: str | None = None,
        max_batch: int = 64,
        seed: int = 0,
        version: int = 0,
        sampling: SamplingConfig | None = None,
        grammar: GrammarConfig | None = None,
        dtype: ComputeDtype = "auto",
        adapter_apply: Literal["auto", "beside", "merge"] = "auto",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        quiet_transformers()
        self.name = name
        self.model_dir = Path(model_dir)
        self.device = device or default_device()
        adapter = self.model_dir if adapters.is_adapter(self.model_dir) else None
        base = adapters.base_of(adapter) if adapter is not None else self.model_dir  # a LoRA lane's checkpoint
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.dtype = model_dtype(dtype, self.device, base)
        # the weights in the compute dtype (learner.dtype); logits are cast to fp32 before any softmax
        self.model = AutoModelForCausalLM.from_pretrained(base, dtype=self.dtype).to(self.device).eval()
        self.max_batch = max_batch
        self.sampling = sampling or SamplingConfig()
        self.grammar_cfg = grammar or GrammarConfig()
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._version = version
        self._queue: asyncio.Queue[_Request | _Swap] = asyncio.Queue()
        self._server: asyncio.Task[None] | None = None
        self._choice_ids: dict[tuple[str, ...], list[int]] = {}
        self.rows_computed = 0
        """prompt rows the constrained batches ran through the model (requests sharing a prompt count once)"""
        self.requests_dropped = 0
        """requests whose waiter was cancelled before the engine reached them (never computed)"""
        self.generate_passes = 0
        """forward passes of free generation (a batch of generating requests takes one pass per token of its
        longest response, not one per token of each)"""
        self.tokens_computed = self.padding_computed = 0
        """token positions the model ran (prompts and generated tokens), and how many of them were padding"""
        self.busy_s = 0.0
        """wall-clock seconds the engine spent in batches of model work (swaps not included)"""
        self.choice_cache_size = 4096
        self._choice_logits: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], Any] = OrderedDict()
        """(prompt ids, choice ids) -> their next-token logits under the weights served now (cleared by a
        swap): a state met again (another rollout of the group, another trajectory's same step) costs
        no forward pass; each request still draws its own sample"""
        exact = self.dtype == torch.float32
        self.adapter_apply = ("merge" if exact else "beside") if adapter_apply == "auto" else adapter_apply
        self.beside = adapters.Beside(self.model)
        """the adapter served beside the base layers (``adapter_apply = "beside"``)"""
        self._base: dict[str, Any] | None = None
        """the base weights of the layers a merged adapter changes, as they were before the first merge"""
        if adapter is not None:
            self._load_adapter(_Adapter(adapter))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Grammar masks over this model's logits (built on first use: most engines never need one).
        Grammars compile on its worker, awaited by ``complete`` before the request is queued."""
        return Grammars(self.tokenizer, int(self.model.config.vocab_size), self.grammar_cfg)

    @property
    def version(self) -> int:
        return self._version

    @property
    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    async def __aenter__(self) -> LocalEngine:
        self._server = asyncio.create_task(self._serve(), name=f"engine:{self.name}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if "grammars" in self.__dict__:
            self.grammars.close()
        if self._server is not None:
            self._server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._server
            self._server = None

    def _ensure_started(self) -> None:
        if self._server is None:
            raise RuntimeError(f"engine {self.name} is not running (use `async with engine:`)")

    async def complete(
        self,
        prompt: str,
        *,
        choices: list[str] | None = None,
        max_tokens: int = 64,
        temperature: float = 1.0,
        index: int = 0,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        grammar: str | None = None,
    ) -> Completion:
        self._ensure_started()
        if prompt_ids is not None:
            self.check_ids(prompt_ids)
        if grammar is not None and choices:
            raise ValueError("a grammar and choices: one constraint at a time")
        # compiled on the grammars' worker, within policy.grammar's budget: the batch thread never compiles
        compiled = None if grammar is None else await self.grammars.compiled_async(grammar)
        req = _Request(
            prompt,
            choices,
            max_tokens,
            temperature,
            asyncio.get_running_loop().create_future(),
            prompt_ids=prompt_ids,
            stop=stop,
            grammar=grammar,
            compiled=compiled,
        )
        self._queue.put_nowait(req)
        return await req.future

    def check_ids(self, ids: list[int]) -> None:
        """``InvalidTokens`` for an id the model has no embedding for (on CPU an IndexError, on CUDA
        a device assert that poisons the process): refused before it is queued."""
        vocab = int(self.model.get_input_embeddings().num_embeddings)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidTokens(bad, vocab)

    async def swap_weights(self, path: Path, version: int) -> float:
        """Load safetensors weights from ``path`` between batches; returns the pause in ms."""
        return await self._enqueue_swap(Path(path), version)

    async def swap_tensors(self, tensors: dict[str, Any], version: int) -> float:
        """Take weights held in memory (the learner's published copy, never modified) between
        batches; returns the pause in ms."""
        return await self._enqueue_swap(tensors, version)

    async def load_adapter(self, path: Path, version: int, tensors: dict[str, Any] | None = None) -> float:
        """Serve the base weights with the LoRA adapter at ``path`` (``tensors``: the same adapter held in
        memory) in place of the previous one, between batches; returns the pause in ms. An adapter is
        applied to the base weights this engine started with (or last swapped in), never on top of a
        previous adapter."""
        return await self._enqueue_swap(_Adapter(Path(path), tensors), version)

    async def _enqueue_swap(self, source: Path | dict[str, Any] | _Adapter, version: int) -> float:
        self._ensure_started()
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((source, version, fut))
        return await fut

    async def _serve(self) -> None:
        while True:
            item = await self._queue.get()
            if isinstance(item, tuple):
                await self._swap(*item)
                continue
            if self._dropped(item):
                continue
            batch = [item]
            swaps: list[_Swap] = []
            while len(batch) < self.max_batch and not self._queue.empty():
                nxt = self._queue.get_nowait()
                if isinstance(nxt, tuple):
                    swaps.append(nxt)
                    break
                if not self._dropped(nxt):
                    batch.append(nxt)
            t0 = time.perf_counter()
            try:
                results = await asyncio.to_thread(self._run_batch, batch)
            except Exception as exc:  # every waiter learns why
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
            else:
                for r, res in zip(batch, results, strict=True):
                    if not r.future.done():
                        r.future.set_result(res)
            finally:
                self.busy_s += time.perf_counter() - t0
            for s in swaps:
                await self._swap(*s)

    def _dropped(self, r: _Request) -> bool:
        """Whether ``r``'s waiter gave up (cancelled) while it was queued: then it costs no forward pass."""
        if r.future.done():
            self.requests_dropped += 1
        return r.future.done()

    def work(self) -> dict[str, int]:
        """What the engine computed since it started (``CountsWork``): milliseconds busy, prompt rows of
        constrained batches, token positions run and how many of them were padding."""
        return {
            "busy_ms": round(self.busy_s * 1e3),
            "rows": self.rows_computed,
            "tokens": self.tokens_computed,
            "padding": self.padding_computed,
        }

    async def _swap(self, source: Path | dict[str, Any] | _Adapter, version: int, fut: asyncio.Future[float]) -> None:
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._load, source)
        except Exception as exc:
            if not fut.done():  # its waiter may have been cancelled (a stop): the engine serves on
                fut.set_exception(exc)
            else:
                log.warning("engine.load_failed", engine=self.name, version=version, error=repr(exc)[:300])
            return
        self._version = version
        if not fut.done():
            fut.set_result((time.perf_counter() - t0) * 1e3)

    def _load(self, source: Path | dict[str, Any] | _Adapter) -> None:
        """Copy the weights into the served model (``load_state_dict`` casts to its dtype and device)."""
        from safetensors.torch import load_file

        self._choice_logits.clear()  # computed by the weights being replaced
        if isinstance(source, _Adapter):
            self._load_adapter(source)
            return
        self._base = None  # new base weights: an adapter loaded later applies to these
        if isinstance(source, dict):
            state, where = source, "in memory"
        else:
            files = sorted(Path(source).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {source}")
            state, where = {}, f"at {source}"
            for f in files:
                state.update(load_file(str(f), device=self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        real_missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if real_missing or unexpected:
            raise ValueError(f"weights {where} do not fit: missing {real_missing[:3]}, unexpected {unexpected[:3]}")
        self.beside.clear()  # whole new weights: served without an adapter

    def _load_adapter(self, source: _Adapter) -> None:
        from safetensors.torch import load_file

        config = adapters.config_of(source.path)
        tensors = source.tensors if source.tensors is not None else load_file(source.path / adapters.ADAPTER_WEIGHTS)
        if self.adapter_apply == "beside":
            self.beside.load(tensors, config)
            return
        state = self.model.state_dict()
        if self._base is None:
            self._base = {}
        for key in adapters.adapted_weights(tensors):
            if key in state and key not in self._base:
                self._base[key] = state[key].detach().clone()
        merged = adapters.merged(self._base, tensors, config)
        _, unexpected = self.model.load_state_dict(merged, strict=False)
        if unexpected:
            raise ValueError(f"adapter at {source.path} does not fit: unexpected {unexpected[:3]}")

    # ---- the model work (runs in a worker thread) ---------------------------------------------

    def choice_token_ids(self, choices: list[str]) -> list[int]:
        return choice_token_ids(self.tokenizer, choices, self._choice_ids)

    def _run_batch(self, batch: list[_Request]) -> list[Completion]:
        import torch

        with torch.no_grad():
            constrained = [r for r in batch if r.choices]
            out: dict[int, Completion] = {}
            if constrained:
                for r, c in zip(constrained, self._choose(constrained), strict=True):
                    out[id(r)] = c
            free = [r for r in batch if not r.choices and r.max_tokens > 0]
            if free:
                for r, c in zip(free, self._generate(free), strict=True):
                    out[id(r)] = c
            for r in batch:  # a zero budget: no token, no forward pass
                out.setdefault(
                    id(r), Completion("", self._prompt_ids(r), [], [], self._version, finish_reason="length")
                )
            return [out[id(r)] for r in batch]

    def _encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def _prompt_ids(self, r: _Request) -> list[int]:
        return list(r.prompt_ids) if r.prompt_ids is not None else self._encode(r.prompt)

    def _choose(self, batch: list[_Request]) -> list[Completion]:
        import torch

        prompts = [self._prompt_ids(r) for r in batch]
        allowed = [self.choice_token_ids(r.choices or []) for r in batch]
        keys = [(tuple(p), tuple(a)) for p, a in zip(prompts, allowed, strict=True)]
        missing = [p for p, k in zip(prompts, keys, strict=True) if k not in self._choice_logits]
        if missing:
            self._next_logits(missing, [k for k in keys if k not in self._choice_logits])
        results = []
        for i, r in enumerate(batch):
            assert r.choices is not None
            logits = self._choice_logits[keys[i]]
            self._choice_logits.move_to_end(keys[i])
            sub = truncate(logits[None] / max(r.temperature, 1e-5), self.sampling)[0]
            logp = torch.log_softmax(sub, -1)
            k = int(torch.multinomial(logp.exp(), 1, generator=self.generator).item())
            results.append(
                Completion(
                    r.choices[k],
                    prompts[i],
                    [allowed[i][k]],
                    [float(logp[k])],
                    self._version,
                    choice=k,
                    allowed_token_ids=list(allowed[i]),
                    choice_logprobs=logp.tolist(),
                )
            )
        while len(self._choice_logits) > self.choice_cache_size:
            self._choice_logits.popitem(last=False)
        return results

    def _next_logits(self, prompts: list[list[int]], keys: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """One forward pass over the distinct ``prompts``; the next-token logits of each key's choices
        are kept (until the weights change) for every request that asks them again."""
        distinct, row = distinct_rows(prompts)  # the m votes on a step, a group's first step: one row each
        self.rows_computed += len(distinct)
        ids, mask, position_ids = self._left_padded(distinct)
        logits = (
            self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=position_ids.to(self.device),
                **self._last_logits_only,
            )
            .logits[:, -1, :]
            .float()
            .cpu()
        )
        for j, key in enumerate(keys):
            self._choice_logits[key] = logits[row[j], list(key[1])].clone()

    def _left_padded(self, prompts: list[list[int]]) -> tuple[Any, Any, Any]:
        """(ids, attention mask, position ids) of ``prompts`` padded on the left: every row's next token
        is at the end, and each row's positions count from its own first token."""
        import torch

        width = max(map(len, prompts))
        self.tokens_computed += width * len(prompts)
        self.padding_computed += width * len(prompts) - sum(map(len, prompts))
        ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def _draw(self, logits: Any, r: _Request, matcher: Any) -> tuple[int, float]:
        """One token for ``r`` from one row's next-token ``logits``: tempered, masked by the grammar's
        ``matcher`` (if any) before truncation (the learner's order, ``loss``, and vLLM's), then drawn;
        with its log-prob under that distribution."""
        import torch

        scaled = logits / max(r.temperature, 1e-5)
        if matcher is not None:
            scaled = scaled.masked_fill(~matcher.allowed()[: scaled.shape[-1]], float("-inf"))
        logp = torch.log_softmax(truncate(scaled[None], self.sampling)[0], -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=self.generator).item())
        if matcher is not None and not matcher.accept(tok):
            raise GrammarError(f"the engine drew token {tok}, which its grammar refuses")
        return tok, float(logp[tok])

    @functools.cached_property
    def _last_logits_only(self) -> dict[str, int]:
        """``logits_to_keep=1`` where the model takes it: the vocabulary-wide logits of the last position
        only, not of every prompt position of every row."""
        import inspect

        return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}

    def _stopped(self, ids: list[int], stops: list[str], window: int = 32) -> bool:
        """Whether the text of the last ``window`` tokens holds a stop string (a stop string longer
        than that many tokens is still cut by the caller, after generation)."""
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _generate(self, batch: list[_Request]) -> list[Completion]:
        """Generate for every request of ``batch`` together: the prompts left-padded into one forward
        pass, then one token per unfinished row per pass, with the cache, until every row has stopped
        (end of sequence, a stop string, its ``max_tokens``). Each row draws from its own distribution
        (its temperature, its grammar's mask before truncation) and records that distribution's
        log-probs; a finished row rides along unread until the batch ends. Every budget is at least 1."""
        import torch

        prompts = [self._prompt_ids(r) for r in batch]
        n, pad = len(batch), self.tokenizer.pad_token_id or 0
        ids, mask, positions = self._left_padded(prompts)
        matchers = [
            None if r.compiled is None else Matcher(r.compiled, int(self.model.config.vocab_size)) for r in batch
        ]
        out_ids: list[list[int]] = [[] for _ in batch]
        out_lp: list[list[float]] = [[] for _ in batch]
        finish = ["length"] * n
        live = [True] * n
        eos = self.tokenizer.eos_token_id
        cache = None
        while any(live):
            res = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                cache=cache,
                use_cache=True,
                **self._last_logits_only,
            )
            if cache is not None:  # a pass after the prompt's: one position a row, a finished row's is padding
                self.tokens_computed += n
                self.padding_computed += n - sum(live)
            cache = res.cache
            self.generate_passes += 1
            logits = res.logits[:, -1].float().cpu()
            ids = torch.full((n, 1), pad, dtype=torch.long)
            for i, r in enumerate(batch):
                if not live[i]:
                    continue
                tok, lp = self._draw(logits[i], r, matchers[i])
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                ids[i, 0] = tok
                if tok == eos or (r.stop and self._stopped(out_ids[i], r.stop)):
                    finish[i], live[i] = "stop", False
                elif len(out_ids[i]) >= r.max_tokens:
                    live[i] = False
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
        return [
            Completion(
                cast(str, self.tokenizer.decode(out_ids[i], skip_special_tokens=True)),
                prompts[i],
                out_ids[i],
                out_lp[i],
                self._version,
                finish_reason=finish[i],
            )
            for i in range(n)
        ]
