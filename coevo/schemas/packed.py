"""Long number lists (token ids, log-probs): array-backed in Python, raw bytes on the wire.

A ``TokenIds`` field holds an ``IntArray`` and a ``Floats`` field a ``FloatArray``: immutable
sequences over one little-endian int32 / float64 buffer. They compare equal to lists of the same
numbers, iterate, index and ``len`` like lists, and ``tolist()`` gives a plain list; a model
accepts a plain list (validated as strict ``list[int]`` / ``list[float]``) and stores the array.

On the wire an event with such arrays is a **frame** (``coevo.schemas.registry.encode``):
``MAGIC``, the JSON head's length (uint32 LE), the JSON head, then the arrays' bytes, each at an
8-aligned offset; the head names each array as ``"@<offset>:<bytes>"``. Decoding a frame validates
the small head and wraps slices of the message's own buffer: no number becomes a Python object and
no byte is copied until someone reads the numbers (measured in ``coevo bench bus``/``codec``).
JSON without a frame (what ``model_dump_json`` writes, and what the durable log holds from before
frames) carries an array as base64 of its little-endian bytes (pydantic's URL-safe alphabet; the
standard one is read too) or as a plain JSON list; both still decode. ``model_dump()`` and
``model_dump(mode="json", context={"lists": True})`` give plain lists (exports for people).

Invariants:
- ``decode(encode(x)) == x`` for every array: float64 keeps every float exactly; an int outside
  int32 is a validation error (token ids are int32), never a silently different number;
- an array's bytes are only ever read inside the frame they came with: a reference outside a frame,
  out of its bounds, not 8-aligned or not a whole number of elements is a validation error, never a
  half-read array; and the references of one frame name at most as many bytes as its arrays hold,
  so a decoded event is never larger than the message (no two references reuse the same bytes to
  multiply a small frame into a huge event).
"""

from __future__ import annotations

import array
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, ClassVar, Literal, Self, overload

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

_BIG_ENDIAN = sys.byteorder != "little"
MAGIC = b"\x00cv1"
"""First bytes of a frame. JSON never starts with a NUL byte, so a reader tells the two apart."""
_HEAD = struct.Struct("<4sI")
_REF = re.compile(r"^@([0-9]{1,10}):([0-9]{1,10})$")


def _swapped(typecode: Literal["i", "d"], data: memoryview) -> array.array[Any]:
    """A copy of ``data``'s bytes as ``typecode`` elements, byte order reversed (for big-endian hosts)."""
    buf = array.array(typecode, data.cast("B").tobytes())
    buf.byteswap()
    return buf


class PackedSequence(Sequence[Any]):
    """An immutable sequence of numbers over one buffer (native order in memory, LE on the wire)."""

    __slots__ = ("_view",)
    typecode: ClassVar[Literal["i", "d"]]
    item: ClassVar[str]

    def __init__(self, values: Iterable[Any] = ()) -> None:
        self._view = memoryview(array.array(self.typecode, values)).toreadonly()

    @classmethod
    def frombytes(cls, raw: bytes | memoryview) -> Self:
        """The array whose little-endian bytes ``raw`` are; on a little-endian machine a view of
        ``raw`` itself (no copy)."""
        view = memoryview(raw).cast("B")
        width = struct.calcsize(cls.typecode)
        if len(view) % width:
            raise ValueError(
                f"packed {cls.item} array: {len(view)} bytes is not a whole number of {width}-byte elements"
            )
        out = cls.__new__(cls)
        out._view = (memoryview(_swapped(cls.typecode, view)) if _BIG_ENDIAN else view.cast(cls.typecode)).toreadonly()
        return out

    def wire_bytes(self) -> bytes | memoryview:
        """The little-endian bytes (a view of the buffer on a little-endian machine)."""
        return _swapped(self.typecode, self._view).tobytes() if _BIG_ENDIAN else self._view.cast("B")

    def tolist(self) -> list[Any]:
        return self._view.tolist()

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._view[index].tolist()  # a slice is a plain list, as ``list(x)[a:b]`` would be
        return self._view[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._view)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedSequence):
            return self.typecode == other.typecode and self._view == other._view
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __hash__(self) -> int:  # equal arrays hash alike (0.0 == -0.0 included)
        return hash((self.typecode, tuple(self._view.tolist())))

    def __add__(self, other: Iterable[Any]) -> list[Any]:
        return [*self._view, *other]

    def __radd__(self, other: Iterable[Any]) -> list[Any]:
        return [*other, *self._view]

    def __repr__(self) -> str:
        shown = self._view[:8].tolist()
        more = f", ... {len(self) - 8} more" if len(self) > 8 else ""
        return f"{type(self).__name__}({shown!r}{more})"

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return type(self).frombytes, (bytes(self.wire_bytes()),)

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, _memo: dict[int, Any]) -> Self:
        return self  # immutable


class IntArray(PackedSequence):
    """Token ids: int32."""

    __slots__ = ()
    typecode, item = "i", "int32"


class FloatArray(PackedSequence):
    """Per-token floats (log-probs): float64."""

    __slots__ = ()
    typecode, item = "d", "float64"


