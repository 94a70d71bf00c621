"""Which JSON schemas a grammar can hold: a whitelist of keywords, and the size budgets. Pure, no I/O.

Invariant: a schema that passes ``check_schema`` uses only keywords xgrammar (0.2.8) enforces, so the
grammar compiled from it refuses every answer the schema refuses; any other keyword (``not``,
``contains``, ``uniqueItems``, ``if``/``then``/``else``, ``dependentRequired``, ``multipleOf``, a
``oneOf`` xgrammar would hold as ``anyOf``, a lookaround or backreference in ``pattern``, an unknown
``format``, a keyword nobody has heard of) is refused with ``SchemaUnsupported`` naming it and where it
stands, and a schema over ``policy.grammar``'s budgets with ``GrammarOverBudget`` naming the field,
before anything compiles it. Annotations (``title``, ``description``, ``default``, ``examples``, …) and
``x-`` extensions constrain nothing and pass.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from coevo.errors import GrammarOverBudget, SchemaUnsupported

SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
"""keywords whose value maps names to subschemas"""
SCHEMA_LISTS = frozenset({"anyOf", "prefixItems"})
"""keywords whose value is a list of subschemas"""
SCHEMA_ONE = frozenset({"items", "additionalProperties", "propertyNames", "unevaluatedProperties"})
"""keywords whose value is one subschema (or a boolean)"""
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "required",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minProperties",
        "maxProperties",
        "$ref",
        "allOf",  # one subschema only (``check_schema``): xgrammar does not intersect several
    }
    | SCHEMA_MAPS
    | SCHEMA_LISTS
    | SCHEMA_ONE
)
"""keywords the grammar holds an answer to"""
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "$anchor",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
        "discriminator",
        "strict",
    }
)
"""keywords that constrain nothing (``discriminator``: OpenAPI's hint beside an ``anyOf``)"""
FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "uuid",
        "ipv4",
        "ipv6",
        "hostname",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
"""the ``format`` values xgrammar writes a grammar for (others it would ignore)"""
_LOOKAROUND = re.compile(r"\(\?(?:=|!|<=|<!)|\\[1-9]|\\k<")
"""a lookahead, lookbehind or backreference: xgrammar drops them from the pattern"""


@dataclass(frozen=True)
class SchemaBudget:
    """The budgets ``check_schema`` holds a request's schemas to (``policy.grammar``'s fields)."""

    max_schema_bytes: int = 64 << 10
    max_enum_values: int = 1024
    max_schema_depth: int = 32

    @classmethod
    def of(cls, cfg: Any) -> SchemaBudget:
        """From a ``GrammarConfig``."""
        return cls(cfg.max_schema_bytes, cfg.max_enum_values, cfg.max_schema_depth)


def check_schema(schema: Any, budget: SchemaBudget, size: int | None = None) -> None:
    """``schema`` (a request's schema, or its tools' parameter schemas in a list) within ``budget``
    and holding only enforced keywords; raises naming the limit or the keywords. ``size``: its bytes
    when already known."""
    size = len(json.dumps(schema).encode()) if size is None else size
    if size > budget.max_schema_bytes:
        raise GrammarOverBudget(
            "policy.grammar.max_schema_bytes", size, budget.max_schema_bytes, "the schema's size in bytes"
        )
    found: list[str] = []
    values = _walk(schema, "#", 0, budget, found)
    if values > budget.max_enum_values:
        raise GrammarOverBudget(
            "policy.grammar.max_enum_values", values, budget.max_enum_values, "the schema's enum and const values"
        )
    if found:
        raise SchemaUnsupported(found)


def _walk(schema: Any, at: str, depth: int, budget: SchemaBudget, found: list[str]) -> int:
    """Record the unsupported keywords of ``schema`` (at path ``at``) in ``found``; its enum/const values."""
    if depth > budget.max_schema_depth:
        raise GrammarOverBudget(
            "policy.grammar.max_schema_depth", depth, budget.max_schema_depth, f"the schema's nesting (at {at[:60]}…)"
        )
    if isinstance(schema, bool):
        return 0
    if isinstance(schema, list):  # the tools' schemas, side by side
        return sum(_walk(s, f"{at}/{i}", depth, budget, found) for i, s in enumerate(schema))
    if not isinstance(schema, dict):
        found.append(f"{at} (a schema must be an object or a boolean)")
        return 0
    values = 0
    for key, value in schema.items():
        here = f"{at}/{key}"
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in ENFORCED:
            found.append(f"{key} (at {at})")
        elif key in ("enum",):
            values += len(value) if isinstance(value, list) else 1
        elif key == "const":
            values += 1
        elif key == "pattern" and isinstance(value, str) and _LOOKAROUND.search(value):
            found.append(f"pattern with a lookaround or backreference (at {here})")
        elif key == "format" and value not in FORMATS:
            found.append(f"format {value!r} (at {at})")
        elif key == "allOf":
            if not isinstance(value, list) or len(value) != 1:
                found.append(f"allOf of several subschemas (at {at})")
            else:
                values += _walk(value[0], f"{here}/0", depth + 1, budget, found)
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            values += sum(_walk(s, f"{here}/{name}", depth + 1, budget, found) for name, s in value.items())
        elif key in SCHEMA_LISTS and isinstance(value, list):
            values += sum(_walk(s, f"{here}/{i}", depth + 1, budget, found) for i, s in enumerate(value))
        elif key in SCHEMA_ONE:
            values += _walk(value, here, depth + 1, budget, found)
    return values
