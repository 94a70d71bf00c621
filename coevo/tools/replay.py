"""Debugging a run after the fact: export/import, trace, replay, re-judge.

Invariants:
- export writes every stored event of a run, in stream order, with its sequence number; importing
  an export under a new run id and exporting again gives the same events (up to the run id);
- replay is deterministic and needs no model: model calls are answered from the recorded
  responses, and the agent's decision functions are fed the recorded inputs in stream order; the
  first output that differs from the recorded one is reported with both sides.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevo.config import CoevoConfig, load_config
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
    decode,
    encode,
)

ENVELOPE = {"event_id", "run_id", "ts", "source", "causation_id", "correlation_id", "schema_version"}


@asynccontextmanager
async def open_run(run_id: str, runs_dir: Path, url: str | None = None) -> AsyncIterator[NatsBus]:
    """The run's events: on ``url``, or on an embedded server over the run's own store."""
    from coevo.runtime.app import open_bus

    async with open_bus(run_id, url=url, store=runs_dir / run_id / "nats", existing=True) as bus:
        yield bus


# ---- export / import ---------------------------------------------------------------------------


async def export_events(bus: NatsBus, out: Path, fmt: str = "jsonl") -> int:
    rows = []
    async for seq, event, msg in bus.history():
        payload: Any = json.loads(msg.data) if event is not None else {"undecodable": msg.data.hex()}
        rows.append({"seq": seq, "subject": msg.subject, "event": payload})
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")
    elif fmt == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise SystemExit("parquet export needs pyarrow: pip install 'coevo[parquet]'") from exc
        table = pa.table({"seq": [r["seq"] for r in rows], "subject": [r["subject"] for r in rows],
                          "kind": [r["event"].get("kind", "") for r in rows],
                          "event": [json.dumps(r["event"], sort_keys=True) for r in rows]})
        pq.write_table(table, out)
    else:
        raise SystemExit(f"unknown format {fmt!r} (jsonl or parquet)")
    return len(rows)


def read_export(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(path).to_pylist()
        return [{"seq": r["seq"], "subject": r["subject"], "event": json.loads(r["event"])} for r in t]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def import_events(bus: NatsBus, rows: Iterable[dict[str, Any]]) -> int:
    """Publish an export into ``bus``'s run (events get the new run id), in the recorded order."""
    n = 0
    for row in rows:
        data = dict(row["event"])
        if "undecodable" in data:
            continue
        data["run_id"] = bus.run_id
        event = decode(json.dumps(data))
        await bus.publish_sync(event)  # in order, one at a time: sequence numbers follow the export's
        n += 1
    return n


