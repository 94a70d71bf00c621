"""#36 item 7: a publish that fails is retried under its id until it is stored, never dropped; the
learner's ``WeightsPublished`` (guarded by no input) is stored before it goes on."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from nats.js.api import DiscardPolicy

from coevo.config import CoevoConfig
from coevo.runtime.bus import NatsBus
from coevo.schemas import WeightsPublished
from coevo.training.learner import LearnerAgent
from tests.test_delivery import _learner_cfg


async def test_the_learners_weights_announcement_is_stored_before_it_goes_on(
    nats_url: str, run_id: str, loop_cfg: CoevoConfig
) -> None:
    """The stream refuses everything (full, discard new) while the learner announces a version: the
    announcement waits, retried under one id, until the stream takes it; it is stored once. Before:
    sent and forgotten, it returned at once, and a refused retry dropped it for good."""
    cfg = _learner_cfg(loop_cfg, **{"bus.publish_retries": 1, "agent.restart_backoff_s": [0.05, 0.2]})
    bus = await NatsBus.connect(nats_url, run_id, bus=cfg.bus, stream=cfg.stream)
    try:
        learner = LearnerAgent(bus, cfg)
        open_cfg = (await bus.js.stream_info(bus.stream)).config
        await bus.js.update_stream(replace(open_cfg, max_msgs=1, discard=DiscardPolicy.NEW))
        await learner.announce("policy", 0, cfg.run.runs_dir, "0" * 64, 1)  # the one message the stream holds
        async with asyncio.TaskGroup() as tg:
            announce = tg.create_task(learner.announce("policy", 3, cfg.run.runs_dir, "3" * 64, 10))
            async with asyncio.timeout(30):
                while learner.counters["republished.weights.published"] < 2:  # two rounds refused
                    await asyncio.wait({announce}, timeout=0.05)
                    assert not announce.done(), "announced without being stored"
            await bus.js.update_stream(replace(open_cfg, max_msgs=-1, discard=DiscardPolicy.OLD))
        published = [e for e in await bus.events(["weights.published"]) if isinstance(e, WeightsPublished)]
        assert [(e.version, e.sha256) for e in published] == [(0, "0" * 64), (3, "3" * 64)]
        assert bus.stats.duplicates == 0  # one id throughout: stored once
    finally:
        await bus.close()
