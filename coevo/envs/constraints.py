"""Constraint checks of the coding environment, decided in coevo on the program's syntax tree.

A constraint (``no_imports``, ``no_while``, ``no_recursion``) is a rule about how a program is
written. ``violations`` reads the program's text with ``ast`` in coevo's own process (the program
never runs here, so nothing it does can change a verdict) and returns, for each requested
constraint, the reasons it is broken (``line N: ...``).

Invariant: the check fails closed. Each requested constraint gets a list of reasons, empty iff it is
satisfied; a program the check cannot read in full (over ``MAX_PROGRAM_CHARS``, not parseable, too
deep to walk) or that uses an *escape hatch* (a construct that can run or reach code the check
cannot see: ``exec``, ``eval``, ``__import__``, dunder or frame attributes, attribute access by a
computed name, modules outside ``SAFE_MODULES``, string annotations) violates every requested
constraint. The one exemption is the task's own code: an import statement identical to one in the
prompt is neither an import nor an escape hatch.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from coevo.envs.loopflow import grown_loops

MAX_PROGRAM_CHARS = 200_000
CONSTRAINT_NAMES: tuple[str, ...] = ("no_imports", "no_while", "no_recursion")

# names that run code from data, or reach namespaces and modules the program's text does not show
ESCAPE_NAMES = frozenset(
    {
        "exec",
        "eval",
        "compile",
        "__import__",
        "globals",
        "locals",
        "vars",
        "__builtins__",
        "breakpoint",
        "__loader__",
        "__spec__",
        "__build_class__",
        "importlib",
        "import_module",
        "help",  # site's help() imports modules by name (absent under -S, but fail closed)
        "attrgetter",
        "methodcaller",  # operator's getattr by a computed name
        "get_type_hints",
        "ForwardRef",  # evaluate annotation strings
        "Formatter",  # string.Formatter().get_field("0.__globals__", ...) returns the object
    }
)
ESCAPE_ATTRS = frozenset(
    {
        "exec",
        "eval",
        "__import__",
        "importlib",
        "import_module",
        "attrgetter",
        "methodcaller",
        "get_type_hints",
        "ForwardRef",
        "Formatter",
    }
)
# frames, code objects, tracebacks: each reaches a namespace (f_globals, f_builtins) or code
FRAME_ATTRS = frozenset(
    {
        "f_globals",
        "f_locals",
        "f_builtins",
        "f_back",
        "f_code",
        "gi_frame",
        "gi_code",
        "gi_yieldfrom",
        "cr_frame",
        "cr_code",
        "cr_await",
        "ag_frame",
        "ag_code",
        "ag_await",
        "tb_frame",
        "tb_next",
        "co_code",
        "co_consts",
        "co_names",
    }
)
REFLECTION_CALLS = frozenset({"getattr", "setattr", "delattr"})
# The dunder allowlist (every other dunder name or attribute is an escape hatch):
# - the name ``__name__``: the module's name, a string, read by the ``if __name__ == "__main__":``
#   guard of whole programs; a string cannot run without exec/eval, which are escape hatches;
# - the attribute ``__init__`` as the callee of a call (``super().__init__(...)``, ``Base.__init__(self)``):
#   it runs an initializer, the program's own (checked with the rest) or a builtin one; taken as a value
#   it is not allowed (its ``__func__``/``__globals__`` would be one dunder further, but fail closed).
# Defining dunder methods (``def __eq__``) and assigning dunders in a class body (``__slots__ = ()``)
# are not accesses and stay allowed.
ALLOWED_DUNDER_NAMES = frozenset({"__name__"})
ALLOWED_DUNDER_CALLS = frozenset({"__init__"})
# modules a program may import while any constraint applies (all pure computation); anything else
# (sys, builtins, inspect, gc, types, ctypes, pickle, marshal, os, subprocess, __main__, a module the
# program wrote itself, ...) can reach code or namespaces the check cannot see
SAFE_MODULES = frozenset(
    {
        "__future__",
        "abc",
        "array",
        "bisect",
        "calendar",
        "cmath",
        "collections",
        "copy",
        "dataclasses",
        "datetime",
        "decimal",
        "enum",
        "fractions",
        "functools",
        "hashlib",
        "heapq",
        "itertools",
        "json",
        "math",
        "numbers",
        "operator",
        "random",
        "re",
        "statistics",
        "string",
        "textwrap",
        "typing",
        "unicodedata",
    }
)
# itertools' unbounded iterators: ``for`` over one is a ``while True`` loop
UNBOUNDED = frozenset({"count", "cycle"})  # always unbounded; ``repeat`` is with one argument
ITERATOR_METHODS = frozenset({"__next__", "__getitem__"})  # a class of its own that iteration calls until it stops
DEFERRED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.GeneratorExp)


@dataclass(frozen=True)
class _Tree:
    """The parsed program: nodes in source order with the deferred scope each sits in (a function,
    lambda, class or generator expression; None at module level), and each node's parent."""

    nodes: list[tuple[ast.AST, str | None]]
    parents: dict[ast.AST, ast.AST]

    def is_callee(self, node: ast.AST) -> bool:
        parent = self.parents.get(node)
        return isinstance(parent, ast.Call) and parent.func is node

    def call_of(self, node: ast.AST) -> ast.Call | None:
        parent = self.parents.get(node)
        return parent if isinstance(parent, ast.Call) and parent.func is node else None


