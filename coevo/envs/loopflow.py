"""Which loops may grow what they iterate: ``no_while``'s check of ``for`` loops and comprehensions.

A ``for`` over a list its own body appends to runs until a condition, like ``while``. The list can
be reached under other names than the one the loop names: an alias (``r = q``), a bound method
(``push = q.append``), an unbound one (``list.append(q, x)``), an iterator or generator over it
(``iter(q)``, ``(y for y in q)``, ``itertools.chain(q)``, a generator function), a container holding
it (at any depth), a function or method it is passed to, a library call handing it back. So the
check is a may-alias analysis over the program's names, not a match on one name.

Invariant (sound relative to a whitelist): the analysis runs only on programs made of the
constructs ``coevo.envs.loopsubset`` lists (any other is refused, naming it); on those, a loop
passes only if nothing in its body (nor in a function its body may call or pass on, nor in a dunder
or decorated method, which run implicitly) may change an object the loop may be iterating. "May be
the same object" is a union of names over the whole program, whatever their scope (``a = b``,
``a = b.attr``, ``a = f(b)``, a parameter bound to an argument, ``a`` taken out of a container
``b`` was put into at any depth); "may change" is a call modelled as changing its receiver or, for
a call the models do not cover, any object reachable from its arguments, passing a callable to a
call, ``+=``, and a slice assignment. What does not settle in a few passes fails closed. Loops over
a fresh copy (``sorted(q)``, ``list(q)``, ``q[:]``, ``range(len(q))``) iterate an object nothing
else holds, and pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from coevo.envs.loopsubset import BUILTIN_MODELS, CHANGING, COMPARISONS, METHOD_MODELS, Program, unmodelled

MAX_PASSES = 32


@dataclass(frozen=True)
class Atom:
    """``name`` itself (``inside=False``), or anything an object ``name`` may be holds, at any depth
    (``inside=True``)."""

    name: str
    inside: bool = False


@dataclass
class Flow:
    """What an expression's value may be (``be``) and may hold, at any depth (``holds``)."""

    be: set[Atom] = field(default_factory=set)
    holds: set[Atom] = field(default_factory=set)

    def __or__(self, other: Flow) -> Flow:
        return Flow(self.be | other.be, self.holds | other.holds)

    def elements(self) -> set[Atom]:
        """What iterating the value, or indexing it, may give (or what that holds)."""
        return self.holds | {Atom(a.name, True) for a in self.be}

    def element(self) -> Flow:
        """An element taken out of the value: one of what it holds, holding any of the rest (a
        literal's nested containers have no name of their own)."""
        return Flow(self.elements(), set(self.holds))

    def every(self) -> set[Atom]:
        return self.be | self.holds

    def deep(self) -> set[Atom]:
        """The value and everything reachable from it."""
        return self.every() | {Atom(a.name, True) for a in self.every()}


