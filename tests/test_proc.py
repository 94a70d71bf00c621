"""What a coevo command does with signals (``coevo.runtime.proc``), in a real subprocess."""

from __future__ import annotations

import signal
import subprocess
import textwrap

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


def test_sigusr1_prints_where_a_bench_waits_and_the_bench_goes_on() -> None:
    proc = subprocess.Popen(
        [PYTHON, "-c", BENCH],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGUSR1)  # the default action would end the process
        assert proc.stderr.readline().startswith("coevo: ")  # "coevo: N asyncio tasks"
        dump = []
        while not (line := proc.stderr.readline()).startswith("    ") or "bench_step" not in line:
            assert line, f"no stack of the bench's task in {dump}"
            dump.append(line)
        out, _ = proc.communicate("done\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == "result done\n"
