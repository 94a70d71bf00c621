"""Replaying a recorded run into an agent's decisions: the scorer, the judge, the rewriter, the learner.

Invariant: replay is deterministic and needs no model: model calls are answered from the recorded
responses, and the agent's decision functions are fed the recorded inputs in stream order; the first
output that differs from the recorded one is reported with both sides.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coevo.config import CoevoConfig
from coevo.observe.progress import tracked
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
    readable,
)

if TYPE_CHECKING:
    from coevo.algorithm.rewriter import Proposal
    from coevo.envs.base import Family

ENVELOPE = {"event_id", "run_id", "ts", "source", "causation_id", "correlation_id", "schema_version"}


@dataclass
class Divergence:
    index: int
    kind: str
    key: str
    recorded: Any
    replayed: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "key": self.key,
            "recorded": self.recorded,
            "replayed": self.replayed,
        }


@dataclass
class ReplayReport:
    into: str
    compared: int = 0
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "into": self.into,
            "compared": self.compared,
            "identical": self.divergence is None,
            "first_divergence": self.divergence.as_dict() if self.divergence else None,
            "notes": self.notes,
        }


def first_difference(recorded: dict[str, Any], replayed: dict[str, Any], path: str = "") -> tuple[str, Any, Any] | None:
    for key in sorted(set(recorded) | set(replayed)):
        a, b = recorded.get(key), replayed.get(key)
        where = f"{path}.{key}" if path else key
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, where)
            if found:
                return found
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if isinstance(x, dict) and isinstance(y, dict):
                    found = first_difference(x, y, f"{where}[{i}]")
                    if found:
                        return found
                elif x != y:
                    return f"{where}[{i}]", x, y
        elif a != b:
            return where, a, b
    return None


def replay_scorer(events: list[tuple[int, Event]], cfg: CoevoConfig) -> ReplayReport:
    """Rebuild every group from the recorded inputs and score it where the original was scored."""
    from coevo.agents.scorer import Group, score_group

    report = ReplayReport("scorer")
    groups: dict[str, Group] = {}
    train_judge = cfg.trains_judge
    for seq, e in tracked(events, "replaying into the scorer"):
        if isinstance(e, TaskScheduled | StepTaken | TrajectoryCompleted | StepJudged):
            groups.setdefault(e.group_id, Group()).add(e)
        elif isinstance(e, GroupScored):
            g = groups.pop(e.group_id, None)
            if g is None or g.scheduled is None:
                report.notes.append(f"seq {seq}: inputs of group {e.group_id} are outside the replayed range")
                continue
            recorded = {k: v for k, v in readable(e).items() if k not in ENVELOPE}
            replayed_event = GroupScored.of(
                score_group(g, cfg, train_judge=train_judge), run_id=e.run_id, source=e.source
            )
            replayed = {k: v for k, v in readable(replayed_event).items() if k not in ENVELOPE}
            report.compared += 1
            diff = first_difference(recorded, replayed)
            if diff:
                report.divergence = Divergence(seq, "group.scored", f"{e.group_id}: {diff[0]}", diff[1], diff[2])
                return report
    return report


class RecordedResponses:
    """An inference client that answers from the recorded votes (keyed by prompt and vote index)."""

    def __init__(self, judged: Iterable[tuple[StepTaken, StepJudged]], mode: str) -> None:
        from coevo.agents.judge import step_prompt

        self.version = 0
        # identical prompts (the same state and action in two trajectories) were answered in stream
        # order: a FIFO per (prompt, vote index) gives each replayed call the answer its original got
        self.answers: dict[tuple[str, int], deque[Any]] = defaultdict(deque)
        for step, j in judged:
            prompt = step_prompt(step, mode)  # type: ignore[arg-type]
            for v in j.votes:
                self.answers[(_h(prompt), v.index)].append(v)
        self.misses = 0

    async def complete(
        self,
        prompt: str,
        *,
        choices: list[str] | None = None,
        max_tokens: int = 0,
        temperature: float = 1.0,
        index: int = 0,
    ) -> Any:
        from coevo.inference.engine import Completion

        queue = self.answers.get((_h(prompt), index))
        vote = queue.popleft() if queue else None
        if vote is None:
            self.misses += 1
            raise LookupError("no recorded response for this prompt (the prompt changed?)")
        if vote.status == "error":
            raise RuntimeError(vote.rationale or "recorded error")
        choice = None
        if choices:
            choice = 0 if vote.value == 1 else 1
        text = vote.rationale if not choices else (choices[choice] if choice is not None else "")
        return Completion(
            text,
            vote.prompt_token_ids,
            vote.response_token_ids,
            vote.logprobs,
            vote.model_version or 0,
            choice=choice,
            allowed_token_ids=vote.allowed_token_ids,
            cost_usd=vote.cost_usd,
            cached=True,
        )


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def judge_votes(client: Any, cfg: CoevoConfig, step: StepTaken) -> list[dict[str, Any]]:
    """The judge agent's voting, as a function of a client (used by replay and re-judge)."""
    from coevo.agents.judge import ask, step_prompt, step_prompt_ids
    from coevo.inference.chat import PromptForm

    mode = cfg.judge.effective_mode
    prompt = step_prompt(step, mode)
    ids = step_prompt_ids(PromptForm.of(client, cfg.judge.prompt_format), step, mode)
    out: list[dict[str, Any]] = []
    for j in range(cfg.judge.m):
        try:
            _, value, status = await ask(client, cfg.judge, prompt, j, ids)
            out.append({"index": j, "value": value, "status": status})
        except LookupError:
            out.append({"index": j, "value": None, "status": "missing"})
        except Exception:  # the recorded call failed, or the judge failed now
            out.append({"index": j, "value": None, "status": "error"})
    return out


