"""Adversarial programs against the coding environment: each is a wrong solution to HumanEval/0 that
tries to forge its verdict or leave the sandbox. Every one must score ``lost`` and leave nothing
outside: the canary directory keeps its contents, the test's listening sockets see no connection,
the canary process gets no signal, the secret in this process's environment is never read.

Several attacks first disarm the audit hook (rebinding its ``deny`` through the closure), so what
stops them is the OS isolation (bubblewrap, seccomp), not the hook. All run under ``bwrap``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coevo.envs.base import StepResult
from coevo.envs.coding import Coding, humaneval_problems
from coevo.envs.sandbox import SandboxResult
from coevo.schemas import TaskSpec

SECRET = "coevo-attack-secret-5f3c9a"
WRONG = "def has_close_elements(numbers, threshold):\n    return True\n"  # fails the tests expecting False
DISARM = """
import gc
_disarmed = 0
for _f in gc.get_objects():
    if callable(_f) and getattr(_f, "__name__", "") == "hook" and getattr(_f, "__closure__", None):
        for _c in _f.__closure__:
            if getattr(_c.cell_contents, "__name__", "") == "deny":
                _c.cell_contents = lambda what: None
                _disarmed += 1
print("hook disarmed", _disarmed, flush=True)
"""


@dataclass
class Canary:
    """What the test owns outside the sandbox, and proof nothing touched it."""

    dir: Path
    tcp: socket.socket
    unix: socket.socket
    proc: subprocess.Popen[bytes]
    signalled: Path
    before: set[str]

    @property
    def port(self) -> int:
        return int(self.tcp.getsockname()[1])

    def fmt(self, program: str) -> str:
        return (
            program.replace("CANARY_DIR", repr(str(self.dir)))
            .replace("CANARY_PORT", str(self.port))
            .replace("CANARY_PID", str(self.proc.pid))
            .replace("HOST_PID", str(os.getpid()))
        )

    def assert_untouched(self) -> None:
        assert sorted(p.name for p in self.dir.iterdir()) == ["keep.txt", "sock"]
        assert (self.dir / "keep.txt").read_text() == "canary"
        for s in (self.tcp, self.unix):
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody connected
        assert self.proc.poll() is None and not self.signalled.exists()
        assert sandbox_processes_left(self.before) == set()


def harness_pids() -> set[str]:
    return set(subprocess.run(["pgrep", "-f", "harness.py"], capture_output=True, text=True).stdout.split())


def sandbox_processes_left(before: set[str], within_s: float = 3.0) -> set[str]:
    """Sandbox processes started since ``before`` that are still alive after ``within_s`` (other
    sessions' sandboxes on this host come and go within it; a leaked one stays)."""
    deadline = time.monotonic() + within_s
    while (left := harness_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Canary]:
    monkeypatch.setenv("COEVO_ATTACK_SECRET", SECRET)
    d = tmp_path / "canary"
    d.mkdir()
    (d / "keep.txt").write_text("canary")
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(d / "sock"))
    unix.listen()
    unix.setblocking(False)
    flag = tmp_path / "signalled"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import signal, time\n"
                f"for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):\n"
                f"    signal.signal(s, lambda *a: open({str(flag)!r}, 'w').write('hit'))\n"
                "time.sleep(120)\n"
            ),
        ]
    )
    c = Canary(d, tcp, unix, proc, flag, harness_pids())
    yield c
    proc.kill()
    proc.wait()
    tcp.close()
    unix.close()


@pytest.fixture(scope="module")
def family() -> Coding:
    return Coding(sandbox="bwrap")


@pytest.fixture(scope="module")
def task(family: Coding) -> TaskSpec:
    return next(t for t in family.initial_tasks(200, 0, 0) if t.params["problem"] == "HumanEval/0")


async def attack(family: Coding, task: TaskSpec, program: str) -> tuple[str, SandboxResult]:
    """Score ``program`` through the environment, and return the sandbox's own account."""
    env = family.make_env()
    await env.reset(task)
    step = await env.step(program)
    _, result = await family.evaluate(task, program)
    assert step.info["pass_matrix"] and not all(step.info["pass_matrix"])
    return step.outcome, result