def violations(program: str, *, entry_point: str, constraints: Sequence[str], prompt: str = "") -> dict[str, list[str]]:
    """Each requested constraint (in order, once) → why ``program`` breaks it (empty: satisfied)."""
    unknown = [c for c in constraints if c not in CONSTRAINT_NAMES]
    if unknown:
        raise ValueError(f"unknown constraints {', '.join(map(repr, unknown))} (known: {', '.join(CONSTRAINT_NAMES)})")
    wanted = list(dict.fromkeys(constraints))
    if not wanted:
        return {}
    if len(program) > MAX_PROGRAM_CHARS:
        return _all(wanted, f"the program has {len(program)} characters (over {MAX_PROGRAM_CHARS}): not checked")
    try:
        tree = ast.parse(program)
        facts = _index(tree)
        allowed = _prompt_imports(prompt)
        escapes = _escapes(facts, allowed)
        found = {
            "escape": escapes,
            "no_imports": _imports(facts, allowed),
            "no_while": _while_loops(facts, allowed, flow=not escapes),
            "no_recursion": _recursion(facts, entry_point),
        }
    except (SyntaxError, ValueError, OverflowError) as exc:
        return _all(wanted, f"the program does not parse ({type(exc).__name__}: {exc}): not checked")
    except (RecursionError, MemoryError) as exc:
        return _all(wanted, f"the program is too deeply nested to check ({type(exc).__name__})")
    return {c: _unique(found["escape"] + found[c]) for c in wanted}


def _all(wanted: list[str], reason: str) -> dict[str, list[str]]:
    return {c: [reason] for c in wanted}


def _unique(reasons: list[str]) -> list[str]:
    return list(dict.fromkeys(reasons))


def _index(tree: ast.Module) -> _Tree:
    nodes: list[tuple[ast.AST, str | None]] = []
    parents: dict[ast.AST, ast.AST] = {}
    stack: list[tuple[ast.AST, str | None]] = [(tree, None)]
    while stack:  # iterative: a deep tree must not overflow this process's stack
        node, scope = stack.pop()
        nodes.append((node, scope))
        inner = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = node.name
        elif isinstance(node, ast.Lambda):
            inner = "<lambda>"
        elif isinstance(node, ast.GeneratorExp):
            inner = "<genexpr>"
        children = list(ast.iter_child_nodes(node))
        for child in children:
            parents[child] = node
        stack.extend((child, inner) for child in reversed(children))
    return _Tree(nodes, parents)


def _prompt_imports(prompt: str) -> frozenset[str]:
    """``ast.dump`` of every import statement in the prompt (at any depth: HumanEval/115 imports inside
    the function). A prompt that does not parse whole (a bare signature) is read line by line."""
    if not prompt.strip():
        return frozenset()
    for text in (prompt, prompt + "\n    pass\n"):
        try:
            return frozenset(
                ast.dump(n) for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Import, ast.ImportFrom))
            )
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    out: set[str] = set()
    for line in prompt.splitlines():
        try:
            stmts = ast.parse(line.strip()).body
        except (SyntaxError, ValueError):
            continue
        out.update(ast.dump(s) for s in stmts if isinstance(s, (ast.Import, ast.ImportFrom)))
    return frozenset(out)


def _at(node: ast.AST) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _modules(facts: _Tree) -> dict[str, str]:
    """Local name → module, for every ``import m`` / ``import m as a`` the program makes."""
    out = {}
    for node, _ in facts.nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    return out


def _attribute_uses(facts: _Tree) -> Iterator[tuple[ast.AST, ast.expr, str]]:
    """(node, base, name) for ``base.name`` and for ``getattr(base, "name")`` (a literal name)."""
    for node, _ in facts.nodes:
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in REFLECTION_CALLS
            and len(node.args) >= 2
            and not any(isinstance(a, ast.Starred) for a in node.args[:2])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            yield node, node.args[0], node.args[1].value


