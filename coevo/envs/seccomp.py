"""A seccomp filter for sandboxed programs, as the classic BPF bwrap's ``--seccomp FD`` loads.

Why: RLIMIT_NPROC does not bind a process whose user namespace maps it onto host root (coevo run
as root), so process creation is refused here instead: ``fork``/``vfork`` and a ``clone`` without
``CLONE_THREAD`` fail with EPERM (threads still work), ``clone3`` with ENOSYS (glibc then falls back
to ``clone``). Calls that widen the kernel surface (``ptrace``, ``unshare``, ``setns``, ``mount``,
``bpf``, ``userfaultfd``, ``perf_event_open``, ``io_uring``, keyrings) fail with EPERM.

Invariant: ``filter_for(arch)`` is a pure function; a syscall from another ABI than the filter's
(i386 on x86-64, x32) is refused, so the numbers checked are the numbers meant.
"""

from __future__ import annotations

import platform
import struct

# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
# struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] (little endian: args[0]'s low word at 16)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16


class _Arch:
    def __init__(
        self, audit: int, clone: int, clone3: int, forks: tuple[int, ...], denied: tuple[int, ...], x32: bool
    ) -> None:
        self.audit, self.clone, self.clone3, self.forks, self.denied, self.x32 = (
            audit,
            clone,
            clone3,
            forks,
            denied,
            x32,
        )


ARCHES = {
    # ptrace, process_vm_readv/writev, keyctl, add_key, request_key, bpf, userfaultfd, perf_event_open,
    # unshare, setns, mount, umount2, pivot_root, io_uring_setup/enter/register, open_by_handle_at
    "x86_64": _Arch(
        0xC000003E,
        clone=56,
        clone3=435,
        forks=(57, 58),
        x32=True,
        denied=(101, 310, 311, 250, 248, 249, 321, 323, 298, 272, 308, 165, 166, 155, 425, 426, 427, 304),
    ),
    "aarch64": _Arch(
        0xC00000B7,
        clone=220,
        clone3=435,
        forks=(),
        x32=False,
        denied=(117, 270, 271, 219, 217, 218, 280, 282, 241, 97, 268, 40, 39, 41, 425, 426, 427, 265),
    ),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_for(arch: str) -> bytes:
    """The compiled program for ``arch`` (a ``platform.machine()`` name); KeyError if unsupported."""
    a = ARCHES[arch]
    eperm: list[int] = []  # syscall numbers answered with each errno
    enosys: list[int] = []
    eperm.extend(a.forks)
    eperm.extend(a.denied)
    enosys.append(a.clone3)
    body: list[tuple[int, int, str]] = []  # (code, k, target label for "jump if true")
    body += [(_JEQ_K, nr, "eperm") for nr in eperm]
    body += [(_JEQ_K, nr, "enosys") for nr in enosys]
    body.append((_JEQ_K, a.clone, "clone"))
    # layout: arch check, load nr, [x32 check], body..., allow, clone: load flags, jset, eperm, enosys, kill
    prog: list[bytes] = []
    head = 3 + (1 if a.x32 else 0)
    n_body = len(body)
    allow_at = head + n_body
    clone_at = allow_at + 1
    eperm_at = clone_at + 3
    enosys_at = eperm_at + 1
    kill_at = enosys_at + 1
    targets = {"eperm": eperm_at, "enosys": enosys_at, "clone": clone_at}
    prog.append(_insn(_LD_W_ABS, _ARCH))
    prog.append(_insn(_JEQ_K, a.audit, 0, kill_at - 2))
    prog.append(_insn(_LD_W_ABS, _NR))
    if a.x32:
        prog.append(_insn(_JGE_K, _X32_BIT, enosys_at - 4, 0))
    for i, (code, k, label) in enumerate(body):
        at = head + i
        prog.append(_insn(code, k, targets[label] - at - 1, 0))
    prog.append(_insn(_RET_K, _ALLOW))
    prog.append(_insn(_LD_W_ABS, _ARG0_LOW))  # clone: args[0] is the flags
    prog.append(_insn(_JSET_K, _CLONE_THREAD, 0, 1))
    prog.append(_insn(_RET_K, _ALLOW))
    prog.append(_insn(_RET_K, _ERRNO | _EPERM))
    prog.append(_insn(_RET_K, _ERRNO | _ENOSYS))
    prog.append(_insn(_RET_K, _KILL_PROCESS))
    assert len(prog) == kill_at + 1
    return b"".join(prog)


def host_filter() -> bytes | None:
    """The filter for this machine, or None where no table exists (then only rlimits apply)."""
    machine = platform.machine()
    return filter_for(machine) if machine in ARCHES else None
