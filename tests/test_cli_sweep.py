"""The sweep of #39: every subcommand given a wrong id, a wrong path, a dead server or a typo, run as
typed. Each fails with a non-zero exit and one line (after argparse's usage for a typo), no traceback,
within seconds, and leaves nothing in the directory it was typed in."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.test_cli import coevo


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEAD = f"nats://127.0.0.1:{_closed_port()}"
"""a server that is not there: a port nothing listens on"""

WRONG_ID = [
    ("run", "--resume", "nosuch"),
    ("agent", "scorr", "--run-id", "r1"),
    ("agent", "nosuch.module:Agent", "--run-id", "r1"),
    ("trace", "t-1", "--run", "nosuch"),
    ("replay", "--run", "nosuch", "--into", "scorer"),
    ("rejudge", "--run", "nosuch"),
    ("dashboard", "--run", "nosuch", "--port", "0"),
    ("report", "--run", "nosuch"),
    ("events", "export", "out.jsonl", "--run", "nosuch"),
]
WRONG_PATH = [
    ("run", "--config", "missing.toml"),
    ("run", "--config", "."),
    ("run", "--policy-model", "missing-model"),
    ("run", "--base", "."),
    ("agent", "policy", "--policy.model", "missing-model", "--run-id", "r1"),
    ("agent", "scorer", "--run-id", "r1", "--nats.credentials_file", "missing.json", "--nats", DEAD),
    ("events", "import", "missing.jsonl"),
    ("schemas", "export", "../a-file"),
    ("report", "--bench", "missing.json"),
    ("bench", "table", "missing.json"),
    ("rejudge", "--run", "nosuch", "--judge", "missing.toml"),
    ("bench", "learn", "--judge-from", "missing-model"),
    ("bench", "learn", "--config", "missing.toml"),
    ("bench", "ladder", "--set", "learner.no_such_field=1"),
    ("bench", "async", "--base", "missing-model"),
    ("bench", "async", "--set", "learner.no_such_field=1"),
    ("bench", "ladder", "--base", "missing-model"),
    ("server", "--store", "../a-file/store", "--port", "-1", "--insecure-loopback"),
    ("trace", "t-1", "--run", "r1", "--runs-dir", "missing-runs"),
]
DEAD_SERVER = [
    ("run", "--nats", DEAD),
    ("agent", "scorer", "--run-id", "r1", "--nats", DEAD),
    ("trace", "t-1", "--run", "r1", "--nats", DEAD),
    ("replay", "--run", "r1", "--into", "judge", "--nats", DEAD),
    ("rejudge", "--run", "r1", "--nats", DEAD),
    ("dashboard", "--run", "r1", "--nats", DEAD),
    ("report", "--run", "r1", "--nats", DEAD),
    ("events", "export", "out.jsonl", "--run", "r1", "--nats", DEAD),
    ("events", "import", "../a-file", "--nats", DEAD),
    ("bench", "bus", "--count", "10", "--nats", DEAD),
]
COMMANDS = [
    ("run",),
    ("agent", "scorer"),
    ("server",),
    ("schemas", "export", "d"),
    ("events", "export", "o.jsonl", "--run", "r1"),
    ("events", "import", "i.jsonl"),
    ("trace", "t-1", "--run", "r1"),
    ("replay", "--run", "r1", "--into", "scorer"),
    ("rejudge", "--run", "r1"),
    ("dashboard", "--run", "r1"),
    ("report", "--run", "r1"),
    *[
        ("bench", b)
        for b in ("bus", "envs", "learn", "ladder", "weights", "learner", "chaos", "soak", "codec", "async")
    ],
    ("bench", "table", "r.json"),
    ("bench", "parity", "--vllm-python", "p"),
]
TYPO = [(*c, "--defintely-not-a-flag") for c in COMMANDS] + [("trcae",), ("bench", "lern")]

CASES = (
    [pytest.param(a, False, id="wrong-id:" + " ".join(a[:2])) for a in WRONG_ID]
    + [pytest.param(a, False, id="wrong-path:" + " ".join(a[:3])) for a in WRONG_PATH]
    + [pytest.param(a, False, id="dead-server:" + " ".join(a[:2])) for a in DEAD_SERVER]
    + [pytest.param(a, True, id="typo:" + " ".join(a[:2])) for a in TYPO]
)


@pytest.mark.parametrize(("args", "usage"), CASES)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path: Path, args: tuple[str, ...], usage: bool) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "a-file").write_text("not a directory, not an export\n")
    t0 = time.monotonic()
    out = coevo(*args, cwd=home, timeout=60)
    took = time.monotonic() - t0
    lines = out.stderr.strip().splitlines()
    assert out.returncode not in (0, None), (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    if usage:  # argparse: its usage, then one line saying what is wrong
        assert out.returncode == 2 and lines[0].startswith("usage: coevo"), out.stderr[-3000:]
        said = [line for line in lines if not line.startswith(("usage:", " "))]
    else:
        said = lines
    assert len(said) == 1 and said[0].startswith("coevo"), out.stderr[-3000:]
    assert list(home.iterdir()) == [], list(home.iterdir())  # nothing left behind
    assert took < 30, took  # no retries for half a minute, no model built
