"""Verdicts decided on the trusted side: which tests decompose into a call and a comparison, and how
a reply from the program becomes pass or fail.

A test ``assert <expr>[, msg]`` decomposes when ``<expr>`` is one of

- ``candidate(A) == E`` / ``!=`` (either side), ``candidate(A) is [not] True|False|None``,
- ``candidate(A)`` / ``not candidate(A)`` (truthiness),
- ``abs(candidate(A) - E) < T`` / ``<=`` (or ``abs(E - candidate(A))``),
- a literal (``assert True``),

where every argument in ``A`` and ``E``, ``T`` are literals (``ast.literal_eval``). Only ``A`` is
sent to the program; ``E`` never leaves this process; the returned value arrives as plain data
(``coevo.envs.harness.decode``) and is compared here with Python's own operators on builtin types.
Any other test is ``Scripted``: it runs in a separate trusted test process whose ``candidate`` is a
proxy to the program's process (``coevo.envs.referee``).

Invariant: everything here is a pure function; a malformed reply is never a pass.
"""

from __future__ import annotations

import ast
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal

from coevo.envs.harness import decode, encode

Expect = Literal["eq", "ne", "is", "is_not", "truthy", "falsy", "close_lt", "close_le"]
_PARSE_ERRORS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)


@dataclass(frozen=True)
class CallCheck:
    """Call ``candidate(*args, **kwargs)`` and test the value: ``value <expect> expected``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    expect: Expect = "eq"
    expected: Any = None
    tol: float = 0.0


@dataclass(frozen=True)
class ConstCheck:
    """A test that asserts a literal: passes iff it is true and the program loaded."""

    value: bool


@dataclass(frozen=True)
class Scripted:
    """A test that needs code run: in the trusted test process, with ``candidate`` proxied."""

    source: str


Plan = CallCheck | ConstCheck | Scripted


def _literal(node: ast.AST) -> tuple[bool, Any]:
    """The value of a literal that is also plain data (so it can be sent), else (False, None)."""
    try:
        value = ast.literal_eval(node)
        encode(value)
    except _PARSE_ERRORS:
        return False, None
    return True, value


def _call(node: ast.AST) -> CallCheck | None:
    """``candidate(<literals>)`` as a check with its arguments, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "candidate"):
        return None
    args = []
    for a in node.args:
        ok, v = _literal(a)
        if not ok:
            return None
        args.append(v)
    kwargs = {}
    for k in node.keywords:
        ok, v = _literal(k.value)
        if k.arg is None or not ok:
            return None
        kwargs[k.arg] = v
    return CallCheck(tuple(args), kwargs)


def _with(check: CallCheck, expect: Expect, expected: Any = None, tol: float = 0.0) -> CallCheck:
    return CallCheck(check.args, check.kwargs, expect, expected, tol)


def _compare(e: ast.Compare) -> CallCheck | None:
    if len(e.ops) != 1:
        return None
    op, left, right = e.ops[0], e.left, e.comparators[0]
    if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
        call, other = (_call(left), right) if _call(left) else (_call(right), left)
        ok, value = _literal(other)
        if call is None or not ok:
            return None
        if isinstance(op, (ast.Eq, ast.NotEq)):
            return _with(call, "eq" if isinstance(op, ast.Eq) else "ne", value)
        if value is True or value is False or value is None:
            return _with(call, "is" if isinstance(op, ast.Is) else "is_not", value)
        return None
    if isinstance(op, (ast.Lt, ast.LtE)):
        ok, tol = _literal(right)
        if not (
            ok
            and type(tol) in (int, float)
            and isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name)
            and left.func.id == "abs"
            and len(left.args) == 1
            and not left.keywords
        ):
            return None
        diff = left.args[0]
        if not (isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub)):
            return None
        call, other = (_call(diff.left), diff.right) if _call(diff.left) else (_call(diff.right), diff.left)
        ok, value = _literal(other)
        if call is None or not ok or type(value) not in (int, float):
            return None
        return _with(call, "close_lt" if isinstance(op, ast.Lt) else "close_le", value, float(tol))
    return None


def plan_test(source: str) -> Plan:
    """How the test ``source`` (statements using ``candidate``) is run and judged."""
    try:
        module = ast.parse(textwrap.dedent(source))
    except _PARSE_ERRORS:
        return Scripted(source)
    if len(module.body) != 1 or not isinstance(module.body[0], ast.Assert):
        return Scripted(source)
    e = module.body[0].test
    ok, value = _literal(e)
    if ok:
        try:
            return ConstCheck(bool(value))
        except _PARSE_ERRORS:
            return Scripted(source)
    plan: CallCheck | None = None
    if isinstance(e, ast.Compare):
        plan = _compare(e)
    elif isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        call = _call(e.operand)
        plan = _with(call, "falsy") if call else None
    else:
        call = _call(e)
        plan = _with(call, "truthy") if call else None
    return plan if plan is not None else Scripted(source)


@dataclass(frozen=True)
class Reply:
    """What the program did with one call: returned ``value``, ``raised`` (``detail``), or sent
    something ``invalid`` (not plain data, or not a reply at all)."""

    kind: Literal["value", "raised", "invalid"]
    value: Any = None
    detail: str = ""


def parse_reply(frame: Any) -> Reply:
    """A frame from the program's process, validated: only well-formed plain data is a value."""
    if type(frame) is not dict or len(frame) not in (1, 2):
        return Reply("invalid", detail="not a reply")
    if set(frame) == {"value"}:
        try:
            return Reply("value", decode(frame["value"]))
        except ValueError as exc:
            return Reply("invalid", detail=f"returned something that is not plain data ({exc})")
    if set(frame) == {"raised", "message"} and type(frame["raised"]) is str and type(frame["message"]) is str:
        return Reply("raised", detail=f"{frame['raised'][:80]}: {frame['message'][:300]}")
    if set(frame) == {"invalid"} and type(frame["invalid"]) is str:
        return Reply("invalid", detail=f"returned something that is not plain data ({frame['invalid'][:200]})")
    return Reply("invalid", detail="not a reply")


def decide(check: CallCheck, value: Any) -> bool:
    """Whether the value the program returned (decoded plain data) passes ``check``."""
    try:
        match check.expect:
            case "eq":
                return bool(value == check.expected)
            case "ne":
                return bool(value != check.expected)
            case "is":
                return value is check.expected
            case "is_not":
                return value is not check.expected
            case "truthy":
                return bool(value)
            case "falsy":
                return not value
            case "close_lt" | "close_le":
                if type(value) not in (int, float, bool, complex):
                    return False
                gap = abs(value - check.expected)
                if math.isnan(gap):
                    return False
                return bool(gap < check.tol if check.expect == "close_lt" else gap <= check.tol)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False
    return False


def helpers_of(context: str, entry: str) -> str:
    """The definitions of a trusted ``context`` (a problem's prompt) that tests may call: its imports,
    functions and classes, except the entry point itself. Empty when it does not parse."""
    try:
        module = ast.parse(context)
    except _PARSE_ERRORS:
        return ""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    nodes = [n for n in module.body if isinstance(n, keep) and getattr(n, "name", None) != entry]
    return "\n\n".join(ast.unparse(n) for n in nodes)
