"""How a sandboxed process is isolated from the host: bubblewrap, or (opted into) a plain process.

``bwrap``: new user, PID, network, IPC, UTS, cgroup and mount namespaces; uid/gid 65534; no
capabilities; no further user namespaces; a fresh ``/proc`` showing only the sandbox's processes;
a minimal ``/dev``; a private, size-capped tmpfs as working directory; an empty environment; a
seccomp filter (``coevo.envs.seccomp``); killed with its parent. Of the host it sees, read-only,
exactly: the interpreter binary, its standard library with every ``site-packages`` and
``dist-packages`` directory in it masked by an empty one, the files the interpreter maps when it
loads every extension module of its standard library (shared libraries, the loader, locale data;
found by ``probe_libraries``) with the symbolic links that name them, ``/etc/ld.so.cache`` and the
harness. No package of any environment (a dataset a package ships is not readable), no ``/etc``,
``/home``, ``/root``, no other binaries, no shell.

``process``: the program runs as coevo's own user with an audit hook, rlimits, and a network
namespace only where the kernel allows one. Not safe for untrusted (RL-trained) programs.

Invariant: ``bwrap_argv`` is a pure function of a ``HostLayout``; ``check_bwrap`` either returns a
narrowed layout a sandbox was seen to start with and import every extension module the broad
probe could, or raises ``SandboxUnavailable`` saying how to fix it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import structlog

from coevo.envs.seccomp import host_filter
from coevo.errors import SandboxUnavailable

Isolation = Literal["bwrap", "process"]
ISOLATIONS: tuple[Isolation, ...] = ("bwrap", "process")
INSTALL_HINT = "install bubblewrap: apt-get install bubblewrap (or your distribution's 'bubblewrap' package)"
WORKDIR = "/tmp/coevo-sbx"
HARNESS_IN_SANDBOX = "/.coevo/harness.py"
SANDBOX_UID = 65534
_SYSTEM_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32", "/libx32")
_PACKAGE_DIRS = ("site-packages", "dist-packages")

log = structlog.get_logger("coevo.sandbox")


@dataclass(frozen=True)
class HostLayout:
    """What of the host a sandbox sees, read-only."""

    bwrap: str
    python: str  # the base interpreter's real path (not a venv's launcher)
    stdlib: str  # its standard library directory (``.../lib/python3.X``), bound whole but for ``masked``
    masked: tuple[str, ...] = ()  # package directories inside ``stdlib``: covered by an empty read-only tmpfs
    files: tuple[str, ...] = ()  # other host files the interpreter maps (shared libraries, loader, locale data)
    file_links: tuple[tuple[str, str], ...] = ()  # (path, target) of the symbolic links naming ``files``
    lib_dirs: tuple[str, ...] = ()  # whole system library directories: only the probe's broad view binds them
    lib_links: tuple[tuple[str, str], ...] = ()  # (path, target) of library directories that are symlinks
    ld_cache: bool = True
    harness: str = str(Path(__file__).with_name("harness.py"))
    tmp_size: bool = True  # bwrap knows --size (0.7+)
    disable_userns: bool = True  # bwrap knows --disable-userns (0.8+)


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def bwrap_argv(
    layout: HostLayout, command: list[str], *, tmp_mb: int, seccomp_fd: int | None, info_fd: int | None = None
) -> list[str]:
    """The bubblewrap command line that runs ``command`` (see ``harness_command``) in a sandbox;
    ``info_fd`` receives bwrap's JSON with the host pid of the sandbox's init (``child-pid``)."""
    argv = [layout.bwrap, "--unshare-all", "--unshare-user"]
    if layout.disable_userns:
        argv.append("--disable-userns")
    argv += [
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--clearenv",
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    bound: list[str] = []
    for d in layout.lib_dirs:
        argv += ["--ro-bind", d, d]
        bound.append(d)
    for path, target in layout.lib_links:
        argv += ["--symlink", target, path]
    if layout.ld_cache:
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for p in (layout.stdlib, layout.python, *layout.files):
        if not _under(p, bound):
            argv += ["--ro-bind", p, p]
            bound.append(p)
    for path, target in layout.file_links:
        if not _under(path, bound):
            argv += ["--symlink", target, path]
    for d in layout.masked:  # after the binds they lie in: an empty, read-only directory hides them
        argv += ["--tmpfs", d, "--remount-ro", d]
    argv += ["--ro-bind", layout.harness, HARNESS_IN_SANDBOX, "--proc", "/proc", "--dev", "/dev"]
    if layout.tmp_size:
        argv += ["--size", str(tmp_mb * 1024 * 1024)]
    argv += ["--tmpfs", "/tmp", "--dir", WORKDIR, "--chdir", WORKDIR, "--remount-ro", "/dev", "--remount-ro", "/"]
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


def package_dirs(stdlib: str) -> tuple[str, ...]:
    """The directories inside ``stdlib`` where packages are installed (``site-packages``,
    ``dist-packages``), however deep a distribution nests them."""
    found = []
    for root, dirs, _ in os.walk(stdlib):
        for d in list(dirs):
            if d in _PACKAGE_DIRS:
                found.append(os.path.join(root, d))
                dirs.remove(d)
            elif d in ("__pycache__", "test", "tests"):
                dirs.remove(d)
    return tuple(sorted(found))


def host_layout(bwrap: str) -> HostLayout:
    """The broad view a probe starts with: the interpreter, its standard library (packages masked)
    and every system library directory."""
    dirs, links = [], []
    for d in _SYSTEM_LIB_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            dirs.append(d)
    stdlib = os.path.dirname(os.path.realpath(os.__file__))  # .../lib/python3.X
    python = base_python()
    helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, env={}).stdout
    # the directory of a shared libpython: bound in the broad view only, narrowed to the file after the probe
    libpython = [os.path.dirname(stdlib)] if not _under(os.path.dirname(stdlib), dirs) else []
    return HostLayout(
        bwrap=bwrap,
        python=python,
        stdlib=stdlib,
        masked=package_dirs(stdlib),
        lib_dirs=(*dirs, *libpython),
        lib_links=tuple(links),
        ld_cache=os.path.exists("/etc/ld.so.cache"),
        tmp_size="--size" in helptext,
        disable_userns="--disable-userns" in helptext,
    )


# Runs as ``python -I -S -c _PROBE`` inside a sandbox: imports every extension module of the standard
# library, then prints them and the files the process maps.
_PROBE = """
import importlib, json, os
d = os.path.join(os.path.dirname(os.__file__), "lib-dynload")
names = sorted({f.split(".")[0] for f in os.listdir(d) if f.endswith(".so")} - {"_tkinter"}) if os.path.isdir(d) else []
ok = []
for name in names:
    try:
        importlib.import_module(name)
        ok.append(name)
    except Exception:
        pass
