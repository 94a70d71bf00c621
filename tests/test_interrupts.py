"""Signals at the end of ``coevo run`` (``coevo.loop.Interrupts``): the first stops the run, the second
skips the closing measurements and the summary still prints with its resume line, a third has the
default action (a child process takes all three). Real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coevo.config import CoevoConfig, load_config
from coevo.loop import Interrupts, _baselines
from coevo.observe.closing import describe
from coevo.observe.tally import RunTally


@pytest.fixture(autouse=True)
def _pytests_own_sigint() -> Iterator[None]:
    """A hurried ``Interrupts`` leaves SIGINT at its default action for good; this process is pytest's."""
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


async def _measuring_until_cancelled(started: asyncio.Event, cancelled: asyncio.Event) -> dict[str, Any]:
    started.set()
    try:
        await asyncio.Event().wait()  # a measurement that takes longer than anyone waits
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return {}


async def test_the_second_signal_skips_the_closing_measurements_and_the_summary_still_prints(tmp_path: Path) -> None:
    cfg = load_config()
    summary = {**RunTally().summary("r1", 60.0).model_dump(), "learner_steps": 2, "groups_scored": 9}
    stop, started, cancelled = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def measure(_cfg: CoevoConfig, _run_dir: Path, _success: bool) -> dict[str, Any]:
        return await _measuring_until_cancelled(started, cancelled)

    loop = asyncio.get_running_loop()
    with Interrupts(stop) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        await stop.wait()
        assert signals.interrupted == "SIGINT" and not signals.hurry.is_set()
        closing = asyncio.ensure_future(_baselines(cfg, tmp_path, summary, measure, signals.hurry))
        await started.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        bars = await closing
        assert not loop.remove_signal_handler(signal.SIGINT)  # a third signal: the default action
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # to the end of the process
    assert cancelled.is_set()  # the measurement stopped, not left running behind the summary
    assert bars == {"skipped": "a second signal skipped them"}
    text = describe(summary, cfg, {"resume": "coevo run --resume r1"}, bars, interrupted=signals.interrupted)
    assert text.startswith("Run r1 was interrupted (SIGINT) before its budget: 2 policy")
    assert "\n  baselines: not measured (a second signal skipped them); `coevo bench heldout`" in text
    assert text.endswith("\n  resume:      coevo run --resume r1")


async def test_a_signal_after_the_budget_ran_out_only_hurries(tmp_path: Path) -> None:
    """The budget stopped the run; a signal while the summary is measured is not an interruption of the
    run, and a measurement that ends first is kept."""
    cfg = load_config()
    summary = RunTally().summary("r1", 60.0).model_dump()
    stop = asyncio.Event()
    stop.set()  # the budget ran out

    async def measure(_cfg: CoevoConfig, _run_dir: Path, success: bool) -> dict[str, Any]:
        return {"random": 0.25, "success_asked": success}

    with Interrupts(stop) as signals:
        assert await _baselines(cfg, tmp_path, summary, measure, signals.hurry) == {
            "random": 0.25,
            "success_asked": False,  # no round was scored
        }
        os.kill(os.getpid(), signal.SIGINT)
        await signals.hurry.wait()
    assert signals.interrupted is None


async def test_a_failed_measurement_prints_the_summary_without_it(tmp_path: Path) -> None:
    async def measure(_cfg: CoevoConfig, _run_dir: Path, _success: bool) -> dict[str, Any]:
        raise RuntimeError("no checkpoint")

    summary = RunTally().summary("r1", 60.0).model_dump()
    assert await _baselines(load_config(), tmp_path, summary, measure, asyncio.Event()) == {}


THREE_SIGNALS = """
import asyncio, os, signal
from coevo.loop import Interrupts

async def main():
    stop = asyncio.Event()
    with Interrupts(stop) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        await stop.wait()
        os.kill(os.getpid(), signal.SIGINT)
        await signals.hurry.wait()
        print("hurried", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(60)
    print("outlived the third signal", flush=True)

asyncio.run(main())
"""


def test_the_third_signal_ends_the_process_at_once_and_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", THREE_SIGNALS], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
    assert done.stdout.endswith("hurried\n") and "run.hurrying" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
