"""What a call's structured-output parameters hold the policy's sampler to: one grammar, or None.
Pure functions, no I/O: each API's spelling in, one grammar out (``coevo.inference.grammar``).

- a forced tool (Chat Completions and Responses ``tool_choice: "required"`` or a named function,
  Messages ``tool_choice`` ``any`` or ``tool``): one wrapped tool call to one of the offered tools
  (or the one named), its arguments satisfying that tool's parameters schema;
- JSON output (``response_format`` / ``text.format`` of type ``json_schema`` or ``json_object``):
  JSON text satisfying the schema; with tools offered and ``tool_choice`` auto, that JSON or a tool call;
- refused with a 400 naming the parameter: a forced tool without tools, a name not offered, a
  schema the grammar engine cannot hold (a keyword it cannot enforce, named: ``schema_rules``), a
  schema over ``policy.grammar``'s budgets (the limit named), a tool choice or format of another kind.

Sampling parameters the learner would not reproduce (``ignored_knobs``) are another matter: the
policy samples at its own temperature and truncation, so a request's own are served without and
counted, or refused under ``policy.serve_strict``.
"""

from __future__ import annotations

from typing import Any

from coevo.config import SamplingConfig
from coevo.errors import ApiError
from coevo.inference.grammar import GrammarError, either, json_grammar, tool_call_grammar
from coevo.inference.schema_rules import SchemaBudget

Forced = tuple[bool, str | None]
"""(a tool call is forced, the tool it must call: None for any offered)"""


def chat_tool_choice(choice: Any) -> Forced:
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str):
        return True, name
    raise ApiError(
        400,
        f'tool_choice {choice!r}: expected "auto", "none", "required" or {{"type": "function", "function": {{"name": …}}}}',
        param="tool_choice",
    )


def responses_tool_choice(choice: Any) -> Forced:
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return True, choice["name"]
    raise ApiError(
        400,
        f'tool_choice {choice!r}: expected "auto", "none", "required" or {{"type": "function", "name": …}}',
        param="tool_choice",
    )


def messages_tool_choice(choice: dict[str, Any] | None) -> Forced:
    kind = (choice or {}).get("type", "auto")
    if kind in ("auto", "none"):
        return False, None
    if kind == "any":
        return True, None
    if kind == "tool" and isinstance((choice or {}).get("name"), str):
        return True, (choice or {})["name"]
    raise ApiError(400, f"tool_choice {choice!r}: expected auto, none, any or tool (with a name)", param="tool_choice")


def json_schema_of(fmt: dict[str, Any] | None, param: str, nested: bool) -> dict[str, Any] | None:
    """The schema a ``response_format`` (``nested``: its schema under ``json_schema``) or a Responses
    ``text.format`` asks for; None for text."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        holder = ((fmt or {}).get("json_schema") or {}) if nested else (fmt or {})
        schema = holder.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, f"{param}: a json_schema format needs its schema (an object)", param=param)
        return schema
    raise ApiError(400, f"{param} {kind!r}: expected text, json_object or json_schema", param=param)


def grammar_for(
    tools: list[dict[str, Any]] | None,
    forced: Forced,
    schema: dict[str, Any] | None,
    *,
    tools_off: bool = False,
    tool_param: str = "tool_choice",
    format_param: str = "response_format",
    budget: SchemaBudget | None = None,
) -> str | None:
    """The grammar of a call (``tools``: chat tool definitions; ``tools_off``: tool choice "none"),
    its schemas within ``budget`` (default: ``policy.grammar``'s defaults)."""
    budget = budget or SchemaBudget()
    must, name = forced
    if must:
        if not tools:
            raise ApiError(400, "tool_choice forces a tool call, but no tools are offered", param=tool_param)
        try:
            return tool_call_grammar(tools, name, budget)
        except GrammarError as exc:
            raise ApiError(400, f"tool_choice: {exc}", param=tool_param) from exc
    if schema is None:
        return None
    try:
        answer = json_grammar(schema, budget)
    except GrammarError as exc:
        raise ApiError(400, f"{format_param}: {exc}", param=format_param) from exc
    if tools and not tools_off:  # the model may still call a tool instead
        try:
            return either(tool_call_grammar(tools, None, budget), answer)
        except GrammarError as exc:
            raise ApiError(400, f"tools: {exc}", param="tools") from exc
    return answer


NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {}}
"""sampling parameters no policy in coevo samples with, at their values that change nothing"""


def ignored_knobs(body: dict[str, Any], temperature: float, sampling: SamplingConfig) -> list[str]:
    """The sampling parameters ``body`` asks for that the policy does not sample with: it samples
    at ``temperature`` with ``sampling``'s truncation, the distribution the learner computes."""
    own = {"temperature": temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p}
    asked = [
        k
        for k, v in own.items()
        if body.get(k) is not None and body[k] != v and not (k == "top_k" and v == 0 and body[k] in (0, -1))
    ]
    asked += [k for k, v in NEUTRAL.items() if body.get(k) not in (None, v)]
    return asked
