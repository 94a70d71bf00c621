"""The coding constraints, judged on the program's syntax tree (no sandbox): each bypass a policy can
learn is a violation with a reason, plain programs pass, and what cannot be read fails closed."""

from __future__ import annotations

import re

import pytest

from coevo.envs.coding import CONSTRAINTS, humaneval_problems
from coevo.envs.constraints import CONSTRAINT_NAMES, MAX_PROGRAM_CHARS, violations

ALL = ("no_imports", "no_while", "no_recursion")
PROMPT = '''from typing import List


def f(numbers: List[int]) -> int:
    """ Sum of the squares.
    >>> f([1, 2])
    5
    """
'''


def check(program: str, *constraints: str, entry: str = "f", prompt: str = "") -> dict[str, list[str]]:
    return violations(program, entry_point=entry, constraints=constraints or ALL, prompt=prompt)


def only(program: str, constraint: str, **kw: str) -> list[str]:
    """The reasons for ``constraint``, asserting the other two are satisfied."""
    found = check(program, **kw)
    assert {c: r for c, r in found.items() if c != constraint} == {c: [] for c in ALL if c != constraint}, found
    return found[constraint]


def test_the_environment_names_the_same_constraints_in_the_same_order() -> None:
    assert tuple(CONSTRAINTS) == CONSTRAINT_NAMES == ALL


# ---- the bypasses of the issue -----------------------------------------------------------------


def test_dunder_import_is_an_import_and_breaks_every_constraint() -> None:
    found = check("def f(x):\n    return __import__('math').sqrt(x)\n")
    assert found == {c: ["line 2: `__import__` can run or reach code the check cannot see"] for c in ALL}


def test_iter_with_a_sentinel_is_a_while_loop() -> None:
    program = "def f(x):\n    n = 0\n    for _ in iter(int, 1):\n        n += 1\n        if n > x:\n            break\n    return n\n"
    assert only(program, "no_while") == ["line 3: iter(f, sentinel) calls until a sentinel: a while loop"]


def test_an_alias_of_the_entry_is_recursion() -> None:
    program = "def f(x):\n    return 0 if x == 0 else 1 + g(x - 1)\ng = f\n"
    assert only(program, "no_recursion") == ["line 2: `g` (an alias of `f`) is referenced inside `f`: a recursive call"]


def test_the_prompts_own_import_is_allowed() -> None:
    program = PROMPT + "    return sum([n * n for n in numbers])\n"
    assert check(program, prompt=PROMPT) == {c: [] for c in ALL}
    # the same program judged without its prompt: the import is the program's own
    assert check(program)["no_imports"] == ["line 1: `from typing import List` (imports other than the prompt's own)"]


# ---- plain programs pass -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "program",
    [
        "def f(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n",
        "def helper(x):\n    return x * 2\ndef f(xs):\n    return [helper(x) for x in xs]\n",
        "def f(x):\n    return x + 1\nprint(f(3))\nassert f(1) == 2\nresults = [f(i) for i in range(3)]\n",
        "class Box:\n    __slots__ = ('v',)\n    def __init__(self, v):\n        self.v = v\n    def __eq__(self, o):\n"
        "        return isinstance(o, Box) and self.v == o.v\n"
        "class Big(Box):\n    def __init__(self, v):\n        super().__init__(v * 10)\n"
        "def f(x):\n    return Big(x).v\n",
        "def f(s):\n    return s.count('a') + getattr(s, 'real', 0)\nif __name__ == '__main__':\n    print(f('aa'))\n",
        "def f(xs):\n    out = []\n    for x in xs:\n        out.append(x)\n    return out\n",
        "class A:\n    def __init__(self):\n        self._x = 1\n    def _h(self):\n        return self._x\n"
        "def f(n):\n    return A()._h()\n",  # its own private names
        "def f(xs):\n    out = []\n    for i, x in enumerate(xs):\n        out.append(i * x)\n    return out\n",
    ],
)
def test_plain_programs_pass_every_constraint(program: str) -> None:
    assert check(program) == {c: [] for c in ALL}


def test_bounded_itertools_pass_no_while() -> None:
    program = (
        "import itertools\nfrom itertools import repeat\ndef f(x):\n"
        "    return list(itertools.repeat(x, 3)) + list(repeat(x, times=2)) + list(itertools.islice(x, 2))\n"
    )
    assert check(program, "no_while", "no_recursion") == {"no_while": [], "no_recursion": []}


