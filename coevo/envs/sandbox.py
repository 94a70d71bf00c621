"""Run untrusted Python in a separate, limited process.

Each run gets a fresh temporary directory (its cwd and HOME), a new session (process group), a
network namespace of its own when the kernel allows it, rlimits on CPU time, address space, file
size, open files and processes, a wall-clock timeout after which the whole group is killed, and an
audit hook (installed before the program runs; Python code cannot remove it) that refuses sockets,
new processes, ctypes, and writes outside the directory.

Invariant: ``run_python`` always returns a ``SandboxResult`` whose ``status`` says what happened
(``ok``, ``error``, ``timeout``, ``memory``, ``forbidden``, ``output_limit``, ``killed``); no child
survives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import resource
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["ok", "error", "timeout", "memory", "forbidden", "output_limit", "killed"]

_FORBIDDEN_EXIT = 86
_MEMORY_EXIT = 87
_CLONE_NEWNET = 0x40000000

BOOT = r'''
import os, sys
ROOT = os.path.realpath(os.getcwd())
_PROC = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
         "os.kill", "os.killpg", "pty.spawn"}
_FS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
       "os.truncate", "shutil.rmtree", "os.utime"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

class SandboxViolation(BaseException):
    pass

def _inside(path):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    full = os.path.realpath(os.path.join(ROOT, str(path)))
    return full == ROOT or full.startswith(ROOT + os.sep)

def _deny(what):
    raise SandboxViolation("sandbox: " + what + " is forbidden")

def _hook(event, args):
    if event.startswith("socket."):
        _deny("network access (" + event + ")")
    if event in _PROC:
        _deny("creating or signalling processes (" + event + ")")
    if event.startswith("ctypes."):
        _deny("ctypes")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                  (mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            _deny("writing outside the sandbox directory (" + str(path) + ")")
    elif event in _FS:
        for a in args[:2]:
            if isinstance(a, (str, bytes)) and not _inside(a):
                _deny(event + " outside the sandbox directory")

sys.addaudithook(_hook)
src = open("program.py").read()
try:
    exec(compile(src, "program.py", "exec"), {"__name__": "__main__"})
except SandboxViolation as exc:
    sys.stderr.write("COEVO_SANDBOX: " + str(exc) + "\n")
    sys.stderr.flush()
    os._exit(%d)
except MemoryError:
    sys.stderr.write("COEVO_SANDBOX: memory limit\n")
    sys.stderr.flush()
    os._exit(%d)
''' % (_FORBIDDEN_EXIT, _MEMORY_EXIT)


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 8
    open_files: int = 64
    processes: int = 32


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    detail: str = ""
    network_isolated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _limit(limits: SandboxLimits, isolate_net: bool) -> None:
    """Runs in the child between fork and exec."""
    mem = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    fsize = limits.file_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolate_net:
        ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)


_NET_OK: bool | None = None


def network_isolation_available() -> bool:
    """Whether this host lets a child enter a fresh network namespace (checked once)."""
    global _NET_OK
    if _NET_OK is None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            rc = ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)
            os._exit(0 if rc == 0 else 1)
        _, status = os.waitpid(pid, 0)
        _NET_OK = os.waitstatus_to_exitcode(status) == 0
    return _NET_OK


async def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
                     files: dict[str, str] | None = None) -> SandboxResult:
    limits = limits or SandboxLimits()
    isolate = network_isolation_available()
    with tempfile.TemporaryDirectory(prefix="coevo-sbx-") as tmp:
        root = Path(tmp)
        (root / "program.py").write_text(code)
        (root / "_boot.py").write_text(BOOT)
        for name, text in (files or {}).items():
            (root / name).write_text(text)
        out_path, err_path = root / "stdout.txt", root / "stderr.txt"
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0"}
        t0 = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "_boot.py", cwd=tmp, env=env, stdin=asyncio.subprocess.PIPE,
                stdout=out, stderr=err, start_new_session=True,
                preexec_fn=lambda: _limit(limits, isolate),
            )
            timed_out = False
            try:
                await asyncio.wait_for(proc.communicate(stdin.encode()), limits.wall_s)
            except TimeoutError:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        duration = time.monotonic() - t0
        stdout = out_path.read_bytes()[:200_000].decode(errors="replace")
        stderr = err_path.read_bytes()[-20_000:].decode(errors="replace")
    rc = proc.returncode
    status: Status
    detail = ""
    if timed_out or (rc in (-signal.SIGXCPU, -signal.SIGKILL) and duration >= limits.cpu_s * 0.9):
        status, detail = "timeout", f"exceeded {limits.wall_s}s wall or {limits.cpu_s}s CPU"
    elif rc == _FORBIDDEN_EXIT:
        status, detail = "forbidden", _marker(stderr)
    elif rc == _MEMORY_EXIT or "MemoryError" in stderr:
        status, detail = "memory", f"exceeded {limits.memory_mb} MB"
    elif rc == -signal.SIGXFSZ or "File too large" in stderr:
        status, detail = "output_limit", f"wrote more than {limits.file_mb} MB"
    elif rc is not None and rc < 0:
        status, detail = "killed", f"killed by signal {-rc}"
    elif rc == 0:
        status = "ok"
    else:
        status, detail = "error", stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {rc}"
    return SandboxResult(status, rc, stdout, stderr, duration, detail, isolate)


def _marker(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("COEVO_SANDBOX: "):
            return line.removeprefix("COEVO_SANDBOX: ")
    return "forbidden"