def _escapes(facts: _Tree, allowed: frozenset[str]) -> list[str]:
    out: list[str] = []
    modules = _modules(facts)
    for node, _ in facts.nodes:
        if isinstance(node, ast.Name):
            if node.id in ESCAPE_NAMES:
                out.append(f"{_at(node)}: `{node.id}` can run or reach code the check cannot see")
            elif _is_dunder(node.id) and not isinstance(node.ctx, ast.Store) and node.id not in ALLOWED_DUNDER_NAMES:
                out.append(f"{_at(node)}: the dunder name `{node.id}`")
            elif node.id in REFLECTION_CALLS and not facts.is_callee(node):
                out.append(f"{_at(node)}: `{node.id}` used other than as a direct call")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECTION_CALLS:
            literal = (
                len(node.args) >= 2
                and not any(isinstance(a, ast.Starred) for a in node.args[:2])
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            )
            if not literal:
                out.append(f"{_at(node)}: `{node.func.id}` with a name that is not a string literal")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and ast.dump(node) not in allowed:
            out.extend(_import_escapes(node))
        elif isinstance(node, ast.MatchClass):
            out.extend(_attribute_escape(node, name, called=False, module=None) for name in node.kwd_attrs)
        elif isinstance(node, (ast.arg, ast.FunctionDef, ast.AsyncFunctionDef, ast.AnnAssign)):
            out.extend(_string_annotations(node))
    own = _own_names(facts)
    for node, base, name in _attribute_uses(facts):
        module = modules.get(base.id) if isinstance(base, ast.Name) else None
        out.append(
            _attribute_escape(node, name, called=facts.is_callee(node), module=module)
            or _private_escape(node, name, own)
        )
    return [r for r in out if r]


def _own_names(facts: _Tree) -> frozenset[str]:
    """Every name the program binds itself: attributes it assigns, functions, classes, variables, arguments."""
    out: set[str] = set()
    for node, _ in facts.nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return frozenset(out)


def _private_escape(node: ast.AST, name: str, own: frozenset[str]) -> str:
    """A private attribute the program did not define is some library's internals (``typing``'s
    ``ForwardRef._evaluate`` runs a string as code): fail closed."""
    if name.startswith("_") and not _is_dunder(name) and name not in own:
        return f"{_at(node)}: the private attribute `{name}` of code the program did not write"
    return ""


def _attribute_escape(node: ast.AST, name: str, *, called: bool, module: str | None) -> str:
    if _is_dunder(name) and not (called and name in ALLOWED_DUNDER_CALLS):
        return f"{_at(node)}: the dunder attribute `{name}`"
    if name in FRAME_ATTRS:
        return f"{_at(node)}: the frame/code attribute `{name}`"
    if name in ESCAPE_ATTRS:
        return f"{_at(node)}: the attribute `{name}` can run or reach code the check cannot see"
    if module is not None and name.startswith("_"):
        return f"{_at(node)}: the private module attribute `{module}.{name}`"
    return ""


def _import_escapes(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [
            f"{_at(node)}: imports `{a.name}`, a module outside the allowed ones"
            for a in node.names
            if a.name.split(".")[0] not in SAFE_MODULES
        ]
    if node.level or not node.module:
        return [f"{_at(node)}: a relative import"]
    if node.module.split(".")[0] not in SAFE_MODULES:
        return [f"{_at(node)}: imports from `{node.module}`, a module outside the allowed ones"]
    return [
        f"{_at(node)}: imports `{a.name}` from `{node.module}`"
        for a in node.names
        if a.name in ESCAPE_NAMES or a.name in ESCAPE_ATTRS or a.name.startswith("_")
    ]


def _string_annotations(node: ast.arg | ast.FunctionDef | ast.AsyncFunctionDef | ast.AnnAssign) -> list[str]:
    """typing.get_type_hints and functools.singledispatch evaluate string annotations as code."""
    ann = node.returns if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else node.annotation
    if ann is not None and any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(ann)):
        return [f"{_at(node)}: a string annotation (evaluated as code by typing and functools)"]
    return []


def _imports(facts: _Tree, allowed: frozenset[str]) -> list[str]:
    return [
        f"{_at(node)}: `{ast.unparse(node)}` (imports other than the prompt's own)"
        for node, _ in facts.nodes
        if isinstance(node, (ast.Import, ast.ImportFrom)) and ast.dump(node) not in allowed
    ]