# ---- escape hatches break every constraint -----------------------------------------------------


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("exec('while True: pass')", "`exec` can run"),
        ("x = eval('1')", "`eval` can run"),
        ("c = compile('1', 'x', 'eval')", "`compile` can run"),
        ("g = globals()['f']", "`globals` can run"),
        ("g = locals()", "`locals` can run"),
        ("g = vars()", "`vars` can run"),
        ("b = __builtins__", "`__builtins__` can run"),
        ("breakpoint()", "`breakpoint` can run"),
        ("help('os')", "`help` can run"),
        ("name = 'f'\nh = getattr(object, name)", "`getattr` with a name that is not a string literal"),
        ("g = getattr", "`getattr` used other than as a direct call"),
        ("setattr(object, 'x' + 'y', 1)", "`setattr` with a name that is not a string literal"),
        ("c = (1).__class__", "the dunder attribute `__class__`"),
        ("c = f.__globals__", "the dunder attribute `__globals__`"),
        ("c = f.__dict__", "the dunder attribute `__dict__`"),
        ("c = object.__subclasses__()", "the dunder attribute `__subclasses__`"),
        ("c = f.__code__", "the dunder attribute `__code__`"),
        ("c = getattr(f, '__code__')", "the dunder attribute `__code__`"),
        ("i = object().__init__", "the dunder attribute `__init__`"),
        ("c = __loader__", "`__loader__` can run"),
        ("c = __class__", "the dunder name `__class__`"),
        ("g = (x for x in [1])\nc = g.gi_frame.f_globals", "the frame/code attribute `gi_frame`"),
        ("import sys", "imports `sys`, a module outside the allowed ones"),
        ("from builtins import print", "imports from `builtins`, a module outside the allowed ones"),
        ("import operator\ng = operator.attrgetter('x')", "the attribute `attrgetter` can run"),
        ("from typing import get_type_hints", "imports `get_type_hints` from `typing`"),
        ("import typing\nt = typing._eval_type", "the private module attribute `typing._eval_type`"),
        ("import importlib", "`importlib`"),
        ("from . import x", "a relative import"),
        ("def g(x: '__import__(\"os\")'):\n    pass", "a string annotation"),
        ("match f:\n    case object(__globals__=g):\n        pass", "the dunder attribute `__globals__`"),
        # typing's internals run a string as code (found by a second read): private attributes fail closed
        (
            "from typing import List, get_args\nr = get_args(List['exec(1)'])[0]._evaluate({}, {}, frozenset())",
            "the private attribute `_evaluate` of code the program did not write",
        ),
        ("import typing\nt = typing\nr = t._eval_type", "the private attribute `_eval_type`"),
    ],
)
def test_escape_hatches_break_every_constraint(program: str, reason: str) -> None:
    found = check("def f(x):\n    return x\n" + program + "\n")
    for c in ALL:
        assert any(reason in r for r in found[c]), (c, found[c])


# ---- no_imports --------------------------------------------------------------------------------


def test_imports_other_than_the_prompts_are_violations() -> None:
    program = PROMPT + "    from typing import Dict\n    import math\n    return 0\n"
    assert only(program, "no_imports", prompt=PROMPT) == [
        "line 9: `from typing import Dict` (imports other than the prompt's own)",
        "line 10: `import math` (imports other than the prompt's own)",
    ]


def test_an_import_inside_the_prompts_function_is_the_prompts_own() -> None:
    prompt = 'def f(x):\n    import math\n    """Round up."""\n'  # as HumanEval/115
    assert check(prompt + "    return math.ceil(x)\n", prompt=prompt) == {c: [] for c in ALL}


def test_the_imports_of_a_prompt_that_does_not_parse_are_read_line_by_line() -> None:
    prompt = "import math\ndef f(x):\n"
    assert check(prompt + "    return math.floor(x)\n", prompt=prompt) == {c: [] for c in ALL}


