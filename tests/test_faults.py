"""Faults a days-long run meets (issue #24), each on the real server and each failing on the code
before its fix: batch-mates waiting behind a slow handler, a score that could not be stored, a
restarted tasks agent's versions."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coevo.config import CoevoConfig
from coevo.runtime.agent import Agent
from coevo.runtime.bus import NatsBus
from coevo.runtime.consumer import Subscription
from coevo.schemas import Source, TaskScheduled, TaskSpec
from tests.conftest import run_until
from tests.test_learner_options import _lane
from tests.test_training import choice_samples, tiny  # noqa: F401  (the module-scoped model fixture)

SRC = Source(agent_id="test", role="tasks")


class Slow(Agent):
    """Handles one scheduled task every ``HANDLE_S`` seconds per worker; two workers, batches of 4."""

    role = "test-slow"
    HANDLE_S = 0.8

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.handled: list[tuple[str, int]] = []
        self.done = asyncio.Event()

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("test-slow", (TaskScheduled,), self.on_task, concurrency=2)]

    async def on_task(self, event: TaskScheduled, delivery: Any) -> None:
        await asyncio.sleep(self.HANDLE_S)
        self.handled.append((event.group_id, delivery.num_delivered))
        if len({g for g, _ in self.handled}) >= 4:
            self.done.set()


async def test_batch_mates_waiting_in_a_worker_are_kept_alive(bus: NatsBus, cfg: CoevoConfig) -> None:
    """One worker fetches all 4 messages and handles them one after the other: the last waits 2.4 s,
    longer than ack_wait (2 s), while the other worker's pull waits for anything redelivered. Each one
    waiting is kept in progress, so none is redelivered (and handled twice)."""
    cfg = cfg.model_copy(update={"bus": cfg.bus.model_copy(update={"fetch_batch": 8})})
    assert cfg.bus.ack_wait_s < 3 * Slow.HANDLE_S
    for i in range(4):
        await bus.publish(
            TaskScheduled(
                run_id=bus.run_id,
                source=SRC,
                task=TaskSpec(task_id=f"t{i}", family="quick"),
                group_id=f"g{i}",
                n_rollouts=1,
            )
        )
    await bus.flush()
    agent = Slow(bus, cfg)
    await run_until([agent], agent.done)
    assert sorted(agent.handled) == [(f"g{i}", 1) for i in range(4)]  # each once, on its first delivery
    info = await bus.js.consumer_info(bus.stream, "test-slow")
    assert info.num_redelivered == 0 and info.num_ack_pending == 0


async def test_a_group_whose_score_was_not_stored_is_scored_again(bus, cfg, monkeypatch) -> None:
    """#24: the scorer forgot a group as scored before its ``GroupScored`` was stored; when the store
    failed, the redelivered input was acknowledged as a scored group's and the group was lost until a
    restart. Now a group is remembered only once its score is stored: the first attempt fails here, the
    redelivery scores it."""
    import asyncio

    from coevo.agents.scorer import ScorerAgent
    from coevo.errors import PublishError
    from coevo.schemas import GroupScored, StepTaken, TaskScheduled, TrajectoryCompleted, new_id
    from tests.samples import sample_events

    cfg = cfg.model_copy(update={"scorer": cfg.scorer.model_copy(update={"reward": "outcome-only"})})
    proto = {type(e): e for e in sample_events(bus.run_id)}
    step = proto[StepTaken].model_copy(update={"event_id": new_id(), "group_id": "g-once", "step_index": 0})
    for e in (
        proto[TaskScheduled].model_copy(update={"event_id": new_id(), "group_id": "g-once", "n_rollouts": 1}),
        step,
        proto[TrajectoryCompleted].model_copy(
            update={
                "event_id": new_id(),
                "group_id": "g-once",
                "rollout_index": 0,
                "num_steps": 1,
                "trajectory_id": step.trajectory_id,
                "step_event_ids": [step.event_id],
            }
        ),
    ):
        await bus.publish_sync(e)
    failed = []
    real_raw, real_republish = bus.publish_raw, bus.republish

    async def publish_raw(subject: str, payload: bytes, msg_id: str) -> asyncio.Future[bool]:
        if subject.endswith(".group.scored") and not failed:
            failed.append(msg_id)
            future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            future.set_exception(PublishError(subject, msg_id, "injected: the stream is not there"))
            return future
        return await real_raw(subject, payload, msg_id)

    async def republish(p):  # the confirmed path
        if p.subject.endswith(".group.scored") and not failed:
            failed.append(p.event_id)
            raise PublishError(p.subject, p.event_id, "injected: the stream is not there")
        return await real_republish(p)

    monkeypatch.setattr(bus, "publish_raw", publish_raw)
    monkeypatch.setattr(bus, "republish", republish)

    async def scored() -> bool:
        return any(isinstance(e, GroupScored) for e in await bus.events(["group.scored"]))

    await run_until([ScorerAgent(bus, cfg)], scored)
    assert failed and [e.group_id for e in await bus.events(["group.scored"])] == ["g-once"]


async def test_a_restarted_tasks_agent_schedules_at_the_version_being_served(bus, cfg) -> None:
    """#24: after a restart the tasks agent labelled its groups version 0 until a new version was
    announced (and its weights subscription delivers only the newest announcement of either lane)."""
    from coevo.agents.tasks import TasksAgent
    from coevo.schemas import Source, TaskScheduled, WeightsPublished

    src = Source(agent_id="learner-1", role="learner")
    for role, version in (("policy", 6), ("policy", 7), ("judge", 3)):  # the judge's is the newest
        await bus.publish_sync(
            WeightsPublished(
                run_id=bus.run_id,
                source=src,
                role=role,
                version=version,
                path=f"/w/{role}{version}",
                sha256="0" * 64,
                bytes=1,
            )
        )
    agent = TasksAgent(bus, cfg)

    async def scheduled() -> bool:
        return bool(await bus.events(["task.scheduled"]))

    await run_until([agent], scheduled)
    scheduled = [e for e in await bus.events(["task.scheduled"]) if isinstance(e, TaskScheduled)]
    assert {e.source.model_version for e in scheduled} == {7}
    assert (agent.policy_version, agent.judge_version) == (7, 3)


async def test_a_publish_whose_ack_was_lost_is_sent_again_without_waiting_for_a_full_table(
    nats_url: str, run_id: str, cfg: CoevoConfig
) -> None:
    """#24: an unanswered publish was sent again only once the table of unacked publishes was full
    (or at a flush): a lost ack left it unconfirmed for as long as the process published little."""
    bus = await NatsBus.connect(
        nats_url, run_id, bus=cfg.bus.model_copy(update={"publish_ack_timeout_s": 0.5}), stream=cfg.stream
    )
    try:
        real_on_ack, dropped = bus._on_ack, []

        async def lose_first(msg: Any) -> None:
            if not dropped:
                dropped.append(msg.subject)  # the server stored it; its answer never arrives
                return
            await real_on_ack(msg)

        bus._on_ack = lose_first  # type: ignore[method-assign]
        first = TaskScheduled(
            run_id=run_id, source=SRC, task=TaskSpec(task_id="a", family="q"), group_id="g-a", n_rollouts=1
        )
        await bus.publish(first)
        async with asyncio.timeout(10):
            while not dropped:
                await asyncio.sleep(0.05)
        assert bus.inflight == 1
        await asyncio.sleep(0.6)  # past the ack timeout: the next publish (a heartbeat, say) sends it again
        await bus.publish(first.model_copy(update={"event_id": "second", "group_id": "g-b"}))
        async with asyncio.timeout(10):
            while bus.inflight:
                await asyncio.sleep(0.05)
        assert bus.stats.publish_retries >= 1 and bus.stats.duplicates >= 1  # stored once
        assert sorted(e.group_id for e in await bus.events(["task.scheduled"])) == ["g-a", "g-b"]
    finally:
        await bus.close()


async def test_a_republish_that_fails_leaves_the_rest_queued(nats_url: str, run_id: str, cfg: CoevoConfig) -> None:
    """#24: a failed republish dropped every failed publish queued after it. #36: and itself. Now:
    the ones behind it are stored without waiting on it, and the one no stream takes is sent again
    under its id until it failed ``bus.publish_retries`` + 1 times while the stream stored others,
    then dead-lettered with its reason: none is dropped silently, nothing is left at close."""
    from coevo.runtime.publishing import MSG_ID, _UnackedPublish
    from coevo.schemas import DeadLettered, encode, subject_for

    bus = await NatsBus.connect(
        nats_url,
        run_id,
        bus=cfg.bus.model_copy(update={"publish_ack_timeout_s": 0.5, "publish_retries": 0}),
        stream=cfg.stream,
    )
    try:
        events = [
            TaskScheduled(
                run_id=run_id, source=SRC, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
            )
            for i in range(2)
        ]
        nowhere = _UnackedPublish("coevo.nowhere.ev.task.scheduled", b"{}", "x", 0.0, {MSG_ID: "x"})  # no stream
        bus._failed = [nowhere] + [
            _UnackedPublish(subject_for(run_id, "task.scheduled"), encode(e), e.event_id, 0.0, {MSG_ID: e.event_id})
            for e in events
        ]
        await bus.flush(timeout_s=20)
        assert bus._failed == []
        stored = await bus.events()
        assert sorted(e.group_id for e in stored if isinstance(e, TaskScheduled)) == ["g0", "g1"]
        (letter,) = [e for e in stored if isinstance(e, DeadLettered)]
        assert letter.original_subject == "coevo.nowhere.ev.task.scheduled" and letter.headers[MSG_ID] == "x"
        assert "no stream answered" in letter.reason
    finally:
        await bus.close()
    assert bus.stats.unstored == 0


def test_a_benchs_agents_die_with_it(tmp_path) -> None:
    """#24: agents started by `coevo bench async` outlived the bench when it was stopped. The benches
    start them as below (``die_with_parent``); the bench is kill -9'd, its agent follows."""
    import os
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import asyncio, sys\n"
                "from coevo.runtime.proc import die_with_parent\n"
                "async def main():\n"
                "    child = await asyncio.create_subprocess_exec(sys.executable, '-c', 'import time; time.sleep(120)',"
                " preexec_fn=die_with_parent)\n"
                "    print(child.pid, flush=True)\n"
                "    await child.wait()\n"
                "asyncio.run(main())\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _ends(child, 5.0), "the child outlived its parent"