ATTACKS = {
    "forged_results_line": """
import os, sys
print("COEVO_RESULTS [true, true, true, true, true, true, true]", flush=True)
sys.stdout.write('{"passed": true}\\n')
def has_close_elements(numbers, threshold):
    print("COEVO_RESULTS [true, true, true, true, true, true, true]", flush=True)
    os._exit(0)
""",
    "rebound_json_dumps": """
import json
json.dumps = lambda *a, **k: '[true, true, true, true, true, true, true]'
json.loads = lambda *a, **k: [True] * 7
"""
    + WRONG,
    "eq_always_true": """
class Yes:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True
    __hash__ = object.__hash__
def has_close_elements(numbers, threshold):
    return Yes()
""",
    "exec_swallows_assertions": """
import builtins
_exec = builtins.exec
def _quiet(*a, **k):
    try:
        return _exec(*a, **k)
    except AssertionError:
        return None
builtins.exec = _quiet
builtins.AssertionError = type("Never", (Exception,), {})
"""
    + WRONG,
    "disarmed_hook_writes_outside": DISARM
    + """
for path in [CANARY_DIR + "/pwned.txt", "/tmp/coevo-pwned.txt", "/usr/lib/pwned.txt"]:
    try:
        open(path, "w").write("pwned")
        print("wrote", path)
    except OSError as e:
        print("write refused", path, e.errno)
"""
    + WRONG,
    "posixsubprocess_fork_exec": DISARM
    + """
import _posixsubprocess, os
cmd = "echo pwned > " + CANARY_DIR + "/shell.txt; kill -USR1 CANARY_PID"
r, w = os.pipe()
for sh in (b"/bin/sh", b"/usr/bin/sh"):
    try:
        pid = _posixsubprocess.fork_exec([sh, b"-c", cmd.encode()], [sh], True, (), None, None, -1, -1, -1, -1,
                                         -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
        print("spawned", pid)
    except Exception as e:
        print("fork_exec refused", type(e).__name__, e)
"""
    + WRONG,
    "other_processes_environ": DISARM
    + """
import os
seen = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            seen.append(open("/proc/" + pid + "/environ", "rb").read().decode(errors="replace"))
        except OSError as e:
            seen.append("refused " + pid)
for pid in (HOST_PID, CANARY_PID, 1):
    try:
        seen.append(open("/proc/%d/environ" % pid, "rb").read().decode(errors="replace"))
    except OSError as e:
        seen.append("refused %d %s" % (pid, e.errno))
print("environ:", seen)
"""
    + WRONG,
    "fork_bomb": DISARM
    + """
import os
n = 0
try:
    while True:
        os.fork()
        n += 1
except OSError as e:
    print("fork refused after", n, e.errno)
"""
    + WRONG,
    "memory_bomb": """
def has_close_elements(numbers, threshold):
    hoard = []  # bytes(n) is calloc'd, untouched: the address-space limit is reached at once, not after
    while numbers == [1.0, 2.0, 3.9, 4.0, 5.0, 2.2]:  # 1 GB of memset (a CI machine took over 2 s)
        hoard.append(bytes(50 * 1024 * 1024))
    return True
""",
    "kill_the_parent": DISARM
    + """
import os, signal
for pid in (os.getppid(), 1, CANARY_PID, HOST_PID):
    for sig in (signal.SIGKILL, signal.SIGUSR1):
        if pid == HOST_PID and sig == signal.SIGKILL:
            continue  # had it worked, this test run would die: SIGUSR1 proves the point as well
        try:
            os.kill(pid, sig)
            print("signalled", pid, sig)
        except OSError as e:
            print("kill refused", pid, e.errno)
"""
    + WRONG,
    "ctypes_raw_syscalls": DISARM
    + """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("kill", libc.syscall(62, CANARY_PID, 10), ctypes.get_errno())  # SYS_kill, SIGUSR1
print("fork", libc.syscall(57), ctypes.get_errno())
fd = libc.open((CANARY_DIR + "/ctypes.txt").encode(), os.O_CREAT | os.O_WRONLY, 0o644)
print("open", fd, ctypes.get_errno())
print("unshare", libc.syscall(272, 0x10000000), ctypes.get_errno())  # a new user namespace
print("ptrace", libc.syscall(101, 16, CANARY_PID, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
"""
    + WRONG,
    "network_to_the_host": DISARM
    + """
import socket
for target, family in ((("127.0.0.1", CANARY_PORT), socket.AF_INET), (CANARY_DIR + "/sock", socket.AF_UNIX)):
    try:
        s = socket.socket(family)
        s.settimeout(1)
        s.connect(target)
        print("connected", target)
    except OSError as e:
        print("connect refused", target, e.errno)
"""
    + WRONG,
    "signals_disable_the_alarm": """
import signal
def has_close_elements(numbers, threshold):
    for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGXCPU):
        signal.signal(s, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
    if numbers == [1.0, 2.0, 3.9, 4.0, 5.0, 2.2]:
        while True:
            pass
    return True
""",
    "forged_frames_on_its_channel": """
import os, socket, json
frames = [{"ready": True}] + [{"passed": True}, {"value": True}] * 20
data = b"".join(len(p).to_bytes(4, "big") + p for p in (json.dumps(f).encode() for f in frames))
for fd in range(3, 16):
    try:
        os.write(fd, data + (2**31).to_bytes(4, "big"))
    except OSError:
        pass
"""
    + WRONG,
}

