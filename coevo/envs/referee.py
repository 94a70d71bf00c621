"""Run tests against a program, with every verdict decided outside the program's process.

The program runs in a sandbox in ``serve`` mode (``coevo.envs.harness``): it loads, then answers
calls of its entry point with plain data over a framed socket. Each test is planned by
``coevo.envs.verdict``:

- ``CallCheck`` (``assert candidate(<literals>) == <literal>`` and kin): the arguments are sent, the
  reply is decoded and compared here;
- ``ConstCheck`` (``assert True``): passes iff the program loaded;
- ``Scripted`` (anything else): runs in a second sandbox, the trusted test process, which holds the
  test code (and the prompt's helper functions) but not the program; its ``candidate`` is a proxy
  whose every call is relayed by this module to the program's process and back as plain data.

Nothing the program prints, exits with, or writes to its channel can turn a test into a pass: a
pass is a value this process compared, or a test process's own report on code the program cannot
reach; any call that did not return plain data fails its test.

Invariant: ``run_tests`` returns one bool and one outcome per test; a call that hangs is stopped
after ``per_test_s`` (its process is killed and the next test gets a fresh one); a program that
dies otherwise fails every test not yet run; no sandbox outlives the call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from coevo.envs.harness import decode, encode
from coevo.envs.isolation import Isolation
from coevo.envs.sandbox import Sandbox, SandboxLimits, SandboxResult, Status
from coevo.envs.verdict import CallCheck, ConstCheck, Reply, Scripted, decide, helpers_of, parse_reply, plan_test
from coevo.errors import BadFrame, ChannelClosed


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: Status = "ok"
    detail: str = ""


class _Process:
    """A sandbox in ``serve`` or ``test`` mode, (re)started on demand. ``failure`` is set when it can
    never serve again (the program does not load, or died): every later request fails with it."""

    def __init__(self, setup: dict[str, Any], isolation: Isolation, limits: SandboxLimits, ready_s: float) -> None:
        self.setup, self.isolation, self.limits, self.ready_s = setup, isolation, limits, ready_s
        self.sbx: Sandbox | None = None
        self.failure: Outcome | None = None
        self.last: SandboxResult | None = None

    async def ready(self) -> Outcome | None:
        """None when the process is up and ready, else why not."""
        if self.failure is not None or self.sbx is not None:
            return self.failure
        self.sbx = Sandbox(self.isolation, self.limits)
        await self.sbx.start(self.setup)
        try:
            frame = await self.sbx.recv(self.ready_s)
        except TimeoutError:
            return await self.dead(fatal=True, timed_out=True)
        except (ChannelClosed, BadFrame):
            return await self.dead(fatal=True)
        if type(frame) is dict and frame.get("ready") is True:
            return None
        error = str(frame.get("error", "not ready"))[:300] if type(frame) is dict else "not ready"
        await self.stop()
        self.failure = Outcome(False, "error", error)
        return self.failure

    async def dead(self, *, fatal: bool, timed_out: bool = False) -> Outcome:
        """Collect a process that stopped answering; ``fatal``: nothing more will be asked of it."""
        assert self.sbx is not None
        # a timeout kills at once; a closed channel usually means an exit: let its status arrive
        result = await (self.sbx.close(timed_out=True) if timed_out else self.sbx.shutdown(grace_s=1.0))
        self.last, self.sbx = result, None
        status: Status = result.status if result.status != "ok" else "error"
        out = Outcome(False, status, result.detail or "exited without answering")
        if fatal:
            self.failure = out
        return out

    async def stop(self) -> None:
        if self.sbx is not None:
            self.last = await self.sbx.shutdown()
            self.sbx = None

    async def exchange(self, request: dict[str, Any], within_s: float) -> Any | Outcome:
        """Send ``request`` and return the reply frame, or the ``Outcome`` that ended the exchange (a
        timeout kills the process; it restarts on the next request)."""
        if (why := await self.ready()) is not None:
            return why
        assert self.sbx is not None
        try:
            await self.sbx.send(request)
            return await self.sbx.recv(within_s)
        except TimeoutError:
            out = await self.dead(fatal=False, timed_out=True)
            return replace(out, status="timeout", detail=f"no answer within {within_s:.1f}s")
        except BadFrame as exc:
            out = await self.dead(fatal=True)
            self.failure = Outcome(False, "invalid_value", f"sent a malformed frame ({exc})")
            return self.failure
        except ChannelClosed:
            return await self.dead(fatal=True)


async def _call(program: _Process, args: list[Any], kwargs: dict[str, Any], within_s: float) -> Reply | Outcome:
    frame = await program.exchange({"args": encode(args), "kwargs": encode(kwargs)}, within_s)
    return frame if isinstance(frame, Outcome) else parse_reply(frame)


def _reply_outcome(reply: Reply) -> Outcome:
    if reply.kind == "invalid":
        return Outcome(False, "invalid_value", reply.detail)
    if reply.detail.startswith("MemoryError"):
        return Outcome(False, "memory", reply.detail)
    if "File too large" in reply.detail:  # RLIMIT_FSIZE on its stdout or a file
        return Outcome(False, "output_limit", reply.detail)
    return Outcome(False, "error", reply.detail)


async def _judge_call(program: _Process, check: CallCheck, per_test_s: float) -> Outcome:
    reply = await _call(program, list(check.args), dict(check.kwargs), per_test_s)
    if isinstance(reply, Outcome):
        return reply
    if reply.kind != "value":
        return _reply_outcome(reply)
    return Outcome(decide(check, reply.value))


async def _judge_script(tests: _Process, program: _Process, source: str, per_test_s: float) -> Outcome:
    """Run one scripted test in the test process, relaying its candidate calls to the program."""
    if (why := await program.ready()) is not None:
        return why
    deadline = time.monotonic() + per_test_s
    failed_call: Outcome | None = None
    request: dict[str, Any] = {"test": source}
    while True:
        frame = await tests.exchange(request, max(0.0, deadline - time.monotonic()))
        if isinstance(frame, Outcome):
            return failed_call or frame
        if type(frame) is dict and "passed" in frame:
            if failed_call is not None:
                return failed_call
            if frame["passed"] is True:
                return Outcome(True)
            return Outcome(False, "ok", str(frame.get("error", ""))[:300])
        call = frame.get("call") if type(frame) is dict else None
        reply = await _relay(program, call, max(0.0, deadline - time.monotonic()))
        if isinstance(reply, Outcome):
            failed_call = failed_call or reply
            request = {"failed": reply.status}
        elif reply.kind == "value":
            request = {"value": encode(reply.value)}
        elif reply.kind == "raised":
            name, _, message = reply.detail.partition(": ")
            request = {"raised": name, "message": message}
            failed_call = failed_call or (_reply_outcome(reply) if name == "MemoryError" else None)
        else:
            failed_call = failed_call or _reply_outcome(reply)
            request = {"failed": "invalid_value"}


async def _relay(program: _Process, call: Any, within_s: float) -> Reply | Outcome:
    try:
        args, kwargs = decode(call["args"]), decode(call["kwargs"])
        if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise ValueError("not a call")
    except (ValueError, TypeError, KeyError):
        return Outcome(False, "error", "the test process sent a malformed call")
    return await _call(program, args, kwargs, within_s)


def default_limits(per_test_s: float, n_tests: int) -> SandboxLimits:
    wall = max(5.0, per_test_s * n_tests + 3.0)
    return SandboxLimits(wall_s=wall, cpu_s=int(wall) + 1)


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
    """Run ``tests`` (assert code using ``candidate``) against ``program``'s ``entry_point``.

    ``prelude`` (module-level code of the test file) and the helper definitions of ``context`` (the
    problem's prompt; trusted) are available to scripted tests. The result's ``outcomes`` has one
    status per test; its ``status`` is the first that is not ``ok``.
    """
    t0 = time.monotonic()
    limits = limits or default_limits(per_test_s, len(tests))
    if not tests:
        return [], SandboxResult("ok", None, "", "", 0.0, network_isolated=isolation == "bwrap")
    ready_s = min(limits.wall_s, max(5.0, per_test_s))
    prog = _Process({"mode": "serve", "program": program, "entry": entry_point}, isolation, limits, ready_s)
    script = _Process(
        {"mode": "test", "entry": entry_point, "prelude": prelude, "helpers": helpers_of(context, entry_point)},
        isolation,
        limits,
        ready_s,
    )
    outcomes: list[Outcome] = []
    try:
        for plan in map(plan_test, tests):
            if isinstance(plan, ConstCheck):
                why = await prog.ready()
                outcomes.append(why or Outcome(plan.value))
            elif isinstance(plan, CallCheck):
                outcomes.append(await _judge_call(prog, plan, per_test_s))
            else:
                assert isinstance(plan, Scripted)
                outcomes.append(await _judge_script(script, prog, plan.source, per_test_s))
    finally:
        await prog.stop()
        await script.stop()
    first = next((o for o in outcomes if o.status != "ok"), None)
    last = prog.last
    return [o.passed for o in outcomes], SandboxResult(
        status=first.status if first else "ok",
        returncode=last.returncode if last else None,
        stdout=last.stdout if last else "",
        stderr=last.stderr if last else "",
        duration_s=time.monotonic() - t0,
        detail=first.detail if first else "",
        network_isolated=last.network_isolated if last else False,
        outcomes=tuple(o.status for o in outcomes),
    )
