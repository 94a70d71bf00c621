"""What a coevo command does with signals (``coevo.runtime.proc``), in a real subprocess."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import textwrap
import time
from typing import IO

from tests.conftest import PYTHON, subprocess_env

BENCH = textwrap.dedent(
    """
    import asyncio, sys
    from coevo.runtime.proc import run_stoppable

    async def bench_step() -> str:  # waits on its input as a bench waits on its work
        print("ready", flush=True)
        return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    print("result", run_stoppable(bench_step()).strip(), flush=True)
    """
)


def read_until(stream: IO[bytes], marker: bytes, timeout: float = 60.0) -> bytes:
    """What ``stream`` gives until ``marker`` appears (unbuffered: what follows stays in the pipe)."""
    data, deadline = b"", time.monotonic() + timeout
    while marker not in data:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} in {timeout:.0f} s: {data!r}"
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"the stream ended before {marker!r}: {data!r}"
            data += chunk
    return data


def test_sigusr1_prints_where_a_bench_waits_and_the_bench_goes_on() -> None:
    proc = subprocess.Popen(
        [PYTHON, "-c", BENCH],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        read_until(proc.stdout, b"ready\n")
        proc.send_signal(signal.SIGUSR1)  # the default action would end the process
        dump = read_until(proc.stderr, b"in bench_step\n")  # where the bench's task waits
        assert dump.startswith(b"coevo: ") and b"asyncio tasks" in dump
        out, _ = proc.communicate(b"done\n", timeout=60)  # the bench goes on and ends with its result
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == b"result done\n"
