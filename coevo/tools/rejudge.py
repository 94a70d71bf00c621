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
    per_traj: dict[str, dict[str, list[scoring.StepRec]]] = {}
    try:
        for step, j in tracked(pairs, "re-judging", unit="steps"):
            new = await judge_votes(client, cfg, step)
            old_votes = tuple(scoring.VoteRec(v.value, v.status) for v in j.votes)
            new_votes = tuple(
                scoring.VoteRec(v["value"], v["status"] if v["status"] in ("ok", "unparseable") else "error")
                for v in new
            )
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
    }
