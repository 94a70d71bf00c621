"""What the dashboard's pages show besides curves: the task pool, the agents, the trajectories.

Invariant: every collection here is bounded (the newest ``limit`` records are kept), so a view of a
run of any length fits in memory; each record is plain JSON-ready data built from events only
(consumer infos aside, which come from JetStream).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coevo.algorithm.recent import put_newest
from coevo.schemas import (
    AgentStatus,
    DeadLettered,
    GroupScored,
    LearnerStepped,
    TaskDecided,
    TaskRewritten,
    TaskScheduled,
    TaskSpec,
    TrajectoryCompleted,
)

if TYPE_CHECKING:
    from coevo.envs.base import Family


@dataclass
class PoolView:
    """Slots (their active task, knobs, difficulty, last accuracy) and the rewrites with their verdicts."""

    limit: int = 500
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)
    rewrites: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)  # by candidate id

    def slot(self, slot_id: str) -> dict[str, Any]:
        return self.slots.setdefault(
            slot_id,
            {
                "slot_id": slot_id,
                "split": None,
                "task_id": None,
                "knobs": {},
                "difficulty": None,
                "accuracy": None,
                "groups": 0,
                "candidate": None,
                "accepted": 0,
                "rejected": 0,
            },
        )

    def scheduled(self, e: TaskScheduled, difficulty: float | None) -> bool:
        """A group was scheduled; True when the slot's active task changed."""
        if e.slot_id is None:
            return False
        s = self.slot(e.slot_id)
        if e.purpose == "candidate":
            s["candidate"] = e.task.task_id
            return False
        changed = s["task_id"] != e.task.task_id
        s.update(split=e.task.split, task_id=e.task.task_id, knobs=dict(e.task.knobs), difficulty=difficulty)
        return changed

    def scored(self, e: GroupScored) -> None:
        if e.slot_id is not None and e.purpose != "candidate":
            s = self.slot(e.slot_id)
            s["accuracy"] = e.accuracy
            s["groups"] += 1

    def rewritten(self, e: TaskRewritten, t: float) -> None:
        cand = e.candidate
        key = cand.task_id if cand else f"{e.parent.task_id}:{e.event_id}"
        put_newest(
            self.rewrites,
            key,
            {
                "t": round(t, 1),
                "slot_id": e.slot_id,
                "parent_id": e.parent.task_id,
                "candidate_id": cand.task_id if cand else None,
                "direction": e.direction,
                "rewriter": e.rewriter,
                "knobs_before": dict(e.parent.knobs),
                "knobs_after": dict(cand.knobs) if cand else None,
                "precheck_ok": e.precheck_ok,
                "precheck_error": e.precheck_error,
                "summaries": e.summaries[:3],
                "accepted": None if e.precheck_ok else False,
                "reason": None if e.precheck_ok else f"precheck: {e.precheck_error or 'failed'}",
                "parent_accuracy": None,
                "candidate_accuracy": None,
            },
            self.limit,
        )
        if not e.precheck_ok:
            self.slot(e.slot_id)["rejected"] += 1

    def decided(self, e: TaskDecided, t: float) -> None:
        rec = self.rewrites.get(e.candidate_id)
        if rec is None:
            rec = {
                "t": round(t, 1),
                "slot_id": e.slot_id,
                "parent_id": e.parent_id,
                "candidate_id": e.candidate_id,
                "direction": e.direction,
                "rewriter": e.rewriter,
                "precheck_ok": True,
            }
            put_newest(self.rewrites, e.candidate_id, rec, self.limit)
        rec.update(
            accepted=e.accepted,
            reason=e.reason,
            parent_accuracy=e.parent_accuracy,
            candidate_accuracy=e.candidate_accuracy,
            decided_t=round(t, 1),
        )
        s = self.slot(e.slot_id)
        s["accepted" if e.accepted else "rejected"] += 1
        if s["candidate"] == e.candidate_id:
            s["candidate"] = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "slots": sorted(self.slots.values(), key=lambda s: (s["split"] or "", s["slot_id"])),
            "rewrites": list(reversed(self.rewrites.values())),
        }