try:  # what glibc loads on demand: pthread_exit's unwinder (a daemon thread ending at exit aborts without it)
    import ctypes
    ctypes.CDLL("libgcc_s.so.1")
except OSError:
    pass
maps = set()
for line in open("/proc/self/maps"):
    parts = line.split(None, 5)
    if len(parts) == 6 and parts[5].startswith("/"):
        maps.add(parts[5].strip())
print(json.dumps({"modules": ok, "maps": sorted(maps)}))
"""


def narrowed(layout: HostLayout, maps: list[str]) -> HostLayout:
    """``layout`` without its whole library directories: only the files a probe saw mapped (outside
    the standard library and the interpreter, which are bound anyway), and the links naming them."""
    files = sorted({os.path.realpath(m) for m in maps} - {layout.python})
    files = [f for f in files if not _under(f, [layout.stdlib]) and os.path.isfile(f)]
    wanted, links = set(files), []
    for d in sorted({os.path.dirname(f) for f in files} | set(layout.lib_dirs)):
        with contextlib.suppress(OSError):
            for entry in os.scandir(d):
                if entry.is_symlink() and os.path.realpath(entry.path) in wanted:
                    links.append((entry.path, os.readlink(entry.path)))
    return replace(layout, files=tuple(files), file_links=tuple(links), lib_dirs=())


def _sandboxed(layout: HostLayout, code: str) -> subprocess.CompletedProcess[str]:
    fd = seccomp_memfd()
    try:
        argv = bwrap_argv(layout, [layout.python, "-I", "-S", "-c", code], tmp_mb=1, seccomp_fd=fd)
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=60,
            env={},
            stdin=subprocess.DEVNULL,
            pass_fds=() if fd is None else (fd,),
        )
    finally:
        if fd is not None:
            os.close(fd)


def find_bwrap() -> str | None:
    """bwrap on PATH (as ``EnvConfig`` checks it at load time)."""
    return shutil.which("bwrap")


@functools.cache
def check_bwrap() -> HostLayout:
    """The host's narrowed layout, after proving a sandbox starts with it and imports every extension
    module of the standard library that the broad view could (once per process)."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable(f"env.sandbox = 'bwrap' but bubblewrap (bwrap) is not installed; {INSTALL_HINT}")
    broad = host_layout(bwrap)
    r = _sandboxed(broad, _PROBE)
    if r.returncode != 0:
        raise SandboxUnavailable(
            f"bubblewrap at {bwrap} cannot start a sandbox here ({r.stderr.strip()[-300:] or f'exit {r.returncode}'}); "
            "it needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
            "kernel.apparmor_restrict_unprivileged_userns=0) or running as root; or set env.sandbox = 'process' "
            "for trusted programs only"
        )
    seen = json.loads(r.stdout)
    layout = narrowed(broad, seen["maps"])
    again = _sandboxed(layout, _PROBE)
    lost = sorted(set(seen["modules"]) - set(json.loads(again.stdout)["modules"] if again.returncode == 0 else []))
    if again.returncode != 0 or lost:
        raise SandboxUnavailable(
            f"the sandbox's narrowed view of {broad.python} is incomplete on this host "
            f"({again.stderr.strip()[-300:] or 'modules that no longer import: ' + ', '.join(lost)}); "
            "please report it with `ldd` of the interpreter"
        )
    if host_filter() is None:
        log.warning(
            "sandbox.no_seccomp",
            machine=os.uname().machine,
            detail="no seccomp table for this architecture: process creation is limited by rlimits only",
        )
    return layout


@functools.cache
def warn_unisolated() -> None:
    """Say once per process that programs run without OS isolation."""
    log.warning(
        "sandbox.unisolated",
        setting="env.sandbox = 'process'",
        detail="programs run as this user with only an audit hook and rlimits: NOT safe for untrusted "
        "(RL-trained) policies; use env.sandbox = 'bwrap'",
    )