# ---- no_while ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("def f(x):\n    while x:\n        x -= 1\n    return x", "line 2: a while loop"),
        ("def f(x):\n    it = iter\n    return next(it(int, 1))", "line 2: `iter` used other than as a direct call"),
        (
            "import itertools\ndef f(x):\n    for i in itertools.count():\n        return i",
            "itertools.count never ends",
        ),
        ("import itertools as it\ndef f(x):\n    return next(it.cycle([x]))", "itertools.cycle never ends"),
        ("from itertools import repeat\ndef f(x):\n    return next(repeat(x))", "itertools.repeat never ends"),
        ("from itertools import count as c\ndef f(x):\n    return next(c(x))", "itertools.count never ends"),
        ("from itertools import *\ndef f(x):\n    return next(count())", "itertools.count never ends"),
        ("import itertools\ndef f(x):\n    return next(getattr(itertools, 'count')())", "itertools.count never ends"),
        (
            "import itertools\ng = itertools.count\ndef f(x):\n    return x",
            "itertools.count used other than as a direct call",
        ),
        (
            "def f(x):\n    todo = [x]\n    for t in todo:\n        if t > 0:\n            todo.append(t - 1)\n    return todo",
            "line 5: a for loop over `todo`, which it grows: a while loop",
        ),
        ("def f(x):\n    q = [x]\n    [q.append(t - 1) for t in q if t > 0]\n    return q", "which it grows"),
        (
            "def f(q):\n    for i, t in enumerate(q):\n        q.append(t)\n    return q",
            "a for loop over `q`, which it grows",
        ),
        (
            "def f(q):\n    for t, u in zip(q, q):\n        q += [t]\n    return q",
            "a for loop over `q`, which it grows",
        ),
        (
            "class It:\n    def __next__(self):\n        return 1\n    def __iter__(self):\n        return self\n"
            "def f(x):\n    for t in It():\n        return t",
            "a class defining `__next__`",
        ),
        (
            "class Seq:\n    def __getitem__(self, i):\n        return i\ndef f(x):\n    for t in Seq():\n        return t",
            "a class defining `__getitem__`",
        ),
    ],
)
def test_loops_that_run_until_a_condition_break_no_while(program: str, reason: str) -> None:
    found = check(program + "\n", "no_while")["no_while"]
    assert any(reason in r for r in found), found


