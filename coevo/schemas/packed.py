"""Long number lists (token ids, log-probs) in a packed wire form; in Python they stay plain lists.

A ``TokenIds`` field is a ``list[int]`` and a ``Floats`` field a ``list[float]`` in Python, validated
exactly as ``list[int]`` / ``list[float]`` are (strict). On the wire (JSON) such a list is written
as the base64 (pydantic's URL-safe alphabet) of its little-endian int32 / float64 array, so reading
a step's thousands of token ids back is one base64 decode and one C-level ``tolist`` instead of
parsing thousands of JSON numbers (measured in ``coevo bench codec``); an empty list stays ``[]``. The models stay the single source of truth: nothing outside
this module knows the wire form.

Invariants:
- ``decode(encode(x)) == x`` for every list: float64 keeps every float exactly, and a list holding
  an int outside int32 is written as a plain JSON list;
- a plain JSON list (what events written before this codec hold: the durable log has them) is
  still read as before;
- a string that is not the base64 of whole elements is a validation error, never a half-read list.
"""

from __future__ import annotations

import array
import struct
import sys
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

_BIG_ENDIAN = sys.byteorder != "little"


class PackedArray:
    """Pydantic annotation: a list validated as its annotated type; in JSON, the base64 of its
    little-endian ``struct`` packing (``typecode``), or a plain JSON list.

    The base64 itself is pydantic-core's (``Frozen``'s ``ser_json_bytes`` / ``val_json_bytes``):
    the bytes never become a Python ``str``.
    """

    def __init__(self, typecode: str, item: str) -> None:
        self.typecode, self.item, self.width = typecode, item, struct.calcsize(typecode)

    def pack(self, value: list[Any], info: core_schema.SerializationInfo) -> bytes | list[Any]:
        if not value or (info.context and info.context.get("lists")):  # exports for people: plain lists
            return value  # ``[]``: no shorter packed, and read back without a call into Python
        try:
            return struct.pack(f"<{len(value)}{self.typecode}", *value)
        except (struct.error, OverflowError):  # an int outside int32: a plain list (read back exactly)
            return value

    def unpack(self, raw: bytes) -> list[Any]:
        if len(raw) % self.width:
            raise ValueError(f"packed {self.item} array: {len(raw)} bytes is not a whole number of "
                             f"{self.width}-byte elements")
        buf = array.array(self.typecode, raw)
        if _BIG_ENDIAN:
            buf.byteswap()
        return buf.tolist()

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        plain = handler(source)  # the list exactly as pydantic validates it (strict in Python)
        packed = core_schema.chain_schema([core_schema.bytes_schema(strict=True),
                                           core_schema.no_info_plain_validator_function(self.unpack)])
        return core_schema.json_or_python_schema(
            # the list first: a failed attempt on a long JSON array costs more than one on a string
            json_schema=core_schema.union_schema([(plain, "list"), (packed, f"packed {self.item}")],
                                                  mode="left_to_right"),
            python_schema=plain,
            serialization=core_schema.plain_serializer_function_ser_schema(self.pack, info_arg=True,
                                                                            when_used="json"),
        )

    def __get_pydantic_json_schema__(self, _schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"anyOf": [
            {"type": "string", "contentEncoding": "base64",
             "description": f"packed: base64 (URL-safe alphabet accepted) of little-endian {self.item} values"},
            {"type": "array", "items": {"type": "integer" if self.typecode == "i" else "number"}},
        ]}


TokenIds = Annotated[list[int], PackedArray("i", "int32")]
"""Token ids: ``list[int]`` in Python; base64 of little-endian int32 on the wire."""

Floats = Annotated[list[float], PackedArray("d", "float64")]
"""Log-probs and other per-token floats: ``list[float]`` in Python; base64 of float64 on the wire."""