@dataclass
class AgentsView:
    """Each agent's last status, its restarts (from its ``restarts.*`` counters) and the dead letters."""

    limit: int = 200
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    dead_letters: deque[dict[str, Any]] = field(default_factory=deque)
    consumers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def status(self, e: AgentStatus) -> int:
        """Record a heartbeat; returns the agent's restarts so far."""
        restarts = sum(v for k, v in e.counters.items() if k.startswith("restarts."))
        self.agents[e.agent_id] = {
            "agent_id": e.agent_id,
            "role": e.role,
            "state": e.state,
            "uptime_s": round(e.uptime_s, 1),
            "restarts": restarts,
            "last_seen": e.ts,
            "detail": e.detail,
            "counters": {k: v for k, v in sorted(e.counters.items()) if "." not in k or k.count(".") == 1},
        }
        return restarts

    def dead_lettered(self, e: DeadLettered, t: float) -> None:
        self.dead_letters.appendleft(
            {
                "t": round(t, 1),
                "consumer": e.consumer,
                "subject": e.original_subject,
                "reason": e.reason[:300],
                "delivery_count": e.delivery_count,
            }
        )
        while len(self.dead_letters) > self.limit:
            self.dead_letters.pop()

    def as_dict(self) -> dict[str, Any]:
        return {
            "agents": sorted(self.agents.values(), key=lambda a: (a["role"], a["agent_id"])),
            "consumers": sorted(self.consumers.values(), key=lambda c: c["name"]),
            "dead_letters": list(self.dead_letters),
        }


@dataclass
class TrajectoriesView:
    """The newest trajectories with their group's accuracy and the learner step that trained it."""

    limit: int = 1000
    trajectories: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    groups: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)

    def completed(self, e: TrajectoryCompleted, t: float) -> None:
        g = self.groups.get(e.group_id)
        put_newest(
            self.trajectories,
            e.trajectory_id,
            {
                "t": round(t, 1),
                "trajectory_id": e.trajectory_id,
                "task_id": e.task_id,
                "group_id": e.group_id,
                "outcome": e.outcome,
                "num_steps": e.num_steps,
                "policy_versions": sorted(set(e.policy_versions)),
                "purpose": g["purpose"] if g else None,
                "accuracy": None,
                "learner_version": None,
            },
            self.limit,
        )

    def scheduled(self, e: TaskScheduled) -> None:
        put_newest(self.groups, e.group_id, {"purpose": e.purpose, "trajectories": []}, 2 * self.limit)

    def scored(self, e: GroupScored) -> None:
        g = self.groups.get(e.group_id)
        if g is not None:
            g["trajectories"] = list(e.trajectory_ids)
        for tid in e.trajectory_ids:
            if rec := self.trajectories.get(tid):
                rec.update(accuracy=e.accuracy, purpose=e.purpose, flagged=e.flagged)

    def trained(self, e: LearnerStepped) -> None:
        if e.role != "policy":
            return
        for gid in e.group_ids:
            for tid in (self.groups.get(gid) or {}).get("trajectories", []):
                if (rec := self.trajectories.get(tid)) and rec["learner_version"] is None:
                    rec["learner_version"] = e.version

    def as_list(self) -> list[dict[str, Any]]:
        return list(reversed(self.trajectories.values()))


def knob_difficulty(task: TaskSpec) -> float | None:
    """The family's own difficulty scalar (``Family.difficulty``: knob positions, higher = harder); None
    for a family this module does not know."""
    family = _family_class(task.family)
    if family is None:
        return None
    return round(object.__new__(family).difficulty(task), 4)  # reads only the class's knob bounds


def _family_class(name: str) -> type[Family] | None:
    if name in ("quickgame", "quickgame-hard"):  # same knobs
        from coevo.envs.quickgame import QuickGame

        return QuickGame
    if name == "coding":
        from coevo.envs.coding import Coding

        return Coding
    if name == "textworld":
        from coevo.envs.textworld_env import TextWorld

        return TextWorld
    return None
