"""The Anthropic Messages API as the policy endpoint speaks it (``POST /v1/messages``): requests as
chat messages, answers as message objects and stream events, errors in Anthropic's shape. Pure
functions and models, no I/O.

Honoured: ``system`` (text or text blocks), ``messages`` with ``text``, ``tool_use`` and
``tool_result`` blocks, ``tools`` (custom tools with an ``input_schema``), ``tool_choice`` ``auto`` /
``none``, ``stop_sequences``, ``max_tokens``, ``stream``, ``metadata.user_id`` (an episode id, like
OpenAI's ``user``). Refused with a 400 naming the parameter: ``tool_choice`` ``any`` or ``tool``
(forcing a tool needs constrained decoding), ``thinking`` enabled, image / document blocks, server
tools. Sampling knobs (``temperature``, ``top_p``, ``top_k``) are accepted and do not change
sampling: the policy samples at ``policy.temperature``, the temperature its learner computes
log-probs at. ``cache_control`` marks are accepted (they change no output).

Invariant: an assistant message built from a returned message's content converts to the same chat
message as the turn the endpoint recorded, so resent conversations reuse the sampled tokens.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coevo.errors import ApiError
from coevo.schemas import new_id
from coevo.serve.openai_api import Finish

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse what would be accepted and ignored (a 400 naming the parameter)."""
        if (self.thinking or {}).get("type", "disabled") != "disabled":
            raise ApiError(
                400, "extended thinking is not supported: the policy's output is what it samples", param="thinking"
            )

    @property
    def user(self) -> str | None:
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice or {}).get("type") != "none"

    def stops(self) -> list[str]:
        return [s for s in self.stop_sequences or [] if s]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic custom tools as chat-completions tool definitions (what chat templates render)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            raise ApiError(
                400,
                f"tools[{i}]: only custom tools (a name and an input_schema) are supported, not {t.get('type')!r}",
                param=f"tools[{i}].type",
            )
        fn = {
            "name": t["name"],
            "description": t.get("description") or "",
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
        }
        out.append({"type": "function", "function": fn})
    return out


def _blocks(content: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    for k, b in enumerate(blocks):
        if b.get("type") != "text":
            raise ApiError(400, f"{where}[{k}]: {b.get('type')!r} blocks are not supported here (text)", param=where)
    return "".join(str(b.get("text", "")) for b in blocks)


def to_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request as chat messages: ``system`` first; ``tool_use`` blocks as the ``tool_calls`` of
    their assistant message; ``tool_result`` blocks as ``tool`` messages before the user's text."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(_blocks(req.system), "system")})
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be user or assistant", param=f"messages[{i}].role")
        texts, calls = [], []
        for k, b in enumerate(_blocks(m.get("content"))):
            kind, where = b.get("type"), f"messages[{i}].content[{k}]"
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})},
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                text = result if isinstance(result, str) else _text(list(result), f"{where}.content")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id"),
                        "content": f"error: {text}" if b.get("is_error") else text,
                    }
                )
            else:
                raise ApiError(400, f"{where}: {kind!r} blocks are not supported in {role} messages", param=where)
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def content_blocks(text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The assistant turn as content blocks: its text (none when it only calls tools), then one
    ``tool_use`` per call (the call's id kept, so the resent conversation matches the recorded one)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if (text or not calls) else []
    for c in calls:
        args = c["function"]["arguments"]
        try:
            value = json.loads(args)
        except ValueError:
            value = None
        blocks.append(
            {
                "type": "tool_use",
                "id": c["id"],
                "name": c["function"]["name"],
                "input": value if isinstance(value, dict) else {"arguments": args},
            }
        )
    return blocks


def stop_reason(finish: Finish, stop_hit: str | None) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    return ("stop_sequence", stop_hit) if stop_hit else ("end_turn", None)


def message_body(
    model: str,
    blocks: list[dict[str, Any]],
    finish: Finish,
    stop_hit: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    reason, sequence = stop_reason(finish, stop_hit)
    return {
        "id": f"msg_{new_id()[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
        **extra,
    }


def stream_events(body: dict[str, Any], pieces: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """A finished message as the events a streaming client expects: message_start, each content
    block (its text delta by delta, ``pieces``: the text each token added; a tool call's input as
    one JSON delta), message_delta with the stop reason and usage, message_stop."""
    usage = body["usage"]
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    out: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for k, block in enumerate(body["content"]):
        first: dict[str, Any]
        if block["type"] == "text":
            first, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in pieces]
        else:
            first = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        out.append(("content_block_start", {"type": "content_block_start", "index": k, "content_block": first}))
        out += [("content_block_delta", {"type": "content_block_delta", "index": k, "delta": d}) for d in deltas]
        out.append(("content_block_stop", {"type": "content_block_stop", "index": k}))
    out.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "usage": {"output_tokens": usage["output_tokens"]},
                "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
            },
        )
    )
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def error_body(exc: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