# each loops until a condition over a list its body grows, through something other than the list's
# own name (found by a second read): the class is "a mutation the iterated object may see"
GROWN_ELSEWHERE = {
    "a generator over the list": "def f(x):\n    q = [x]\n    for t in (y for y in q):\n"
    "        if t > 0:\n            q.append(t - 1)\n    return q",
    "a generator function over it": "def g(q):\n    for y in q:\n        yield y\ndef f(x):\n    q = [x]\n"
    "    for t in g(q):\n        if t > 0:\n            q.append(t - 1)\n    return q",
    "a generator closing over it": "def f(x):\n    q = [x]\n    def g():\n        yield from q\n"
    "    for t in g():\n        if t > 0:\n            q.append(t - 1)\n    return q",
    "itertools.chain(q)": "import itertools\ndef f(x):\n    q = [x]\n    for t in itertools.chain(q):\n"
    "        if t > 0:\n            q.append(t - 1)\n    return q",
    "list.append(q, x)": "def f(x):\n    q = [x]\n    for t in q:\n        if t > 0:\n"
    "            list.append(q, t - 1)\n    return q",
    "a bound q.append": "def f(x):\n    q = [x]\n    push = q.append\n    for t in q:\n        if t > 0:\n"
    "            push(t - 1)\n    return q",
    "an alias r = q": "def f(x):\n    q = [x]\n    r = q\n    for t in r:\n        if t > 0:\n"
    "            q.append(t - 1)\n    return q",
    "a helper that grows it": "def grow(q, t):\n    q.append(t)\ndef f(x):\n    q = [x]\n    for t in q:\n"
    "        if t > 0:\n            grow(q, t - 1)\n    return q",
    "heapq.heappush(q, x)": "import heapq\ndef f(x):\n    q = [x]\n    for t in q:\n        if t > 0:\n"
    "            heapq.heappush(q, t - 1)\n    return q",
    "a list inside another": "def f(x):\n    q = [x]\n    box = [q]\n    for t in q:\n        for r in box:\n"
    "            if t > 0:\n                r.append(t - 1)\n    return q",
    "a method growing self's list": "class Q:\n    def __init__(self, x):\n        self.items = [x]\n"
    "    def push(self, t):\n        self.items.append(t)\ndef f(x):\n    q = Q(x)\n    for t in q.items:\n"
    "        if t > 0:\n            q.push(t - 1)\n    return q.items",
    "an iterator over it": "def f(x):\n    q = [x]\n    it = iter(q)\n    for t in it:\n        if t > 0:\n"
    "            q.extend([t - 1])\n    return q",
    "a list a call hands back": "def f(x):\n    q = [x]\n    d = {}\n    for t in q:\n        if t > 0:\n"
    "            d.setdefault('k', q).append(t - 1)\n    return q",
    "a callable passed to map": "def f(x):\n    q = [x]\n    for t in q:\n        if t > 0:\n"
    "            list(map(list.append, [q], [t - 1]))\n    return q",
    "a comprehension's bound method": "def f(x):\n    q = [x]\n    push = q.append\n"
    "    [push(t - 1) for t in q if t > 0]\n    return q",
    # a third read: each aliasing construct below passed the check, and fills the list it loops over
    "a starred target, *r, = [q]": "def f(x):\n    q = [x]\n    *r, = [q]\n    for t in q:\n        if t > 0:\n"
    "            r[0].append(t - 1)\n    return q",
    "a starred target, a, *r = 0, q": "def f(x):\n    q = [x]\n    a, *r = 0, q\n    for t in q:\n        if t > 0:\n"
    "            r[0].append(t - 1)\n    return q",
    "min's default": "def f(x):\n    q = [x]\n    r = min([], default=q)\n    for t in q:\n        if t > 0:\n"
    "            r.append(t - 1)\n    return q",
    "copy.copy of a list holding it": "import copy\ndef f(x):\n    q = [x]\n    r = copy.copy([q])[0]\n    for t in q:\n"
    "        if t > 0:\n            r.append(t - 1)\n    return q",
    "dict.get's default": "def f(x):\n    q = [x]\n    r = {}.get('k', q)\n    for t in q:\n        if t > 0:\n"
    "            r.append(t - 1)\n    return q",
    "an element of a nested literal": "def f(x):\n    q = [x]\n    box = [[q]]\n    r = box[0]\n    for t in q:\n"
    "        if t > 0:\n            r[0].append(t - 1)\n    return q",
    "two levels of named lists": "def f(x):\n    q = [x]\n    inner = [q]\n    box = [inner]\n    for t in q:\n"
    "        if t > 0:\n            box[0][0].append(t - 1)\n    return q",
    "random.choice of a list holding it": "import random\ndef f(x):\n    q = [x]\n    r = [q]\n    for t in q:\n"
    "        if t > 0:\n            random.choice(r).append(t - 1)\n    return q",
    "heapq.heappush into another list": "import heapq\ndef f(x):\n    q = [x]\n    r = []\n    heapq.heappush(r, q)\n"
    "    for t in q:\n        if t > 0:\n            r[0].append(t - 1)\n    return q",
    "list.append(r, q) before the loop": "def f(x):\n    q = [x]\n    r = []\n    list.append(r, q)\n    for t in q:\n"
    "        if t > 0:\n            r[0].append(t - 1)\n    return q",
    "operator.setitem": "import operator\ndef f(x):\n    q = [x]\n    r = [0]\n    operator.setitem(r, 0, q)\n"
    "    for t in q:\n        if t > 0:\n            r[0].append(t - 1)\n    return q",
    "setattr": "class O:\n    pass\ndef f(x):\n    q = [x]\n    o = O()\n    setattr(o, 'a', q)\n    for t in q:\n"
    "        if t > 0:\n            o.a.append(t - 1)\n    return q",
    "a field of a library object": "def f(x):\n    q = [x]\n    s = slice(q)\n    for t in q:\n        if t > 0:\n"
    "            s.stop.append(t - 1)\n    return q",
    "a class attribute": "G = []\nclass C:\n    r = G\ndef f(x):\n    G.append(x)\n    for t in G:\n        if t > 0:\n"
    "            C().r.append(t - 1)\n    return list(G)",
    "an exception's args": "class E(Exception):\n    pass\ndef f(x):\n    q = [x]\n    e = E(q)\n    for t in q:\n"
    "        if t > 0:\n            e.args[0].append(t - 1)\n    return q",
    "a starred argument": "def g(r, t):\n    r.append(t)\ndef f(x):\n    q = [x]\n    for t in q:\n        if t > 0:\n"
    "            g(*[q, t - 1])\n    return q",
    "sum of lists": "def f(x):\n    q = [x]\n    r = sum([[q]], [])\n    for t in q:\n        if t > 0:\n"
    "            r[0].append(t - 1)\n    return q",
    "a keyword of dict()": "def f(x):\n    q = [x]\n    r = dict(a=q)['a']\n    for t in q:\n        if t > 0:\n"
    "            r.append(t - 1)\n    return q",
    "a partial of list.append as a key": "import functools\ndef f(x):\n    q = [x]\n"
    "    p = functools.partial(list.append, q)\n    for t in q:\n        if t > 0:\n"
    "            sorted([t - 1], key=p)\n    return q",
    "a comparison method returning it": "G = []\nclass C:\n    def __eq__(self, o):\n        return G\n"
    "def f(x):\n    G.append(x)\n    for t in G:\n        if t > 0:\n            (C() == 1).append(t - 1)\n    return list(G)",
    "a defaultdict's factory": "import collections\nG = []\ndef f(x):\n    G.append(x)\n"
    "    d = collections.defaultdict(lambda: G)\n    for t in G:\n        if t > 0:\n            d['k'].append(t - 1)\n"
    "    return list(G)",
}

