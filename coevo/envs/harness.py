"""The code that runs inside the sandbox, and the plain-data wire format it shares with coevo.

Started as ``python -I [-S] harness.py FD`` with only the standard library. FD is one end of a
socket pair; frames on it are a 4-byte big-endian length and a JSON payload. The first frame says
what to do:

- ``run``: execute the program as ``__main__`` (its stdin and stdout are the process's);
- ``serve``: execute the program, answer ``ready``, then answer each ``{"args", "kwargs"}`` frame
  with what the entry point did: ``{"value": <plain data>}``, ``{"raised": name, "message"}`` or
  ``{"invalid": why}`` (it returned something that is not plain data);
- ``test``: run trusted test code whose ``candidate`` is a proxy: each call is sent to the parent as
  ``{"call": ...}`` and only plain data comes back, so the program can never reach this process.

Values cross as plain data only (``encode``/``decode``): None, bool, int, float, str, bytes,
complex, and lists, tuples, sets, frozensets and dicts of them, with tuples, sets and dicts tagged
so that Python's ``==`` on the decoded value means what it meant on the original.

Invariant: in ``run`` and ``serve`` modes this process is untrusted: whatever it sends is data the
parent decodes and judges; it never sends a verdict. The audit hook (``guard``) is a second layer
only; the isolation is the sandbox around the process.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

FORBIDDEN_EXIT = 86
MEMORY_EXIT = 87
MAX_FRAME = 8 * 1024 * 1024
MAX_DEPTH = 100
_INF = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class NotPlainData(TypeError):
    """A value (or a part of it) is not of a plain-data type."""


def encode(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-able data; raises ``NotPlainData`` for anything else (subclasses included)."""
    t = type(value)
    if value is None or t is bool or t is str or t is int:
        return value
    if t is float:
        return value if math.isfinite(value) else {"F": repr(value)}
    if depth >= MAX_DEPTH:
        raise NotPlainData("nested too deeply")
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise NotPlainData(f"a {t.__name__} is not plain data")


def decode(obj: Any, depth: int = 0) -> Any:
    """The value ``encode`` made ``obj`` from; raises ``ValueError`` on anything it cannot have made."""
    t = type(obj)
    if obj is None or t is bool or t is str or t is int or t is float:
        return obj
    if depth >= MAX_DEPTH:
        raise ValueError("nested too deeply")
    if t is list:
        return [decode(v, depth + 1) for v in obj]
    if t is not dict or len(obj) != 1:
        raise ValueError("not plain data")
    ((tag, body),) = obj.items()
    try:
        if tag == "F" and body in _INF:
            return _INF[body]
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is not list:
            raise ValueError("not plain data")
        items = [decode(v, depth + 1) for v in body]
        if tag == "t":
            return tuple(items)
        if tag == "s":
            return set(items)
        if tag == "f":
            return frozenset(items)
        if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
            return {k: v for k, v in items}  # pairs arrive as lists
        if tag == "c" and len(items) == 2 and all(type(x) is float or type(x) is int for x in items):
            return complex(items[0], items[1])
    except TypeError as exc:  # an unhashable set member or dict key
        raise ValueError(f"not plain data: {exc}") from None
    raise ValueError("not plain data")


def pack(obj: Any) -> bytes:
    payload = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return len(payload).to_bytes(4, "big") + payload


def unpack(payload: bytes) -> Any:
    """A frame's payload as JSON; ``ValueError`` (never anything else) when it is not."""
    try:
        return json.loads(payload)
    except (RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None


# ---- inside the sandbox --------------------------------------------------------------------------


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def recv(fd: int) -> Any:
    """The next frame; exits quietly when the parent has gone."""
    head = _read_exact(fd, 4)
    n = int.from_bytes(head, "big") if head else MAX_FRAME + 1
    body = _read_exact(fd, n) if n <= MAX_FRAME else None
    if body is None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0)
    return unpack(body)


def send(fd: int, obj: Any) -> None:
    data = pack(obj)
    while data:
        data = data[os.write(fd, data) :]