def normalized(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An export with run ids and subjects made run-neutral (to compare two runs' exports)."""
    out = []
    for r in rows:
        e = dict(r["event"])
        e.pop("run_id", None)
        out.append({"seq": r["seq"], "subject": r["subject"].split(".", 2)[-1], "event": e})
    return out


# ---- trace -------------------------------------------------------------------------------------


async def trace(bus: NatsBus, ident: str) -> dict[str, Any]:
    """The causal timeline around a trajectory, task, step or weights version (``policy:12``/``v12``)."""
    events = await bus.events()
    steps = [e for e in events if isinstance(e, StepTaken)]
    trajs = [e for e in events if isinstance(e, TrajectoryCompleted)]
    judged = {e.step_event_id: e for e in events if isinstance(e, StepJudged)}
    scored = [e for e in events if isinstance(e, GroupScored)]
    learner = [e for e in events if isinstance(e, LearnerStepped)]
    published = [e for e in events if isinstance(e, WeightsPublished)]
    applied = [e for e in events if isinstance(e, WeightsApplied)]
    decided = [e for e in events if isinstance(e, TaskDecided)]
    rewritten = [e for e in events if isinstance(e, TaskRewritten)]
    scheduled = {e.group_id: e for e in events if isinstance(e, TaskScheduled)}

    def lineage(task_id: str) -> list[dict[str, Any]]:
        chain = []
        current = task_id
        for _ in range(100):
            rw = next((r for r in rewritten if r.candidate and r.candidate.task_id == current), None)
            if rw is None or rw.candidate is None:
                break
            # the same candidate (same parent, same knobs: same id) can be proposed again after a
            # rejection: its acceptance, if any, is what made it a task; else its latest decision
            tried = [x for x in decided if x.candidate_id == current]
            d = next((x for x in reversed(tried) if x.accepted), tried[-1] if tried else None)
            chain.append({"task_id": current, "parent_id": rw.parent.task_id, "direction": rw.direction,
                          "knobs": rw.candidate.knobs, "rewriter": rw.rewriter, "summaries": rw.summaries,
                          "accepted": d.accepted if d else None, "reason": d.reason if d else None,
                          "parent_accuracy": d.parent_accuracy if d else None,
                          "candidate_accuracy": d.candidate_accuracy if d else None})
            current = rw.parent.task_id
        return chain

    def weights(version: int, role: str = "policy") -> dict[str, Any]:
        pub = next((p for p in published if p.role == role and p.version == version), None)
        return {"role": role, "version": version, "path": pub.path if pub else None,
                "sha256": pub.sha256 if pub else None,
                "applied": [{"server": a.server, "pause_ms": a.pause_ms, "ok": a.ok, "ts": a.ts}
                            for a in applied if a.role == role and a.version == version]}

    def traj_view(t: TrajectoryCompleted) -> dict[str, Any]:
        group = next((g for g in scored if t.trajectory_id in g.trajectory_ids), None)
        adv = {s.step_event_id: s.advantage for s in (group.policy_samples if group else [])}
        out_steps = []
        for sid in t.step_event_ids:
            st = next((s for s in steps if s.event_id == sid), None)
            if st is None:
                continue
            j = judged.get(sid)
            out_steps.append({"step": st.step_index, "event_id": sid, "action": st.action_text,
                              "result": st.next_observation[:120], "policy_version": st.policy_version,
                              "reference_label": st.reference_label,
                              "votes": [{"value": v.value, "status": v.status, "rationale": v.rationale[-200:]}
                                        for v in (j.votes if j else [])],
                              "advantage": adv.get(sid)})
        used_by = next((s for s in learner if group and group.group_id in s.group_ids and s.role == "policy"), None)
        task = scheduled.get(t.group_id)
        return {"trajectory_id": t.trajectory_id, "task_id": t.task_id, "outcome": t.outcome,
                "task": task.task.model_dump() if task else None, "lineage": lineage(t.task_id),
                "steps": out_steps,
                "group": {"group_id": group.group_id, "accuracy": group.accuracy, "purpose": group.purpose,
                          "flagged": group.flagged} if group else None,
                "learner_step": {"version": used_by.version, "loss": used_by.loss, "ts": used_by.ts}
                if used_by else None,
                "weights": weights(used_by.version) if used_by else None}

    if t := next((t for t in trajs if t.trajectory_id == ident), None):
        return {"kind": "trajectory", **traj_view(t)}
    if st := next((s for s in steps if s.event_id == ident), None):
        t = next(t for t in trajs if t.trajectory_id == st.trajectory_id)
        return {"kind": "step", "step_event_id": ident, **traj_view(t)}
    task_trajs = [t for t in trajs if t.task_id == ident]
    if task_trajs or any(r.candidate and r.candidate.task_id == ident for r in rewritten):
        groups = [g for g in scored if g.task_id == ident]
        return {"kind": "task", "task_id": ident, "lineage": lineage(ident),
                "groups": [{"group_id": g.group_id, "accuracy": g.accuracy, "purpose": g.purpose} for g in groups],
                "trajectories": [t.trajectory_id for t in task_trajs]}
    role, _, num = ident.rpartition(":")
    num = num.removeprefix("v")
    if num.isdigit():
        version = int(num)
        role = role or "policy"
        step = next((s for s in learner if s.role == role and s.version == version), None)
        return {"kind": "weights", **weights(version, role),
                "learner_step": step.model_dump(include={"loss", "kl", "clip_fraction", "mismatch_kl",
                                                         "samples", "group_ids", "staleness_histogram"})
                if step else None}
    raise KeyError(f"nothing in run {bus.run_id} is called {ident!r}")


# ---- replay ------------------------------------------------------------------------------------


@dataclass
class Divergence:
    index: int
    kind: str
    key: str
    recorded: Any
    replayed: Any

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "key": self.key, "recorded": self.recorded,
                "replayed": self.replayed}


@dataclass
class ReplayReport:
    into: str
    compared: int = 0
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"into": self.into, "compared": self.compared, "identical": self.divergence is None,
                "first_divergence": self.divergence.as_dict() if self.divergence else None, "notes": self.notes}


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