# constructs the analysis does not model: refused as such, naming the construct (each program
# grows the list it loops over through the construct)
UNMODELLED = {
    "match q: case r:": (
        "def f(x):\n    q = [x]\n    match q:\n        case r:\n            pass\n    for t in q:\n        if t > 0:\n"
        "            r.append(t - 1)\n    return q",
        "line 3: a `match` statement: the loop check does not model it (not checked)",
    ),
    "except ... as e": (
        "def f(x):\n    q = [x]\n    try:\n        raise ValueError(q)\n    except ValueError as e:\n"
        "        r = e.args[0]\n    for t in q:\n        if t > 0:\n            r.append(t - 1)\n    return q",
        "line 5: `except ... as e` (the raised object can be anything)",
    ),
    "a property": (
        "G = []\nclass C:\n    @property\n    def p(self):\n        return G\ndef f(x):\n    G.append(x)\n"
        "    c = C()\n    for t in G:\n        if t > 0:\n            c.p.append(t - 1)\n    return list(G)",
        "line 4: the decorator `@property`",
    ),
    "a decorator": (
        "G = []\ndef dec(fn):\n    return lambda: G\n@dec\ndef h():\n    return 0\ndef f(x):\n    G.append(x)\n"
        "    for t in G:\n        if t > 0:\n            h().append(t - 1)\n    return list(G)",
        "line 5: the decorator `@dec`",
    ),
    "__new__": (
        "G = []\nclass C:\n    def __new__(cls):\n        return G\ndef f(x):\n    G.append(x)\n    for t in G:\n"
        "        if t > 0:\n            C().append(t - 1)\n    return list(G)",
        "line 3: the dunder method `__new__` (Python calls it implicitly)",
    ),
    "__iter__": (
        "G = []\nclass C:\n    def __iter__(self):\n        return iter(G)\ndef f(x):\n    G.append(x)\n"
        "    for t in C():\n        if t > 0:\n            G.append(t - 1)\n    return list(G)",
        "line 3: the dunder method `__iter__`",
    ),
    "a class based on list": (
        "class L(list):\n    pass\ndef f(x):\n    q = L([x])\n    for t in q:\n        if t > 0:\n"
        "            q += [t - 1]\n    return q",
        "line 1: the class `L` based on `list`",
    ),
}


@pytest.mark.parametrize("program", list(GROWN_ELSEWHERE.values()), ids=list(GROWN_ELSEWHERE))
def test_a_loop_over_a_list_grown_through_another_name_breaks_no_while(program: str) -> None:
    found = check(program + "\n", "no_while")["no_while"]
    assert any("which it grows: a while loop" in r for r in found), found
    # it really loops until a condition: run it, it visits every value down to 0
    scope: dict[str, object] = {}
    exec(program, scope)  # the test's own program
    result = scope["f"](3)  # type: ignore[operator]
    items = result if isinstance(result, list) else list(result)  # type: ignore[call-overload]
    assert set(items) == {0, 1, 2, 3}, items


