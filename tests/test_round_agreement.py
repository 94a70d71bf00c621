"""Held-out step agreement in a run: every evaluation group's task gets a ``StepAgreementMeasured`` from the
policy agent, equal to what ``coevo bench``'s step agreement measures for the same path and weights, and the
summary, the dashboard's series and the tally read each round from those events. A real loop of tiny
models on a real nats-server."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from coevo.acting.ceiling import ceiling_path
from coevo.bench.steps import model_agreement
from coevo.config import CoevoConfig
from coevo.envs import make_family
from coevo.inference.clients import model_dir
from coevo.loop import build_agents, summarize
from coevo.observe.aggregate import Aggregator
from coevo.observe.tally import RunTally
from coevo.runtime.agent import run_agents
from coevo.runtime.bus import NatsBus
from coevo.schemas import GroupScored, Source, StepAgreementMeasured, TaskScheduled, TaskSpec
from tests.test_loop import wait_for

pytestmark = pytest.mark.slow


def _rounds(events: list) -> dict[str, list[str]]:
    """eval round -> its scheduled group ids."""
    out: dict[str, list[str]] = {}
    for e in events:
        if isinstance(e, TaskScheduled) and e.purpose == "eval":
            out.setdefault(e.group_id.split("-")[0], []).append(e.group_id)
    return out


def _measured(events: list) -> dict[str, StepAgreementMeasured]:
    """group id -> its first measure."""
    out: dict[str, StepAgreementMeasured] = {}
    for e in events:
        if isinstance(e, StepAgreementMeasured):
            out.setdefault(e.group_id, e)
    return out


async def test_every_evaluation_group_is_measured_as_the_bench_measures_it(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = loop_cfg.model_copy(update={"env": loop_cfg.env.model_copy(update={"n_heldout": 2})})
    assert cfg.policy.mode == "choice" and make_family(cfg.env).has_ceiling
    stop = asyncio.Event()

    def two_rounds_measured(events: list) -> bool:
        rounds, measured = _rounds(events), _measured(events)
        return sum(all(g in measured for g in groups) for groups in rounds.values()) >= 2

    async def until_done() -> None:
        await wait_for(bus, two_rounds_measured, timeout=300)
        stop.set()

    await asyncio.gather(run_agents(build_agents(bus, cfg), handle_signals=False, until=stop), until_done())
    events = await bus.events()
    rounds, measured = _rounds(events), _measured(events)
    assert len(rounds["eval0"]) == 2 and set(rounds["eval0"]) <= set(measured)
    family = make_family(cfg.env)
    tasks = {e.group_id: e.task for e in events if isinstance(e, TaskScheduled)}
    # round 0 is scheduled before any train group, so it is measured long before a first learner step
    # could be trained, published and applied: those are the base weights, which the bench loads from disk
    base = [m for g, m in measured.items() if g in rounds["eval0"]]
    assert {m.policy_version for m in base} == {0}
    for m in base:  # the same path, the same weights: the bench's number
        path = await ceiling_path(family, tasks[m.group_id], f"{m.group_id}-r0", cfg.policy)
        bench = await model_agreement(model_dir(cfg, "policy"), [[path]], cfg.policy, cfg.learner.dtype)
        assert m.states == len(path) > 0 and m.task_id == tasks[m.group_id].task_id
        assert m.agreement == pytest.approx(bench.sampled[0][0], abs=1e-4)
        # greedy: a near tie of a tiny model's labels may break the other way in a batch of other shape
        assert m.greedy == pytest.approx(bench.greedy[0][0], abs=1 / m.states + 1e-9)
    # the summary and the dashboard's series read each complete round's mean from the events
    complete = [r for r in sorted(rounds, key=lambda r: int(r[4:])) if all(g in measured for g in rounds[r])]
    means = [round(statistics.fmean(measured[g].agreement for g in rounds[r]), 4) for r in complete]
    summary = await summarize(bus, 0.0, 60.0)
    assert summary["heldout_agreement_rounds"] == means and len(means) >= 2
    assert summary["heldout_agreement_start"] == means[0] and summary["heldout_agreement_end"] == means[-1]
    agg = Aggregator()
    points = [p for e in events for p in agg.add(e) if p.name == "heldout_agreement"]
    assert [p.value for p in points] == means and [p.step for p in points] == [int(r[4:]) for r in complete]


SRC = Source(agent_id="policy-1", role="policy")
HELD = TaskSpec(task_id="qg-h0", family="quickgame", params={"seed": 2}, knobs={"steps": 3}, split="heldout")


def test_a_round_counts_once_every_group_of_it_is_measured_however_its_groups_are_interleaved() -> None:
    """The tasks agent schedules a round's groups one by one between other groups: a group measured (or
    scored) before the round's last one is scheduled does not make the round, nor does a second measure
    of a group; a group with an empty path counts, with no value."""

    def scheduled(group: str) -> TaskScheduled:
        return TaskScheduled(
            run_id="r", source=SRC, group_id=group, task=HELD, purpose="eval", n_rollouts=1, round_size=2
        )

    def measured(group: str, agreement: float | None, states: int = 4) -> StepAgreementMeasured:
        return StepAgreementMeasured(
            run_id="r", source=SRC, group_id=group, task_id="qg-h0", policy_version=0, states=states,
            agreement=agreement, greedy=None if agreement is None else 1.0,
        )  # fmt: skip

    def scored(group: str, accuracy: float) -> GroupScored:
        return GroupScored(
            run_id="r", source=SRC, task_id="qg-h0", group_id=group, accuracy=accuracy, n_trajectories=1,
            policy_band_ok=False, judge_band_ok=False, purpose="eval",
        )  # fmt: skip

    tally, agg = RunTally(), Aggregator()
    points = []

    def feed(*events: object) -> None:
        for e in events:
            tally.add(e)
            points.extend(p for p in agg.add(e) if p.name in ("heldout_agreement", "success_heldout"))

    feed(scheduled("eval0-a"), measured("eval0-a", 0.5), scored("eval0-a", 1.0), measured("eval0-a", 0.9))
    summary = tally.summary("r", 1.0)
    assert points == [] and summary.heldout_agreement_rounds == [] and summary.heldout_success_rounds == [1.0]
    # (an incomplete round stands in for the success rounds only while no round is complete, as before)
    feed(scheduled("eval0-b"), measured("eval0-b", None, states=0), scored("eval0-b", 0.0))
    assert [(p.name, p.value) for p in points] == [("heldout_agreement", 0.5), ("success_heldout", 0.5)]
    summary = tally.summary("r", 1.0)
    assert summary.heldout_agreement_rounds == [0.5] and summary.heldout_success_rounds == [0.5]
