"""The OpenAI Responses API as the policy endpoint speaks it (``POST /v1/responses``): requests as
chat messages, answers as response objects and stream events. Pure functions and models, no I/O.

Honoured: ``input`` (a string, or items: messages with text parts, ``function_call``,
``function_call_output``), ``instructions``, function ``tools``, ``tool_choice: "auto" | "none"``,
``max_output_tokens``, ``previous_response_id`` (the conversation the endpoint kept, see
``History``), ``store``, ``stream``, ``user``, ``metadata`` (echoed), ``include:
["message.output_text.logprobs"]``. Refused with a 400 naming the parameter: anything that would
change what is generated and that the endpoint cannot do exactly (``tool_choice: "required"`` or a
named function, ``text.format`` other than text, tool types other than functions, non-text input
parts, ``conversation``, ``background``, ``prompt``). Sampling knobs (``temperature``, ``top_p``,
``reasoning``, ``truncation``, ``parallel_tool_calls``) are accepted and do not change sampling:
the policy samples at ``policy.temperature``, the temperature its learner computes log-probs at.

Invariant: the conversation a response's items give back as input (its output items) converts to
the same chat messages as the assistant turn the endpoint recorded, so an agent that resends the
whole conversation each turn reuses the sampled tokens exactly (``coevo.inference.chat``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coevo.algorithm.recent import put_newest
from coevo.errors import ApiError
from coevo.inference.chat import message_text
from coevo.schemas import new_id
from coevo.serve.openai_api import Finish

REFUSED = ("conversation", "background", "prompt")
"""request fields that change what is generated or where state lives, and that this endpoint lacks"""


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse what would be accepted and ignored (a 400 naming the parameter)."""
        extra = self.model_extra or {}
        for name in REFUSED:
            if extra.get(name) not in (None, False):
                raise ApiError(400, f"{name} is not supported by the coevo policy endpoint", param=name)
        for name in self.include or []:
            if name != "message.output_text.logprobs":
                raise ApiError(
                    400, f"include {name!r} is not supported (only message.output_text.logprobs)", param="include"
                )

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat-completions tool definitions (what chat templates render)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ApiError(
                400,
                f'tools[{i}]: only function tools (type "function" with a name) are supported, not {t.get("type")!r}',
                param=f"tools[{i}].type",
            )
        fn = {
            "name": t["name"],
            "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object", "properties": {}},
        }
        out.append({"type": "function", "function": fn})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ApiError(
                    400,
                    f"{where}.content[{k}]: {kind!r} parts are not supported (the policy reads text)",
                    param=f"{where}.content",
                )
        return "".join(str(p.get("text", "")) for p in content)
    return message_text(content)


def to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input as chat messages: message items as they are (``developer`` as ``system``),
    ``function_call`` items as the ``tool_calls`` of the assistant message they follow (or of a new
    one), ``function_call_output`` items as ``tool`` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role", "user")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"input[{i}].role {role!r} is not a message role", param=f"input[{i}].role")
            out.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text(item.get("content"), f"input[{i}]"),
                }
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else _text(output, f"input[{i}].output"),
                }
            )
        else:
            raise ApiError(
                400,
                f"input[{i}]: items of type {kind!r} are not supported (messages, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    return out


def output_items(text: str, calls: list[dict[str, Any]], logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The assistant turn as output items: its text as one message (none when it only calls tools),
    then one ``function_call`` per tool call."""
    items: list[dict[str, Any]] = []
    if text or not calls:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{new_id()[:24]}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for c in calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{new_id()[:24]}",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_body(
    req: ResponsesRequest,
    model: str,
    items: list[dict[str, Any]],
    finish: Finish,
    prompt_tokens: int,
    completion_tokens: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    incomplete = finish == "length"
    return {
        "id": f"resp_{new_id()[:24]}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "output": items,
        "parallel_tool_calls": True,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "previous_response_id": req.previous_response_id,
        "store": req.store is not False,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "temperature": None,
        "top_p": None,
        "truncation": "disabled",
        "user": req.user,
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
        **extra,
    }


def stream_events(body: dict[str, Any], pieces: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """A finished response as the events a streaming client expects, in order: created, in progress,
    each output item added, its text delta by delta (``pieces``: the text each token added) or its
    arguments, done; then completed (or incomplete)."""
    events: list[dict[str, Any]] = []
    started = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events += [{"type": "response.created", "response": started}, {"type": "response.in_progress", "response": started}]
    for at, item in enumerate(body["output"]):
        if item["type"] == "message":
            events += _message_events(at, item, pieces)
        else:
            events += _call_events(at, item)
    events.append(
        {"type": "response.incomplete" if body["status"] == "incomplete" else "response.completed", "response": body}
    )
    return [(e["type"], {**e, "sequence_number": k}) for k, e in enumerate(events)]


def _message_events(at: int, item: dict[str, Any], pieces: list[str]) -> list[dict[str, Any]]:
    part = item["content"][0]
    where = {"item_id": item["id"], "output_index": at, "content_index": 0}
    empty = {**part, "text": "", "logprobs": []}
    return [
        {
            "type": "response.output_item.added",
            "output_index": at,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **where, "part": empty},
        *({"type": "response.output_text.delta", **where, "delta": p, "logprobs": []} for p in pieces),
        {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]},
        {"type": "response.content_part.done", **where, "part": part},
        {"type": "response.output_item.done", "output_index": at, "item": item},
    ]


def _call_events(at: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": at}
    return [
        {
            "type": "response.output_item.added",
            "output_index": at,
            "item": {**item, "status": "in_progress", "arguments": ""},
        },
        {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
        {
            "type": "response.function_call_arguments.done",
            **where,
            "name": item["name"],
            "arguments": item["arguments"],
        },
        {"type": "response.output_item.done", "output_index": at, "item": item},
    ]


def text_logprobs(tokens: list[tuple[str, float]]) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []} for t, v in tokens]


@dataclass(frozen=True)
class Kept:
    """A stored response: the conversation up to and including its output, and whose it is."""

    messages: list[dict[str, Any]]
    episode_id: str | None


class History:
    """Responses kept for ``previous_response_id``, the most recent ``size`` of them.

    Invariant: a kept response is continued only by calls of the episode it was made in (or, for
    one made outside episodes, by calls outside episodes); an unknown id is a 400 naming it."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.kept: OrderedDict[str, Kept] = OrderedDict()

    def keep(self, response_id: str, messages: list[dict[str, Any]], episode_id: str | None) -> None:
        put_newest(self.kept, response_id, Kept(messages, episode_id), self.size)

    def before(self, response_id: str | None, episode_id: str | None) -> list[dict[str, Any]]:
        """The conversation ``response_id`` ended with (empty for None)."""
        if response_id is None:
            return []
        kept = self.kept.get(response_id)
        if kept is None or kept.episode_id != episode_id:
            raise ApiError(
                400,
                f"previous_response_id {response_id!r} is unknown here (not stored, forgotten, or of another episode)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return list(kept.messages)


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn as a chat message (what ``to_messages`` gives back for ``output_items``)."""
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg
