"""The OpenAI wire format as the policy endpoint speaks it: requests, responses, stream chunks,
errors, tool calls. Pure functions and models, no I/O.

Accepted and honoured: ``messages`` (text parts), ``prompt`` (text or token ids), ``max_tokens`` /
``max_completion_tokens``, ``n``, ``stream`` (+ ``stream_options.include_usage``), ``stop`` (passed
to generation, which ends there; the text is cut before it), ``logprobs`` (chat: ``true``;
completions: ``0``: the sampled tokens' log-probs), ``tools`` (rendered by the model's chat template;
``<tool_call>{json}</tool_call>`` in the output becomes ``tool_calls``), ``tool_choice`` (``"auto"``,
``"none"``, and ``"required"`` or a named function, held by a grammar: ``coevo.serve.constraints``),
``response_format`` (``json_schema``, ``json_object``: held by a grammar), ``user``. Refused with a
400 naming the parameter: log-prob alternatives (``top_logprobs`` > 0, completions ``logprobs`` > 0),
the legacy ``functions`` / ``function_call`` (send ``tools`` / ``tool_choice``), and ``response_format``
on Completions (structured outputs are held on Chat Completions and Responses). Accepted without changing
sampling: its knobs (``temperature``, ``top_p``, penalties, ``seed``): the policy samples at
``policy.temperature``, the temperature the learner computes log-probs at, so what is trained is
what was sampled (each one asked for is counted, ``endpoint.knobs_ignored.<name>``, and refused with a
400 under ``policy.serve_strict``: ``coevo.serve.constraints.ignored_knobs``).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coevo.errors import ApiError
from coevo.schemas import new_id


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI parameters are accepted and ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    temperature: float | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in (self.stop or []) if s]


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse what would be accepted and ignored (a 400 naming the parameter)."""
        legacy = next((k for k in ("functions", "function_call") if (self.model_extra or {}).get(k) is not None), None)
        if legacy is not None:
            raise ApiError(
                400,
                f"{legacy}: the legacy function-calling parameters are not served (send tools and tool_choice)",
                param=legacy,
            )
        if self.top_logprobs:
            raise ApiError(
                400,
                "top_logprobs > 0: alternatives are not returned (logprobs: true gives the sampled tokens' log-probs)",
                param="top_logprobs",
            )


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def check(self) -> None:
        if (self.model_extra or {}).get("response_format") is not None:
            raise ApiError(
                400,
                "response_format is not held on /v1/completions (use /v1/chat/completions or /v1/responses)",
                param="response_format",
            )
        if self.logprobs:
            raise ApiError(
                400,
                "logprobs > 0: alternatives are not returned (logprobs: 0 gives the sampled tokens' log-probs)",
                param="logprobs",
            )

    def single(self) -> str | list[int]:
        """The one prompt of this request (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request (send a batch as separate requests)", param="prompt")
            p = p[0]
        if isinstance(p, list) and not all(isinstance(t, int) for t in p):
            raise ApiError(400, "prompt must be text or a list of token ids", param="prompt")
        return p  # type: ignore[return-value]


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes / Qwen convention
    most chat templates teach) as OpenAI ``tool_calls``; the text left around them. A block that is
    not such JSON stays text."""
    calls: list[dict[str, Any]] = []

    def take(m: re.Match[str]) -> str:
        try:
            body = json.loads(m.group(1))
        except ValueError:
            return m.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return m.group(0)
        args = body.get("arguments", {})
        calls.append(
            {
                "id": f"call_{new_id()[:24]}",
                "type": "function",
                "function": {"name": body["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
        return ""

    rest = _TOOL_CALL.sub(take, text)
    return (rest.strip() if calls else text), calls


def cut_at_stop(decode: Any, ids: list[int], stops: list[str]) -> tuple[int, str | None]:
    """How many of ``ids`` to keep so that the text ends right after the first stop string, and the
    text before it (None: no stop string occurs). ``decode(ids) -> text``."""
    text = decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return len(ids), None
    at, _ = min(hits)
    for k in range(1, len(ids) + 1):
        if len(decode(ids[:k])) > at:
            return k, text[:at]
    return len(ids), text[:at]


Finish = Literal["stop", "length", "tool_calls"]


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_choice(
    index: int, text: str, calls: list[dict[str, Any]], finish: Finish, logprobs: list[tuple[str, float]] | None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    lp = (
        None
        if logprobs is None
        else {
            "content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []} for t, v in logprobs]
        }
    )
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}


def completion_choice(
    index: int, text: str, finish: Finish, logprobs: list[tuple[str, float]] | None
) -> dict[str, Any]:
    lp = None
    if logprobs is not None:
        offsets, at = [], 0
        for t, _ in logprobs:
            offsets.append(at)
            at += len(t)
        lp = {
            "tokens": [t for t, _ in logprobs],
            "token_logprobs": [v for _, v in logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": lp}


def envelope(
    kind: Literal["chat.completion", "text_completion"],
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, int],
    extra: dict[str, Any],
) -> dict[str, Any]:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{new_id()[:24]}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
        **extra,
    }


def stream_chunks(body: dict[str, Any], pieces: list[list[str]], include_usage: bool) -> list[dict[str, Any]]:
    """A finished response as the chunks a streaming client expects: per choice, its text piece by
    piece (``pieces[i]``: the text each token added), then its finish reason; usage last if asked."""
    chat = body["object"] == "chat.completion"
    base = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
    }
    out: list[dict[str, Any]] = []
    for choice, texts in zip(body["choices"], pieces, strict=True):
        i = choice["index"]
        if chat:
            out.append(
                {
                    **base,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
            out += [{**base, "choices": [{"index": i, "delta": {"content": t}, "finish_reason": None}]} for t in texts]
            if choice["message"].get("tool_calls"):
                calls = [{"index": k, **c} for k, c in enumerate(choice["message"]["tool_calls"])]
                out.append({**base, "choices": [{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}]})
            out.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}]})
        else:
            out += [
                {**base, "choices": [{"index": i, "text": t, "finish_reason": None, "logprobs": None}]} for t in texts
            ]
            out.append(
                {
                    **base,
                    "choices": [{"index": i, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None}],
                }
            )
    if include_usage:
        out.append({**base, "choices": [], "usage": body["usage"]})
    return out