def payload(event: Event) -> dict[str, Any]:
    return json.loads(encode(event))


def within(events: list[tuple[int, Event]], start: int | None, end: int | None) -> list[tuple[int, Event]]:
    return [(s, e) for s, e in events if (start is None or s >= start) and (end is None or s <= end)]


def replay_scorer(events: list[tuple[int, Event]], cfg: CoevoConfig) -> ReplayReport:
    """Rebuild every group from the recorded inputs and score it where the original was scored."""
    from coevo.agents.scorer import Group, score_group

    report = ReplayReport("scorer")
    groups: dict[str, Group] = {}
    train_judge = cfg.trains_judge
    for seq, e in events:
        if isinstance(e, TaskScheduled | StepTaken | TrajectoryCompleted | StepJudged):
            groups.setdefault(e.group_id, Group()).add(e)
        elif isinstance(e, GroupScored):
            g = groups.pop(e.group_id, None)
            if g is None or g.scheduled is None:
                report.notes.append(f"seq {seq}: inputs of group {e.group_id} are outside the replayed range")
                continue
            recorded = {k: v for k, v in payload(e).items() if k not in ENVELOPE}
            replayed_event = GroupScored(run_id=e.run_id, source=e.source, **score_group(g, cfg, train_judge=train_judge))
            replayed = {k: v for k, v in payload(replayed_event).items() if k not in ENVELOPE}
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

    async def complete(self, prompt: str, *, choices: list[str] | None = None, max_tokens: int = 0,
                       temperature: float = 1.0, index: int = 0) -> Any:
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
        return Completion(text, vote.prompt_token_ids, vote.response_token_ids, vote.logprobs,
                          vote.model_version or 0, choice=choice, allowed_token_ids=vote.allowed_token_ids,
                          cost_usd=vote.cost_usd, cached=True)


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def judge_votes(client: Any, cfg: CoevoConfig, step: StepTaken) -> list[dict[str, Any]]:
    """The judge agent's voting, as a function of a client (used by replay and re-judge)."""
    from coevo.agents.judge import ask, step_prompt

    prompt = step_prompt(step, cfg.judge.effective_mode)
    out = []
    for j in range(cfg.judge.m):
        try:
            _, value, status = await ask(client, cfg.judge, prompt, j)
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
    for seq, e in events:
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
    from coevo.algorithm.rewriter import BuiltinRewriter
    from coevo.envs import make_family

    report = ReplayReport("rewriter")
    family = make_family(cfg.env)
    low, high = cfg.tasks.band
    scored: dict[str, GroupScored] = {}
    pending: dict[str, tuple[TaskRewritten, float]] = {}
    candidate_acc: dict[str, float] = {}
    for seq, e in events:
        if isinstance(e, GroupScored):
            scored[e.event_id] = e
            if e.purpose == "candidate":
                candidate_acc[e.task_id] = e.accuracy
        elif isinstance(e, TaskRewritten):
            cause = scored.get(e.causation_id or "")
            if cause is None:
                report.notes.append(f"seq {seq}: the group that triggered this rewrite is outside the range")
                continue
            if e.rewriter.startswith("builtin"):
                proposal = await BuiltinRewriter().propose(family, e.parent, e.direction, cause.failures)
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
            accepted, reason = scoring.accept_rewrite(rw.direction, parent_acc, candidate_acc[e.candidate_id],
                                                      low, high)
            report.compared += 1
            if (accepted, reason) != (e.accepted, e.reason):
                report.divergence = Divergence(seq, "task.decided", e.candidate_id,
                                               {"accepted": e.accepted, "reason": e.reason},
                                               {"accepted": accepted, "reason": reason})
                return report
    return report


