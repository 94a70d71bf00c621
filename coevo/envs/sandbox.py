"""Run untrusted Python in a separate, limited, isolated process.

A ``Sandbox`` is one process running ``coevo.envs.harness`` under the chosen isolation
(``coevo.envs.isolation``: bubblewrap by default, or an opted-into plain process), with rlimits on
CPU time, address space, file size, open files and processes, a wall-clock limit after which it
is killed, and a framed channel (a socket pair, not stdout) to it. ``run_python`` runs one program
to completion; ``coevo.envs.referee`` drives the ``serve`` and ``test`` modes.

Invariant: every sandbox ends in a ``SandboxResult`` whose ``status`` says what happened (``ok``,
``error``, ``timeout``, ``memory``, ``forbidden``, ``output_limit``, ``killed``; ``invalid_value``
for a run whose program returned something that is not plain data); no process survives it: its
process group is killed, and a bubblewrap sandbox dies with bwrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from coevo.envs import harness
from coevo.envs.isolation import Isolation, bwrap_argv, check_bwrap, harness_command, seccomp_memfd, warn_unisolated
from coevo.errors import BadFrame, ChannelClosed

Status = Literal["ok", "error", "timeout", "memory", "forbidden", "output_limit", "killed", "invalid_value"]

_CLONE_NEWNET = 0x40000000
_STDOUT_KEEP = 200_000
_STDERR_KEEP = 20_000


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 8
    open_files: int = 64
    processes: int = 32
    tmp_mb: int = 16  # bwrap: size of the private working directory (a tmpfs)


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    detail: str = ""
    network_isolated: bool = False
    outcomes: tuple[Status, ...] = ()  # run_tests: one per test

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def classify(
    rc: int | None, *, timed_out: bool, stderr: str, duration_s: float, limits: SandboxLimits
) -> tuple[Status, str]:
    """What a finished process's exit says (``rc`` < 0: killed by that signal)."""
    if timed_out or (rc in (-signal.SIGXCPU, -signal.SIGKILL) and duration_s >= limits.cpu_s * 0.9):
        return "timeout", f"exceeded {limits.wall_s}s wall or {limits.cpu_s}s CPU"
    if rc == harness.FORBIDDEN_EXIT:
        return "forbidden", _marker(stderr)
    if rc == harness.MEMORY_EXIT or "MemoryError" in stderr:
        return "memory", f"exceeded {limits.memory_mb} MB"
    if rc == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit", f"wrote more than {limits.file_mb} MB"
    if rc is not None and rc < 0:
        return "killed", f"killed by signal {-rc}"
    if rc == 0:
        return "ok", ""
    return "error", stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {rc}"


def bwrap_returncode(rc: int | None) -> int | None:
    """bwrap exits 128+N when its program died of signal N; as -N, like a direct child."""
    if rc is not None and 128 < rc < 128 + signal.NSIG:
        return -(rc - 128)
    return rc


def _marker(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("COEVO_SANDBOX: "):
            return line.removeprefix("COEVO_SANDBOX: ")
    return "forbidden"


_NET_OK: bool | None = None


def network_isolation_available() -> bool:
    """Whether this host lets a plain child enter a fresh network namespace (``process`` isolation)."""
    global _NET_OK
    if _NET_OK is None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            rc = ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)
            os._exit(0 if rc == 0 else 1)
        _, status = os.waitpid(pid, 0)
        _NET_OK = os.waitstatus_to_exitcode(status) == 0
    return _NET_OK


def _unshare_net() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET)


async def _sandbox_gone(info_fd: int, within_s: float = 5.0) -> None:
    """Wait until the sandbox's init (named on bwrap's info fd) has exited: the kernel kills every
    process of a PID namespace before its init is gone."""
    try:
        pid = int(json.loads(os.read(info_fd, 65536))["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return  # bwrap never started a sandbox, or it is already gone
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: None if gone.done() else gone.set_result(None))
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone, within_s)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


