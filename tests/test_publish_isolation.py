"""A publish that can never succeed is dead-lettered with its reason, and no other publish waits on it.

Failed publishes used to be retried first, blocking, by every later publish: one that no stream
stores (a subject outside the stream, a permission the role lacks) was kept for ever, and every later
publish of the process raised *its* error after its retries (about 5 s each)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coevo.config import CoevoConfig, NatsConfig
from coevo.errors import PublishError
from coevo.runtime.app import credentials_dir, open_bus
from coevo.runtime.bus import NatsBus
from coevo.schemas import DeadLettered, Source, TaskScheduled, TaskSpec, WeightsPublished, kind_of
from tests.samples import sample_events

SRC = Source(agent_id="test", role="test")


def sched(run_id: str, i: int) -> TaskScheduled:
    return TaskScheduled(
        run_id=run_id, source=SRC, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
    )


async def test_a_publish_no_stream_stores_is_dead_lettered_and_holds_up_no_other(
    nats_url: str, run_id: str, cfg: CoevoConfig
) -> None:
    bus = await NatsBus.connect(
        nats_url, run_id, bus=cfg.bus.model_copy(update={"publish_retries": 2}), stream=cfg.stream
    )
    try:
        nowhere = f"coevo.nowhere-{run_id}.ev.task.scheduled"
        bad = await bus.publish_raw(nowhere, b'{"not": "stored"}', "bad-1")
        with pytest.raises(PublishError, match="no stream answered"):
            await asyncio.wait_for(asyncio.shield(bad), 5)
        # the next publish is sent and answered on its own: it neither raises the other's error nor waits
        good = await bus.publish(sched(run_id, 1))
        assert await asyncio.wait_for(good, 5) is True
        await bus.flush(timeout_s=30)  # the bad one is retried (backing off) until it is dead-lettered
        assert bus._failed == [] and bus.inflight == 0
        later = await bus.publish(sched(run_id, 2))
        assert await asyncio.wait_for(later, 5) is True
        events = await bus.events()
        assert [e.group_id for e in events if isinstance(e, TaskScheduled)] == ["g1", "g2"]
        (letter,) = [e for e in events if isinstance(e, DeadLettered)]
        assert letter.original_subject == nowhere and letter.raw == b'{"not": "stored"}'
        assert "no stream answered" in letter.reason and "never stored" in letter.reason
        assert letter.consumer == "publish" and letter.event_id == "unstored-bad-1"
    finally:
        await bus.close()
    assert bus.stats.unstored == 0


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[NatsBus]:
    async with open_bus("pubiso", store=tmp_path / "nats") as bus:  # as coevo run: embedded, as admin
        yield bus


async def test_a_publish_the_role_may_not_make_is_dead_lettered_and_holds_up_no_other(
    admin: NatsBus, tmp_path: Path, cfg: CoevoConfig
) -> None:
    """The policy announces weights (the learner's subject): the server refuses it without a reply.
    Once the stream stored another of the policy's publishes, each further failure counts; after
    ``bus.publish_retries`` + 1 of them it is dead-lettered on the policy's own dead-letter subject."""
    url = f"nats://{admin.nc.connected_url.hostname}:{admin.nc.connected_url.port}"
    policy = await NatsBus.connect(
        url,
        admin.run_id,
        nats_cfg=NatsConfig(credentials_file=credentials_dir(tmp_path / "nats") / "policy.json"),
        bus=cfg.bus.model_copy(update={"publish_ack_timeout_s": 0.5, "publish_retries": 1}),
        name="policy",
    )
    src = Source(agent_id="policy-1", role="policy")
    forged = WeightsPublished(
        run_id=admin.run_id, source=src, role="policy", version=9, path="/w/v9", sha256="0" * 64, bytes=1
    )
    step = next(e for e in sample_events(admin.run_id) if kind_of(e) == "step.taken")
    try:
        await policy.publish(forged)
        with pytest.raises(PublishError):
            await policy.flush(timeout_s=1.0)  # unanswered for its ack timeout: it failed
        good = await policy.publish(step)  # not behind the forged one
        assert await asyncio.wait_for(good, 5) is True
        await policy.flush(timeout_s=30)
        assert policy._failed == []
    finally:
        await policy.close()
    events = await admin.events()
    assert [e for e in events if isinstance(e, WeightsPublished)] == []
    assert [e.event_id for e in events if kind_of(e) == "step.taken"] == [step.event_id]
    (letter,) = [e for e in events if isinstance(e, DeadLettered)]
    assert letter.source.role == "policy" and letter.original_subject.endswith("weights.published.policy")
    assert "not acknowledged within 0.5 s" in letter.reason, letter.reason
