"""Which loops may grow what they iterate: ``no_while``'s check of ``for`` loops and comprehensions.

A ``for`` over a list its own body appends to runs until a condition, like ``while``. The list can
be reached under other names than the one the loop names: an alias (``r = q``), a bound method
(``push = q.append``), an unbound one (``list.append(q, x)``), an iterator or generator over it
(``iter(q)``, ``(y for y in q)``, ``itertools.chain(q)``, a generator function), a container holding
it, a function or method it is passed to. So the check is a may-alias analysis over the program's
names, not a match on one name.

Invariant (a sound over-approximation): a loop passes only if nothing in its body (nor in a
function its body may call, nor in a dunder or decorated method, which run implicitly) may change
an object the loop may be iterating. "May be the same object" is a union of names over the whole
program, whatever their scope (``a = b``, ``a = b.attr``, ``a = f(b)``, a parameter bound to an
argument, ``a`` taken out of a container ``b`` was put into); "may change" is any method call on
it other than the read-only ones, passing it (or a method of it) to a call other than a pure
builtin's, ``+=``, and a slice assignment. What the analysis cannot settle in a few passes fails
closed. Loops over a fresh copy (``sorted(q)``, ``list(q)``, ``q[:]``, ``range(len(q))``) iterate
an object nothing else holds, and pass.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

MAX_PASSES = 32
# builtins whose result holds none of their arguments (a number, a string, a bool, a range)
SCALAR = frozenset(
    {
        "len", "sum", "int", "float", "bool", "str", "repr", "abs", "round", "ord", "chr", "hash", "id",
        "isinstance", "issubclass", "callable", "any", "all", "range", "format", "bin", "hex", "oct",
        "divmod", "pow", "ascii", "complex",
    }
)  # fmt: skip
# builtins that return a new container of their argument's elements, taken now (not lazily)
COPY = frozenset({"list", "tuple", "set", "frozenset", "sorted", "dict", "bytes", "bytearray"})
# builtins that never change an argument passed to them as a value (a callable passed is still called)
# (not map and filter: they call their first argument with the others' elements)
PURE = SCALAR | COPY | frozenset({"print", "min", "max", "enumerate", "zip", "reversed", "iter", "next"})
# methods that change nothing of their receiver; the first group returns new objects holding none of it
FRESH_METHODS = frozenset(
    {
        "count", "index", "find", "rfind", "rindex", "startswith", "endswith", "isdigit", "isalpha",
        "isalnum", "isspace", "isupper", "islower", "isnumeric", "isdecimal", "isidentifier", "istitle",
        "lower", "upper", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "join", "replace",
        "title", "capitalize", "swapcase", "zfill", "center", "ljust", "rjust", "format", "encode",
        "decode", "partition", "rpartition", "casefold", "expandtabs", "translate", "bit_length",
        "is_integer", "hex", "conjugate",
    }
)  # fmt: skip
ELEMENT_METHODS = frozenset({"get", "copy", "keys", "values", "items", "most_common", "issubset", "issuperset"})
READ_ONLY = FRESH_METHODS | ELEMENT_METHODS | frozenset({"union", "intersection", "difference", "isdisjoint"})
# methods that store their arguments in the receiver (modelled as its contents, not as a change of them)
STORING = frozenset({"append", "insert", "add", "extend", "update", "setdefault", "appendleft", "extendleft"})
BUILTIN_NAMES = frozenset(dir(builtins))


@dataclass(frozen=True)
class Atom:
    """``name`` itself (``inside=False``), or an element of what ``name`` holds (``inside=True``)."""

    name: str
    inside: bool = False


@dataclass
class Flow:
    """What an expression's value may be (``be``) and may hold (``holds``)."""

    be: set[Atom] = field(default_factory=set)
    holds: set[Atom] = field(default_factory=set)

    def __or__(self, other: Flow) -> Flow:
        return Flow(self.be | other.be, self.holds | other.holds)

    def elements(self) -> set[Atom]:
        """What iterating the value, or indexing it, may give."""
        return self.holds | {Atom(a.name, True) for a in self.be}

    def every(self) -> set[Atom]:
        return self.be | self.holds


