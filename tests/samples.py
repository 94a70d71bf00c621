"""One valid instance of every event type (used by round-trip and schema tests)."""

from __future__ import annotations

from coevo.schemas import (
    EVENT_TYPES,
    AgentStatus,
    BudgetExceeded,
    DeadLettered,
    Event,
    GroupScored,
    LearnerStepped,
    RunFinished,
    Source,
    StepAgreementMeasured,
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
    WeightsPublished,
)


def sample_events(run_id: str) -> list[Event]:
    src = Source(agent_id="a-1", role="policy", model_version=3)
    task = TaskSpec(task_id="quick-1", family="quickgame", params={"seed": 1}, knobs={"steps": 3})
    child = task.model_copy(
        update={"task_id": "quick-1.v1", "parent_id": "quick-1", "version": 1, "knobs": {"steps": 4}}
    )
    sample = TrainingSample(
        sample_id="s1",
        role="policy",
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        logprobs=[-0.5],
        advantage=1.25,
        model_version=3,
        step_event_id="e1",
    )
    common = {"run_id": run_id, "source": src}
    events: list[Event] = [
        TaskScheduled(**common, task=task, slot_id="slot-0", group_id="g1", n_rollouts=8),
        TaskRewritten(
            **common,
            slot_id="slot-0",
            parent=task,
            candidate=child,
            direction="harder",
            summaries=["went the wrong way"],
            rewriter="builtin",
            moves=1,
            moves_wanted=2,
            precheck_ok=True,
        ),
        TaskDecided(
            **common,
            slot_id="slot-0",
            parent_id="quick-1",
            candidate_id="quick-1.v1",
            direction="harder",
            accepted=True,
            reason="0 < 0.5 < 0.9",
            parent_accuracy=0.875,
            candidate_accuracy=0.5,
            rewriter="builtin",
        ),
        StepTaken(
            **common,
            trajectory_id="tr1",
            task_id="quick-1",
            group_id="g1",
            step_index=0,
            observation="You are in a hall.",
            candidates=["go north", "take key"],
            prompt_token_ids=[5, 6, 7],
            response_token_ids=[8],
            logprobs=[-0.25],
            response_text="1",
            action_index=1,
            action_text="take key",
            next_observation="Taken.",
            reference_label=1,
            policy_version=3,
        ),
        TrajectoryCompleted(
            **common,
            trajectory_id="tr1",
            task_id="quick-1",
            group_id="g1",
            outcome="won",
            num_steps=1,
            step_event_ids=["e1"],
            policy_versions=[3],
        ),
        StepJudged(
            **common,
            step_event_id="e1",
            trajectory_id="tr1",
            task_id="quick-1",
            group_id="g1",
            step_index=0,
            votes=[
                Vote(index=0, value=1, status="ok", rationale="good"),
                Vote(index=1, value=None, status="unparseable"),
            ],
            judge_version=2,
        ),
        GroupScored(
            **common,
            task_id="quick-1",
            group_id="g1",
            accuracy=0.5,
            n_trajectories=8,
            policy_band_ok=True,
            judge_band_ok=True,
            policy_samples=[sample],
            judge_samples=[sample.model_copy(update={"role": "judge"})],
        ),
        LearnerStepped(
            **common,
            role="policy",
            version=4,
            samples=16,
            tokens=100,
            loss=0.1,
            kl=0.01,
            clip_fraction=0.05,
            mismatch_kl=0.0,
            staleness_histogram={"0": 10, "1": 6},
            tokens_per_second=1000.0,
        ),
        WeightsPublished(**common, role="policy", version=4, path="/tmp/ckpt/v4", sha256="a" * 64, bytes=123),
        WeightsApplied(**common, role="policy", server="local", version=4, pause_ms=12.5),
        AgentStatus(**common, agent_id="a-1", role="policy", state="running", uptime_s=3.0, counters={"x": 1}),
        DeadLettered(
            **common,
            original_subject="coevo.r.ev.task.scheduled",
            consumer="c",
            reason="bad",
            raw=b"\x00\x01binary",
            delivery_count=1,
            headers={"Nats-Msg-Id": "x"},
        ),
        StepAgreementMeasured(
            **common, group_id="eval0-g1", task_id="quick-h1", policy_version=3, states=6, agreement=0.42, greedy=0.5
        ),
        BudgetExceeded(**common, backend="litellm", model="openai/gpt-4.1-mini", spent_usd=1.01, max_usd=1.0),
        RunFinished(**common, summary={"policy_success_end": 0.9}),
    ]
    assert {type(e) for e in events} == set(EVENT_TYPES), "a new event type needs a sample here"
    return events