def _while_loops(facts: _Tree, allowed: frozenset[str], *, flow: bool) -> list[str]:
    """``while``, and what loops like one: ``iter(f, sentinel)``, itertools' unbounded iterators, and
    a ``for`` over a list its own body may grow, under any name (``loopflow``: each runs until a
    condition, not over a given range; with ``flow`` False, as for a program that already fails
    closed on an escape hatch, that analysis is not run)."""
    out: list[str] = []
    itertools_modules = {k for k, v in _modules(facts).items() if v == "itertools"}
    imported: dict[str, str] = {}  # local name → itertools function
    for node, _ in facts.nodes:
        if isinstance(node, ast.ImportFrom) and node.module == "itertools":
            for a in node.names:
                if a.name == "*":
                    imported.update({n: n for n in (*UNBOUNDED, "repeat")})
                elif a.name in (*UNBOUNDED, "repeat"):
                    imported[a.asname or a.name] = a.name
    for node, _ in facts.nodes:
        if isinstance(node, ast.While):
            out.append(f"{_at(node)}: a while loop")
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name in ITERATOR_METHODS
            and isinstance(facts.parents.get(node), ast.ClassDef)
        ):
            out.append(
                f"{_at(node)}: a class defining `{node.name}`: iterating it runs until it says stop, a while loop"
            )
        elif isinstance(node, ast.Name) and node.id == "iter" and isinstance(node.ctx, ast.Load):
            call = facts.call_of(node)
            if call is None:
                out.append(f"{_at(node)}: `iter` used other than as a direct call (iter(f, sentinel) loops)")
            elif len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
                out.append(f"{_at(node)}: iter(f, sentinel) calls until a sentinel: a while loop")
        elif isinstance(node, ast.Name) and node.id in imported and isinstance(node.ctx, ast.Load):
            out += _unbounded(facts, node, imported[node.id])
    for node, base, name in _attribute_uses(facts):
        if isinstance(base, ast.Name) and base.id in itertools_modules and name in (*UNBOUNDED, "repeat"):
            out += _unbounded(facts, node, name)
    return out + (grown_loops(facts.nodes[0][0]) if flow else [])


def _unbounded(facts: _Tree, node: ast.AST, name: str) -> list[str]:
    call = facts.call_of(node)
    if call is None:
        return [f"{_at(node)}: itertools.{name} used other than as a direct call"]
    bounded = (
        name == "repeat"
        and not any(isinstance(a, ast.Starred) for a in call.args)
        and not any(k.arg is None for k in call.keywords)
        and len(call.args) + sum(k.arg == "times" for k in call.keywords) >= 2
    )
    return [] if bounded else [f"{_at(node)}: itertools.{name} never ends: a while loop"]


def _recursion(facts: _Tree, entry: str) -> list[str]:
    """Any reference to the entry point (or an alias of it) from deferred code — a function, lambda,
    class body or generator expression — is a possible recursive call, so a violation: this covers
    direct and mutual recursion (every cycle through the entry passes through such a reference). At
    module level the entry may only be called (``print(f(3))``) or aliased (``g = f``, then ``g`` is
    watched too); passing it anywhere else (an argument, a container) loses track of it, as does
    rebinding or decorating it (a wrapper can call the original again)."""
    if not entry:
        return ["there is no entry point to check recursion against"]
    out: list[str] = []
    aliases = {entry}
    changed = True
    while changed:  # module-level `g = f` (and `h = g`, ...), in any order
        changed = False
        for node, scope in facts.nodes:
            value, targets = _alias_binding(node)
            if scope is None and isinstance(value, ast.Name) and value.id in aliases:
                new = {t for t in targets if t not in aliases}
                aliases |= new
                changed |= bool(new)
    defs = 0
    for node, scope in facts.nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == entry:
            if scope is None:
                defs += 1
            if node.decorator_list:
                out.append(f"{_at(node)}: `{entry}` is decorated (a decorator can call it again)")
            if isinstance(node, ast.ClassDef) or defs > 1:
                out.append(f"{_at(node)}: `{entry}` is defined again")
        elif isinstance(node, ast.Name) and node.id == entry and not isinstance(node.ctx, ast.Load):
            out.append(f"{_at(node)}: `{entry}` is rebound (a wrapper can call the original again)")
        elif isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == entry:
            out.append(f"{_at(node)}: `{entry}` is rebound by an import")
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name == entry:
            out.append(f"{_at(node)}: `{entry}` is rebound")
        elif isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load):
            what = f"`{entry}`" if node.id == entry else f"`{node.id}` (an alias of `{entry}`)"
            if scope is not None:
                out.append(f"{_at(node)}: {what} is referenced inside `{scope}`: a recursive call")
            elif not facts.is_callee(node) and not _is_alias_value(facts, node):
                out.append(f"{_at(node)}: {what} is passed on at module level, where the check cannot follow it")
    return out


def _alias_binding(node: ast.AST) -> tuple[ast.expr | None, list[str]]:
    """(value, names) of a plain-name binding ``a = b = value`` / ``a: T = value`` / ``(a := value)``."""
    if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
        return node.value, [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name):
        return node.value, [node.target.id]
    return None, []


def _is_alias_value(facts: _Tree, node: ast.Name) -> bool:
    value, targets = _alias_binding(facts.parents.get(node, node))
    return value is node and bool(targets)
