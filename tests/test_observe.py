"""The aggregator, its sinks and the report, without NATS: events in, series, files and text out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coevo.cli.run import resume_command
from coevo.config import load_config
from coevo.loop import _HideFromConsole
from coevo.observe.aggregate import Aggregator, ConsumerInfo
from coevo.observe.closing import (
    describe,
    health_warnings,
    judge_warning,
    no_learning_reason,
    starving_warning,
    unvoted_warning,
)
from coevo.observe.series import CHARTS, SPECS, Point, Series, tb_tag
from coevo.observe.tally import SUMMARY_FIELDS, SUMMARY_TABLE, RunTally, summary_table
from coevo.schemas import (
    AgentStatus,
    DeadLettered,
    Event,
    GroupScored,
    LearnerStepped,
    RunFinished,
    Source,
    StepJudged,
    StepTaken,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
    TaskSpec,
    TrainingSample,
    TrajectoryCompleted,
    Vote,
    WeightsApplied,
)
from tests.conftest import REPO

SRC = Source(agent_id="tasks-1", role="tasks")
TASK = TaskSpec(
    task_id="qg-t0",
    family="quickgame",
    params={"seed": 1},
    knobs={"steps": 3, "distractors": 0, "slack": 1, "hints": 0},
)
HELD = TaskSpec(task_id="qg-h0", family="quickgame", params={"seed": 2}, knobs={"steps": 3}, split="heldout")


def ev(cls: type[Event], ts: float, **fields: Any) -> Event:
    return cls(run_id="r1", source=SRC, ts=1000.0 + ts, **fields)


def sample(i: int) -> TrainingSample:
    return TrainingSample(
        sample_id=f"s{i}",
        role="policy",
        prompt_token_ids=[1],
        response_token_ids=[2],
        logprobs=[-0.1],
        advantage=0.5,
        model_version=0,
        step_event_id=f"e{i}",
    )


def scored(ts: float, gid: str, acc: float, purpose: str = "train", reward: float = 0.0, **kw: Any) -> Event:
    return ev(
        GroupScored,
        ts,
        task_id=HELD.task_id if purpose == "eval" else TASK.task_id,
        group_id=gid,
        slot_id="heldout-0" if purpose == "eval" else "train-0",
        purpose=purpose,
        accuracy=acc,
        n_trajectories=4,
        policy_band_ok=True,
        judge_band_ok=True,
        mean_reward=reward,
        **kw,
    )


def a_run() -> list[Event]:
    """A small run: 6 train groups, a 2-group eval round, 2 learner steps, weights, a rewrite, agents."""
    child = TASK.model_copy(
        update={"task_id": "qg-t0__v1", "parent_id": "qg-t0", "version": 1, "knobs": {**TASK.knobs, "steps": 4}}
    )
    events: list[Event] = [
        ev(TaskScheduled, 0, task=TASK, slot_id="train-0", group_id="g-1", n_rollouts=4),
        ev(
            StepTaken,
            0.5,
            trajectory_id="g-1-r0",
            task_id="qg-t0",
            group_id="g-1",
            step_index=0,
            observation="o",
            action_text="go north",
            policy_version=0,
        ),
        ev(
            StepJudged,
            0.6,
            step_event_id="e1",
            trajectory_id="g-1-r0",
            task_id="qg-t0",
            group_id="g-1",
            step_index=0,
            votes=[
                Vote(index=0, value=1, status="ok"),
                Vote(index=1, value=None, status="error", rationale="timeout", cost_usd=0.01),
            ],
        ),
        ev(
            TrajectoryCompleted,
            0.7,
            trajectory_id="g-1-r0",
            task_id="qg-t0",
            group_id="g-1",
            outcome="won",
            num_steps=1,
            policy_versions=[0],
        ),
    ]
    for i, acc in enumerate([0.25, 0.5, 0.5, 0.75, 0.75, 1.0]):
        events.append(
            scored(
                1 + i,
                f"g-{i + 1}",
                acc,
                reward=acc - 0.5,
                judge_process_accuracy=0.5 + i / 20,
                judge_outcome_accuracy=0.6,
                judge_consistency=0.3,
                judge_vote_positive=round(0.6 - i / 10, 2),
                judge_steps_silent=i / 5,
                steps_labelled_good=0.8,
                trajectory_ids=["g-1-r0"] if i == 0 else [],
                policy_samples=[sample(i)] if acc < 1 else [],
            )
        )
    events += [
        ev(TaskScheduled, 7, task=HELD, slot_id="heldout-0", group_id="eval1-a", n_rollouts=4, purpose="eval"),
        ev(TaskScheduled, 7, task=HELD, slot_id="heldout-0", group_id="eval1-b", n_rollouts=4, purpose="eval"),
        scored(8, "eval1-a", 0.5, "eval"),
        scored(9, "eval1-b", 1.0, "eval"),
        ev(
            LearnerStepped,
            10,
            role="policy",
            version=1,
            samples=3,
            tokens=30,
            loss=0.5,
            kl=0.01,
            clip_fraction=0.1,
            mismatch_kl=0.02,
            mismatch_kl_current=0.001,
            staleness_histogram={"0": 2, "1": 1},
            tokens_per_second=100.0,
            group_ids=["g-1"],
        ),
        ev(WeightsApplied, 11, role="policy", server="policy-a", version=1, pause_ms=12.5),
        ev(WeightsApplied, 11.5, role="policy", server="vllm-b", version=1, pause_ms=40.0, transport="gloo"),
        ev(WeightsApplied, 11.6, role="policy", server="vllm-b", version=1, pause_ms=0.0, ok=False, error="x"),
        ev(
            TaskRewritten,
            12,
            slot_id="train-0",
            parent=TASK,
            candidate=child,
            direction="harder",
            rewriter="builtin",
            precheck_ok=True,
        ),
        ev(
            TaskDecided,
            13,
            slot_id="train-0",
            parent_id="qg-t0",
            candidate_id="qg-t0__v1",
            direction="harder",
            accepted=True,
            reason="in band",
            parent_accuracy=1.0,
            candidate_accuracy=0.5,
            rewriter="builtin",
        ),
        ev(TaskScheduled, 14, task=child, slot_id="train-0", group_id="g-7", n_rollouts=4),
        ev(
            AgentStatus,
            15,
            agent_id="judge-1",
            role="judge",
            state="running",
            uptime_s=15,
            counters={"restarts.main": 2, "judge.handled": 5},
        ),
        ev(
            AgentStatus,
            15.2,
            agent_id="policy-1",
            role="policy",
            state="running",
            uptime_s=15,
            counters={"endpoint.tokens.reused": 5, "endpoint.tokens.diverged": 1},
        ),
        ev(
            AgentStatus,
            15.4,
            agent_id="policy-1",
            role="policy",
            state="running",
            uptime_s=16,
            counters={"endpoint.tokens.reused": 7, "endpoint.tokens.diverged": 2},
        ),
        ev(
            DeadLettered,
            16,
            original_subject="coevo.r1.ev.step.taken",
            consumer="judge",
            reason="bad",
            raw=b"x",
            delivery_count=3,
        ),
        ev(
            LearnerStepped,
            20,
            role="policy",
            version=2,
            samples=2,
            tokens=20,
            loss=0.25,
            kl=0.02,
            clip_fraction=0.0,
            mismatch_kl=0.01,
            staleness_histogram={"1": 2},
            tokens_per_second=120.0,
            entropy=0.4,
        ),
    ]
    return events


def fold(events: list[Event]) -> tuple[Aggregator, list[Point]]:
    agg = Aggregator(tick_s=5.0)
    points = [p for i, e in enumerate(events, 1) for p in agg.add(e, i)]
    return agg, points + agg.finish()


def values(points: list[Point], key: str) -> list[float]:
    return [p.value for p in points if p.key == key]


def test_the_aggregator_turns_events_into_every_series() -> None:
    agg, points = fold(a_run())
    assert values(points, "success_train") == [0.25, 0.5, 0.5, 0.75, 0.75, 1.0]
    assert values(points, "train_groups_mixed") == [1.0, 1.0, 1.0, 1.0, 1.0, 0.8333]  # the last group all won
    assert values(points, "success_heldout") == [0.75]  # emitted once its round is complete
    assert len(values(points, "reward_std")) == 5
    assert values(points, 'learner_loss{role="policy"}') == [0.5, 0.25]
    assert [p.step for p in points if p.name == "learner_loss"] == [1, 2]  # the step is the version
    assert values(points, 'learner_staleness_mean{role="policy"}') == [0.3333, 1.0]
    assert values(points, 'learner_entropy{role="policy"}') == [0.4]  # the first step did not report one
    assert values(points, 'learner_mismatch_kl_current{role="policy"}') == [0.001]  # the second had no sample of v1
    assert values(points, 'weights_pause_ms{role="policy",server="vllm-b",transport="gloo"}') == [40.0]
    assert values(points, 'weights_apply_failures_total{role="policy",server="vllm-b"}') == [1.0]
    assert values(points, 'task_difficulty{slot="train-0"}')[-1] > values(points, 'task_difficulty{slot="train-0"}')[0]
    assert values(points, "rewrites_proposed_total")[-1] == 1 and values(points, "rewrites_accepted_total")[-1] == 1
    assert values(points, "judge_errors_total")[-1] == 1 and values(points, "judge_cost_usd_total")[-1] == 0.01
    assert values(points, 'dead_letters_total{consumer="judge"}') == [1.0]
    assert values(points, 'agent_restarts_total{agent="judge-1"}') == [2.0]
    assert values(points, 'endpoint_prompts_total{tokens="diverged"}')[-1] == 2  # prefix breaks, not 1 + 2
    assert values(points, 'endpoint_prompts_total{tokens="reused"}')[-1] == 7
    assert values(points, 'learner_staleness_samples_total{role="policy",staleness="1"}')[-1] == 3
    assert values(points, "trajectories_per_second") and values(points, "judge_process_accuracy")
    assert {p.name for p in points} <= set(SPECS) and {s.chart for s in SPECS.values()} <= set(CHARTS)
    # the views of the pages
    state = agg.state_json()
    slot = next(s for s in state["slots"] if s["slot_id"] == "train-0")
    assert slot["task_id"] == "qg-t0__v1" and slot["accepted"] == 1
    assert state["rewrites"][0]["accepted"] is True and state["rewrites"][0]["reason"] == "in band"
    assert state["agents"][0]["restarts"] == 2 and state["dead_letters"][0]["consumer"] == "judge"
    traj = agg.trajectories.as_list()[0]
    assert traj["learner_version"] == 1 and traj["accuracy"] == 0.25  # trained by step 1, group accuracy


def test_same_events_same_points_and_the_summary_matches_the_tally() -> None:
    events = a_run()
    _, first = fold(events)
    _, again = fold(events)
    assert first == again
    agg, _ = fold(events)
    tally = RunTally()
    for e in events:
        tally.add(e)
    assert agg.summary(20.0) == tally.summary("r1", 20.0).model_dump()
    assert agg.summary(20.0)["heldout_success_end"] == 0.75
    summary = tally.summary("r1", 20.0)
    assert (summary.policy_mismatch_kl_max, summary.policy_mismatch_kl_current_max) == (0.02, 0.001)
    s = tally.summary("r1", 20.0)  # 6 groups with votes: a quarter is the first or the last group
    assert (s.judge_vote_positive_start, s.judge_vote_positive) == (0.6, 0.1)
    assert (s.judge_steps_silent_start, s.judge_steps_silent) == (0.0, 1.0)
    assert s.steps_labelled_good == 0.8
    assert (s.policy_entropy_start, s.policy_entropy) == (0.4, 0.4)  # one policy step reported an entropy


def test_consumer_infos_become_series_and_rows() -> None:
    agg = Aggregator()
    agg.add(ev(TaskScheduled, 0, task=TASK, slot_id="train-0", group_id="g-1", n_rollouts=4), 1)
    points = agg.add_consumers([ConsumerInfo("judge", pending=7, ack_pending=3)], wall=1010.0)
    assert {p.key: p.value for p in points} == {
        'consumer_pending{consumer="judge"}': 7.0,
        'consumer_ack_pending{consumer="judge"}': 3.0,
    }
    assert points[0].t == 10.0 and agg.state_json()["consumers"][0]["pending"] == 7


def test_a_series_stays_bounded_and_keeps_its_latest_point() -> None:
    s = Series("success_train", (), cap=100)
    for i in range(10_000):
        s.append(float(i), float(i))
    assert len(s.points) < 100 and s.visible()[-1] == (9999.0, 9999.0)
    assert s.points[0] == (0.0, 0.0) and s.count == 10_000


def test_summary_fields_are_documented() -> None:
    """docs/observability.md's summary table is the one generated from RunSummary's descriptions."""
    doc = (REPO / "docs" / "observability.md").read_text()
    start, end = doc.index(SUMMARY_TABLE[0]), doc.index(SUMMARY_TABLE[1]) + len(SUMMARY_TABLE[1])
    assert doc[start:end] == summary_table(), (
        "regenerate: python -c 'from coevo.observe.tally import summary_table; print(summary_table())'"
    )
    assert set(RunTally().summary("r", 1.0).model_dump()) == set(SUMMARY_FIELDS)
    documented = set(re.findall(r"^\| `([a-z_0-9]+)` \|", doc, re.MULTILINE))
    assert set(SPECS) <= documented, set(SPECS) - documented  # and every series


def test_the_human_summary_says_what_improved_and_warns_without_a_learner_step() -> None:
    cfg = load_config()
    summary = {
        **RunTally().summary("r1", 90.0).model_dump(),
        "policy_success_start": 0.25,
        "policy_success_end": 0.75,
        "policy_success_change": {"groups": (6, 6), "low": 0.4, "high": 0.6},  # improved: above 0 (#39)
        "learner_steps": 3,
        "groups_scored": 30,
    }
    text = describe(summary, cfg, {"report": "runs/r1/report/index.html"})
    assert "policy success on train groups: 0.25 -> 0.75 (improved, +0.50" in text
    assert "report:" in text and "warning" not in text
    assert text.startswith("Run r1 finished: 3 policy") and "interrupted" not in text
    resume = resume_command(["run", "--minutes", "5", "--run-id", "r1", "--set", "policy.n=4"])("r1")
    stopped = describe(summary, cfg, {"resume": resume}, interrupted="SIGINT")
    assert stopped.startswith("Run r1 was interrupted (SIGINT) before its budget: 3 policy")
    assert "\n  resume:      coevo run --minutes 5 --set policy.n=4 --resume r1" in stopped
    assert resume_command(["run", "--resume=r1", "--base", "m b"])("r1") == "coevo run --base 'm b' --resume r1"
    # why held-out success is missing, and what to change
    assert f"one runs after every {cfg.tasks.eval_every} train groups and this run scored 30; --set" in text
    external = load_config(overrides={"env.family": "external"})
    assert "there are no held-out tasks; --env.tasks_from FAMILY" in describe(summary, external, {})
    one = {**summary, "heldout_success_start": 0.19, "heldout_success_end": 0.19, "heldout_success_rounds": [0.19]}
    assert (
        "0.19 -> 0.19 (+0.00, one window: nothing to compare; first vs last evaluation round, fixed tasks; one "
        "round only: --set tasks.eval_every=N" in describe(one, cfg, {})
    )
    idle = {
        **RunTally().summary("r1", 30.0).model_dump(),
        "groups_scored": 4,
        "policy_samples": 0,
        "train_groups_with_samples": 0,
    }
    assert "every rollout won or every one lost" in (no_learning_reason(idle, cfg) or "")
    few = {**idle, "policy_samples": 5, "train_groups_with_samples": 2}
    assert f"fewer than learner.batch_samples = {cfg.learner.batch_samples}" in describe(few, cfg, {})
    by_groups = load_config(overrides={"learner.batch_groups": 8})
    assert "learner.batch_groups = 8 groups were scored" in (no_learning_reason(few, by_groups) or "")
    # a judge that failed every vote is named, not the run's length
    unscored = {**idle, "groups_scored": 0, "judge_errors": 96, "judge_calls": 0}
    failing = no_learning_reason(unscored, cfg) or ""
    assert "96 of the judge's 96 votes failed" in failing and "--minutes" not in failing
    assert "too short" in (no_learning_reason({**unscored, "judge_errors": 0}, cfg) or "")
    # a long curve: its length, its ends and its extremes, in words
    many = {**one, "heldout_success_rounds": [0.2, 0.1, 0.3, 0.3, 0.9, 0.4, 0.5, 0.5, 0.6, 0.7]}
    assert "; 10 rounds, first and last four 0.20 0.10 0.30 0.30 0.50 0.50 0.60 0.70, lowest 0.10, highest 0.90" in (
        describe(many, cfg, {})
    )


def test_the_human_summary_warns_when_the_learner_starves_at_the_end() -> None:
    tally = RunTally()
    for i in range(100):  # the first fifth mixed, then every group won
        tally.train.append(0.5 if i < 20 else 1.0)
    tally.entropy.extend([0.4] * 10 + [0.01] * 10)
    tally.learner_steps = 20
    summary = tally.summary("r1", 600.0).model_dump()
    assert summary["train_groups_unanimous_end"] == 1.0 and summary["policy_entropy"] == pytest.approx(0.01)
    text = describe(summary, load_config(), {})
    assert "warning: the learner was starving at the end: 100% of the last 20 train groups" in text
    assert "fell from 0.40 to 0.01 nats" in text and "learner.entropy_target" in text
    steady = {**summary, "policy_entropy": 0.3}  # starving without a collapse: no advice about the entropy
    assert "learner.entropy_target" not in (starving_warning(steady) or "") and starving_warning(steady)
    tally.train[-1] = 0.5  # 19 of 20 unanimous: 95 % still warns; a shorter run does not
    assert starving_warning(tally.summary("r1", 600.0).model_dump())
    assert starving_warning({**summary, "groups_scored": 40}) is None


def test_the_summary_says_when_the_judge_lagged_the_policy() -> None:
    """Steps scored without votes (stragglers): their share of the scored steps, and a warning past 25 %."""
    from tests.samples import sample_events

    group = next(e for e in sample_events("r1") if isinstance(e, GroupScored))
    tally = RunTally()
    for i in range(4):  # 4 groups of 40 steps; 15 of each scored without votes
        steps = [f"g{i}-s{j}" for j in range(40)]
        tally.add(group.model_copy(update={"group_id": f"g{i}", "step_event_ids": steps, "stragglers": steps[:15]}))
    tally.counts["step.taken"] = 160
    summary = tally.summary("r1", 600.0).model_dump()
    assert summary["steps_without_votes"] == 0.375
    cfg = load_config(overrides={"scorer.vote_timeout_s": 45.0})
    text = unvoted_warning(summary, cfg) or ""
    assert text.startswith("the judge lagged the policy: 38% of the steps") and "vote_timeout_s = 45 s" in text
    assert "warning: the judge lagged" in describe(summary, cfg, {})
    assert unvoted_warning({**summary, "steps_without_votes": 0.25}, cfg) is None  # at the bound: no warning
    assert unvoted_warning({**summary, "events": {"step.taken": 99}}, cfg) is None  # too few steps to say
    assert RunTally().summary("r1", 1.0).steps_without_votes is None  # no group scored


def test_the_summary_names_a_judge_that_collapsed_onto_one_vote() -> None:
    """The 15-minute ladder's trained judges (docs/benchmarks.md): +1 on 0.3 % of the steps, 99 % silent."""
    from tests.samples import sample_events

    group = next(e for e in sample_events("r1") if isinstance(e, GroupScored))
    tally = RunTally()
    for i in range(8):  # the first quarter judges; the rest votes -1 everywhere and hears nothing
        late = i >= 2
        tally.add(
            group.model_copy(
                update={
                    "group_id": f"g{i}",
                    "judge_vote_positive": 0.003 if late else 0.25,
                    "judge_steps_silent": 0.99 if late else 0.45,
                }
            )
        )
    tally.judge_steps = 11
    summary = tally.summary("r1", 900.0).model_dump()
    assert summary["judge_vote_positive"] == pytest.approx(0.003) and summary["judge_steps_silent"] == 0.99
    text = judge_warning(summary) or ""
    assert text.startswith("the judge collapsed: it voted +1 on 0.3% of the steps in the last quarter (25% in")
    assert "99% of its steps were silent" in text and "warning: the judge collapsed" in describe(
        summary, load_config(), {}
    )
    assert judge_warning({**summary, "judge_vote_positive": 0.995})  # onto +1: the same
    assert judge_warning({**summary, "judge_vote_positive": 0.05}) is None  # still votes both ways
    assert judge_warning({**summary, "judge_steps_silent": 0.9}) is None  # still hears most steps
    assert judge_warning({**summary, "judge_learner_steps": 0}) is None  # a fixed judge is not trained to collapse