@pytest.mark.parametrize("name", list(UNMODELLED))
def test_what_the_loop_analysis_does_not_model_breaks_no_while(name: str) -> None:
    program, reason = UNMODELLED[name]
    found = check(program + "\n", "no_while")["no_while"]
    assert any(r.startswith(reason) and r.endswith("(not checked)") for r in found), found
    scope: dict[str, object] = {}
    exec(program + "\n", scope)  # the test's own program: it does loop over what it grows
    assert sorted(scope["f"](3)) == [0, 1, 2, 3]  # type: ignore[operator]


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("async def g():\n    return 1", "line 3: an `async def`"),
        ("def g(x):\n    y = yield\n    yield y", "line 4: the value of a `yield` expression"),
        ("class M(type):\n    pass\nclass C(metaclass=M):\n    pass", "the class keyword `metaclass=`"),
        ("class C:\n    def __getattr__(self, n):\n        return []", "the dunder method `__getattr__`"),
        ("x = open('f')", "line 3: a call of the builtin `open` (what it does with its arguments)"),
        ("import dataclasses\n@dataclasses.dataclass\nclass C:\n    x: int = 0", "the class decorator"),
        ("try:\n    pass\nexcept* ValueError:\n    pass", "line 3: a `try ... except*`"),
    ],
)
def test_every_construct_off_the_whitelist_is_named(program: str, reason: str) -> None:
    found = check("def f(x):\n    return x\n" + program + "\n", "no_while")["no_while"]
    assert any(reason in r and r.endswith("the loop check does not model it (not checked)") for r in found), found


def test_the_whitelist_keeps_the_reference_solutions_that_use_for_loops() -> None:
    """Of the 164 HumanEval reference solutions, no_while refuses exactly those with a while loop
    (and /160, which uses eval): the whitelist refuses none of the others."""
    refused = {
        pid
        for pid, p in humaneval_problems().items()
        if violations(p.solution or "", entry_point=p.entry_point, constraints=["no_while"], prompt=p.prompt)[
            "no_while"
        ]
    }
    with_while = {pid for pid, p in humaneval_problems().items() if re.search(r"^\s*while ", p.solution or "", re.M)}
    assert len(with_while) == 15
    assert refused == with_while | {"HumanEval/160"}


@pytest.mark.parametrize(
    "program",
    [
        "def f(grid):\n    for row in grid:\n        row.append(0)\n    return grid",
        "def f(xs):\n    total = xs[0]\n    for x in xs:\n        total += x\n    return total",
        "def f(xs):\n    out = list(xs)\n    for x in xs:\n        out.append(x * 2)\n    return out",
        "def f(xs):\n    seen = set()\n    for x in sorted(xs):\n        seen.add(x)\n        xs.append(x)\n    return seen",
        "def f(xs):\n    n = len(xs)\n    for i in range(len(xs)):\n        xs.append(i)\n    return n",
        "def f(s):\n    out = []\n    for w in s.split():\n        out.append(w.upper())\n    return ' '.join(out)",
        "def f(xs):\n    counts = {}\n    for x in xs:\n        counts[x] = counts.get(x, 0) + 1\n    return counts",
        # honest uses of what the whitelist models: library calls, classes, decorators, generators
        "import collections\ndef f(xs):\n    c = collections.Counter(xs)\n    out = []\n    for k, v in c.most_common():\n"
        "        out.append(k)\n    for x in xs:\n        c[x] += 1\n    return out",
        "import heapq\ndef f(xs):\n    h = []\n    for x in xs:\n        heapq.heappush(h, x)\n    out = []\n"
        "    for _ in range(len(h)):\n        out.append(heapq.heappop(h))\n    return out",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n"
        "    def __len__(self):\n        return len(self.items)\ndef f(xs):\n    s = Stack()\n    for x in xs:\n"
        "        s.push(x)\n    return len(s)",
        "def f(xs):\n    d = {}\n    for x in xs:\n        d.setdefault(x % 3, []).append(x)\n    return [sorted(v) for v in d.values()]",
        "import itertools\ndef f(xs):\n    out = []\n    for a, b in itertools.combinations(xs, 2):\n        out.append(a + b)\n"
        "    return out",
        "import functools\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "def f(n):\n    out = []\n    for i in range(n):\n        out.append(fib(i))\n    return out",
        "class P:\n    def __init__(self, x):\n        self.x = x\n    def __eq__(self, o):\n        return self.x == o.x\n"
        "    def __repr__(self):\n        return f'P({self.x})'\ndef f(xs):\n    out = []\n    for p in [P(x) for x in xs]:\n"
        "        out.append(str(p))\n    return out",
        "def f(xs):\n    out = []\n    for y in filter(lambda v: v > 0, map(int, xs)):\n        out.append(y)\n    return out",
        "def gen(xs):\n    for x in xs:\n        yield x * 2\ndef f(xs):\n    out = []\n    for y in gen(xs):\n        out.append(y)\n"
        "    return out",
        "def f(xs):\n    out = []\n    for x in xs:\n        try:\n            out.append(int(x))\n        except ValueError:\n"
        "            pass\n    return out",
    ],
)
def test_loops_over_what_the_body_does_not_grow_pass_no_while(program: str) -> None:
    assert check(program + "\n", "no_while") == {"no_while": []}


