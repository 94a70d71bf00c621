"""What a person sees while coevo runs (#39 item 8): log lines above the status line, each ending in
its newline, never run into it; an agent in its own process says what it has done; the closing line
says whose minutes it counts."""

from __future__ import annotations

import asyncio
import io
import logging
import types
from pathlib import Path

from rich.console import Console

from coevo.config import load_config
from coevo.observe.closing import describe
from coevo.observe.status import agent_line, logs_above, show_status
from coevo.observe.tally import RunTally


def test_a_log_line_prints_above_the_status_line_with_its_newline() -> None:
    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=100)
    plain = io.StringIO()
    handler = logging.StreamHandler(plain)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with console.status("42s | trajectories 7") as status, logs_above(console):
            logging.getLogger("coevo.test").warning("a log line while the status line is drawn")
            status.update("43s | trajectories 8")
        assert handler.stream is plain  # its own stream back afterwards
    finally:
        root.removeHandler(handler)
    out = terminal.getvalue()
    assert "a log line while the status line is drawn\n" in out  # through the console: a line of its own
    assert plain.getvalue() == ""  # nothing written past the status line


def test_a_handler_left_with_a_closed_stream_is_left_alone(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    closed = (tmp_path / "gone.log").open("w")  # a file another test's handler wrote to, then closed
    stale = logging.StreamHandler(closed)
    closed.close()
    root = logging.getLogger()
    root.addHandler(stale)
    try:
        with console.status("1s"), logs_above(console):
            pass
        assert stale.stream is closed
    finally:
        root.removeHandler(stale)


async def test_show_status_off_a_terminal_logs_progress_until_stopped() -> None:
    console = Console(file=io.StringIO(), force_terminal=False)
    stop = asyncio.Event()
    lines: list[str] = []

    def line() -> str:
        lines.append("x")
        if len(lines) == 3:
            stop.set()
        return f"progress {len(lines)}"

    await asyncio.wait_for(show_status(line, stop, every_s=0.01, console=console), 10)
    assert len(lines) == 3


def test_an_agents_status_line_says_what_it_did() -> None:
    agent = types.SimpleNamespace(agent_id="scorer-1", counters={"scorer.handled": 12, "scorer.retried": 0})
    assert agent_line(agent) == "scorer-1: handled 12"
    idle = types.SimpleNamespace(agent_id="judge-2", counters={"judge.handled": 0})
    assert agent_line(idle) == "judge-2: waiting for work"


def test_the_closing_line_says_the_minutes_are_this_processs() -> None:
    summary = {**RunTally().summary("r1", 180.0).model_dump(), "learner_steps": 83, "groups_scored": 281}
    first = describe(summary, load_config(), {}).splitlines()[0]
    assert first.startswith("Run r1 finished: 83 policy and 0 judge learner steps")
    assert first.endswith("281 train groups scored in all (this process ran 3.0 min of it).")


def test_the_progress_line_counts_train_groups_as_the_closing_summary_does() -> None:
    from coevo.loop import Progress
    from coevo.observe.aggregate import Aggregator

    scorer = types.SimpleNamespace(counters={"groups_scored": 31, "trajectories.won": 1, "trajectories.lost": 3})
    aggregator = Aggregator()  # the run's whole stream: a resumed run's earlier sessions too
    aggregator.tally.train.extend([0.0, 0.5, 1.0])
    aggregator.tally.purposes.update({"train": 3, "eval": 40})
    line = Progress([scorer], aggregator).line()  # type: ignore[list-item]
    assert "groups scored 43 (3 train) |" in line and "train success, last 3 groups: 50%" in line
    assert "groups scored 31 |" in Progress([scorer]).line()  # type: ignore[list-item]  # no aggregator: no split