def _policy_step(version: int, ts: float, entropy: float) -> LearnerStepped:
    """tests.samples' policy step (16 samples, 100 tokens) at 100 tokens a second: 1 s of its own."""
    from tests.samples import sample_events

    step = next(e for e in sample_events("r1") if isinstance(e, LearnerStepped))
    return step.model_copy(update={"version": version, "ts": ts, "entropy": entropy, "tokens_per_second": 100.0})


def _other(ts: float) -> LearnerStepped:
    return _policy_step(0, ts, 0.5).model_copy(update={"samples": 0, "role": "judge"})  # no policy step


def test_the_summary_names_a_collapse_and_the_longest_wait_for_a_batch() -> None:
    tally = RunTally()
    tally.add(_other(1000.0))  # the run's first event
    # steps at 60, 90, 120 s, then none for 250 s, then two more; each step took 1 s (100 tokens at 100/s),
    # and the entropy falls under the floor
    times, entropies = [60.0, 90.0, 120.0, 370.0, 400.0], [0.4, 0.3, 0.2, 0.03, 0.02]
    for v, (ts, h) in enumerate(zip(times, entropies, strict=True), 1):
        tally.add(_policy_step(v, 1000.0 + ts, h))
    tally.add(_other(1450.0))  # the last
    summary = tally.summary("r1", 450.0).model_dump()
    assert summary["policy_step_gap_max_s"] == 249.0 and summary["policy_step_gap_where"] == "after version 3"
    assert summary["policy_entropy_min"] == 0.02
    warned = health_warnings(summary)
    assert len(warned) == 2
    assert "entropy ended at 0.020" in warned[0] and "lowest batch 0.020" in warned[0]
    assert "went 249 s without a step (after version 3)" in warned[1]
    assert "the policy collapsed" in describe(summary, load_config(), {})
    steady = {**summary, "policy_entropy": 0.3, "policy_step_gap_max_s": 119.0}
    assert health_warnings(steady) == []
    assert health_warnings({**summary, "learner_steps": 0}) == []  # no step at all: no_learning_reason's case
    first = RunTally()
    first.add(_other(0.0))
    first.add(_policy_step(1, 201.0, 0.5))
    assert first.summary("r", 201.0).policy_step_gap_max_s == 200.0
    assert first.summary("r", 201.0).policy_step_gap_where == "before the first step"
    # a resumed run: the hours between its sessions are no wait; the second session's own waits count
    first.add(RunFinished(run_id="r", source=SRC, ts=230.0))
    first.add(_other(9000.0))
    first.add(_policy_step(2, 9031.0, 0.5))
    first.add(_other(9100.0))
    resumed = first.summary("r", 100.0)
    assert resumed.policy_step_gap_max_s == 200.0 and resumed.policy_step_gap_where == "before the first step"
    first.add(_other(9400.0))  # the second session's open wait: 369 s after its last step
    assert first.summary("r", 400.0).policy_step_gap_where == "after the last step"
    assert first.summary("r", 400.0).policy_step_gap_max_s == 369.0