async def replay_judge(events: list[tuple[int, Event]], cfg: CoevoConfig) -> ReplayReport:
    report = ReplayReport("judge")
    steps = {e.event_id: e for _, e in events if isinstance(e, StepTaken)}
    pairs = [(steps[e.step_event_id], e) for _, e in events if isinstance(e, StepJudged) and e.step_event_id in steps]
    client = RecordedResponses(pairs, cfg.judge.effective_mode)
    for seq, e in tracked(events, "replaying into the judge"):
        if not isinstance(e, StepJudged) or e.step_event_id not in steps:
            continue
        replayed = await judge_votes(client, cfg, steps[e.step_event_id])
        recorded = [{"index": v.index, "value": v.value, "status": v.status} for v in e.votes]
        report.compared += 1
        if replayed != recorded:
            report.divergence = Divergence(seq, "step.judged", e.step_event_id, recorded, replayed)
            return report
    return report


async def replay_rewriter(events: list[tuple[int, Event]], cfg: CoevoConfig) -> ReplayReport:
    """Re-propose each built-in rewrite from the recorded failures, and re-decide each rolled-out
    candidate with the acceptance gate on the recorded accuracies."""
    from coevo.algorithm import scoring
    from coevo.envs import make_family
    from coevo.envs.base import spec_hash

    report = ReplayReport("rewriter")
    family = make_family(cfg.env)
    heldout = {
        spec_hash(t.family, t.params, t.knobs)
        for t in family.initial_tasks(cfg.env.n_train, cfg.env.n_heldout, cfg.env.seed)
        if t.split == "heldout"
    }
    low, high = cfg.tasks.band
    scored: dict[str, GroupScored] = {}
    pending: dict[str, tuple[TaskRewritten, float]] = {}
    candidate_acc: dict[str, float] = {}
    for seq, e in tracked(events, "replaying into the rewriter"):
        if isinstance(e, GroupScored):
            scored[e.event_id] = e
            if e.purpose == "candidate":
                candidate_acc[e.task_id] = e.accuracy
        elif isinstance(e, TaskRewritten):
            cause = scored.get(e.causation_id or "")
            if cause is None:
                report.notes.append(f"seq {seq}: the group that triggered this rewrite is outside the range")
                continue
            proposal = await _reproposed(e, cause, family, heldout)
            if proposal is not None:
                recorded = e.candidate.model_dump() if e.candidate else None
                replayed = proposal.candidate.model_dump() if proposal.candidate else None
                report.compared += 1
                if recorded != replayed:
                    report.divergence = Divergence(seq, "task.rewritten", e.slot_id, recorded, replayed)
                    return report
            if e.candidate is not None and e.precheck_ok:
                pending[e.candidate.task_id] = (e, cause.accuracy)
        elif isinstance(e, TaskDecided) and e.candidate_id in pending and e.candidate_id in candidate_acc:
            rw, parent_acc = pending.pop(e.candidate_id)
            if e.reason.startswith("candidate group flagged"):
                continue
            accepted, reason = scoring.accept_rewrite(
                rw.direction, parent_acc, candidate_acc[e.candidate_id], low, high
            )
            report.compared += 1
            if (accepted, reason) != (e.accepted, e.reason):
                report.divergence = Divergence(
                    seq,
                    "task.decided",
                    e.candidate_id,
                    {"accepted": e.accepted, "reason": e.reason},
                    {"accepted": accepted, "reason": reason},
                )
                return report
    return report


