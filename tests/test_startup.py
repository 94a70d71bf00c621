"""Starting agents loads their models off the event loop: the bus is answered, and a line says it loads."""

from __future__ import annotations

import asyncio
import time

import pytest

from coevo.config import CoevoConfig
from coevo.loop import build_agents
from coevo.runtime.aio import off_the_loop
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored
from tests.conftest import run_until

LOAD_S = 1.0


@pytest.mark.alone  # a loop gap measured while other tests load the cores is theirs, not the agents'
async def test_agents_load_their_models_off_the_event_loop(
    bus: NatsBus, loop_cfg: CoevoConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each model load takes a second longer here (a real model takes a minute on 2 cores): the event loop
    never stalls that long, a beat says the start is still loading, and the agents built on the worker
    thread then run the loop on this one."""
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained

    def slow(*a, **kw):
        time.sleep(LOAD_S)
        return load(*a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", slow)
    ticking = True
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while ticking:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beats: list[float] = []
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.1)  # ticking before the build starts
    agents = await off_the_loop(lambda: build_agents(bus, loop_cfg), beats.append, every_s=0.5)
    ticking = False
    await tick
    assert {"tasks", "policy", "scorer", "learner", "judge"} <= {a.role for a in agents}
    assert max(gaps) < LOAD_S / 2, max(gaps)  # two models of a second each: the loop never waited on one
    assert len(beats) >= 2 and beats == sorted(beats)

    async def scored() -> bool:
        return bool(await bus.events(["group.scored"]))

    await run_until(agents, scored, timeout_s=60)
    assert any(isinstance(e, GroupScored) for e in await bus.events(["group.scored"]))