def test_the_summary_says_where_the_rewriters_candidates_landed() -> None:
    """Every verdict of the real gate (``accept_rewrite``, band 0.2..0.8) read back from the event alone."""
    from coevo.algorithm.scoring import accept_rewrite

    cases = [  # direction, parent accuracy, candidate accuracy (None: refused before any rollout), where it landed
        ("harder", 0.9, 0.5, "accepted"),
        ("harder", 0.9, 0.1, "too_hard"),
        ("harder", 0.875, 0.0, "unsolved"),
        ("harder", 0.8, 0.9, "not_harder"),
        ("harder", 0.8, 0.8, "not_harder"),
        ("easier", 0.1, 0.5, "accepted"),
        ("easier", 0.0, 0.125, "accepted"),  # easier need not reach the band: only rise and stay under its top
        ("easier", 0.1, 0.9, "too_easy"),
        ("easier", 0.125, 0.125, "not_easier"),
        ("easier", 0.125, None, "unmeasured"),
    ]
    tally = RunTally()
    for direction, parent, candidate, _ in cases:
        accepted, reason = (
            (False, "precheck failed") if candidate is None else accept_rewrite(direction, parent, candidate)
        )
        tally.add(
            TaskDecided(
                run_id="r1",
                source=SRC,
                slot_id="s",
                parent_id="p",
                candidate_id="c",
                direction=direction,
                accepted=accepted,
                reason=reason,
                parent_accuracy=parent,
                candidate_accuracy=candidate,
                rewriter="builtin",
            )
        )
    summary = tally.summary("r1", 60.0).model_dump()
    assert summary["rewrites_decided"] == {
        "harder": {"accepted": 1, "not_harder": 2, "too_hard": 1, "unsolved": 1},
        "easier": {"accepted": 2, "not_easier": 1, "too_easy": 1, "unmeasured": 1},
    }
    assert summary["rewrites_accepted"] == 3
    assert (
        "(harder: 2 not harder, 1 accepted, 1 too hard, 1 unsolved; easier: 2 accepted, 1 not easier, 1 too easy, "
        "1 unmeasured)" in describe(summary, load_config(), {})
    )
    assert RunTally().summary("r2", 1.0).rewrites_decided == {}


