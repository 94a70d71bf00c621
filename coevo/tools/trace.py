"""The causal timeline around one thing a run did: a trajectory, a step, a task or a weights version.

Invariant: a trace reads the run's events once and indexes them in one pass; every answer is then a
lookup, so a trace costs O(events + the ids they list), however long the run. The answer is the one
a scan of the events in stream order gives: where one event is looked up, the first that matches
(the last for a step's votes, a group's schedule and a candidate's decision); where a list is given,
every match, in stream order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevo.runtime.bus import NatsBus
from coevo.schemas import (
    Event,
    GroupScored,
    LearnerStepped,
    StepJudged,
    StepTaken,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
    TrajectoryCompleted,
    WeightsApplied,
    WeightsPublished,
)

MAX_LINEAGE = 100  # rewrite generations followed back from a task (a guard against a cycle)

Version = tuple[str, int]  # (role, version)


@dataclass
class RunIndex:
    """A run's events by the keys a trace looks them up by (see the module's invariant)."""

    trajectories: dict[str, TrajectoryCompleted] = field(default_factory=dict)  # by trajectory id
    trajectories_of_task: dict[str, list[TrajectoryCompleted]] = field(default_factory=dict)
    steps: dict[str, StepTaken] = field(default_factory=dict)  # by event id
    judged: dict[str, StepJudged] = field(default_factory=dict)  # by step event id: the last
    group_of_trajectory: dict[str, GroupScored] = field(default_factory=dict)  # the first listing it
    groups_of_task: dict[str, list[GroupScored]] = field(default_factory=dict)
    scheduled: dict[str, TaskScheduled] = field(default_factory=dict)  # by group id: the last
    trained_by: dict[str, LearnerStepped] = field(default_factory=dict)  # group id -> first policy step
    learner_steps: dict[Version, LearnerStepped] = field(default_factory=dict)
    published: dict[Version, WeightsPublished] = field(default_factory=dict)
    applied: dict[Version, list[WeightsApplied]] = field(default_factory=dict)
    rewrite_of: dict[str, TaskRewritten] = field(default_factory=dict)  # by candidate task id
    decided: dict[str, TaskDecided] = field(default_factory=dict)  # by candidate id: the last
    accepted: dict[str, TaskDecided] = field(default_factory=dict)  # by candidate id: the last accepted

    def versions(self, role: str) -> set[int]:
        """The weights versions of ``role`` the run recorded (0: the weights it started from)."""
        return {0} | {v for r, v in (*self.learner_steps, *self.published, *self.applied) if r == role}

    @classmethod
    def of(cls, events: list[Event]) -> RunIndex:
        index = cls()
        for e in events:
            index.add(e)
        return index

    def add(self, e: Event) -> None:
        if isinstance(e, TrajectoryCompleted):
            self.trajectories.setdefault(e.trajectory_id, e)
            self.trajectories_of_task.setdefault(e.task_id, []).append(e)
        elif isinstance(e, StepTaken):
            self.steps.setdefault(e.event_id, e)
        elif isinstance(e, StepJudged):
            self.judged[e.step_event_id] = e
        elif isinstance(e, GroupScored):
            for trajectory_id in e.trajectory_ids:
                self.group_of_trajectory.setdefault(trajectory_id, e)
            self.groups_of_task.setdefault(e.task_id, []).append(e)
        elif isinstance(e, TaskScheduled):
            self.scheduled[e.group_id] = e
        elif isinstance(e, LearnerStepped) and e.is_step:
            self.learner_steps.setdefault((e.role, e.version), e)
            for group_id in e.group_ids if e.role == "policy" else ():
                self.trained_by.setdefault(group_id, e)
        elif isinstance(e, WeightsPublished):
            self.published.setdefault((e.role, e.version), e)
        elif isinstance(e, WeightsApplied):
            self.applied.setdefault((e.role, e.version), []).append(e)
        elif isinstance(e, TaskRewritten):
            if e.candidate:
                self.rewrite_of.setdefault(e.candidate.task_id, e)
        elif isinstance(e, TaskDecided):
            self.decided[e.candidate_id] = e
            if e.accepted:
                self.accepted[e.candidate_id] = e


async def trace(bus: NatsBus, ident: str) -> dict[str, Any]:
    """The causal timeline around a trajectory, task, step or weights version (``policy:12``/``v12``)."""
    index = RunIndex.of(await bus.events())
    if t := index.trajectories.get(ident):
        return {"kind": "trajectory", **trajectory_view(index, t)}
    if st := index.steps.get(ident):
        return step_trace(index, st)
    if ident in index.trajectories_of_task or ident in index.rewrite_of:
        return task_trace(index, ident)
    if version := weights_version(ident):
        return weights_trace(index, *version)
    raise KeyError(f"nothing in run {bus.run_id} is called {ident!r}")


# ---- one answer per kind of ident --------------------------------------------------------------


def step_trace(index: RunIndex, step: StepTaken) -> dict[str, Any]:
    t = index.trajectories.get(step.trajectory_id)
    if t is None:
        raise RuntimeError(f"step {step.event_id}: its trajectory {step.trajectory_id} never completed")
    return {"kind": "step", "step_event_id": step.event_id, **trajectory_view(index, t)}


def task_trace(index: RunIndex, task_id: str) -> dict[str, Any]:
    return {
        "kind": "task",
        "task_id": task_id,
        "lineage": lineage(index, task_id),
        "groups": [
            {"group_id": g.group_id, "accuracy": g.accuracy, "purpose": g.purpose}
            for g in index.groups_of_task.get(task_id, [])
        ],
        "trajectories": [t.trajectory_id for t in index.trajectories_of_task.get(task_id, [])],
    }


def weights_version(ident: str) -> Version | None:
    """``policy:12``, ``judge:v3``, ``v12`` or ``12`` (the policy's) as (role, version); else None."""
    role, _, num = ident.rpartition(":")
    num = num.removeprefix("v")
    return (role or "policy", int(num)) if num.isdigit() else None


def weights_trace(index: RunIndex, role: str, version: int) -> dict[str, Any]:
    known = index.versions(role)
    if version not in known:
        raise KeyError(
            f"no weights version {role}:{version} in the run ({role} versions {_spans(sorted(known))} recorded)"
        )
    step = index.learner_steps.get((role, version))
    return {
        "kind": "weights",
        **weights(index, version, role),
        "learner_step": step.model_dump(
            include={"loss", "kl", "clip_fraction", "mismatch_kl", "samples", "group_ids", "staleness_histogram"}
        )
        if step
        else None,
    }


def _spans(numbers: list[int]) -> str:
    """``0-12, 15``: runs of consecutive numbers."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


# ---- the parts of an answer --------------------------------------------------------------------


def trajectory_view(index: RunIndex, t: TrajectoryCompleted) -> dict[str, Any]:
    group = index.group_of_trajectory.get(t.trajectory_id)
    used_by = index.trained_by.get(group.group_id) if group else None
    task = index.scheduled.get(t.group_id)
    return {
        "trajectory_id": t.trajectory_id,
        "task_id": t.task_id,
        "outcome": t.outcome,
        "task": task.task.model_dump() if task else None,
        "lineage": lineage(index, t.task_id),
        "steps": steps_view(index, t, group),
        "group": {
            "group_id": group.group_id,
            "accuracy": group.accuracy,
            "purpose": group.purpose,
            "flagged": group.flagged,
        }
        if group
        else None,
        "learner_step": {"version": used_by.version, "loss": used_by.loss, "ts": used_by.ts} if used_by else None,
        "weights": weights(index, used_by.version) if used_by else None,
    }


def steps_view(index: RunIndex, t: TrajectoryCompleted, group: GroupScored | None) -> list[dict[str, Any]]:
    """The trajectory's recorded steps with their votes and, once its group is scored, advantages."""
    advantage = {s.step_event_id: s.advantage for s in (group.policy_samples if group else [])}
    out = []
    for sid in t.step_event_ids:
        st = index.steps.get(sid)
        if st is None:
            continue
        j = index.judged.get(sid)
        out.append(
            {
                "step": st.step_index,
                "event_id": sid,
                "action": st.action_text,
                "result": st.next_observation[:120],
                "policy_version": st.policy_version,
                "reference_label": st.reference_label,
                "votes": [
                    {"value": v.value, "status": v.status, "rationale": v.rationale[-200:]}
                    for v in (j.votes if j else [])
                ],
                "advantage": advantage.get(sid),
            }
        )
    return out


def lineage(index: RunIndex, task_id: str) -> list[dict[str, Any]]:
    """The rewrites that led to ``task_id``, newest first, each with the decision on it."""
    chain = []
    current = task_id
    for _ in range(MAX_LINEAGE):
        rw = index.rewrite_of.get(current)
        if rw is None or rw.candidate is None:
            break
        # the same candidate (same parent, same knobs: same id) can be proposed again after a
        # rejection: its acceptance, if any, is what made it a task; else its latest decision
        d = index.accepted.get(current) or index.decided.get(current)
        chain.append(
            {
                "task_id": current,
                "parent_id": rw.parent.task_id,
                "direction": rw.direction,
                "knobs": rw.candidate.knobs,
                "rewriter": rw.rewriter,
                "summaries": rw.summaries,
                "accepted": d.accepted if d else None,
                "reason": d.reason if d else None,
                "parent_accuracy": d.parent_accuracy if d else None,
                "candidate_accuracy": d.candidate_accuracy if d else None,
            }
        )
        current = rw.parent.task_id
    return chain


def weights(index: RunIndex, version: int, role: str = "policy") -> dict[str, Any]:
    """A weights version: where it was published, and every server it was applied on."""
    pub = index.published.get((role, version))
    return {
        "role": role,
        "version": version,
        "path": pub.path if pub else None,
        "on_disk": Path(pub.path).exists() if pub else None,  # False: pruned (publication keeps the newest)
        "sha256": pub.sha256 if pub else None,
        "applied": [
            {"server": a.server, "pause_ms": a.pause_ms, "ok": a.ok, "ts": a.ts}
            for a in index.applied.get((role, version), [])
        ],
    }