class Aliases:
    """Names that may share an object, and what each such object may hold, for one program."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.nodes = program.nodes
        self.classdefs = program.classdefs
        self.parent: dict[str, str] = {}
        self.contents: dict[str, set[str]] = {}
        self._reach: dict[str, frozenset[str]] = {}
        self.defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda]] = {}
        self._lambdas: dict[ast.Lambda, str] = {}
        self.selves: set[str] = set()  # the first parameter of every method (``super()`` is one of them)
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
                self.selves.update(p for m in node.body if isinstance(m, ast.FunctionDef) for p in _params(m)[:1])
        rebound = {n.id for n in self.nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        rebound |= {n.arg for n in self.nodes if isinstance(n, ast.arg)}
        rebound |= {a.asname or a.name.split(".")[0] for n in self.nodes if isinstance(n, ast.alias) for a in [n]}
        functions = [n.name for n in self.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        self.plain_defs = frozenset(n for n in functions if functions.count(n) == 1) - rebound - self.classdefs
        self.plain_defs |= self._function_aliases(rebound)
        self.by_class: dict[str, list[str]] = {}
        self.bindings: list[tuple[str, Flow]] = []
        self.stores: list[tuple[Flow, Flow]] = []  # (container, what is put into it)
        # each call: what it may call, with what, and whether it returns what that returns
        self.calls: list[tuple[ast.Call, Flow, list[Flow], bool]] = []
        self.callables: list[Flow] = []  # values that may be a bound method, or a callable of a library
        for node in self.nodes:
            self._facts(node)
        self.settled = self._solve()
        """False: no fixed point within ``MAX_PASSES`` (the caller fails closed)"""
        # the classes of callables other than the program's functions: bound methods, a library's
        self.callable_classes = self.classes(a for f in self.callables for a in f.be)

    def _function_aliases(self, rebound: set[str]) -> frozenset[str]:
        """Names bound only by ``g = f`` (``f`` a plain function, or such a name): calling one calls ``f``."""
        stores: dict[str, list[ast.AST]] = {}
        for n in self.nodes:
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                stores.setdefault(n.id, []).append(n)
        other = {n.arg for n in self.nodes if isinstance(n, ast.arg)} | set(self.program.imports) | set(self.defs)
        out: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, nodes in stores.items():
                if name in out or name in other:
                    continue
                parents = [self.program.parents.get(n) for n in nodes]
                if all(
                    isinstance(p, ast.Assign)
                    and p.targets == [n]
                    and isinstance(p.value, ast.Name)
                    and (p.value.id in self.plain_defs or p.value.id in out)
                    for n, p in zip(nodes, parents, strict=True)
                ):
                    out.add(name)
                    changed = True
        return frozenset(out)

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
        self._reach.clear()
        return True

    def _inside(self, root: str) -> frozenset[str]:
        """Every class an object of class ``root`` may hold, at any depth."""
        if root not in self._reach:
            seen: set[str] = set()
            todo = [root]
            while todo:
                for c in self.contents.get(todo.pop(), ()):
                    c = self.find(c)
                    if c not in seen:
                        seen.add(c)
                        todo.append(c)
            self._reach[root] = frozenset(seen)
        return self._reach[root]

    def classes(self, atoms: Iterable[Atom]) -> set[str]:
        """The classes ``atoms`` may be (inside: any class their class holds, at any depth)."""
        out: set[str] = set()
        for a in atoms:
            root = self.find(a.name)
            if a.inside:
                out.update(self._inside(root))
            else:
                out.add(root)
        return out

    def _hold(self, container: str, items: set[str]) -> bool:
        held = self.contents.setdefault(self.find(container), set())
        new = {self.find(i) for i in items} - held  # held may name a class by an older root: added once more
        held.update(new)
        if new:
            self._reach.clear()
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
            for call, callee, args, returns in self.calls:
                changed |= self._bind_params(call, callee, args, returns=returns)
            if not changed:
                return True
        return False

    # ---- facts -------------------------------------------------------------------------------

    def flow(self, node: ast.expr | None) -> Flow:
        """What ``node``'s value may be and hold, in names."""
        if node is None or isinstance(node, (ast.Constant, ast.JoinedStr, ast.FormattedValue)):
            return Flow()
        if isinstance(node, ast.Name):  # a builtin function holds nothing of the program's
            return Flow() if self.program.is_builtin(node) else Flow({Atom(node.id)})
        if isinstance(node, ast.Attribute):  # a field or bound method: the object, or what it holds
            if self.program.is_builtin(node.value):  # list.append: a callable of its own
                return Flow({Atom(f"<builtin {ast.unparse(node)}>")})
            inner = self.flow(node.value)  # (slice(q).start is q; the program's objects are their fields)
            return Flow(inner.be | inner.elements(), inner.holds)
        if isinstance(node, ast.Subscript):
            inner = self.flow(node.value)
            return Flow(holds=inner.elements()) if isinstance(node.slice, ast.Slice) else inner.element()
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
        if isinstance(node, ast.Compare):  # a bool, or what the program's comparison methods return
            return Flow({Atom(_returns(d)) for d in COMPARISONS if d in self.defs})
        if isinstance(node, ast.BoolOp):  # one of its operands
            return _union(self.flow(v) for v in node.values)
        if isinstance(node, ast.IfExp):
            return self.flow(node.body) | self.flow(node.orelse)
        if isinstance(node, (ast.NamedExpr, ast.Starred)):
            return self.flow(node.value)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):  # numbers, or a new sequence (no operator methods)
            parts = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
            return Flow(holds={a for p in parts for a in self.flow(p).elements()})
        names = {Atom(n.id) for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        return Flow(names, set(names))  # any other expression (none, on the whitelist): any part of it

    def model(self, call: ast.Call) -> tuple[str, ast.expr | None]:
        """(how the call is modelled, its receiver): ``loopsubset``'s models, "plain" for the program's
        own function or class called by its name."""
        func, program = call.func, self.program
        if isinstance(func, ast.Name):
            if program.is_builtin(func):
                return BUILTIN_MODELS.get(func.id, "generic"), None
            if func.id in self.plain_defs:
                return "plain", None
            if func.id in self.classdefs and func.id not in program.imports:
                return "class", None
            return program.module_model(func) or "generic", None
        if isinstance(func, ast.Attribute):
            module = program.module_model(func)
            if module is not None:
                return module, None
            if program.is_builtin(func.value):  # list.append(q, x), dict.fromkeys(q): unbound
                return "generic", None
            return METHOD_MODELS.get(func.attr, "generic"), func.value
        return "generic", None

    def _args(self, call: ast.Call) -> list[Flow]:
        """Each argument's flow; ``*xs`` and ``**kw`` pass their elements."""
        out = []
        for a in call.args:
            f = self.flow(a)
            out.append(f | f.element() if isinstance(a, ast.Starred) else f)
        for k in call.keywords:
            f = self.flow(k.value)
            out.append(f | f.element() if k.arg is None else f)
        return out

    def _call_flow(self, call: ast.Call) -> Flow:
        kind, receiver = self.model(call)
        args = self._args(call)
        whole = _union(args)
        mine = self.flow(receiver) if receiver is not None else Flow()
        result = Flow({Atom(_result(call))})  # the program's functions it may call: what they return (solved)
        if kind in ("plain", "scalar", "store", "mutate", "setattr"):
            return result
        if kind == "class":  # a new object; an exception's (or an own initializer's) fields hold the arguments
            return result | Flow(holds=whole.every())
        if kind == "copy":
            keywords = _union(self.flow(k.value) for k in call.keywords if k.arg is not None)
            return result | Flow(holds=mine.elements() | whole.elements() | keywords.every())
        if kind in ("lazy", "view", "map"):
            mapped = {Atom(_result(call))} if kind == "map" else set()
            return result | Flow((mine | whole).every(), (mine | whole).elements() | mapped)
        if kind == "element":
            return result | self._element(call, whole)
        if kind == "container":
            return result | Flow(holds=whole.every())
        if kind in ("get", "pop", "setdefault"):
            return result | mine.element() | whole
        if kind == "super":
            return result | Flow({Atom(s) for s in self.selves})
        return result | self._generic(call, receiver)

    def _element(self, call: ast.Call, whole: Flow) -> Flow:
        """One of the arguments, or an element of one: which, for the builtins that say."""
        func, args = call.func, call.args
        if (
            not isinstance(func, ast.Name)
            or not self.program.is_builtin(func)
            or any(isinstance(a, ast.Starred) for a in args)
        ):
            return Flow(whole.every() | whole.elements(), whole.elements())
        default = _union(self.flow(k.value) for k in call.keywords if k.arg in ("default", "start"))
        flows = [self.flow(a) for a in args]
        if func.id in ("min", "max") and len(flows) > 1:  # one of its arguments, or its default
            return _union(flows) | default
        if func.id in ("min", "max", "next"):  # an element of the first, its default, or next's second
            return _union(f.element() for f in flows[:1]) | _union(flows[1:]) | default
        if func.id == "sum":  # its start, or a new object of its elements' elements
            return _union(flows[1:]) | default | Flow(holds={a for f in flows[:1] for a in f.deep()})
        return _union(flows)  # getattr(o, "a", default): an attribute is the object; type(o)

    def _generic(self, call: ast.Call, receiver: ast.expr | None) -> Flow:
        """A call the models do not cover: it may return, or store in each other, anything reachable
        from its arguments, its receiver and its callee (a module: what earlier calls left there)."""
        parts = _union(self._args(call)) | self.flow(call.func)
        if receiver is not None:
            parts |= self.flow(receiver)
        deep = parts.deep() | {Atom(_result(call), True)}
        return Flow(deep, deep)

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
            for elt in target.elts:  # ``*r`` is a new list of elements; the others, an element each
                self._bind(elt, Flow(holds=flow.elements()) if isinstance(elt, ast.Starred) else flow.element())
        elif isinstance(target, ast.Starred):
            self._bind(target.value, flow)
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
            self._bind(node.target, self.flow(node.iter).element())
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            deep = self.flow(node.context_expr).deep()  # what ``__enter__`` returns: anything it reaches
            self._bind(node.optional_vars, Flow(deep, deep))
        elif isinstance(node, ast.ClassDef):
            self._class_facts(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self.bindings += [(_returns(self._def_name(node)), f) for f in self._results(node)]
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            for param in _params(node):
                for default in defaults:
                    self.bindings.append((param, self.flow(default)))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and not self._used_in_place(node):
            self.callables.append(self.flow(node))  # a bound method taken as a value (or a field read)
        elif isinstance(node, ast.Call):
            self._call_facts(node)

    def _class_facts(self, node: ast.ClassDef) -> None:
        """Calling the class returns the ``self`` of its methods; an instance reads the class's
        attributes and its bases' (so all are one object here); a class attribute is the class."""
        for d in self.defs[node.name]:
            self.bindings += [(_returns(node.name), Flow({Atom(p)})) for p in _params(d)[:1]]
        self.bindings.append((node.name, Flow({Atom(_returns(node.name))})))
        self.bindings += [(node.name, Flow({Atom(b.id)})) for b in node.bases if isinstance(b, ast.Name)]
        for stmt in node.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                self.bindings.append((node.name, Flow(self.flow(stmt.value).every())))

    def _call_facts(self, node: ast.Call) -> None:
        kind, receiver = self.model(node)
        args = self._args(node)
        if receiver is not None:  # the receiver of a method is an argument too
            args.append(self.flow(receiver))
        self.calls.append((node, self._callee(node.func), args, True))
        if kind not in ("plain", "class"):  # a library may call a callable it is given, with the others
            for i, f in enumerate(args):
                others = [g | g.element() for j, g in enumerate(args) if j != i or kind == "generic"]
                self.calls.append((node, Flow(f.deep()), others, kind in ("generic", "map")))
        if kind in ("store", "setdefault") and receiver is not None:
            for f in args[:-1]:
                self.stores.append((self.flow(receiver), f))
        elif kind == "setattr" and len(node.args) == 3:
            self._bind_object(node.args[0], self.flow(node.args[2]))
        elif kind == "generic":
            deep = self._generic(node, receiver)
            self.stores.append((deep, deep))
            self.callables.append(Flow({Atom(_result(node))}))

    def _used_in_place(self, node: ast.Attribute) -> bool:
        """Whether ``node`` is called, or read further (``o.a.b``, ``o.a[i]``), rather than passed on."""
        parent = self.program.parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            return True
        return isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node

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

    def _bind_params(self, call: ast.Call, callee: Flow, flows: list[Flow], *, returns: bool) -> bool:
        """Parameters of the program's functions a call may call, bound to its arguments (every
        argument to every parameter: over-approximated, so ``*args``, keywords and ``self`` need no
        cases), and the call's result to what they return."""
        changed = False
        for name in {n for c in self.classes(callee.every()) for n in self.by_class.get(c, ())}:
            if returns:
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
        kind, receiver = self.model(call)
        if kind == "generic":  # anything reachable from what it is given
            yield call, self.classes(self._generic(call, receiver).be)
            return
        if kind in CHANGING and receiver is not None:  # q.append(t), d.setdefault(k, q).append(t)
            yield call, self.classes(self.flow(receiver).be)
        if kind == "plain":
            return  # its parameters are bound to the arguments, and its body is part of the loop's region
        # a callable it is given (sorted(xs, key=q.append), map(list.append, [q], xs), re.sub(p, q.append, s))
        # may be called with the other arguments: each may change (a function of the program's is part of
        # the region). A builtin calls only a keyword's callable, or map's and filter's first argument.
        given = [k.value for k in call.keywords]
        if not (isinstance(call.func, ast.Name) and self.program.is_builtin(call.func)):
            given += call.args
        elif kind == "map" or call.func.id == "filter":
            given += call.args[:1]
        reach = [self.classes(self.flow(a).deep()) for a in (*call.args, *(k.value for k in call.keywords))]
        if any(self.classes(self.flow(a).deep()) & self.callable_classes for a in given):
            yield call, set().union(*reach)

    def implicit(self) -> set[str]:
        """The program's functions whose bodies run without a call naming them: dunder methods
        (operators, comparisons), decorated ones, generators and coroutines (their bodies run in
        ``next`` of an object made elsewhere)."""
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
        (``sorted(xs, key=grow)``), or held in what it names (``fs[0]()``)."""
        out: set[str] = set()
        for node in region:
            if isinstance(node, (ast.Name, ast.Attribute)):
                callee = self._callee(node)
                for c in self.classes(callee.be | {Atom(a.name, True) for a in callee.be}):
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


def grown_loops(tree: ast.AST) -> list[str]:
    """``line N: a for loop over `X`, which it grows: a while loop`` for each loop (``for``, and each
    generator of a comprehension) whose body may change what it iterates; fails closed: a program
    with a construct outside ``loopsubset``'s whitelist gets one reason per such construct instead."""
    program = Program(tree)
    refused = unmodelled(program)
    if refused:
        return refused
    flow = Aliases(program)
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