def _beat(agent: str, role: str, **work: int) -> AgentStatus:
    counters = {"emitted.step.taken": 5, **{f"engine.{k}": v for k, v in work.items()}}
    return AgentStatus(
        run_id="r1", source=SRC, agent_id=agent, role=role, state="running", uptime_s=1.0, counters=counters
    )


def test_the_summary_says_where_the_compute_went() -> None:
    """Engines' work comes from their agents' heartbeats (each a total: the last one counts), the learner's
    from its steps' own time; shares are of the run's wall clock, per role."""
    tally = RunTally()
    tally.add(_beat("policy-a", "policy", busy_ms=10_000, rows=5, tokens=20_000, padding=1_000))
    tally.add(_beat("policy-a", "policy", busy_ms=40_000, rows=50, tokens=80_000, padding=8_000))
    tally.add(_beat("judge-a", "judge", busy_ms=20_000, rows=40, tokens=30_000, padding=0))
    tally.add(_beat("judge-b", "judge", busy_ms=10_000, rows=10, tokens=30_000, padding=3_000))  # a second judge
    tally.add(_beat("tasks-1", "tasks"))  # no engine: not a row
    for v in (1, 2, 3):
        tally.add(_policy_step(v, 10.0 * v, 0.5))  # 100 tokens at 100 a second: 1 s each
    summary = tally.summary("r1", 100.0).model_dump()
    assert summary["busy_share"] == {"judge engine": 0.3, "policy engine": 0.4, "learner": 0.03}
    assert summary["engine_tokens_per_s"] == {"policy": 2000.0, "judge": 2000.0}
    assert summary["engine_padding_share"] == {"policy": 0.1, "judge": 0.05}
    line = "  busy: judge engine 30% (2,000 tokens/s, 5% padding), policy engine 40% (2,000 tokens/s, 10% padding), "
    assert line + "learner 3% of the run (overlapping on shared cores)" in describe(summary, load_config(), {})
    quiet = RunTally().summary("r2", 10.0).model_dump()  # remote servers only, no learner step
    assert quiet["busy_share"] == {} and "busy:" not in describe(quiet, load_config(), {})


