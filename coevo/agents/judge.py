"""The judge agent: ``m`` votes on every step, concurrently.

Invariants: each ``StepTaken`` yields exactly one ``StepJudged`` with ``m`` votes, whose event id
is derived from the step's id, so a step judged twice (the judge died before acking) is stored
once. A vote is ``ok`` (+1/-1), ``unparseable`` (counted, scored -2 for the judge) or ``error``
(the model call failed: not a vote at all).
"""

from __future__ import annotations

import asyncio
from typing import Any

from coevo.agents.clients import make_client
from coevo.agents.prompts import VERDICT_LABELS, judge_prompt, parse_vote
from coevo.agents.weights import WeightsFollower
from coevo.runtime.agent import Agent
from coevo.runtime.bus import Delivery
from coevo.runtime.consumer import Subscription
from coevo.schemas import StepJudged, StepTaken, Vote


def judged_id(step_event_id: str) -> str:
    return f"judged-{step_event_id}"


class JudgeAgent(WeightsFollower, Agent):
    role = "judge"
    lane = "judge"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.client = make_client(self.cfg, "judge", seed=self.cfg.run.seed + 1)

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("judge", (StepTaken,), self.on_step, concurrency=self.cfg.judge.max_concurrent_steps),
                *self.weight_subscriptions()]

    async def run(self) -> None:
        async with self.client:  # type: ignore[attr-defined]
            await super().run()

    async def vote(self, prompt: str, index: int) -> Vote:
        cfg = self.cfg.judge
        try:
            if cfg.mode == "verdict":
                c = await self.client.complete(prompt, choices=list(VERDICT_LABELS), temperature=cfg.temperature)
                value = 1 if c.choice == 0 else -1
                status = "ok"
            else:
                c = await self.client.complete(prompt, max_tokens=cfg.max_tokens, temperature=cfg.temperature)
                parsed = parse_vote(c.text)
                value, status = (parsed, "ok") if parsed is not None else (None, "unparseable")
        except Exception as exc:  # the call failed: an error vote, never a -1
            self.counters["vote_errors"] += 1
            self.log.warning("judge.call_failed", error=repr(exc)[:300])
            return Vote(index=index, value=None, status="error", rationale=repr(exc)[:500])
        self.counters[f"votes.{status}"] += 1
        return Vote(index=index, value=value, status=status, rationale=c.text if cfg.mode == "reasoned" else "",
                    prompt_token_ids=c.prompt_token_ids, response_token_ids=c.response_token_ids,
                    logprobs=c.logprobs, allowed_token_ids=c.allowed_token_ids, model_version=c.model_version)

    async def on_step(self, step: StepTaken, _d: Delivery) -> None:
        prompt = judge_prompt(step.objective, step.observation, step.action_text, step.next_observation,
                              self.cfg.judge.mode)
        votes = await asyncio.gather(*(self.vote(prompt, j) for j in range(self.cfg.judge.m)))
        versions = [v.model_version for v in votes if v.model_version is not None]
        await self.emit(self.event(
            StepJudged, cause=step, event_id=judged_id(step.event_id), correlation_id=step.group_id,
            step_event_id=step.event_id, trajectory_id=step.trajectory_id, task_id=step.task_id,
            group_id=step.group_id, step_index=step.step_index, votes=list(votes),
            judge_version=max(versions) if versions else None))