def apply_limits(limits: dict[str, int]) -> None:
    import resource

    pairs = {
        "memory_mb": (resource.RLIMIT_AS, 1024 * 1024),
        "file_mb": (resource.RLIMIT_FSIZE, 1024 * 1024),
        "cpu_s": (resource.RLIMIT_CPU, 1),
        "open_files": (resource.RLIMIT_NOFILE, 1),
        "processes": (resource.RLIMIT_NPROC, 1),
    }
    for name, (res, unit) in pairs.items():
        if name in limits:
            value = int(limits[name]) * unit
            hard = value + 1 if res == resource.RLIMIT_CPU else value
            resource.setrlimit(res, (value, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class SandboxViolation(BaseException):
    pass


def guard(root: str) -> None:
    """The audit hook of the ``process`` isolation, kept as a second layer under bubblewrap."""
    proc_events = {
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.exec",
        "os.spawn",
        "os.system",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "pty.spawn",
        "signal.pthread_kill",
    }
    fs_events = {
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.symlink",
        "os.link",
        "os.truncate",
        "shutil.rmtree",
        "os.utime",
    }
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True
        full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
        return full == root or full.startswith(root + os.sep)

    def deny(what: str) -> None:
        raise SandboxViolation("sandbox: " + what + " is forbidden")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith("socket."):
            deny("network access (" + event + ")")
        if event in proc_events:
            deny("creating or signalling processes (" + event + ")")
        if event.startswith("ctypes."):
            deny("ctypes")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path):
                deny("writing outside the sandbox directory (" + str(path) + ")")
        elif event in fs_events:
            for a in args[:2]:
                if isinstance(a, (str, bytes)) and not inside(a):
                    deny(event + " outside the sandbox directory")

    sys.addaudithook(hook)


def _run(fd: int, setup: dict[str, Any]) -> None:
    os.close(fd)
    exec(compile(setup["program"], "program.py", "exec"), {"__name__": "__main__"})


def _serve(fd: int, setup: dict[str, Any]) -> None:
    ns: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(setup["program"], "solution.py", "exec"), ns)
    except (SandboxViolation, MemoryError):
        raise
    except BaseException as exc:
        send(fd, {"ready": False, "error": _describe(exc)})
        return
    fn = ns.get(setup["entry"])
    if not callable(fn):
        send(fd, {"ready": False, "error": f"the program defines no function {setup['entry']!r}"})
        return
    send(fd, {"ready": True})
    while True:
        req = recv(fd)
        args, kwargs = decode(req["args"]), decode(req["kwargs"])
        try:
            value = fn(*args, **kwargs)
        except SandboxViolation:
            raise
        except BaseException as exc:
            reply = {"raised": type(exc).__name__, "message": _describe(exc)}
        else:
            try:
                reply = {"value": encode(value)}
                pack(reply)
            except (NotPlainData, ValueError, RecursionError) as exc:
                reply = {"invalid": str(exc)[:200]}
        send(fd, reply)


class CandidateFailed(BaseException):
    """The program did not answer a call with data (timeout, crash, not plain data)."""


def _raise_like(name: str, message: str) -> BaseException:
    import builtins

    cls = getattr(builtins, str(name), None)
    # StopIteration would end the iteration of a test's map()/next() quietly instead of failing it
    if isinstance(cls, type) and issubclass(cls, Exception) and cls not in (StopIteration, StopAsyncIteration):
        try:
            return cls(message)
        except Exception:
            pass
    return Exception(f"{name}: {message}")


def _test(fd: int, setup: dict[str, Any]) -> None:
    def candidate(*args: Any, **kwargs: Any) -> Any:
        try:
            call = {"args": encode(list(args)), "kwargs": encode(kwargs)}
        except NotPlainData as exc:
            raise TypeError(f"candidate's arguments must be plain data: {exc}") from None
        send(fd, {"call": call})
        reply = recv(fd)
        if "value" in reply:
            return decode(reply["value"])
        if "raised" in reply:
            raise _raise_like(reply["raised"], reply.get("message", ""))
        raise CandidateFailed(reply.get("failed", "failed"))

    base: dict[str, Any] = {"__name__": "__coevo_test__"}
    try:
        exec(compile(setup["helpers"], "helpers.py", "exec"), base)
        exec(compile(setup["prelude"], "prelude.py", "exec"), base)
    except Exception as exc:
        send(fd, {"ready": False, "error": "the tests' prelude failed: " + _describe(exc)})
        return
    base["candidate"] = candidate
    if setup["entry"]:
        base[setup["entry"]] = candidate
    send(fd, {"ready": True})
    while True:
        src = recv(fd)["test"]
        try:
            exec(compile(src, "test.py", "exec"), dict(base))
            reply: dict[str, Any] = {"passed": True}
        except BaseException as exc:
            reply = {"passed": False, "error": _describe(exc)}
        send(fd, reply)


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except Exception:
        return type(exc).__name__


MODES = {"run": _run, "serve": _serve, "test": _test}


def main() -> None:
    fd = int(sys.argv[1])
    setup = recv(fd)
    apply_limits(setup.get("limits", {}))
    for name, text in setup.get("files", {}).items():
        with open(os.path.basename(name), "w") as f:
            f.write(text)
    if setup.get("guard"):
        guard(os.path.realpath(os.getcwd()))
    try:
        MODES[setup["mode"]](fd, setup)
    except SandboxViolation as exc:
        sys.stderr.write("COEVO_SANDBOX: " + str(exc) + "\n")
        sys.stderr.flush()
        os._exit(FORBIDDEN_EXIT)
    except MemoryError:
        sys.stderr.write("COEVO_SANDBOX: memory limit\n")
        sys.stderr.flush()
        os._exit(MEMORY_EXIT)


if __name__ == "__main__":
    main()