class Aliases:
    """Names that may share an object, and what each such object may hold, for one program."""

    def __init__(self, tree: ast.AST) -> None:
        self.nodes = list(ast.walk(tree))
        self.own = frozenset(_bound_names(self.nodes))
        self.modules = frozenset(n.asname or n.name.split(".")[0] for n in self.nodes if isinstance(n, ast.alias))
        self.classdefs = frozenset(n.name for n in self.nodes if isinstance(n, ast.ClassDef))
        # an operator on an object of the program's own classes runs its dunder method: anything
        self.operators = any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_dunder(n.name) and n.name != "__init__"
            for n in self.nodes
        )
        self.parent: dict[str, str] = {}
        self.contents: dict[str, set[str]] = {}
        self.defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda]] = {}
        self._lambdas: dict[ast.Lambda, str] = {}
        for node in self.nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.Lambda):
                name = f"<lambda@{node.lineno}:{node.col_offset}>"
                self._lambdas[node] = name
                self.defs.setdefault(name, []).append(node)
            elif isinstance(node, ast.ClassDef):  # calling a class runs its methods on the new object
                methods = [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                self.defs.setdefault(node.name, []).extend(methods)
        rebound = {n.id for n in self.nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        rebound |= {n.arg for n in self.nodes if isinstance(n, ast.arg)} | self.modules
        self.plain_defs = (
            frozenset(n.name for n in self.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
            - rebound
            - self.classdefs
        )
        self.by_class: dict[str, list[str]] = {}
        self.bindings: list[tuple[str, Flow]] = []
        self.stores: list[tuple[Flow, Flow]] = []  # (container, what is put into it)
        self.calls: list[tuple[ast.Call, Flow, list[Flow]]] = []  # each call: its callee's and arguments' flows
        for node in self.nodes:
            self._facts(node)
        self.settled = self._solve()
        """False: no fixed point within ``MAX_PASSES`` (the caller fails closed)"""

    # ---- union-find --------------------------------------------------------------------------

    def find(self, name: str) -> str:
        root = name
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while name != root:
            self.parent[name], name = root, self.parent.get(name, name)
        return root

    def _union(self, a: str, b: str) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[ra] = rb
        self.contents.setdefault(rb, set()).update(self.contents.pop(ra, set()))
        return True

    def classes(self, atoms: Iterable[Atom]) -> set[str]:
        """The classes ``atoms`` may be (an element: any class its container's class holds)."""
        out: set[str] = set()
        for a in atoms:
            root = self.find(a.name)
            out.update({self.find(c) for c in self.contents.get(root, ())} if a.inside else {root})
        return out

    def _hold(self, container: str, items: set[str]) -> bool:
        held = self.contents.setdefault(self.find(container), set())
        new = {self.find(i) for i in items} - held  # held may name a class by an older root: added once more
        held.update(new)
        return bool(new)

    def _solve(self) -> bool:
        for _ in range(MAX_PASSES):
            changed = False
            for target, flow in self.bindings:
                for c in self.classes(flow.be):
                    changed |= self._union(target, c)
                changed |= self._hold(target, self.classes(flow.holds))
            for container, item in self.stores:
                for c in self.classes(container.be):
                    changed |= self._hold(c, self.classes(item.every()))
            self._index_defs()
            for call, callee, args in self.calls:
                changed |= self._bind_params(call, callee, args)
            if not changed:
                return True
        return False

    # ---- facts -------------------------------------------------------------------------------

    def flow(self, node: ast.expr | None) -> Flow:
        """What ``node``'s value may be and hold, in names."""
        if node is None or isinstance(node, ast.Constant):
            return Flow()
        if isinstance(node, ast.Name):  # a builtin function holds nothing of the program's
            return Flow() if node.id in BUILTIN_NAMES and node.id not in self.own else Flow({Atom(node.id)})
        if isinstance(node, ast.Attribute):  # a field or bound method of the object: the object itself
            return self.flow(node.value)
        if isinstance(node, ast.Subscript):
            inner = self.flow(node.value)
            return Flow(holds=inner.elements()) if isinstance(node.slice, ast.Slice) else Flow(inner.elements())
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return Flow(holds={a for e in node.elts for a in self.flow(e).every()})
        if isinstance(node, ast.Dict):
            return Flow(holds={a for e in (*node.keys, *node.values) for a in self.flow(e).every()})
        if isinstance(node, (ast.ListComp, ast.SetComp)):
            return Flow(holds=self.flow(node.elt).every())
        if isinstance(node, ast.DictComp):
            return Flow(holds=self.flow(node.key).every() | self.flow(node.value).every())
        if isinstance(node, ast.Lambda):
            return Flow({Atom(self._lambdas[node])})
        if isinstance(node, ast.Call):
            return self._call_flow(node)
        if isinstance(node, ast.GeneratorExp):  # it iterates what its loops name, lazily
            lazy = {a for g in node.generators for a in self.flow(g.iter).every()}
            return Flow(lazy, self.flow(node.elt).every())
        if isinstance(node, (ast.Compare, ast.JoinedStr)):
            return Flow()
        if isinstance(node, ast.BoolOp):  # one of its operands
            return _union(self.flow(v) for v in node.values)
        if isinstance(node, ast.IfExp):
            return self.flow(node.body) | self.flow(node.orelse)
        if isinstance(node, (ast.NamedExpr, ast.Starred, ast.Await)):
            return self.flow(node.value)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and not self.operators:  # numbers, or a new sequence
            parts = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
            return Flow(holds={a for p in parts for a in self.flow(p).elements()})
        names = {Atom(n.id) for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        return Flow(names, set(names))  # any other expression: any part of it

    def _call_flow(self, call: ast.Call) -> Flow:
        func = call.func
        args = [*call.args, *(k.value for k in call.keywords)]
        if isinstance(func, ast.Name) and func.id in BUILTIN_NAMES and func.id not in self.own:
            flows = [self.flow(x) for x in args]
            if func.id in SCALAR or func.id == "print":
                return Flow()
            if func.id in COPY:
                return Flow(holds={a for f in flows for a in f.elements()})
            if func.id in ("min", "max", "next") and len(call.args) == 1:  # an element of its argument
                return Flow({a for f in flows for a in f.elements()})
            if func.id in ("min", "max"):  # one of its arguments
                return Flow({a for f in flows for a in f.be}, {a for f in flows for a in f.holds})
        if isinstance(func, ast.Attribute) and func.attr in FRESH_METHODS:
            return Flow()
        if isinstance(func, ast.Attribute) and func.attr in ELEMENT_METHODS:
            receiver = self.flow(func.value)
            return Flow(receiver.elements() | receiver.be, receiver.elements())
        result = Flow({Atom(_result(call))})  # the program's functions it may call: what they return (solved)
        if isinstance(func, ast.Name) and func.id in self.plain_defs:
            return result
        # any other call may return (or hold) its arguments; a method, its object too; a callable held
        # in a variable, what that variable's object holds (``sd = d.setdefault``; ``sd(k)``)
        parts: set[Atom] = set()
        for x in args:
            parts |= self.flow(x).every()
        if isinstance(func, ast.Name):
            parts |= {Atom(a.name, True) for a in self.flow(func).be}
        else:
            parts |= self.flow(func).every()
        return result | Flow(parts, set(parts))

    def _callee_names(self, func: ast.expr) -> set[str]:
        """Names of the program's functions ``func`` may be, by name (the solver adds aliases)."""
        if isinstance(func, ast.Name):
            return {func.id}
        if isinstance(func, ast.Attribute):
            return {func.attr} | self._callee_names(func.value)
        return set()

    def _bind(self, target: ast.expr, flow: Flow) -> None:
        if isinstance(target, ast.Name):
            self.bindings.append((target.id, flow))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._bind(elt, Flow(flow.elements()))
        elif isinstance(target, ast.Starred):
            self._bind(target.value, Flow(holds=flow.elements()))
        elif isinstance(target, ast.Attribute):  # obj.attr = v: obj may now reach v
            self._bind_object(target.value, flow)
        elif isinstance(target, ast.Subscript):
            self.stores.append((self.flow(target.value), flow))

    def _bind_object(self, node: ast.expr, flow: Flow) -> None:
        for atom in self.flow(node).be:
            self.bindings.append((atom.name, Flow(flow.every())))

    def _facts(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            value = self.flow(node.value)
            for target in node.targets:
                self._bind(target, value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            self._bind(node.target, self.flow(node.value))
        elif isinstance(node, ast.AugAssign):
            value = self.flow(node.value)
            self._bind(node.target, Flow(value.be, value.every()))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind(node.target, Flow(self.flow(node.iter).elements()))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._bind(node.optional_vars, self.flow(node.context_expr))
        elif isinstance(node, ast.ClassDef):  # calling it returns the ``self`` of its methods
            for d in self.defs[node.name]:
                self.bindings += [(_returns(node.name), Flow({Atom(p)})) for p in _params(d)[:1]]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self.bindings += [(_returns(self._def_name(node)), f) for f in self._results(node)]
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            for param in _params(node):
                for default in defaults:
                    self.bindings.append((param, self.flow(default)))
        elif isinstance(node, ast.Call):
            args = [*node.args, *(k.value for k in node.keywords)]
            if isinstance(node.func, ast.Attribute):  # the receiver of a method is an argument too
                args.append(node.func.value)
            self.calls.append((node, self._callee(node.func), [self.flow(a) for a in args]))
            if isinstance(node.func, ast.Attribute) and node.func.attr in STORING:
                for arg in node.args:
                    self.stores.append((self.flow(node.func.value), self.flow(arg)))

    def _def_name(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> str:
        return self._lambdas[node] if isinstance(node, ast.Lambda) else node.name

    def _results(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> Iterator[Flow]:
        """What calling ``node`` may return: its return values; a generator, what it yields and,
        lazily, everything its loops iterate (nested functions' included: over-approximated)."""
        if isinstance(node, ast.Lambda):
            yield self.flow(node.body)
            return
        inner = _walk(node.body)
        generator = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in inner)
        for n in inner:
            if isinstance(n, ast.Return):
                yield self.flow(n.value)
            elif isinstance(n, ast.Yield):
                yield Flow(holds=self.flow(n.value).every())
            elif isinstance(n, ast.YieldFrom):
                yield Flow(self.flow(n.value).every())
            elif generator and isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                yield Flow(self.flow(n.iter).every())

    def _callee(self, func: ast.expr) -> Flow:
        return Flow({Atom(n) for n in self._callee_names(func)}) | self.flow(func)

    def _bind_params(self, call: ast.Call, callee: Flow, flows: list[Flow]) -> bool:
        """Parameters of the program's functions a call may call, bound to its arguments (every
        argument to every parameter: over-approximated, so ``*args``, keywords and ``self`` need no
        cases), and the call's result to what they return."""
        changed = False
        for name in {n for c in self.classes(callee.be) for n in self.by_class.get(c, ())}:
            changed |= self._union(_result(call), _returns(name))
            for node in self.defs[name]:
                for param in _params(node):
                    for f in flows:
                        for c in self.classes(f.be):
                            changed |= self._union(param, c)
                        changed |= self._hold(param, self.classes(f.holds))
        return changed

    # ---- the loops ---------------------------------------------------------------------------

    def mutations(self, region: Iterable[ast.AST]) -> Iterator[tuple[ast.AST, set[str]]]:
        """(node, classes it may change) for each place in ``region`` that may change an object."""
        for node in region:
            if isinstance(node, ast.Call):
                yield from self._call_mutations(node)
            elif isinstance(node, ast.AugAssign):
                yield node, self.classes(self.flow(node.target).be)
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.slice, ast.Slice)
            ):
                yield node, self.classes(self.flow(node.value).be)

    def _call_mutations(self, call: ast.Call) -> Iterator[tuple[ast.AST, set[str]]]:
        func = call.func
        args = [*call.args, *(k.value for k in call.keywords)]
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Constant):
                return  # "".join(q): a literal's methods change no argument
            if func.attr not in READ_ONLY:  # q.append(t), d.setdefault(k, q).append(t)
                yield call, self.classes(self.flow(func.value).be)
            if func.attr in READ_ONLY | STORING and self._program_object(func.value):
                # stores are contents (solved); reads change nothing; list.append(q, x) is neither
                args = [a for a in args if isinstance(a, (ast.Attribute, ast.Lambda))]
        else:
            yield call, self.classes(self.flow(func).be)  # push(t), with push = q.append
            if isinstance(func, ast.Name) and func.id in self.plain_defs:
                args = []  # its parameters are bound to them, and its body is part of the loop's region
            elif isinstance(func, ast.Name) and func.id in PURE and func.id not in self.own:
                # map(q.append, ...), sorted(..., key=q.append): a callable passed is called
                args = [a for a in call.args if isinstance(a, (ast.Attribute, ast.Lambda))]
                args += [k.value for k in call.keywords]
        for arg in args:
            yield call, self.classes(self.flow(arg).every())

    def _program_object(self, node: ast.expr) -> bool:
        """Whether ``node`` is rooted in a variable of the program (not a module, a class, a builtin
        or a call): then a method called on it is the object's own (``list.append(q, x)`` is not)."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return (
            isinstance(node, ast.Name)
            and node.id in self.own
            and node.id not in self.modules
            and node.id not in self.classdefs
        )

    def implicit(self) -> set[str]:
        """The program's functions whose bodies run without a call naming them: dunder methods
        (operators, iteration), decorated ones (properties), generators and coroutines (their
        bodies run in ``next`` or ``await`` of an object made elsewhere)."""
        return {
            name
            for name, defs in self.defs.items()
            if _is_dunder(name)
            or any(
                getattr(d, "decorator_list", None)
                or isinstance(d, ast.AsyncFunctionDef)
                or any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(d))
                for d in defs
            )
        }

    def reached(self, region: Iterable[ast.AST]) -> set[str]:
        """The program's functions ``region`` names or reaches, called or passed on
        (``sorted(xs, key=grow)``)."""
        out: set[str] = set()
        for node in region:
            if isinstance(node, (ast.Name, ast.Attribute)):
                for c in self.classes(self._callee(node).be):
                    out.update(self.by_class.get(c, ()))
        return out

    def _index_defs(self) -> None:
        self.by_class = {}
        for name in self.defs:
            self.by_class.setdefault(self.find(name), []).append(name)

    def closures(self) -> dict[str, dict[str, ast.AST]]:
        """Each function → every class it, or a function it reaches (transitively), may change,
        with the first place that does."""
        self._index_defs()
        edges = {d: self.reached(_walk(self.defs[d])) for d in self.defs}
        out: dict[str, dict[str, ast.AST]] = {}
        for component in _components(edges):  # each after every one it reaches
            members = set(component)
            merged = _first_sites(self.mutations(_walk(n for d in component for n in self.defs[d])))
            for e in sorted({e for d in component for e in edges[d]} - members):
                for c, node in out[e].items():
                    merged.setdefault(c, node)
            out.update(dict.fromkeys(component, merged))
        return out


def _first_sites(found: Iterable[tuple[ast.AST, set[str]]]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node, classes in found:
        for c in sorted(classes):
            out.setdefault(c, node)
    return out


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of ``edges``, each listed after every component it reaches
    (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(edges[root])))]
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                out.append(component)
    return out


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[str]:
    a = node.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x))]


def _union(flows: Iterable[Flow]) -> Flow:
    out = Flow()
    for f in flows:
        out = out | f
    return out


def _result(call: ast.Call) -> str:
    return f"<call#{id(call)}>"


def _returns(name: str) -> str:
    return f"<returns:{name}>"


def _bound_names(nodes: list[ast.AST]) -> Iterator[str]:
    for node in nodes:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.alias):
            yield node.asname or node.name.split(".")[0]


def grown_loops(tree: ast.AST) -> list[str]:
    """``line N: a for loop over `X`, which it grows: a while loop`` for each loop (``for``, and each
    generator of a comprehension) whose body may change what it iterates; fails closed."""
    flow = Aliases(tree)
    if not flow.settled:
        return [f"the program's names alias each other too deeply to check its loops (over {MAX_PASSES} passes)"]
    closures = flow.closures()
    implicit: dict[str, ast.AST] = {}
    for name in sorted(flow.implicit()):
        for c, site in closures[name].items():
            implicit.setdefault(c, site)
    out: list[str] = []
    for node in flow.nodes:
        if isinstance(node, (ast.For, ast.AsyncFor)):
            loops = [(node.iter, _walk(node.body))]
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            parts = [node.elt] if not isinstance(node, ast.DictComp) else [node.key, node.value]
            loops = [
                (gen.iter, _walk([*parts, *gen.ifs, *(x for g in node.generators[i + 1 :] for x in (g.iter, *g.ifs))]))
                for i, gen in enumerate(node.generators)
            ]
        else:
            continue
        for iterable, body in loops:
            iterated = flow.classes(flow.flow(iterable).be)
            if not iterated:
                continue
            sources = [_first_sites(flow.mutations(body)), *(closures[d] for d in flow.reached(body)), implicit]
            changed = [(getattr(src[c], "lineno", 0), c) for src in sources for c in iterated if c in src]
            if changed:
                line, c = min(changed)
                names = [n.id for n in ast.walk(iterable) if isinstance(n, ast.Name) and flow.find(n.id) == c]
                label = names[0] if names else ast.unparse(iterable)
                out.append(f"line {line}: a for loop over `{label}`, which it grows: a while loop")
    return out


def _walk(nodes: Iterable[ast.AST]) -> list[ast.AST]:
    return [n for node in nodes for n in ast.walk(node)]
