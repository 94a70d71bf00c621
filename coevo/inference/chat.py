"""Conversations as tokens: chat templates, and token-in/token-out across turns.

A multi-turn agent sends the whole conversation again at every call. Re-tokenising the rendered
conversation need not give back the tokens the model actually produced (a BPE merge across the
boundary, a decode that does not round-trip), and training on tokens the model never sampled is
off-policy in a way no importance weight sees. So each call's prompt is built from the previous
call's exact ids: its prompt ids, the response ids as sampled, then only the text the template
adds after them, tokenised alone.

Invariant: when a request extends the previous turn (its messages start with the previous
messages plus the assistant message that was returned), the prompt ids start with the previous
prompt and response ids, bit for bit; ``how`` says whether a fresh tokenisation would have agreed
(``reused``) or not (``mismatch``: the exact tokens are kept and the disagreement is counted). A
conversation that does not extend the previous turn (edited, truncated) is tokenised afresh
(``diverged``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

TokenPath = Literal["fresh", "reused", "mismatch", "diverged"]


def message_text(content: Any) -> str:
    """OpenAI message content (a string, or a list of parts) as text; only text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def normalize(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them and as turns are compared: role, text content, and the
    tool fields when present."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": str(m.get("role", "user")), "content": message_text(m.get("content"))}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
        out.append(msg)
    return out


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):  # templates want arguments as a mapping
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"id": call.get("id"), "type": "function", "function": {"name": fn.get("name"), "arguments": args}}


@dataclass(frozen=True)
class Turn:
    """What one call of a conversation left behind, for the next call to build on."""

    messages: list[dict[str, Any]]
    """the request's messages (normalised)"""
    assistant: dict[str, Any]
    """the assistant message returned (normalised)"""
    prompt_ids: list[int]
    response_ids: list[int]
    tools: list[dict[str, Any]] | None = None


class ChatTokens:
    """Renders conversations with a tokenizer's chat template (the tiny models' template when it has
    none) and builds prompts token-in/token-out."""

    def __init__(self, tokenizer: Any) -> None:
        from coevo.inference.models import CHAT_TEMPLATE

        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) or CHAT_TEMPLATE

    def render(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, generation: bool = True
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation, chat_template=self.template
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Rendered text to ids: special tokens written in the text are those tokens, nothing is added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, previous: Turn | None = None
    ) -> tuple[list[int], TokenPath]:
        """The prompt ids of ``messages`` (normalised), reusing ``previous``'s exact tokens when the
        conversation extends it."""
        full = self.render(messages, tools=tools)
        fresh = self.encode(full)
        if previous is None:
            return fresh, "fresh"
        ids = self._extend(previous, messages, tools, full)
        if ids is None:
            return fresh, "diverged"
        return ids, ("reused" if ids == fresh else "mismatch")

    def _extend(
        self, prev: Turn, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, full: str
    ) -> list[int] | None:
        k = len(prev.messages)
        if tools != prev.tools or messages[: k + 1] != [*prev.messages, prev.assistant]:
            return None
        before = self.render(prev.messages, tools=tools)
        with_turn = self.render([*prev.messages, prev.assistant], tools=tools, generation=False)
        if not (with_turn.startswith(before) and full.startswith(with_turn)):
            return None
        turn_text = with_turn[len(before) :]  # the assistant turn as the template writes it
        sampled = self.decode(prev.response_ids)
        if not turn_text.startswith(sampled):  # a special token sampled (pad, EOS) is not in the text shown
            sampled = str(self.tokenizer.decode(prev.response_ids, skip_special_tokens=True))
        if not turn_text.startswith(sampled):  # the template rewrites the turn (e.g. tool calls): no reuse
            return None
        closing = turn_text[len(sampled) :]  # what the template adds after the sampled tokens (EOS, newline)
        return [*prev.prompt_ids, *prev.response_ids, *self.encode(closing), *self.encode(full[len(with_turn) :])]


def completion_prompt(
    tokenizer: Any, prompt: str, previous: tuple[str, list[int], str, list[int]] | None
) -> tuple[list[int], TokenPath]:
    """``/v1/completions``: the ids of ``prompt`` (BOS + text, as every client encodes), reusing the
    previous call's (prompt text, prompt ids, response text, response ids) when ``prompt`` extends it
    and the response text is exactly what those ids decode to (a stop string cut inside a token, or
    a token the agent never saw, makes a prefix break: tokenised afresh)."""
    from coevo.inference.engine import encode_prompt

    fresh = encode_prompt(tokenizer, prompt)
    if previous is None:
        return fresh, "fresh"
    text, ids, response_text, response_ids = previous
    if not prompt.startswith(text + response_text):
        return fresh, "diverged"
    if tokenizer.decode(response_ids, skip_special_tokens=True) != response_text:
        return fresh, "diverged"  # the shown text is not what the sampled ids say (cut at a stop string)
    rest = prompt[len(text) + len(response_text) :]
    out = [*ids, *response_ids, *tokenizer.encode(rest, add_special_tokens=False)]
    return out, ("reused" if out == fresh else "mismatch")


class Conversation:
    """One multi-turn conversation with a model, token-in/token-out (the policy's ``chat`` mode): each
    user message is answered by the model; every prompt builds on the exact tokens of the turns before."""

    def __init__(self, tokens: ChatTokens, system: str | None = None) -> None:
        self.tokens = tokens
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.turn: Turn | None = None

    async def ask(self, client: Any, text: str, *, max_tokens: int, temperature: float) -> tuple[Any, TokenPath]:
        """The model's answer to ``text`` (a ``Completion``) and how its prompt ids were built."""
        self.messages.append({"role": "user", "content": text})
        messages = normalize(self.messages)
        ids, how = self.tokens.prompt(messages, previous=self.turn)
        c = await client.complete("", prompt_ids=ids, max_tokens=max_tokens, temperature=temperature)
        assistant = {"role": "assistant", "content": c.text}
        self.turn = Turn(messages, normalize([assistant])[0], list(c.prompt_token_ids), list(c.response_token_ids))
        self.messages.append(assistant)
        return c, how


def has_own_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` ships a chat template of its own (an instruct model's), not coevo's tiny
    models' fallback."""
    from coevo.inference.models import CHAT_TEMPLATE

    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and template != CHAT_TEMPLATE


class PromptForm:
    """How a role's built-in prompts reach its model: through the chat template (``chat``), or as raw
    text after BOS (``raw``: ``ids`` is None and the client encodes the text). ``auto`` is chat when the
    tokenizer has a template of its own. A client without a tokenizer (an external API) gets the text."""

    def __init__(self, tokenizer: Any | None, form: Literal["auto", "chat", "raw"]) -> None:
        chat = tokenizer is not None and (form == "chat" or (form == "auto" and has_own_template(tokenizer)))
        self.tokens = ChatTokens(tokenizer) if chat else None

    @property
    def chat(self) -> bool:
        return self.tokens is not None

    def ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        """The prompt ids of ``messages`` rendered with the generation prompt, or None (raw)."""
        if self.tokens is None:
            return None
        return self.tokens.encode(self.tokens.render(messages))

    @classmethod
    def of(cls, client: Any, form: Literal["auto", "chat", "raw"]) -> PromptForm:
        """The form for ``client``'s model: a client without its tokenizer at hand gets raw prompts."""
        return cls(client.tokenizer if isinstance(client, HoldsTokenizer) else None, form)


@runtime_checkable
class HoldsTokenizer(Protocol):
    """A client that serves from its own tokenizer (the local engine), so prompts can use its chat template."""

    tokenizer: Any