def replay_learner(events: list[tuple[int, Event]], cfg: CoevoConfig, *, rel_tol: float = 1e-4,
                   abs_tol: float = 1e-6) -> ReplayReport:
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
        for seq, e in events:
            if isinstance(e, GroupScored):
                groups[e.group_id] = e
                continue
            if not isinstance(e, LearnerStepped):
                continue
            lane = lanes.get(e.role)
            if lane is None:
                temp = cfg.policy.temperature if e.role == "policy" else cfg.judge.temperature
                lr = cfg.learner.judge_lr if e.role == "judge" else None
                lane = Lane(e.role, model_dir(cfg, e.role), _Path(tmp), cfg.learner, temperature=temp, lr=lr,
                            device="cpu")
                lanes[e.role] = lane
            if lane.version != e.version - 1:
                report.notes.append(f"seq {seq}: {e.role} v{e.version} follows v{lane.version}; replay starts "
                                    "from the base weights, so it needs the run from its first learner step")
                return report
            missing = [g for g in e.group_ids if g not in groups]
            if missing:
                report.notes.append(f"seq {seq}: groups {missing[:3]} are outside the replayed range")
                return report
            samples = [s for g in e.group_ids for s in
                       (groups[g].policy_samples if e.role == "policy" else groups[g].judge_samples)]
            m = lane.step(samples, list(e.group_ids))
            recorded = {"version": e.version, "samples": e.samples, "loss": e.loss, "kl": e.kl,
                        "clip_fraction": e.clip_fraction, "mismatch_kl": e.mismatch_kl}
            replayed = {"version": m.version, "samples": m.samples, "loss": m.loss, "kl": m.kl,
                        "clip_fraction": m.clip_fraction, "mismatch_kl": m.mismatch_kl}
            report.compared += 1
            for key, a in recorded.items():
                b = replayed[key]
                if not math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol):
                    report.divergence = Divergence(seq, "learner.stepped", f"{e.role} v{e.version}: {key}",
                                                   recorded, replayed)
                    return report
    return report


async def load_events(bus: NatsBus, start: int | None = None, end: int | None = None) -> list[tuple[int, Event]]:
    return within([(s, e) async for s, e, _ in bus.history() if e is not None], start, end)


def run_config(runs_dir: Path, run_id: str, overrides: dict[str, Any]) -> CoevoConfig:
    """The config the run was started with (``config.json``), with ``overrides`` on top."""
    path = runs_dir / run_id / "config.json"
    base = json.loads(path.read_text()) if path.exists() else {}
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and not prefix.endswith(("staleness_histogram", "params", "knobs")):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = node

    walk("", base)
    flat = {k: v for k, v in flat.items() if v is not None and not k.startswith(("nats.", "run."))}
    return load_config(overrides={**flat, **overrides})


async def rejudge(bus: NatsBus, cfg: CoevoConfig, use_recorded: bool) -> dict[str, Any]:
    """Another judge over the recorded steps: agreement with the original votes, accuracy of both."""
    from coevo.algorithm import scoring
    from coevo.inference.clients import make_client

    events = await load_events(bus)
    steps = {e.event_id: e for _, e in events if isinstance(e, StepTaken)}
    original = {e.step_event_id: e for _, e in events if isinstance(e, StepJudged)}
    outcomes = {e.trajectory_id: e.outcome for _, e in events if isinstance(e, TrajectoryCompleted)}
    pairs = [(steps[s], j) for s, j in original.items() if s in steps]
    if use_recorded:
        client: Any = RecordedResponses(pairs, cfg.judge.effective_mode)
    else:
        client = make_client(cfg, "judge")
        await client.__aenter__()
    agree = total = 0
    per_traj: dict[str, dict[str, list[scoring.StepRec]]] = {}
    try:
        for step, j in pairs:
            new = await judge_votes(client, cfg, step)
            old_votes = tuple(scoring.VoteRec(v.value, v.status) for v in j.votes)
            new_votes = tuple(scoring.VoteRec(v["value"], v["status"] if v["status"] in ("ok", "unparseable")
                                              else "error") for v in new)
            total += 1
            agree += scoring.majority(old_votes) == scoring.majority(new_votes)
            d = per_traj.setdefault(step.trajectory_id, {"old": [], "new": []})
            d["old"].append(scoring.StepRec(step.event_id, step.step_index, old_votes, step.reference_label))
            d["new"].append(scoring.StepRec(step.event_id, step.step_index, new_votes, step.reference_label))
    finally:
        if not use_recorded:
            await client.__aexit__(None, None, None)

    def acc(which: str) -> tuple[float | None, float | None]:
        trajs = [scoring.TrajRec(t, outcomes.get(t, "aborted"), tuple(v[which])) for t, v in per_traj.items()]
        return scoring.judge_accuracies(trajs)

    (po, oo), (pn, on) = acc("old"), acc("new")
    return {"steps": total, "agreement": agree / total if total else None,
            "original": {"process_accuracy": po, "outcome_accuracy": oo},
            "rejudge": {"process_accuracy": pn, "outcome_accuracy": on}}

