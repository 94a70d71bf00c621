"""The part of Python that ``no_while``'s loop analysis models, and how it models each call.

``coevo.envs.loopflow`` proves that no loop grows what it iterates by following where objects may go
(a may-alias analysis over names). That proof holds only for constructs whose data flow it models:
a construct outside them (a ``match`` pattern binding a name, ``except ... as e`` handing over a
raised object, a decorator replacing a function, a dunder method Python calls implicitly, a builtin
whose aliasing it does not know) can move an object where the analysis cannot see it.

Invariant (a whitelist, failing closed): ``unmodelled`` returns one reason per construct in the
program that is not on the whitelist below (the AST node kinds of ``NODES``, with the extra rules of
``_node_reason``; the builtins of ``BUILTIN_MODELS`` as callees). ``loopflow`` checks loops only
when it is empty: anything else is refused, naming the construct. The call models here are the
facts the analysis trusts about code it does not read; each is an over-approximation of every
stdlib object that answers to that name, and calls that match none get the generic model (the
result, every argument and the receiver may hold, be and change each other, and any callable among
them may be called with any of them).
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator

BUILTIN_NAMES = frozenset(dir(builtins))
EXCEPTIONS = frozenset(
    n
    for n in BUILTIN_NAMES
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
)

# How a call's result relates to its arguments (and, for a method, its receiver):
# "scalar": holds nothing of theirs (a number, a string, a bool, None, a fresh object of data);
# "copy": a new container of their elements; "lazy": an iterator over them (it is them, for a loop);
# "element": one of them or an element of one (for builtins, which: see loopflow); "map": "lazy", whose
# elements are what the callable it is given returns; "container": a new object holding them;
# "view" (methods): the receiver itself, for a loop; "get": an element of the receiver, or an argument;
# "store": puts its arguments into the receiver; "setdefault": both "store" and "get";
# "pop": takes an element out of it;
# "mutate": changes the receiver, stores nothing; "generic": anything (see the module docstring).
# Only "store", "pop", "mutate" and "generic" change an object (the receiver, or for "generic" all).
_SCALAR_BUILTINS = (
    "abs all any ascii bin bool callable chr complex delattr divmod float format hasattr hash hex id input int "
    "isinstance issubclass len object oct ord pow print range repr round str"
)
BUILTIN_MODELS: dict[str, str] = {
    **dict.fromkeys(_SCALAR_BUILTINS.split(), "scalar"),
    **dict.fromkeys(("list", "tuple", "set", "frozenset", "dict", "sorted", "bytes", "bytearray"), "copy"),
    **dict.fromkeys(("iter", "enumerate", "zip", "reversed", "filter"), "lazy"),
    **dict.fromkeys(("next", "min", "max", "sum", "getattr", "type"), "element"),
    "map": "map",  # lazy, and its elements are what its function returns
    **dict.fromkeys(("slice", *EXCEPTIONS), "container"),
    "setattr": "setattr",  # setattr(o, "a", v) is o.a = v
    "super": "super",  # the first parameter of the method it is called in
}
# module → function → model ("*": any function of the module); anything not listed is "generic"
MODULE_MODELS: dict[str, dict[str, str]] = {
    **{m: {"*": "scalar"} for m in ("math", "cmath", "string", "re", "hashlib", "json", "fractions", "decimal")},
    **{m: {"*": "scalar"} for m in ("datetime", "calendar", "unicodedata", "textwrap", "numbers")},
    "statistics": {"*": "element"},
    "random": {"*": "element", "shuffle": "generic", "sample": "copy", "choices": "copy"},
    "bisect": {"bisect": "scalar", "bisect_left": "scalar", "bisect_right": "scalar"},
    "heapq": {"nlargest": "copy", "nsmallest": "copy", "merge": "lazy"},
    "copy": {"copy": "copy", "deepcopy": "copy"},
    "collections": {"Counter": "copy", "OrderedDict": "copy", "deque": "copy"},
    "itertools": dict.fromkeys(
        (
            "chain combinations combinations_with_replacement permutations product islice zip_longest pairwise "
            "compress tee filterfalse takewhile dropwhile repeat"
        ).split(),
        "lazy",
    ),
}
_FRESH_METHODS = (
    "count index rindex find rfind startswith endswith isdigit isalpha isalnum isspace isupper islower isnumeric "
    "isdecimal isidentifier istitle isprintable isascii lower upper strip lstrip rstrip split rsplit splitlines "
    "join replace title capitalize swapcase zfill center ljust rjust format encode decode partition rpartition "
    "casefold expandtabs translate removeprefix removesuffix bit_length bit_count is_integer hex conjugate "
    "hexdigest digest issubset issuperset isdisjoint"
)
METHOD_MODELS: dict[str, str] = {
    **dict.fromkeys(_FRESH_METHODS.split(), "scalar"),
    **dict.fromkeys(("copy", "union", "intersection", "difference", "symmetric_difference", "most_common"), "copy"),
    **dict.fromkeys(("keys", "values", "items", "elements"), "view"),
    "get": "get",
    **dict.fromkeys(("append", "insert", "add", "extend", "update", "appendleft", "extendleft"), "store"),
    "setdefault": "setdefault",  # stores its default, and returns it or an element
    **dict.fromkeys(("pop", "popleft", "popitem"), "pop"),
    **dict.fromkeys(("sort", "reverse", "clear", "remove", "discard", "rotate"), "mutate"),
}
CHANGING = frozenset({"store", "setdefault", "pop", "mutate", "generic"})

# dunder methods a class may define: Python calls them implicitly, and their results reach the
# program only as a bool, an int or a str it makes itself (``__len__``, ``__hash__``, ``__bool__``,
# ``in``), as a ``str`` (no class may subclass ``str``: see BASES), or as the value of a comparison
# (``loopflow`` gives a comparison the results of the program's comparison methods). ``__init__``
# must return None.
COMPARISONS = frozenset({"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"})
DUNDER_DEFS = COMPARISONS | {"__init__", "__repr__", "__str__", "__hash__", "__len__", "__bool__", "__contains__"}
# decorators that leave calling the function as it was: the result is the function's own
DECORATORS = frozenset({"staticmethod", "classmethod"})
CACHE_DECORATORS = frozenset({"cache", "lru_cache"})  # functools': calls return what the function returned

NODES: frozenset[type[ast.AST]] = frozenset(
    {
        ast.Module, ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.While, ast.If, ast.Return,
        ast.Pass, ast.Break, ast.Continue, ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.alias,
        ast.Assert, ast.Raise, ast.Try, ast.ExceptHandler, ast.Delete, ast.Global, ast.Nonlocal, ast.With,
        ast.withitem, ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Slice, ast.Starred, ast.List,
        ast.Tuple, ast.Set, ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
        ast.comprehension, ast.Call, ast.keyword, ast.Lambda, ast.arguments, ast.arg, ast.BinOp, ast.UnaryOp,
        ast.BoolOp, ast.Compare, ast.IfExp, ast.JoinedStr, ast.FormattedValue, ast.NamedExpr, ast.Yield,
        ast.YieldFrom, ast.Load, ast.Store, ast.Del,
    }
)  # fmt: skip
_OPERATORS = (ast.operator, ast.unaryop, ast.cmpop, ast.boolop)


class Program:
    """What the whitelist and the analysis both need to know of a program's names."""

    def __init__(self, tree: ast.AST) -> None:
        self.nodes = list(ast.walk(tree))
        self.parents = {child: node for node in self.nodes for child in ast.iter_child_nodes(node)}
        stored = {n.id for n in self.nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        stored |= {n.arg for n in self.nodes if isinstance(n, ast.arg)}
        stored |= {n.name for n in self.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        classes = [n for n in self.nodes if isinstance(n, ast.ClassDef)]
        stored |= {n.name for n in classes}
        # local name → the module or module function an import binds to it, if nothing else binds it
        imported: dict[str, list[str]] = {}
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    imported.setdefault(a.asname or a.name.split(".")[0], []).append(
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    imported.setdefault(a.asname or a.name, []).append(f"{node.module}.{a.name}")
        self.imports = {k: v[0] for k, v in imported.items() if len(v) == 1 and k not in stored}
        self.own = frozenset(stored | set(imported))
        self.classdefs = frozenset(n.name for n in classes if sum(c.name == n.name for c in classes) == 1)

    def is_builtin(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in BUILTIN_NAMES and node.id not in self.own

    def qualified(self, func: ast.expr) -> str | None:
        """``module.function`` a callee names through an import (``math.sqrt``, ``sqrt`` from
        ``from math import sqrt``), if nothing else binds that name."""
        if isinstance(func, ast.Name):
            return self.imports.get(func.id) if "." in self.imports.get(func.id, "") else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.imports:
            return f"{self.imports[func.value.id]}.{func.attr}"
        return None

    def module_model(self, func: ast.expr) -> str | None:
        name = self.qualified(func)
        if name is None:
            return None
        module, _, function = name.rpartition(".")
        table = MODULE_MODELS.get(module, {})
        return table.get(function, table.get("*", "generic"))


def unmodelled(program: Program) -> list[str]:
    """``line N: ...`` for each construct of ``program`` outside the whitelist (empty: all modelled)."""
    return [reason for node in program.nodes for reason in _node_reasons(program, node)]


def _node_reasons(program: Program, node: ast.AST) -> Iterator[str]:
    at = f"line {getattr(node, 'lineno', '?')}"
    tail = "the loop check does not model it (not checked)"
    if not (type(node) in NODES or isinstance(node, _OPERATORS)):
        yield f"{at}: {_describe(node)}: {tail}"
    elif isinstance(node, ast.ExceptHandler) and node.name is not None:
        yield f"{at}: `except ... as {node.name}` (the raised object can be anything): {tail}"
    elif isinstance(node, (ast.Yield, ast.YieldFrom)) and not isinstance(program.parents.get(node), ast.Expr):
        yield f"{at}: the value of a `yield` expression (what `send()` passes in): {tail}"
    elif isinstance(node, ast.FunctionDef):
        if _is_dunder(node.name) and node.name not in DUNDER_DEFS:
            yield f"{at}: the dunder method `{node.name}` (Python calls it implicitly): {tail}"
        for d in node.decorator_list:
            if not _known_decorator(program, d):
                yield f"{at}: the decorator `@{ast.unparse(d)}` (what it puts in the function's place): {tail}"
    elif isinstance(node, ast.ClassDef):
        for d in node.decorator_list:
            yield f"{at}: the class decorator `@{ast.unparse(d)}`: {tail}"
        for k in node.keywords:
            yield f"{at}: the class keyword `{k.arg or '**'}=` (a metaclass runs code implicitly): {tail}"
        for base in node.bases:
            if not (
                isinstance(base, ast.Name)
                and (base.id in program.classdefs or (program.is_builtin(base) and base.id in EXCEPTIONS | {"object"}))
            ):
                yield (
                    f"{at}: the class `{node.name}` based on `{ast.unparse(base)}` (only `object`, exceptions "
                    f"and the program's own classes are modelled): {tail}"
                )
    elif isinstance(node, ast.Call) and program.is_builtin(node.func):
        assert isinstance(node.func, ast.Name)
        if node.func.id not in BUILTIN_MODELS:
            yield f"{at}: a call of the builtin `{node.func.id}` (what it does with its arguments): {tail}"


def _known_decorator(program: Program, d: ast.expr) -> bool:
    if isinstance(d, ast.Name) and program.is_builtin(d) and d.id in DECORATORS:
        return True
    if isinstance(d, ast.Call):  # lru_cache(maxsize=None): constants only
        if not all(isinstance(a, ast.Constant) for a in (*d.args, *(k.value for k in d.keywords))):
            return False
        d = d.func
    return program.qualified(d) in {f"functools.{n}" for n in CACHE_DECORATORS}


def _describe(node: ast.AST) -> str:
    names = {
        ast.Match: "a `match` statement",
        ast.AsyncFunctionDef: "an `async def`",
        ast.AsyncFor: "an `async for`",
        ast.AsyncWith: "an `async with`",
        ast.Await: "an `await`",
        ast.TryStar: "a `try ... except*`",
    }
    if isinstance(node, ast.pattern) or isinstance(node, ast.match_case):
        return f"a `match` pattern ({type(node).__name__})"
    return names.get(type(node), f"the construct `{type(node).__name__}`")


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")