async def _reproposed(e: TaskRewritten, cause: GroupScored, family: Family, heldout: set[str]) -> Proposal | None:
    """The proposal today's code makes from a recorded rewrite's inputs: a fresh world (the tasks agent's,
    whichever rewriter it runs; never one of the ``heldout`` tasks' ``spec_hash``) or the built-in
    rewriter's knob steps; None for a model's proposal (not reproducible without its recorded answer)."""
    from coevo.algorithm.rewriter import BuiltinRewriter, fresh_world

    if e.rewriter.endswith(":world"):
        return fresh_world(family, e.parent, [], cause.event_id, e.rewriter.removesuffix(":world"), heldout)
    if e.rewriter.startswith("builtin"):
        return await BuiltinRewriter().propose(family, e.parent, e.direction, cause.failures, e.moves)
    return None


STEP_FIELDS = ("version", "samples", "loss", "kl", "clip_fraction", "mismatch_kl")
"""what a replayed learner step must reproduce of its ``LearnerStepped``"""


def replay_learner(
    events: list[tuple[int, Event]], cfg: CoevoConfig, *, rel_tol: float = 1e-4, abs_tol: float = 1e-6
) -> ReplayReport:
    """Retrain both lanes from the base models on the recorded batches (the groups each recorded
    ``LearnerStepped`` used, in order) and compare version, sample count, loss, KL, clip fraction and
    sampler mismatch. Starts from the beginning of the run (the base weights)."""
    import math
    import tempfile
    from pathlib import Path as _Path

    from coevo.inference.clients import model_dir
    from coevo.training.lane import Lane

    report = ReplayReport("learner")
    groups: dict[str, GroupScored] = {}
    lanes: dict[str, Lane] = {}
    with tempfile.TemporaryDirectory(prefix="coevo-replay-") as tmp:
        for seq, e in tracked(events, "replaying into the learner"):
            if isinstance(e, GroupScored):
                groups[e.group_id] = e
                continue
            if not isinstance(e, LearnerStepped) or not e.is_step:  # a report of untrained groups: nothing to replay
                continue
            lane = lanes.get(e.role)
            if lane is None:
                temp = cfg.policy.temperature if e.role == "policy" else cfg.judge.temperature
                lr = cfg.learner.judge_lr if e.role == "judge" else None
                lane = Lane(
                    e.role, model_dir(cfg, e.role), _Path(tmp), cfg.learner, temperature=temp, lr=lr, device="cpu"
                )
                lanes[e.role] = lane
            if lane.version != e.version - 1:
                report.notes.append(
                    f"seq {seq}: {e.role} v{e.version} follows v{lane.version}; replay starts "
                    "from the base weights, so it needs the run from its first learner step"
                )
                return report
            missing = [g for g in e.group_ids if g not in groups]
            if missing:
                report.notes.append(f"seq {seq}: groups {missing[:3]} are outside the replayed range")
                return report
            samples = [
                s
                for g in e.group_ids
                for s in (groups[g].policy_samples if e.role == "policy" else groups[g].judge_samples)
            ]
            m = lane.step(samples, list(e.group_ids))
            recorded = {k: getattr(e, k) for k in STEP_FIELDS}
            replayed = {k: getattr(m, k) for k in STEP_FIELDS}
            report.compared += 1
            for key, a in recorded.items():
                b = replayed[key]
                if not math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol):
                    report.divergence = Divergence(
                        seq, "learner.stepped", f"{e.role} v{e.version}: {key}", recorded, replayed
                    )
                    return report
    return report