def test_the_console_shows_what_a_person_acts_on_and_the_log_file_the_rest() -> None:
    import logging

    def shown(event: str, level: int = logging.INFO) -> bool:
        record = logging.LogRecord("coevo.x", level, "", 0, {"event": event, "counters": {}}, None, None)
        return _HideFromConsole().filter(record)

    assert not shown("agent.stopped") and not shown("learner.checkpoint") and not shown("weights.transferred")
    assert shown("run.started") and shown("policy.endpoint") and shown("progress") and shown("learner.resumed")
    assert shown("learner.checkpoint", logging.WARNING) and shown("consumer.recreated", logging.ERROR)


# ---- sinks ----------------------------------------------------------------------------------------


def test_tensorboard_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from coevo.observe.sinks import TensorBoardSink

    _, points = fold(a_run())
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(points)
    sink.close()
    sink.close()  # idempotent
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [s.value for s in acc.Scalars("success/success_train")] == [0.25, 0.5, 0.5, 0.75, 0.75, 1.0]
    assert [s.step for s in acc.Scalars("loss/learner_loss/policy")] == [1, 2]
    assert (
        tb_tag("weights_pause_ms", (("role", "policy"), ("server", "a/b"), ("transport", "disk")))
        == "weights/weights_pause_ms/policy/a_b/disk"
    )