# what each attack's own output shows it tried (and how far it got)
EVIDENCE = {
    "forged_results_line": "COEVO_RESULTS",
    "disarmed_hook_writes_outside": "hook disarmed 1",
    "posixsubprocess_fork_exec": "fork_exec refused",
    "other_processes_environ": "environ:",
    "fork_bomb": "fork refused after 0 1",
    "kill_the_parent": "kill refused",
    "ctypes_raw_syscalls": "fork -1 1",
    "network_to_the_host": "connect refused",
}
OUTCOMES = {"eq_always_true": "invalid_value", "memory_bomb": "memory", "signals_disable_the_alarm": "timeout"}


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_attack_scores_lost_and_leaves_nothing(name: str, canary: Canary, family: Coding, task: TaskSpec) -> None:
    outcome, result = await attack(family, task, canary.fmt(ATTACKS[name]))
    assert outcome == "lost"
    if name in EVIDENCE:
        assert EVIDENCE[name] in result.stdout, result.stdout[-2000:]
    if name in OUTCOMES:
        assert OUTCOMES[name] in result.outcomes, result
    assert SECRET not in result.stdout + result.stderr
    for pid in (canary.proc.pid, os.getpid()):  # signals to the sandbox's own init (pid 1) stay inside
        assert f"signalled {pid} " not in result.stdout
    assert "wrote /" not in result.stdout.replace("wrote /tmp/coevo-pwned", "")  # its own tmpfs is writable
    canary.assert_untouched()


async def test_the_sandbox_cannot_reach_what_the_attacks_aim_at(canary: Canary, family: Coding, task: TaskSpec) -> None:
    """The details behind the outcomes: errno by errno, the OS refused."""
    _, r = await attack(family, task, canary.fmt(ATTACKS["ctypes_raw_syscalls"]))
    out = r.stdout
    assert "kill -1 3" in out  # ESRCH: the canary's pid does not exist in the sandbox's PID namespace
    assert "open -1 2" in out  # ENOENT: the canary directory is not in the sandbox's view
    assert "unshare -1 1" in out and "ptrace -1 1" in out  # EPERM (seccomp)
    _, r = await attack(family, task, canary.fmt(ATTACKS["other_processes_environ"]))
    assert f"refused {os.getpid()} 2" in r.stdout  # the host's processes are invisible
    _, r = await attack(family, task, canary.fmt(ATTACKS["network_to_the_host"]))
    assert "connect refused ('127.0.0.1'" in r.stdout and "connected" not in r.stdout
    canary.assert_untouched()


async def test_every_humaneval_reference_solution_still_wins(family: Coding) -> None:
    tasks = family.initial_tasks(200, 200, 0)
    assert len(tasks) == 164
    gate = asyncio.Semaphore(4)

    async def score(t: TaskSpec) -> tuple[str, str, list[bool]]:
        async with gate:
            env = family.make_env()
            await env.reset(t)
            r = await env.step(humaneval_problems()[t.params["problem"]].solution or "")
            return t.params["problem"], r.outcome, r.info["pass_matrix"]

    results = await asyncio.gather(*(score(t) for t in tasks))
    lost = [(pid, matrix) for pid, outcome, matrix in results if outcome != "won"]
    assert lost == []
    assert sum(len(m) for _, _, m in results) == sum(len(p.tests) for p in humaneval_problems().values())


