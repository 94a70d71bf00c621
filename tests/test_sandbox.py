"""The sandbox contains what untrusted programs try, each with a clear outcome."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from coevo.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=256, file_mb=1)


async def test_ok_program_runs_in_its_own_directory() -> None:
    r = await run_python("import os\nopen('x.txt', 'w').write('hi')\nprint(open('x.txt').read(), os.getcwd())",
                         limits=LIMITS)
    assert r.status == "ok" and r.stdout.startswith("hi /")
    assert "coevo-sbx-" in r.stdout
    assert not Path(r.stdout.split()[1]).exists()  # the directory is gone afterwards


async def test_fork_bomb_is_contained() -> None:
    r = await run_python("import os\nwhile True:\n    os.fork()\n", limits=LIMITS)
    assert r.status == "forbidden" and "os.fork" in r.detail
    r = await run_python("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", limits=LIMITS)
    assert r.status == "forbidden" and "subprocess.Popen" in r.detail


async def test_memory_bomb_is_contained() -> None:
    r = await run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))\n", limits=LIMITS)
    assert r.status == "memory"


async def test_infinite_loop_is_killed_with_its_children() -> None:
    r = await run_python("while True:\n    pass\n", limits=LIMITS)
    assert r.status == "timeout" and r.duration_s < LIMITS.wall_s + 2
    r = await run_python("import time\ntime.sleep(60)\n", limits=LIMITS)
    assert r.status == "timeout" and r.duration_s < LIMITS.wall_s + 2
    leftover = subprocess.run(["pgrep", "-f", "coevo-sbx-"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


async def test_network_is_refused() -> None:
    r = await run_python("import socket\nsocket.create_connection(('127.0.0.1', 4222), timeout=1)\n", limits=LIMITS)
    assert r.status == "forbidden" and "network" in r.detail


async def test_write_outside_its_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    r = await run_python(f"open({str(target)!r}, 'w').write('x')\n", limits=LIMITS)
    assert r.status == "forbidden" and "outside the sandbox" in r.detail
    assert not target.exists()
    r = await run_python(f"import os\nos.remove({str(tmp_path)!r})\n", limits=LIMITS)
    assert r.status == "forbidden"
    r = await run_python("import ctypes\n", limits=LIMITS)
    assert r.status == "forbidden" and "ctypes" in r.detail


async def test_output_flood_and_errors() -> None:
    r = await run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits=LIMITS)
    assert r.status == "output_limit"
    r = await run_python("1/0", limits=LIMITS)
    assert r.status == "error" and "ZeroDivisionError" in r.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need privileges here")
async def test_network_namespace_when_available() -> None:
    r = await run_python("print(open('/proc/net/dev').read().count(':'))", limits=LIMITS)
    assert r.network_isolated and r.stdout.strip() == "1"  # only the loopback device
