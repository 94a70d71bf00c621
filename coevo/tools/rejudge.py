"""Another judge over a run's recorded steps, compared with the judge that ran.

Invariant: every recorded step with a recorded verdict is judged again exactly once, by the judge
agent's own voting (``replay.judge_votes``); answered from the recorded responses under the run's
own config, the new votes are the recorded ones: agreement 1, both accuracies equal.
"""

from __future__ import annotations

from typing import Any

from coevo.config import CoevoConfig
from coevo.observe.progress import tracked
from coevo.runtime.bus import NatsBus
from coevo.schemas import StepJudged, StepTaken, TrajectoryCompleted
from coevo.tools.events import load_events
from coevo.tools.replay import RecordedResponses, judge_votes


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
    counts: dict[str, int] = {}
    per_traj: dict[str, dict[str, list[scoring.StepRec]]] = {}
    try:
        for step, j in tracked(pairs, "re-judging", unit="steps"):
            new = await judge_votes(client, cfg, step)
            old_votes = tuple(scoring.VoteRec(v.value, v.status) for v in j.votes)
            new_votes = tuple(
                scoring.VoteRec(v["value"], v["status"] if v["status"] in ("ok", "unparseable") else "error")
                for v in new
            )
            for v in new_votes:
                counts[v.status] = counts.get(v.status, 0) + 1
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
    return {
        "steps": total,
        "agreement": agree / total if total else None,
        "original": {"process_accuracy": po, "outcome_accuracy": oo},
        "rejudge": {"process_accuracy": pn, "outcome_accuracy": on},
        "rejudge_votes": {status: counts.get(status, 0) for status in ("ok", "unparseable", "error")},
    }


def unparsed(votes: dict[str, int]) -> tuple[str, bool] | None:
    """What a re-judge's vote counts say against its numbers, and whether they mean nothing at all
    (no vote parsed): None when every vote parsed."""
    bad = votes.get("unparseable", 0) + votes.get("error", 0)
    total = bad + votes.get("ok", 0)
    if bad == 0:
        return None
    failed = f", {votes['error']} failed" if votes.get("error") else ""
    what = (
        f"{votes.get('unparseable', 0)} of the new judge's {total} votes were unparseable (no \\boxed{{1}} "
        f"or \\boxed{{-1}} in the answer){failed}"
    )
    if votes.get("ok", 0) == 0:
        return f"rejudge: {what}: its agreement and accuracies mean nothing", True
    return f"rejudge: {what}: agreement and accuracies count them as no verdict", False