WANDB_CHILD = """
import json, sys
from pathlib import Path
from coevo.observe import sinks
from coevo.observe.series import Point
points = [Point(n, tuple(map(tuple, labels)), t, v, step, wall) for n, labels, t, v, step, wall in json.loads(sys.argv[2])]
for s in sinks.make_sinks(Path(sys.argv[1]), "r1", tensorboard=False, wandb=True, project="p"):
    s.write(points)
    s.close()
"""


def test_wandb_sink_logs_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real wandb, offline (no network): once the sink is closed, the run's files hold what was logged.
    In a process of its own, as a run is: wandb keeps process-wide state (its service, console hooks)."""
    pytest.importorskip("wandb", reason="wandb is an optional extra (coevo[wandb]); the dev extra installs it")
    from coevo.observe import sinks

    _, points = fold(a_run())
    shown = [[p.name, p.labels, p.t, p.value, p.step, p.wall] for p in points[:3]]
    env = {**os.environ, "WANDB_SILENT": "true"}
    done = subprocess.run(
        [sys.executable, "-c", WANDB_CHILD, str(tmp_path), json.dumps(shown)], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    (log,) = (tmp_path / "wandb").glob("offline-run-*-r1/run-r1.wandb")  # the offline log `wandb sync` uploads
    data = log.read_bytes()  # its history records hold each logged key and value (protobuf, as text)
    for p in points[:3]:
        tag, value = sinks.tb_tag(p.name, p.labels).encode(), json.dumps(p.value).encode()
        assert tag in data and value in data, (tag, value, len(data))
    monkeypatch.setattr(sinks, "wandb_available", lambda: False)
    assert sinks.make_sinks(tmp_path, "r1", tensorboard=False, wandb=True) == []  # warned, not required


def test_prometheus_exposition_parses() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from coevo.observe.exposition import registry_for

    agg, _ = fold(a_run())
    text = generate_latest(registry_for(aggregator=agg)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["coevo_success_train"].samples[0].value == 1.0
    pause = {s.labels["server"]: s.value for s in families["coevo_weights_pause_ms"].samples}
    assert pause == {"policy-a": 12.5, "vllm-b": 40.0}
    assert families["coevo_rewrites_accepted"].type == "counter"
    kinds = {s.labels["kind"] for s in families["coevo_events"].samples}
    assert {"group.scored", "learner.stepped"} <= kinds


# ---- the report -------------------------------------------------------------------------------------


def test_report_of_a_run_has_the_plots_and_opens_alone(tmp_path: Path) -> None:
    from coevo.observe.report import write_report

    events = [*a_run(), ev(RunFinished, 30, summary={"learner_steps": 2})]
    agg, _ = fold(events)
    path = write_report(agg, tmp_path / "report")
    page = path.read_text()
    for plot in ("success", "reward", "judge", "kl", "weights", "loss", "staleness_hist"):
        assert f'id="plot-{plot}"' in page
        assert (tmp_path / "report" / "plots" / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'src="http' not in page and "<script" not in page
    assert "learner_steps" in page and SUMMARY_FIELDS["learner_steps"] in page


def test_report_of_bench_results(tmp_path: Path) -> None:
    from coevo.cli import main

    curve = [
        {"seconds": 0.0, "success": 0.2, "policy_version": 0},
        {"seconds": 60.0, "success": 0.7, "policy_version": 9},
    ]
    learn = tmp_path / "learn.json"
    learn.write_text(
        json.dumps(
            {
                "final_success": 0.7,
                "curves": {"integrated": curve, "outcome_only": curve},
                "integrated": {"learner_steps": 9},
            }
        )
    )
    ladder = tmp_path / "ladder.json"
    rung = {"train_success": 0.6, "heldout_success": 0.5, "judge_process_accuracy": 0.7, "curve": curve}
    ladder.write_text(json.dumps({"minutes_per_rung": 1, "rungs": {"policy-only": rung, "full": rung}}))
    assert main(["report", "--bench", str(learn)]) == 0
    assert main(["report", "--bench", str(ladder), "--out", str(tmp_path / "lad")]) == 0
    assert (tmp_path / "learn" / "plots" / "curves.png").exists()
    page = (tmp_path / "lad" / "index.html").read_text()
    assert 'id="plot-rungs"' in page and "rungs.full.train_success" in page


def test_progress_bar_counts(capsys: pytest.CaptureFixture[str]) -> None:
    from coevo.observe.progress import progress_bar

    with progress_bar("reading", 3, force=True) as bar:
        for _ in range(3):
            bar.advance()
    with progress_bar("quiet", 3) as bar:  # not a terminal: nothing drawn
        bar.advance()
    err = capsys.readouterr().err
    assert "reading" in err and "3/3" in err and "quiet" not in err


def test_trace_tree_shows_rationales_and_the_learner_step_number() -> None:
    from rich.console import Console

    from coevo.tools.trace_view import tree

    step = {
        "step": 0,
        "action": "go north",
        "result": "ok",
        "policy_version": 2,
        "reference_label": 1,
        "advantage": 0.5,
        "votes": [
            {"value": 1, "status": "ok", "rationale": "moves toward the key"},
            {"value": None, "status": "error", "rationale": "timeout"},
        ],
    }
    t = {
        "kind": "trajectory",
        "trajectory_id": "g-1-r0",
        "task_id": "qg-t0",
        "outcome": "won",
        "lineage": [],
        "steps": [step],
        "group": None,
        "learner_step": {"version": 7, "loss": 0.1, "ts": 0.0},
        "weights": {"applied": []},
    }
    console = Console(width=200, record=True)
    console.print(tree(t))
    text = console.export_text()
    assert "vote 0: +1: moves toward the key" in text and "vote 1: error: timeout" in text
    assert "trained by policy learner step 7" in text