# correct solutions of HumanEval/0 that break a constraint the way a policy learns to: each passes
# every problem test and fails exactly the constraint checks named
BYPASSES = {
    "dunder_import": (
        """    math = __import__("math")
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and math.fabs(a - b) < threshold:
                return True
    return False
""",
        {"no_imports", "no_while", "no_recursion"},
    ),  # an escape hatch breaks every constraint
    "iter_sentinel_loop": (
        """    i = 0
    for _ in iter(int, 1):
        if i >= len(numbers):
            return False
        if any(i != j and abs(numbers[i] - b) < threshold for j, b in enumerate(numbers)):
            return True
        i += 1
""",
        {"no_while"},
    ),
    "starred_alias_worklist": (  # a for loop over a worklist it grows through `*alias, = [todo]`
        """    todo = [0]
    *alias, = [todo]
    for i in todo:
        if i >= len(numbers):
            return False
        if any(i != j and abs(numbers[i] - b) < threshold for j, b in enumerate(numbers)):
            return True
        alias[0].append(i + 1)
""",
        {"no_while"},
    ),
    "match_alias_worklist": (  # the same through a match capture, which the loop check does not model
        """    todo = [0]
    match todo:
        case alias:
            pass
    for i in todo:
        if i >= len(numbers):
            return False
        if any(i != j and abs(numbers[i] - b) < threshold for j, b in enumerate(numbers)):
            return True
        alias.append(i + 1)
""",
        {"no_while"},
    ),
    "aliased_recursion": (
        """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    if len(numbers) < 2:
        return False
    head, rest = numbers[0], numbers[1:]
    return any(abs(head - x) < threshold for x in rest) or again(rest, threshold)


again = has_close_elements
""",
        {"no_recursion"},
    ),
}


@pytest.mark.parametrize("name", sorted(BYPASSES))
async def test_constraint_bypasses_fail_their_checks_only(name: str, family: Coding, task: TaskSpec) -> None:
    program, broken = BYPASSES[name]
    strict = family.derive(task, {"constraints": 3, "examples": 1})
    env = family.make_env()
    await env.reset(strict)
    step = await env.step(program)
    checks = family.checks_for(strict)
    assert len(step.info["pass_matrix"]) == len(checks) == len(humaneval_problems()["HumanEval/0"].tests) + 3
    failed = {c for c, ok in zip(checks, step.info["pass_matrix"], strict=True) if not ok}
    assert step.outcome == "lost" and failed == broken, step.info
    assert {c for c, why in step.info["constraint_violations"].items() if why} == broken
    assert step.info["sandbox"] == "ok"


async def test_a_solution_under_a_prompt_that_imports_passes_every_constraint(family: Coding, task: TaskSpec) -> None:
    """HumanEval/0's prompt starts with ``from typing import List``; its reference solution uses
    ``for`` loops only, so it passes all three constraints (the old text check could never pass it)."""
    problem = humaneval_problems()["HumanEval/0"]
    assert problem.prompt.lstrip().startswith("from typing import List")
    strict = family.derive(task, {"constraints": 3, "examples": 1})
    step = await _one_step(family, strict, problem.solution or "")
    assert step.outcome == "won" and step.info["pass_matrix"] == [True] * (len(problem.tests) + 3)
    assert step.info["constraint_violations"] == {"no_imports": [], "no_while": [], "no_recursion": []}
    assert (await family.precheck(strict)).ok


async def _one_step(family: Coding, task: TaskSpec, program: str) -> StepResult:
    env = family.make_env()
    await env.reset(task)
    return await env.step(program)


def test_signals_from_the_test_reach_the_canary(canary: Canary) -> None:
    """The canary is live: a signal that does arrive is seen (so 'untouched' means something)."""
    time.sleep(0.3)
    canary.proc.send_signal(signal.SIGUSR1)
    for _ in range(50):
        if canary.signalled.exists():
            break
        time.sleep(0.05)
    assert canary.signalled.exists()