class Blob:
    """The arrays of one frame being written: parts and their 8-aligned offsets."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.size = 0

    def add(self, data: bytes | memoryview) -> str:
        ref = f"@{self.size}:{len(data)}"
        self.parts.append(data)
        self.size += len(data)
        if pad := -self.size % 8:
            self.parts.append(b"\0" * pad)
            self.size += pad
        return ref


class Arrays:
    """The arrays of one frame being read: references are checked against its bytes and counted,
    so that together they name no more bytes than it holds."""

    __slots__ = ("left", "view")

    def __init__(self, view: memoryview) -> None:
        self.view, self.left = view, len(view)

    def take(self, ref: str) -> memoryview:
        m = _REF.match(ref)
        if m is None:
            raise ValueError(f"array reference {ref!r} is not '@offset:bytes'")
        start, n = int(m[1]), int(m[2])
        if start % 8 or start + n > len(self.view):
            raise ValueError(
                f"array reference {ref!r} not 8-aligned inside the frame's {len(self.view)} bytes "
                "of arrays (past the frame or misaligned)"
            )
        if n > self.left:
            raise ValueError(f"array reference {ref!r}: the frame's references name more bytes than it holds")
        self.left -= n
        return self.view[start : start + n]


def frame(head: bytes, blob: Blob) -> bytes:
    """``MAGIC``, the head's length, the head (space-padded so the arrays start 8-aligned), the arrays."""
    head += b" " * (-(len(head) + _HEAD.size) % 8)
    return b"".join((_HEAD.pack(MAGIC, len(head)), head, *blob.parts))


def unframe(raw: bytes | memoryview) -> tuple[memoryview, memoryview] | None:
    """(head, arrays) of a frame, or None when ``raw`` is not one (plain JSON)."""
    view = memoryview(raw).cast("B")
    if view[:4] != MAGIC:
        return None
    if len(view) < _HEAD.size:
        raise ValueError("truncated frame: no head length")
    (_magic, n) = _HEAD.unpack_from(view)
    if _HEAD.size + n > len(view):
        raise ValueError(f"truncated frame: a {n}-byte head in {len(view)} bytes")
    return view[_HEAD.size : _HEAD.size + n], view[_HEAD.size + n :]


class PackedArray:
    """Pydantic annotation for a ``PackedSequence`` field (see the module's docstring)."""

    def __init__(self, cls: type[PackedSequence]) -> None:
        self.cls = cls
        self.empty = cls()
        """shared by every empty field (arrays are immutable): most events carry some empty arrays"""

    def from_list(self, values: list[Any]) -> PackedSequence:
        if not values:
            return self.empty
        try:
            return self.cls(values)
        except OverflowError as exc:
            raise ValueError(f"{self.cls.item} array: a value is out of range ({exc})") from exc

    def from_ref(self, ref: str, info: core_schema.ValidationInfo) -> PackedSequence:
        frame = info.context.get("frame") if isinstance(info.context, dict) else None
        if not isinstance(frame, Arrays):
            raise ValueError(f"array reference {ref!r} outside a frame")
        return self.cls.frombytes(frame.take(ref))

    def dump(self, value: Sequence[Any], info: core_schema.SerializationInfo) -> Any:
        if not value:
            return []
        context = info.context if isinstance(info.context, dict) else {}
        if info.mode != "json" or context.get("lists"):
            return list(value)  # ``[]`` stays a list; python mode and exports for people: plain lists
        packed = value if isinstance(value, self.cls) else self.from_list(list(value))
        blob = context.get("blob")
        if isinstance(blob, Blob):
            return blob.add(packed.wire_bytes())
        return bytes(packed.wire_bytes())  # base64 (the model's ``ser_json_bytes``)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        number = core_schema.int_schema(strict=True) if self.cls is IntArray else core_schema.float_schema()
        from_list = core_schema.no_info_after_validator_function(
            self.from_list, core_schema.list_schema(number, strict=True)
        )
        from_ref = core_schema.with_info_after_validator_function(
            self.from_ref, core_schema.str_schema(pattern=_REF.pattern, strict=True)
        )
        from_b64 = core_schema.no_info_after_validator_function(
            self.cls.frombytes, core_schema.bytes_schema(strict=True)
        )
        return core_schema.json_or_python_schema(
            json_schema=core_schema.union_schema(
                [(from_ref, "frame reference"), (from_list, "list"), (from_b64, f"packed {self.cls.item}")],
                mode="left_to_right",
            ),
            python_schema=core_schema.union_schema(
                [(core_schema.is_instance_schema(self.cls), self.cls.__name__), (from_list, "list")],
                mode="left_to_right",
            ),
            serialization=core_schema.plain_serializer_function_ser_schema(self.dump, info_arg=True),
        )

    def __get_pydantic_json_schema__(
        self, _schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        kind = "integer" if self.cls is IntArray else "number"
        return {
            "anyOf": [
                {
                    "type": "string",
                    "contentEncoding": "base64",
                    "description": f"packed: base64 (URL-safe alphabet accepted) of little-endian {self.cls.item} values",
                },
                {
                    "type": "string",
                    "pattern": _REF.pattern,
                    "description": f"inside a coevo frame: offset and length of the little-endian {self.cls.item} bytes",
                },
                {"type": "array", "items": {"type": kind}},
            ]
        }


TokenIds = Annotated[IntArray, PackedArray(IntArray)]
"""Token ids: an ``IntArray`` (int32); a plain ``list[int]`` is accepted and converted."""

Floats = Annotated[FloatArray, PackedArray(FloatArray)]
"""Log-probs and other per-token floats: a ``FloatArray`` (float64); a ``list[float]`` is accepted."""
