"""Delivery under faults, against a real nats-server: the outbox, and a learner that cannot hang."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from nats.js.api import DiscardPolicy

from coevo.config import CoevoConfig, load_config
from coevo.runtime.agent import Agent, run_agents
from coevo.runtime.bus import NatsBus
from coevo.runtime.claims import Claim, is_claim
from coevo.runtime.consumer import Subscription
from coevo.runtime.outbox import Outbox
from coevo.runtime.server import EmbeddedServer
from coevo.schemas import (
    GroupScored,
    LearnerStepped,
    Source,
    TaskDecided,
    TaskScheduled,
    TaskSpec,
    TrainingSample,
    TrajectoryCompleted,
    encode,
)
from coevo.training.learner import LearnerAgent
from tests.conftest import LOOP_OVERRIDES

SRC = Source(agent_id="test", role="test")


def test_derived_ids_are_the_same_for_the_same_fact_only() -> None:
    box = Outbox("cause-1", "echo")
    done = TrajectoryCompleted(
        run_id="r", source=SRC, trajectory_id="t", task_id="q", group_id="g", outcome="won", num_steps=1
    )
    later = done.model_copy(update={"event_id": "other", "ts": done.ts + 5})  # same fact, other id and clock
    assert box.derived_id(done) == box.derived_id(later)
    assert box.derived_id(done) != box.derived_id(done.model_copy(update={"outcome": "lost"}))
    assert box.derived_id(done) != Outbox("cause-2", "echo").derived_id(done)
    assert box.derived_id(done) != Outbox("cause-1", "other-consumer").derived_id(done)


class Answers(Agent):
    role = "test-answers"
    emits = (TrajectoryCompleted,)

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("answers", (TaskScheduled,), self.on_task)]

    async def on_task(self, event: TaskScheduled, _d) -> None:
        self.counters["handled"] += 1
        await self.emit(
            self.event(
                TrajectoryCompleted,
                cause=event,
                trajectory_id=f"tr-{event.group_id}",
                task_id=event.task.task_id,
                group_id=event.group_id,
                outcome="won",
                num_steps=1,
            )
        )


async def test_an_output_the_stream_refuses_keeps_its_input_until_it_is_stored(tmp_path: Path) -> None:
    """The stream is full (discard new): the handler's output is refused while the input's ack would
    go through. The input must stay unacknowledged (redelivered) until the output is stored."""
    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    cfg = load_config(
        overrides={
            "bus.publish_ack_timeout_s": 1.0,
            "bus.publish_retries": 1,
            "bus.nak_backoff_s": [0.3],
            "bus.max_deliver": 100,
            "bus.ack_wait_s": 3.0,
            "bus.in_progress_every_s": 1.0,
            "bus.fetch_timeout_s": 0.2,
            "agent.heartbeat_s": 60,
        }
    )
    try:
        async with await NatsBus.connect(server.url, "outbox", bus=cfg.bus) as bus:
            await bus.publish_sync(
                TaskScheduled(
                    run_id="outbox", source=SRC, task=TaskSpec(task_id="q", family="x"), group_id="g1", n_rollouts=1
                )
            )
            full = (await bus.js.stream_info(bus.stream)).config
            await bus.js.update_stream(replace(full, max_msgs=1, discard=DiscardPolicy.NEW))
            agent = Answers(bus, cfg)
            stop = asyncio.Event()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(run_agents([agent], handle_signals=False, until=stop))
                async with asyncio.timeout(20):
                    while agent.counters["handled"] < 3:  # refused, nak'd, redelivered, refused again...
                        await asyncio.sleep(0.1)
                refused = await bus.js.consumer_info(bus.stream, "answers")
                await bus.js.update_stream(replace(full, max_msgs=-1, discard=DiscardPolicy.OLD))  # room again
                async with asyncio.timeout(20):
                    while (await bus.js.consumer_info(bus.stream, "answers")).num_ack_pending:
                        await asyncio.sleep(0.2)
                stop.set()
            answers = await bus.events(["trajectory.completed"])
    finally:
        server.stop()
    assert refused.num_ack_pending == 1  # while refused, the input was never acknowledged
    assert len(answers) == 1 and answers[0].event_id.startswith("o-")  # then stored once, under its derived id


# ---- the learner ---------------------------------------------------------------------------------------


def _samples(group: str, n: int = 2, *, bad: int = 0) -> list[TrainingSample]:
    out = [
        TrainingSample(
            sample_id=f"{group}-{i}",
            role="policy",
            prompt_token_ids=[5, 6, 7, 8],
            response_token_ids=[9 + i],
            logprobs=[-1.0],
            advantage=1.0 if i % 2 else -1.0,
            model_version=0,
            step_event_id=f"{group}-e{i}",
        )
        for i in range(n)
    ]
    for i in range(bad):  # a token id the model has no embedding for
        out.append(out[0].model_copy(update={"sample_id": f"{group}-bad{i}", "response_token_ids": [10**6]}))
    return out


def _scored(run_id: str, group: str, task: str, purpose: str = "train", **kw) -> GroupScored:
    return GroupScored(
        run_id=run_id,
        source=SRC,
        task_id=task,
        group_id=group,
        purpose=purpose,
        accuracy=0.5,
        n_trajectories=2,
        policy_band_ok=True,
        judge_band_ok=True,
        **kw,
    )


def _decided(run_id: str, group: str | None, candidate: str, accepted: bool) -> TaskDecided:
    return TaskDecided(
        run_id=run_id,
        source=SRC,
        slot_id="s",
        parent_id="p",
        candidate_id=candidate,
        group_id=group,
        direction="harder",
        accepted=accepted,
        reason="test",
        parent_accuracy=0.9,
        candidate_accuracy=0.5,
        rewriter="builtin",
    )


async def _trained(
    bus: NatsBus, learner: LearnerAgent, group_ids: set[str], timeout: float = 90
) -> list[LearnerStepped]:
    """Run ``learner`` until LearnerStepped events cover ``group_ids``; the policy steps."""
    stop = asyncio.Event()
    steps: list[LearnerStepped] = []

    async def watch() -> None:
        nonlocal steps
        async with asyncio.timeout(timeout):
            while True:
                steps = [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped)]
                if group_ids <= {g for s in steps for g in s.group_ids}:
                    break
                await asyncio.sleep(0.3)
        await asyncio.sleep(1.0)  # anything else it would train is trained by now
        stop.set()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(run_agents([learner], handle_signals=False, until=stop))
        tg.create_task(watch())
    return [s for s in steps if s.role == "policy"]


def _learner_cfg(loop_cfg: CoevoConfig, **extra) -> CoevoConfig:
    return load_config(
        overrides={
            **LOOP_OVERRIDES,
            "run.runs_dir": str(loop_cfg.run.runs_dir),
            "run.run_id": loop_cfg.run.run_id,
            "env.cache_dir": str(loop_cfg.env.cache_dir),
            "nats.url": loop_cfg.nats.url,
            "loop": "policy-only",
            "learner.batch_samples": 4,
            "bus.ack_wait_s": 5.0,
            "bus.in_progress_every_s": 1.0,
            "bus.fetch_timeout_s": 0.2,
            "bus.nak_backoff_s": [0.2],
            "agent.heartbeat_s": 1.0,
            **extra,
        }
    )


async def test_verdicts_are_per_proposal_and_survive_a_restart(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = _learner_cfg(loop_cfg)
    run = bus.run_id
    for event in (
        _scored(run, "cand-a", "c1", "candidate", policy_samples=_samples("cand-a")),
        _decided(run, "cand-a", "c1", accepted=False),
        _decided(run, None, "c1", accepted=False),  # a pre-check rejection of the same id, no group
        _scored(run, "cand-b", "c1", "candidate", policy_samples=_samples("cand-b")),
        _decided(run, "cand-b", "c1", accepted=True),
    ):
        await bus.publish_sync(event)
    first = await _trained(bus, LearnerAgent(bus, cfg), {"cand-b"})
    trained = {g for s in first for g in s.group_ids}
    assert "cand-b" in trained and "cand-a" not in trained  # the re-proposal's own verdict decides
    # a verdict given while no learner ran, for a group that arrives later: known after the restart
    await bus.publish_sync(_decided(run, "cand-c", "c2", accepted=True))
    await bus.publish_sync(_scored(run, "cand-c", "c2", "candidate", policy_samples=_samples("cand-c")))
    second = await _trained(bus, LearnerAgent(bus, cfg), {"cand-c"})
    assert {g for s in second for g in s.group_ids} >= {"cand-c"}
    assert "cand-a" not in {g for s in second for g in s.group_ids}


async def test_a_bad_sample_is_rejected_alone_and_a_candidate_without_verdict_is_let_go(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    cfg = _learner_cfg(loop_cfg, **{"learner.verdict_wait_s": 0.3, "bus.max_deliver": 2})
    run = bus.run_id
    await bus.publish_sync(_scored(run, "cand-x", "orphan", "candidate", policy_samples=_samples("cand-x")))
    await bus.publish_sync(_scored(run, "g-bad", "t1", policy_samples=_samples("g-bad", 3, bad=1)))
    await bus.publish_sync(_scored(run, "g-ok", "t2", policy_samples=_samples("g-ok", 2)))
    learner = LearnerAgent(bus, cfg)
    steps = await _trained(bus, learner, {"g-bad", "g-ok"})
    assert sum(s.samples for s in steps) == 5  # 3 + 2 good samples; the bad one alone was dropped
    assert learner.counters["samples.rejected.policy"] == 1
    assert learner.counters["groups.candidate_without_verdict"] == 1  # not held for ever, not trained
    assert "cand-x" not in {g for s in steps for g in s.group_ids}
    info = await bus.js.consumer_info(bus.stream, "learner")
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert await bus.events(["dead.lettered"]) == []


# ---- large events by reference -------------------------------------------------------------------------


async def test_a_group_larger_than_the_streams_message_limit_travels_by_reference(
    nats_url: str, loop_cfg: CoevoConfig
) -> None:
    cfg = _learner_cfg(loop_cfg, **{"stream.max_msg_size": 32 * 1024, "bus.inline_max_bytes": 8 * 1024})
    big = [s.model_copy(update={"prompt_token_ids": list(range(5, 400)) * 2}) for s in _samples("g-big", 64)]
    event = _scored("bigrun", "g-big", "t-big", policy_samples=big)
    assert len(encode(event)) > 4 * cfg.stream.max_msg_size
    async with await NatsBus.connect(nats_url, "bigrun", bus=cfg.bus, stream=cfg.stream) as bus:
        await bus.publish_sync(event)
        stored = [m async for _, _, m in bus.history(["group.scored"])]
        assert len(stored[0].data) < 1024 and is_claim(stored[0].headers)  # the stream holds a claim
        assert await bus.events(["group.scored"]) == [event]  # history follows it back to the whole event
        steps = await _trained(
            bus,
            LearnerAgent(bus, cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_id": "bigrun"})})),
            {"g-big"},
        )
        assert sum(s.samples for s in steps) == 64  # the consumer did too: every sample trained
        # a claim whose object is gone is dead-lettered with the reason, not trained
        store = await bus.payload_store()
        await store.delete(Claim.parse(stored[0].data).key)
        assert not [e async for _, e, _ in bus.history(["group.scored"]) if e is not None]
