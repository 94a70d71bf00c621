"""Another judge over a run's recorded steps, compared with the judge that ran.

Invariant: every recorded step with a recorded verdict (or, with ``limit``, an evenly spread
sample of them, ``spread``) is judged again exactly once, by the judge agent's own voting
(``replay.judge_votes``), up to ``judge.max_concurrent_steps`` steps at once; answered from the
recorded responses under the run's own config (one step at a time: identical prompts are answered in
stream order), the new votes are the recorded ones: agreement 1, both accuracies equal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coevo.algorithm.scoring import StepRec, TrajRec, VoteRec, judge_accuracies, majority
from coevo.config import CoevoConfig
from coevo.observe.progress import tracked
from coevo.runtime.bus import NatsBus
from coevo.schemas import StepJudged, StepTaken, TrajectoryCompleted
from coevo.schemas.events import Outcome
from coevo.tools.events import load_events
from coevo.tools.replay import RecordedResponses, judge_votes

T = TypeVar("T")


def spread(items: Sequence[T], limit: int | None) -> list[T]:
    """``limit`` of ``items`` evenly spread over them, in order (all of them when ``limit`` is None or
    not smaller): a sample of a whole run, not its first minutes."""
    if limit is None or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


@dataclass
class Tally:
    """The old and the new votes of the steps judged again, by trajectory."""

    agree: int = 0
    total: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    per_traj: dict[str, dict[str, list[StepRec]]] = field(default_factory=dict)

    def add(self, step: StepTaken, old: StepJudged, new: list[dict[str, Any]]) -> None:
        old_votes = tuple(VoteRec(v.value, v.status) for v in old.votes)
        new_votes = tuple(
            VoteRec(v["value"], v["status"] if v["status"] in ("ok", "unparseable") else "error") for v in new
        )
        for v in new_votes:
            self.counts[v.status] = self.counts.get(v.status, 0) + 1
        self.total += 1
        self.agree += majority(old_votes) == majority(new_votes)
        d = self.per_traj.setdefault(step.trajectory_id, {"old": [], "new": []})
        d["old"].append(StepRec(step.event_id, step.step_index, old_votes, step.reference_label))
        d["new"].append(StepRec(step.event_id, step.step_index, new_votes, step.reference_label))

    def result(self, outcomes: dict[str, Outcome]) -> dict[str, Any]:
        def acc(which: str) -> tuple[float | None, float | None]:
            trajs = [TrajRec(t, outcomes.get(t, "aborted"), tuple(v[which])) for t, v in self.per_traj.items()]
            return judge_accuracies(trajs)

        (po, oo), (pn, on) = acc("old"), acc("new")
        return {
            "steps": self.total,
            "agreement": self.agree / self.total if self.total else None,
            "original": {"process_accuracy": po, "outcome_accuracy": oo},
            "rejudge": {"process_accuracy": pn, "outcome_accuracy": on},
            "rejudge_votes": {status: self.counts.get(status, 0) for status in ("ok", "unparseable", "error")},
        }


async def rejudge(bus: NatsBus, cfg: CoevoConfig, use_recorded: bool, limit: int | None = None) -> dict[str, Any]:
    """Another judge over the recorded steps: agreement with the original votes, accuracy of both, and
    the new judge's wall clock."""
    from coevo.inference.clients import make_client

    events = await load_events(bus)
    steps = {e.event_id: e for _, e in events if isinstance(e, StepTaken)}
    original = {e.step_event_id: e for _, e in events if isinstance(e, StepJudged)}
    outcomes = {e.trajectory_id: e.outcome for _, e in events if isinstance(e, TrajectoryCompleted)}
    pairs = spread([(steps[s], j) for s, j in original.items() if s in steps], limit)
    if use_recorded:
        client: Any = RecordedResponses(pairs, cfg.judge.effective_mode)
    else:
        client = make_client(cfg, "judge")
        await client.__aenter__()
    permits = asyncio.Semaphore(1 if use_recorded else cfg.judge.max_concurrent_steps)

    async def votes(step: StepTaken) -> list[dict[str, Any]]:
        async with permits:
            return await judge_votes(client, cfg, step)

    tally = Tally()
    t0 = time.monotonic()
    calls = [asyncio.ensure_future(votes(step)) for step, _ in pairs]
    try:
        for (step, j), call in tracked(list(zip(pairs, calls, strict=True)), "re-judging", unit="steps"):
            tally.add(step, j, await call)
    finally:
        for call in calls:
            call.cancel()
        if not use_recorded:
            await client.__aexit__(None, None, None)
    seconds = round(time.monotonic() - t0, 2)
    return tally.result(outcomes) | {"rejudge_seconds": seconds, "judge_mode": cfg.judge.effective_mode}


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