class Sandbox:
    """One harness process. ``start`` it with a setup frame, talk over ``send``/``recv``, then ``wait``
    for it or ``close`` it (both idempotent; ``async with`` closes)."""

    def __init__(self, isolation: Isolation = "bwrap", limits: SandboxLimits | None = None) -> None:
        self.isolation = isolation
        self.limits = limits or SandboxLimits()
        self.result: SandboxResult | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._dirs: list[str] = []
        self._t0 = 0.0
        self._timed_out = False
        self._isolated_net = False
        self._info_r: int | None = None  # bwrap --info-fd: names the sandbox's init, awaited at close
        self._setup_error = ""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def deadline(self) -> float:
        return self._t0 + self.limits.wall_s

    async def start(self, setup: dict[str, Any], *, stdin: bool = False) -> None:
        out_dir = tempfile.mkdtemp(prefix="coevo-out-")
        self._dirs.append(out_dir)
        parent_sock, child_sock = socket.socketpair()
        seccomp_fd = info_w = None
        fds = [child_sock.fileno()]
        try:
            if self.isolation == "bwrap":
                layout = await asyncio.to_thread(check_bwrap)
                seccomp_fd = seccomp_memfd()
                self._info_r, info_w = os.pipe()
                os.set_blocking(self._info_r, False)
                fds += [fd for fd in (seccomp_fd, info_w) if fd is not None]
                argv = bwrap_argv(
                    layout,
                    harness_command(layout, child_sock.fileno()),
                    tmp_mb=self.limits.tmp_mb,
                    seccomp_fd=seccomp_fd,
                    info_fd=info_w,
                )
                cwd, env, preexec = out_dir, {}, None
                self._isolated_net = True
            else:
                warn_unisolated()
                cwd = tempfile.mkdtemp(prefix="coevo-sbx-")
                self._dirs.append(cwd)
                argv = [sys.executable, "-I", str(Path(harness.__file__)), str(child_sock.fileno())]
                env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
                self._isolated_net = network_isolation_available()
                preexec = _unshare_net if self._isolated_net else None
            self._t0 = time.monotonic()
            with (Path(out_dir) / "stdout.txt").open("wb") as out, (Path(out_dir) / "stderr.txt").open("wb") as err:
                self._proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=cwd,
                    env=env,
                    stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    pass_fds=fds,
                    preexec_fn=preexec,
                )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
            for fd in (seccomp_fd, info_w):
                if fd is not None:
                    os.close(fd)
        self._reader, self._writer = await asyncio.open_unix_connection(sock=parent_sock)
        limits = {k: v for k, v in asdict(self.limits).items() if k not in ("wall_s", "tmp_mb")}
        try:
            await self.send({**setup, "limits": limits, "guard": True})
        except ChannelClosed:  # a sandbox that died at once: its result says why
            pass
        except ValueError as exc:  # e.g. a program larger than a frame: it never runs
            self._setup_error = str(exc)
            await self.close()

    async def send(self, obj: Any) -> None:
        assert self._writer is not None, "send before start"
        try:
            self._writer.write(harness.pack(obj))
            await asyncio.wait_for(self._writer.drain(), max(0.0, self.deadline - time.monotonic()))
        except (ConnectionError, TimeoutError) as exc:
            raise ChannelClosed(str(exc)) from None

    async def recv(self, within_s: float) -> Any:
        """The next frame. ``TimeoutError`` after ``within_s`` (or the wall limit); ``ChannelClosed`` at
        its end; ``BadFrame`` when it is not a frame of JSON."""
        assert self._reader is not None, "recv before start"
        limit = min(within_s, self.deadline - time.monotonic())
        try:
            async with asyncio.timeout(max(0.0, limit)):
                n = int.from_bytes(await self._reader.readexactly(4), "big")
                if n > harness.MAX_FRAME:
                    raise BadFrame(f"a frame of {n} bytes (limit {harness.MAX_FRAME})")
                payload = await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            raise ChannelClosed("the sandboxed process closed its channel") from None
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                self._timed_out = True
            raise
        try:
            return harness.unpack(payload)
        except ValueError as exc:
            raise BadFrame(str(exc)) from None

    async def wait(self, stdin: bytes | None = None) -> SandboxResult:
        """Let the process finish (feeding it ``stdin``) within the wall limit, then the result."""
        assert self._proc is not None, "wait before start"
        if self.result is None:
            try:
                await asyncio.wait_for(self._proc.communicate(stdin), max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                self._timed_out = True
        return await self.close()

    async def shutdown(self, grace_s: float = 1.0) -> SandboxResult:
        """End the conversation: close the channel (the harness exits at its end), then ``close``."""
        if self.result is None and self._proc is not None and self._writer is not None:
            self._writer.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), grace_s)
        return await self.close()

    async def close(self, *, timed_out: bool = False) -> SandboxResult:
        """Kill whatever is left and return the result (the same one on every call)."""
        if self.result is not None:
            return self.result
        self._timed_out = self._timed_out or timed_out
        proc, rc, stdout, stderr = self._proc, None, "", ""
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            rc = bwrap_returncode(proc.returncode) if self.isolation == "bwrap" else proc.returncode
        if self._info_r is not None:  # the sandbox dies with bwrap, asynchronously: see it gone
            await _sandbox_gone(self._info_r)
            os.close(self._info_r)
            self._info_r = None
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        if self._dirs:
            out = Path(self._dirs[0])
            with contextlib.suppress(OSError):
                stdout = (out / "stdout.txt").read_bytes()[:_STDOUT_KEEP].decode(errors="replace")
                stderr = (out / "stderr.txt").read_bytes()[-_STDERR_KEEP:].decode(errors="replace")
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        duration = time.monotonic() - self._t0 if self._t0 else 0.0
        status, detail = classify(rc, timed_out=self._timed_out, stderr=stderr, duration_s=duration, limits=self.limits)
        if self._setup_error:
            status, detail = "error", f"not started: {self._setup_error}"
        self.result = SandboxResult(status, rc, stdout, stderr, duration, detail, self._isolated_net)
        return self.result


async def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    files: dict[str, str] | None = None,
    isolation: Isolation = "bwrap",
) -> SandboxResult:
    """Run ``code`` as ``__main__`` with ``stdin``; ``files`` are written to its working directory."""
    async with Sandbox(isolation, limits) as sbx:
        await sbx.start({"mode": "run", "program": code, "files": files or {}}, stdin=True)
        return await sbx.wait(stdin.encode())