# ---- no_recursion ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("def f(x):\n    return f(x - 1) if x else 0", "line 2: `f` is referenced inside `f`: a recursive call"),
        (
            "def f(x):\n    return g(x)\ndef g(x):\n    return f(x - 1) if x else 0",
            "line 4: `f` is referenced inside `g`: a recursive call",
        ),
        ("def f(x):\n    return h(x)\ng = f\nh = g", "`h` (an alias of `f`) is referenced inside `f`"),
        ("def f(x):\n    return (lambda: f)()(x - 1) if x else 0", "`f` is referenced inside `<lambda>`"),
        ("def f(x):\n    return 0\nclass C:\n    m = f", "`f` is referenced inside `C`"),
        (
            "def f(x):\n    return next(gs[x])\ngs = [(f(i) for i in [1]) for _ in range(3)]",
            "referenced inside `<genexpr>`",
        ),
        ("def f(x, me=None):\n    return 0\ndef g(x, h=f):\n    return h(x)", "`f` is referenced inside `g`"),
        (
            "def fix(g):\n    return lambda *a: g(g, *a)\n@fix\ndef f(self, x):\n    return self(x - 1) if x else 0",
            "line 4: `f` is decorated",
        ),
        ("def f(x):\n    return 0\nf = print", "line 3: `f` is rebound"),
        ("def f(x):\n    return 0\ndef f(x):\n    return 1", "line 3: `f` is defined again"),
        ("def f(x):\n    return reg[0](x)\nreg = []\nreg.append(f)", "line 4: `f` is passed on at module level"),
        ("def f(x):\n    return t[0](x)\nt = [f]", "line 3: `f` is passed on at module level"),
        ("from math import floor as f", "`f` is rebound by an import"),
    ],
)
def test_references_to_the_entry_from_deferred_code_break_no_recursion(program: str, reason: str) -> None:
    found = check(program + "\n", "no_recursion")["no_recursion"]
    assert any(reason in r for r in found), found


def test_recursion_needs_an_entry_point() -> None:
    assert check("print(1)\n", "no_recursion", entry="") == {
        "no_recursion": ["there is no entry point to check recursion against"]
    }


# ---- failing closed ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("def f(x):\n    return (\n", "does not parse (SyntaxError"),
        ("def f(x):\n    return 1\0\n", "does not parse"),
        ("x = 1\n" * (MAX_PROGRAM_CHARS // 6 + 1), f"over {MAX_PROGRAM_CHARS}): not checked"),
        ("x = " + "(" * 1000 + ")" * 1000, "too many nested parentheses"),
        ("x = " + "-" * 100_000 + "1", "too deeply nested to check"),
        ("x = " + "1+" * 90_000 + "1", "too deeply nested to check"),
    ],
)
def test_what_cannot_be_read_breaks_every_constraint(program: str, reason: str) -> None:
    found = check(program)
    assert list(found) == list(ALL)
    for c in ALL:
        assert len(found[c]) == 1 and reason in found[c][0], found[c]


def test_constraint_names_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown constraints 'no_for', 'no_def'"):
        violations("x = 1", entry_point="f", constraints=["no_while", "no_for", "no_def"])
    assert violations("x = 1", entry_point="f", constraints=[]) == {}
    assert violations("x = 1", entry_point="f", constraints=["no_while", "no_while"]) == {"no_while": []}
