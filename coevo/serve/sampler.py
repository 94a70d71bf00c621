"""Sampling for the policy endpoint, whatever API a call came through: prompt ids built off the
event loop, stop strings passed to generation, the text cut at the stop, tool calls parsed, stream
pieces built in linear time.

Invariants:
- what is recorded is what was sampled: the response ids and log-probs are the engine's, cut only
  after the token in which a stop string begins (that token was sampled; the text shown ends before
  the stop string);
- tokenising, rendering chat templates and decoding run on one worker thread, never on the policy
  agent's event loop (a large body costs that thread, not every other episode's calls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, TypeVar

from coevo.errors import ApiError
from coevo.inference.chat import ChatTokens, TokenPath, Turn, completion_prompt
from coevo.inference.engine import KnowsContext
from coevo.serve import openai_api as oa

T = TypeVar("T")


@dataclass(frozen=True)
class Sampled:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    text: str
    finish: oa.Finish
    version: int
    tokens: str
    """how the prompt was built: fresh, reused, mismatch, diverged (chat.TokenPath) or tokens (ids given)"""
    stop_hit: str | None = None
    """the stop string the text was cut at"""
    pieces: tuple[str, ...] = ()
    """the text each token added, for streaming (one piece: the text was cut or does not decode token by token)"""
    grammar: str | None = None
    """the grammar every token was drawn under (structured output), recorded with the step"""


@dataclass(frozen=True)
class ChatCall:
    """One chat-shaped call (Chat Completions, Responses, Messages), as the endpoint samples it."""

    messages: list[dict[str, Any]]
    """normalised (``coevo.inference.chat.normalize``)"""
    tools: list[dict[str, Any]] | None
    """chat-completions tool definitions, rendered by the chat template"""
    parse_tools: bool
    max_tokens: int
    stops: list[str]
    grammar: str | None = None
    """what the sampler is held to (``coevo.serve.constraints``): a forced tool call, a JSON schema"""


@dataclass(frozen=True)
class Answer:
    sample: Sampled
    text: str
    calls: list[dict[str, Any]]

    @property
    def finish(self) -> oa.Finish:
        return "tool_calls" if self.calls else self.sample.finish

    @property
    def pieces(self) -> list[str]:
        """The shown text piece by piece (at once when parsing tool calls rewrote it)."""
        if self.text == self.sample.text:
            return list(self.sample.pieces)
        return [self.text] if self.text else []


class Sampler:
    def __init__(self, client: Any, temperature: float, counters: Any) -> None:
        self.client, self.temperature, self.counters = client, temperature, counters
        self._chat: ChatTokens | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="coevo-endpoint-tokens")

    @property
    def chat(self) -> ChatTokens:
        if self._chat is None:
            self._chat = ChatTokens(self.client.tokenizer)
        return self._chat

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def chat_prompt(self, call: ChatCall, previous: Turn | None = None) -> tuple[list[int], TokenPath]:
        ids, how = await self.off_loop(self.chat.prompt, call.messages, call.tools, previous)
        return ids, how

    async def text_prompt(
        self, prompt: str | list[int], previous: tuple[str, list[int], str, list[int]] | None
    ) -> tuple[list[int], str]:
        if isinstance(prompt, list):
            return list(prompt), "tokens"
        ids, how = await self.off_loop(completion_prompt, self.client.tokenizer, prompt, previous)
        return ids, how

    def decode(self, ids: list[int]) -> str:
        return str(self.client.tokenizer.decode(ids, skip_special_tokens=True))

    async def sample(
        self, prompt_ids: list[int], how: str, max_tokens: int, stops: list[str], grammar: str | None = None
    ) -> Sampled:
        limit = self.client.context_length if isinstance(self.client, KnowsContext) else None
        if limit is not None and len(prompt_ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the model's context of {limit}",
                param="messages",
                code="context_length_exceeded",
            )
        held = {} if grammar is None else {"grammar": grammar}  # clients without grammars are asked for none
        c = await self.client.complete(
            "", prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=self.temperature, stop=stops or None, **held
        )
        self.counters[f"endpoint.tokens.{how}"] += 1
        if grammar is not None:
            self.counters["endpoint.calls.constrained"] += 1
        s: Sampled = await self.off_loop(self._finish, c, how, stops, grammar)
        return s

    def _finish(self, c: Any, how: str, stops: list[str], grammar: str | None = None) -> Sampled:
        ids, lps, finish = list(c.response_token_ids), list(c.logprobs), c.finish_reason
        text, hit = self.decode(ids), None
        if stops:
            k, before = oa.cut_at_stop(self.decode, ids, stops)
            if before is not None:
                hit = next(s for s in stops if text.startswith(s, len(before)))
                ids, lps, text, finish = ids[:k], lps[:k], before, "stop"
        return Sampled(
            list(c.prompt_token_ids),
            ids,
            lps,
            text,
            "length" if finish == "length" else "stop",
            c.model_version,
            how,
            hit,
            tuple(self.pieces(ids, text)),
            grammar,
        )

    def pieces(self, ids: list[int], shown: str) -> list[str]:
        """The text each token added, decoding only the tokens since the last emitted piece (linear
        in the length, as vLLM detokenises); the whole text at once when the pieces would not add up
        to ``shown``."""
        out: list[str] = []
        prefix = read = 0
        for k in range(1, len(ids) + 1):
            before, now = self.decode(ids[prefix:read]), self.decode(ids[prefix:k])
            if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
                out.append(now[len(before) :])  # an incomplete character waits for the next token
                prefix, read = read, k
        if "".join(out) != shown:
            return [shown] if shown else []
        return out

    def answer(self, s: Sampled, parse_tools: bool) -> Answer:
        text, calls = oa.parse_tool_calls(s.text) if parse_tools else (s.text, [])
        return Answer(s, text, calls)

    def token_logprobs(self, s: Sampled) -> list[tuple[str, float]]:
        tok = self.client.tokenizer
        return [(tok.decode([t], skip_special_tokens=False), lp) for t, lp in zip(s.ids, s.logprobs, strict=True)]