def _ends(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` is gone within ``within_s`` (killed if not)."""
    import os
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    os.kill(pid, 9)
    return False


def test_a_rank_whose_launcher_is_gone_before_it_starts_ends_at_once(tmp_path) -> None:
    """#24 (a bench stopped while torchrun started a group): the ranks asked to die with their launcher
    only once torch was imported, seconds after it was gone, and ran on as orphans holding the
    learner's consumer. ``coevo``'s entry point asks first; a parent gone by then ends the rank."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "t"}
    launcher = subprocess.run(
        ["sh", "-c", f"{sys.executable} -m coevo --help > {out} 2>&1 & echo $!"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )  # gone at once
    assert _ends(int(launcher.stdout), 20.0), "the rank outlived its launcher"
    assert out.read_text() == ""  # it never got to the command
    done = subprocess.run([sys.executable, "-m", "coevo", "--help"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "usage" in done.stdout  # a rank whose launcher lives runs as before


def test_a_candidate_refused_before_any_rollout_does_not_decide_its_later_groups() -> None:
    """#24: a pre-check failure (no group, no accuracy) was recorded under the candidate's id and
    rejected a later group of the same candidate, re-proposed and accepted."""
    from coevo.schemas import GroupScored, TaskDecided
    from coevo.training.learner import Verdicts
    from tests.samples import sample_events

    proto = {type(e): e for e in sample_events("r")}
    refused = proto[TaskDecided].model_copy(
        update={
            "candidate_id": "c1",
            "group_id": None,
            "accepted": False,
            "candidate_accuracy": None,
            "reason": "pre-check failed: x",
        }
    )
    group = proto[GroupScored].model_copy(update={"task_id": "c1", "group_id": "g9", "purpose": "candidate"})
    verdicts = Verdicts()
    verdicts.add(refused)
    assert verdicts.of(group) is None  # the group waits for its own verdict
    verdicts.add(refused.model_copy(update={"group_id": "g9", "accepted": True, "candidate_accuracy": 0.5}))
    assert verdicts.of(group) is True
    assert verdicts.of(group.model_copy(update={"group_id": "g10"})) is None  # another proposal's group: its own


def test_a_checkpoint_rewritten_at_its_version_is_never_missing(tmp_path, monkeypatch) -> None:
    """#24: sealing a directory over an existing one deleted the old one first; a crash before the
    rename left no checkpoint of that version. Now the two are swapped atomically: a crash at any
    point (here: where the old code renamed) leaves a whole one in place."""
    import os

    from coevo.weights import tensorfiles
    from coevo.weights.manifest import file_sha256, manifest_of

    final = tmp_path / "v000003"

    def written(content: str):
        tmp = tmp_path / ".tmp-v000003"
        tmp.mkdir()
        (tmp / "w.bin").write_text(content)
        return tmp, {"w.bin": {"bytes": len(content), "sha256": file_sha256(tmp / "w.bin")}}

    tmp, files = written("old")
    tensorfiles.seal(tmp, final, files, durable=True, version=3)
    tmp, files = written("new!")

    def crash(*_a: object, **_kw: object) -> None:
        raise OSError("the process died here")

    monkeypatch.setattr(os, "rename", crash)  # dies after the old one would have been deleted
    try:
        tensorfiles.seal(tmp, final, files, durable=True, version=3)
    except OSError:
        pass
    assert final.is_dir() and manifest_of(final) is not None, "no checkpoint of version 3 left"
    assert (final / "w.bin").read_text() == "new!" and not tmp.exists()  # swapped, the old one removed


# ---- the learner's lanes ----------------------------------------------------------------------------


def _state(lane: Any) -> tuple[list[Any], dict[str, Any]]:
    import copy

    return (
        [p.detach().clone() for p in lane.model.parameters()],
        copy.deepcopy({i: s for i, s in enumerate(lane.optimizer.state.values())}),
    )


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_batch_whose_later_optimiser_step_fails_is_trained_whole_or_not_at_all(tiny, tmp_path, inject) -> None:  # noqa: F811
    """#24: with minibatches x epochs > 1, a failure in the third optimiser step left the first two in
    the weights, and the retry trained the groups again: partial double training. Now the lane is
    as before the batch, and the retried batch gives the weights of one clean training."""

    samples = choice_samples(tiny, 8)
    warm = _lane(tiny, tmp_path / "a", minibatches=2, epochs=2)
    warm.step(samples[:4], ["warm"])  # optimiser state exists: it must come back too
    before, opt_before = _state(warm)
    inject({"lane.optimizer_step": {"after": 2, "times": 1}})
    with pytest.raises(Exception, match="fault injected"):
        warm.step(samples, ["g"])
    after, opt_after = _state(warm)
    assert _same(before, after), "the failed batch's first optimiser steps stayed in the weights"
    assert all(_same(list(opt_before[i].values())[1:], list(opt_after[i].values())[1:]) for i in opt_before)
    assert (warm.version, warm.steps_total, warm.has_consumed("g")) == (1, 4, False)
    warm.step(samples, ["g"])  # the retry (the fault fired once)

    clean = _lane(tiny, tmp_path / "b", minibatches=2, epochs=2)
    clean.step(samples[:4], ["warm"])
    clean.step(samples, ["g"])
    assert _same(_state(warm)[0], _state(clean)[0])  # trained once, exactly as without the fault
    assert warm.steps_total == clean.steps_total == 8


async def _learner_with_a_slow_step(bus: NatsBus, tiny: Any, tmp_path: Any, inject: Any) -> tuple[Any, Any, Any]:  # noqa: F811
    """A learner agent on the real bus with one real policy lane whose next step takes a second."""
    from coevo.training.learner import LaneQueue, LearnerAgent

    learner = LearnerAgent(bus, CoevoConfig(run={"runs_dir": tmp_path}))
    q = LaneQueue(_lane(tiny, tmp_path / "ckpt"))
    learner.lanes["policy"] = q
    samples = await asyncio.to_thread(choice_samples, tiny, 4)
    inject({"lane.optimizer_step": {"delay_s": 1.0, "error": False, "times": 1}})
    return learner, q, samples


async def test_a_redelivery_during_the_running_step_joins_it(bus: NatsBus, tiny, tmp_path, inject) -> None:  # noqa: F811
    """#24: a group redelivered while its step ran was queued again and trained twice."""
    learner, q, samples = await _learner_with_a_slow_step(bus, tiny, tmp_path, inject)
    first = learner.enqueue("policy", q, "g", samples)
    step = asyncio.create_task(learner.train("policy", q))
    while not q.training:
        await asyncio.sleep(0.01)
    again = learner.enqueue("policy", q, "g", samples)  # the redelivery, while the step runs
    await step
    assert again is first and not q.queued
    assert [e.group_ids for e in await bus.events(["learner.stepped"])] == [["g"]]
    assert q.lane.steps_total == 1 and "g" in q.undurable


async def test_a_lane_cancelled_mid_step_releases_the_batch_it_was_training(
    bus: NatsBus,
    tiny,  # noqa: F811
    tmp_path,
    inject,
) -> None:
    """#24: a failure of the other lane (or of main) while a step ran cancelled the lane with its batch
    in neither ``queued`` nor ``undurable``: those groups' handlers waited for ever (the ack floor
    pinned). Now cancellation waits for the step's thread, and the release fails the batch's futures
    (redelivered), trained or not."""
    from coevo.errors import Retry

    learner, q, samples = await _learner_with_a_slow_step(bus, tiny, tmp_path, inject)
    done = learner.enqueue("policy", q, "g", samples)
    main = asyncio.create_task(learner.main())
    while not q.training:
        await asyncio.sleep(0.01)
    main.cancel()  # what the TaskGroup does when the judge lane or main fails
    with pytest.raises(asyncio.CancelledError):
        await main
    assert done.done(), "the group of the step running at the cancellation was never released"
    assert isinstance(done.exception(), Retry)
    assert q.lane.has_consumed("g")  # the thread finished its step: a redelivery waits for a checkpoint


def test_fault_rules_fire_as_written_and_a_wrong_field_is_named(inject, monkeypatch) -> None:
    from coevo.errors import ConfigError, InjectedFault
    from coevo.runtime import faults

    inject({"p": {"after": 2, "times": 2}, "other": {"rank": 1}})
    fired = []
    for i in range(6):
        try:
            faults.hit("p")
            faults.hit("other")  # rank 0 here: never
            faults.hit("not-a-point")
        except InjectedFault:
            fired.append(i)
    assert fired == [2, 3]  # after two passes, twice
    with pytest.raises(ConfigError, match="unknown field") as err:
        faults.parse('{"handler": {"delay": 1}}')
    assert err.value.field == "COEVO_FAULTS.handler"
    with pytest.raises(ConfigError, match="not JSON"):
        faults.parse("{")


def test_the_chaos_plan_gives_each_role_its_faults() -> None:
    from coevo.bench.chaos import KINDS, ChaosPlan, fault_rules

    every = ChaosPlan(faults=tuple(KINDS), hosts=3)
    assert set(fault_rules(every, "learner")) == {"claims.fetch", "lane.optimizer_step", "publish"}
    assert set(fault_rules(every, "policy")) == {"claims.fetch", "handler", "follower.load", "publish"}
    assert fault_rules(ChaosPlan(), "policy") == {}  # kill, node, garbage: nothing inside the agents
    with pytest.raises(ValueError, match="need hosts"):
        ChaosPlan(faults=("link_cut",))
    with pytest.raises(ValueError, match="unknown fault kinds"):
        ChaosPlan(faults=("meteor",))


async def test_a_scorer_whose_rebuild_meets_an_outage_waits_for_it_instead_of_exiting(bus: NatsBus, cfg) -> None:
    """#24 (chaos --hosts 3): the scorer's rebuild read the stream before the agent ran, unsupervised; a
    node down or a claim unreadable then ended the process (12 exits in 10 minutes, each a cold
    start). Now it is read again after the outage, and the agent runs."""
    import nats.js.errors

    from coevo.agents.scorer import ScorerAgent
    from coevo.errors import PayloadUnavailable
    from coevo.schemas import TaskScheduled
    from tests.samples import sample_events

    scheduled = next(e for e in sample_events(bus.run_id) if isinstance(e, TaskScheduled))
    await bus.publish_sync(scheduled)
    (sub,) = ScorerAgent(bus, cfg).subscriptions()
    puller = await bus.puller(sub.durable, sub.kinds)
    try:
        assert await puller.fetch(1, 2.0)  # delivered before a restart, never acknowledged
    finally:
        await puller.unsubscribe()
    scorer = ScorerAgent(bus, cfg)
    real, outages = (
        scorer.bus.js.consumer_info,
        [
            nats.js.errors.ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable"),
            PayloadUnavailable("claimed object unreadable now"),
        ],
    )

    async def consumer_info(*a: Any, **kw: Any) -> Any:
        if outages:
            raise outages.pop(0)
        return await real(*a, **kw)

    scorer.bus.js.consumer_info = consumer_info  # type: ignore[method-assign]
    try:
        task = asyncio.create_task(scorer.run())
        async with asyncio.timeout(30):
            while scorer.state != "running":
                assert not task.done(), task.exception()
                await asyncio.sleep(0.05)
        assert not outages and scorer.groups[scheduled.group_id].scheduled is not None
        assert scorer.counters["retried.scorer.rebuild"] == 2
        scorer.stop()
        await task
    finally:
        scorer.bus.js.consumer_info = real  # type: ignore[method-assign]


async def test_a_stop_ends_start_up_work_under_way_at_once(bus: NatsBus, cfg) -> None:
    """#24: a SIGTERM while the scorer rebuilt (a read of the stream during a partition, minutes) waited
    for the read: the bench's scorer outlived the bench. ``until_answered`` now cancels the work."""
    from coevo.agents.scorer import ScorerAgent

    scorer, started, cancelled = ScorerAgent(bus, cfg), asyncio.Event(), asyncio.Event()

    async def rebuild() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # a read that does not come back
        except asyncio.CancelledError:
            cancelled.set()
            raise

    scorer.rebuild = rebuild  # type: ignore[method-assign]
    task = asyncio.create_task(scorer.run())
    await asyncio.wait_for(started.wait(), 10)
    scorer.stop()
    await asyncio.wait_for(task, 5)
    assert cancelled.is_set() and scorer.state != "running"


async def test_a_stop_while_a_consumer_is_being_created_ends_it_at_once(bus: NatsBus, cfg) -> None:
    """#24 chaos: a policy told to stop while its consumer's creation waited on a node across a cut
    took 8 s (the request's timeout): the consumer drained only once it ran."""
    from coevo.runtime.consumer import Consumer, Subscription
    from coevo.schemas import Source, TaskScheduled

    creating = asyncio.Event()

    async def puller(*_a: Any, **_kw: Any) -> Any:  # the server does not answer
        creating.set()
        await asyncio.Event().wait()

    async def handler(_e: Any, _d: Any) -> None:
        raise AssertionError("nothing is delivered")

    consumer = Consumer(bus, Subscription("test-creating", (TaskScheduled,), handler), Source(agent_id="a", role="t"))
    real, bus.open_consumer = bus.open_consumer, puller  # type: ignore[method-assign]
    try:
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        await asyncio.wait_for(creating.wait(), 10)
        stop.set()
        await asyncio.wait_for(task, 2)
    finally:
        bus.open_consumer = real  # type: ignore[method-assign]
