"""How a sandboxed process is isolated from the host: bubblewrap, or (opted into) a plain process.

``bwrap``: new user, PID, network, IPC, UTS, cgroup and mount namespaces; uid/gid 65534; no
capabilities; no further user namespaces; a fresh ``/proc`` showing only the sandbox's processes;
a minimal ``/dev``; a read-only view of the interpreter, its standard library and the system's
shared libraries and nothing else of the host (no ``/etc``, ``/home``, ``/root``, no binaries); a
private, size-capped tmpfs as working directory; an empty environment; a seccomp filter
(``coevo.envs.seccomp``); killed with its parent.

``process``: the program runs as coevo's own user with an audit hook, rlimits, and a network
namespace only where the kernel allows one. Not safe for untrusted (RL-trained) programs.

Invariant: ``bwrap_argv`` is a pure function of a ``HostLayout``; ``check_bwrap`` either returns a
layout a sandbox was seen to start with, or raises ``SandboxUnavailable`` saying how to fix it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from coevo.envs.base import EnvError
from coevo.envs.seccomp import host_filter

Isolation = Literal["bwrap", "process"]
ISOLATIONS: tuple[Isolation, ...] = ("bwrap", "process")
INSTALL_HINT = "install bubblewrap: apt-get install bubblewrap (or your distribution's 'bubblewrap' package)"
WORKDIR = "/tmp/coevo-sbx"
HARNESS_IN_SANDBOX = "/.coevo/harness.py"
SANDBOX_UID = 65534
_SYSTEM_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32",
                    "/libx32")

log = structlog.get_logger("coevo.sandbox")


class SandboxUnavailable(EnvError):
    """The configured isolation cannot run on this host (e.g. bubblewrap is missing)."""


@dataclass(frozen=True)
class HostLayout:
    """What of the host a sandbox sees, read-only."""

    bwrap: str
    python: str  # the base interpreter's real path (not a venv's launcher)
    python_lib: str  # the directory holding its standard library (and libpython, if shared)
    lib_dirs: tuple[str, ...] = ()  # system library directories, bound read-only
    lib_links: tuple[tuple[str, str], ...] = ()  # (path, target) of library directories that are symlinks
    ld_cache: bool = True
    harness: str = str(Path(__file__).with_name("harness.py"))
    tmp_size: bool = True  # bwrap knows --size (0.7+)
    disable_userns: bool = True  # bwrap knows --disable-userns (0.8+)


def bwrap_argv(layout: HostLayout, command: list[str], *, tmp_mb: int, seccomp_fd: int | None,
               info_fd: int | None = None) -> list[str]:
    """The bubblewrap command line that runs ``command`` (see ``harness_command``) in a sandbox;
    ``info_fd`` receives bwrap's JSON with the host pid of the sandbox's init (``child-pid``)."""
    argv = [layout.bwrap, "--unshare-all", "--unshare-user"]
    if layout.disable_userns:
        argv.append("--disable-userns")
    argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--clearenv",
             "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8"]
    bound: list[str] = []
    for d in layout.lib_dirs:
        argv += ["--ro-bind", d, d]
        bound.append(d)
    for path, target in layout.lib_links:
        argv += ["--symlink", target, path]
    if layout.ld_cache:
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for p in (layout.python_lib, layout.python):
        if not any(p == b or p.startswith(b.rstrip("/") + "/") for b in bound):
            argv += ["--ro-bind", p, p]
            bound.append(p)
    argv += ["--ro-bind", layout.harness, HARNESS_IN_SANDBOX, "--proc", "/proc", "--dev", "/dev"]
    if layout.tmp_size:
        argv += ["--size", str(tmp_mb * 1024 * 1024)]
    argv += ["--tmpfs", "/tmp", "--dir", WORKDIR, "--chdir", WORKDIR, "--remount-ro", "/dev",
             "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return argv + command


def harness_command(layout: HostLayout, channel_fd: int) -> list[str]:
    """The harness, as started inside the sandbox: the base interpreter, isolated, without site."""
    return [layout.python, "-I", "-S", HARNESS_IN_SANDBOX, str(channel_fd)]


def seccomp_memfd() -> int | None:
    """A file descriptor holding this machine's seccomp filter, for bwrap to read (caller closes)."""
    program = host_filter()
    if program is None:
        return None
    fd = os.memfd_create("coevo-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def base_python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def host_layout(bwrap: str) -> HostLayout:
    """Read this host's paths (the interpreter, its stdlib, library directories) and bwrap's options."""
    dirs, links = [], []
    for d in _SYSTEM_LIB_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            dirs.append(d)
    stdlib = os.path.dirname(os.path.realpath(os.__file__))  # .../lib/python3.X
    helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, env={}).stdout
    return HostLayout(bwrap=bwrap, python=base_python(), python_lib=os.path.dirname(stdlib),
                      lib_dirs=tuple(dirs), lib_links=tuple(links), ld_cache=os.path.exists("/etc/ld.so.cache"),
                      tmp_size="--size" in helptext, disable_userns="--disable-userns" in helptext)


def find_bwrap() -> str | None:
    """bwrap on PATH (as ``EnvConfig`` checks it at load time)."""
    return shutil.which("bwrap")


@functools.cache
def check_bwrap() -> HostLayout:
    """The host's layout, after proving a sandbox starts with it (once per process)."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable(f"env.sandbox = 'bwrap' but bubblewrap (bwrap) is not installed; {INSTALL_HINT}")
    layout = host_layout(bwrap)
    fd = seccomp_memfd()
    try:
        argv = bwrap_argv(layout, [layout.python, "-I", "-S", "-c", "pass"], tmp_mb=1, seccomp_fd=fd)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={}, stdin=subprocess.DEVNULL,
                           pass_fds=() if fd is None else (fd,))
    finally:
        if fd is not None:
            os.close(fd)
    if r.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap at {bwrap} cannot start a sandbox here ({r.stderr.strip()[-300:] or f'exit {r.returncode}'}); "
            "it needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
            "kernel.apparmor_restrict_unprivileged_userns=0) or running as root; or set env.sandbox = 'process' "
            "for trusted programs only")
    if host_filter() is None:
        log.warning("sandbox.no_seccomp", machine=os.uname().machine,
                    detail="no seccomp table for this architecture: process creation is limited by rlimits only")
    return layout


@functools.cache
def warn_unisolated() -> None:
    """Say once per process that programs run without OS isolation."""
    log.warning("sandbox.unisolated", setting="env.sandbox = 'process'",
                detail="programs run as this user with only an audit hook and rlimits: NOT safe for untrusted "
                       "(RL-trained) policies; use env.sandbox = 'bwrap'")
