"""The judge agent: ``m`` votes on every step, concurrently.

Invariants: each ``StepTaken`` yields exactly one ``StepJudged`` with ``m`` votes, whose event id
is derived from the step's id, so a step judged twice (the judge died before acking) is stored
once; except a step of a group the judge has seen scored (``GroupScored``: the scorer stopped waiting
for its votes, so none could count), which is acknowledged unjudged and counted: before its votes
were asked (``steps.skipped_scored``), or while they were in flight, which are then cancelled (a local
engine drops them from its queue; ``steps.abandoned_scored``). So a judge slower than the policy
spends its compute on the steps whose votes still count. A vote is ``ok`` (+1/-1), ``unparseable``
(counted, scored -2 for the judge) or ``error`` (the model call failed: not a vote at all).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from typing import Any, Literal

from coevo.algorithm.prompts import VERDICT_LABELS, Messages, judge_messages, judge_prompt, parse_vote
from coevo.algorithm.recent import put_newest
from coevo.config import JudgeBase, LitellmEndpoint
from coevo.errors import OverBudget
from coevo.inference.chat import PromptForm
from coevo.inference.clients import make_client
from coevo.inference.engine import CachesCalls, Completion, Metered, engine_counters
from coevo.runtime.agent import Agent
from coevo.runtime.aio import unless_set
from coevo.runtime.consumer import Delivery, Subscription
from coevo.schemas import (
    BudgetExceeded,
    FloatArray,
    GroupScored,
    IntArray,
    StepJudged,
    StepTaken,
    Vote,
    WeightsApplied,
    WeightsPublished,
)
from coevo.schemas.events import Role
from coevo.weights.follower import WeightsFollower, report_applied, weights_subscription

SCORED_KEPT = 4096
"""the newest groups a judge remembers, scored or not (the late steps of a scored one are not judged)"""
TESTS_KEPT = 256
"""the newest groups whose unit tests a coding judge keeps (a group's steps arrive close together)"""


def judged_id(step_event_id: str) -> str:
    return f"judged-{step_event_id}"


def step_prompt(step: StepTaken, mode: Literal["verdict", "reasoned"]) -> str:
    return judge_prompt(step.objective, step.observation, step.action_text, step.next_observation, mode)


def step_messages(step: StepTaken, mode: Literal["verdict", "reasoned"]) -> Messages:
    return judge_messages(step.objective, step.observation, step.action_text, step.next_observation, mode)


def step_prompt_ids(form: PromptForm, step: StepTaken, mode: Literal["verdict", "reasoned"]) -> list[int] | None:
    """The step's prompt through the judge's chat template, or None where the raw text is sent."""
    return form.ids(step_messages(step, mode)) if form.chat else None


async def ask(
    client: Any, cfg: JudgeBase, prompt: str, index: int, prompt_ids: list[int] | None = None
) -> tuple[Completion, Literal[1, -1] | None, Literal["ok", "unparseable"]]:
    """One vote: (completion, value, ``ok`` or ``unparseable``). A failed call raises. ``prompt_ids``:
    the prompt rendered with the chat template (``step_prompt_ids``; None: ``prompt`` as raw text).
    Used by the judge agent, and by replay and re-judge with other clients."""
    ids = {"prompt_ids": prompt_ids} if prompt_ids is not None else {}
    if cfg.effective_mode == "verdict":
        c = await client.complete(prompt, choices=list(VERDICT_LABELS), temperature=cfg.temperature, index=index, **ids)
        return c, (1 if c.choice == 0 else -1), "ok"
    c = await client.complete(prompt, max_tokens=cfg.max_tokens, temperature=cfg.temperature, index=index, **ids)
    parsed = parse_vote(c.text)
    return c, parsed, ("ok" if parsed is not None else "unparseable")


class JudgeAgent(Agent):
    role = "judge"
    emits = (StepJudged, WeightsApplied, BudgetExceeded)
    lane: Role = "judge"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.client = make_client(self.cfg, "judge", seed=self.cfg.run.seed + 1)
        self.weights = WeightsFollower.of(
            self.cfg, self.bus, self.lane, self.client, server=self.agent_id, counters=self.counters
        )
        self.form = PromptForm.of(self.client, self.cfg.judge.prompt_format)
        self._tests: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()  # the newest TESTS_KEPT groups'
        self._test_locks: dict[str, asyncio.Lock] = {}
        self._groups: OrderedDict[str, asyncio.Event] = OrderedDict()  # set once scored; the newest SCORED_KEPT

    def snapshot_counters(self) -> dict[str, int]:
        return {**super().snapshot_counters(), **engine_counters(self.client)}

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription("judge", (StepTaken,), self.on_step, concurrency=self.cfg.judge.max_concurrent_steps),
            # its own, from the newest on: a judge that starts late needs no scores from before it
            Subscription("judge-scored", (GroupScored,), self.on_scored, concurrency=1, shared=False, deliver="last"),
            weights_subscription(self.lane, self.on_weights),
        ]

    def scored(self, group_id: str) -> asyncio.Event:
        """Set once ``group_id`` is seen scored."""
        if (event := self._groups.get(group_id)) is None:
            event = asyncio.Event()
            put_newest(self._groups, group_id, event, SCORED_KEPT)
        return event

    async def on_scored(self, event: GroupScored, _d: Delivery) -> None:
        self.scored(event.group_id).set()

    async def on_weights(self, event: WeightsPublished, delivery: Delivery) -> None:
        if (applied := await self.weights.follow(event, delivery)) is not None:
            await report_applied(self, applied)

    async def run(self) -> None:
        if isinstance(self.client, CachesCalls):
            self.client.attach_cache(await self.bus.kv(f"llmcache_{self.role}"))
        async with self.client:  # type: ignore[attr-defined]
            await super().run()

    async def vote(self, prompt: str, index: int, prompt_ids: list[int] | None = None) -> Vote:
        cfg = self.cfg.judge
        external = cfg.backend == "litellm"
        try:
            c, value, status = await ask(self.client, cfg, prompt, index, prompt_ids)
        except OverBudget as exc:
            await self.report_budget(exc)
            return Vote(index=index, value=None, status="error", rationale=str(exc)[:500])
        except Exception as exc:  # the call failed: an error vote, never a -1
            self.counters["vote_errors"] += 1
            if self.counters["vote_errors"] in (1, 10, 100) or self.counters["vote_errors"] % 1000 == 0:
                self.log.warning(
                    "judge.call_failed",
                    error=str(exc)[:300],
                    errors=self.counters["vote_errors"],
                    note="error votes are not votes; groups with mostly errors are not trained on",
                )
            return Vote(index=index, value=None, status="error", rationale=str(exc)[:500])
        self.counters[f"votes.{status}"] += 1
        return Vote(
            index=index,
            value=value,
            status=status,
            rationale=c.text if cfg.effective_mode == "reasoned" else "",
            prompt_token_ids=IntArray(c.prompt_token_ids),
            response_token_ids=IntArray(c.response_token_ids),
            logprobs=FloatArray(c.logprobs),
            allowed_token_ids=None if c.allowed_token_ids is None else IntArray(c.allowed_token_ids),
            model_version=None if external else c.model_version,
            cost_usd=c.cost_usd,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            latency_ms=c.latency_ms,
            cached=c.cached,
        )

    async def report_budget(self, exc: Exception) -> None:
        if self.counters["budget_exceeded"]:
            return
        self.counters["budget_exceeded"] = 1
        judge = self.cfg.judge
        max_usd = judge.api.max_usd if isinstance(judge, LitellmEndpoint) else None
        self.log.error("judge.budget_exceeded", error=str(exc))
        spent = self.client.spent_usd if isinstance(self.client, Metered) else 0.0
        await self.emit(
            self.event(
                BudgetExceeded, backend=judge.backend, model=judge.model or "", spent_usd=spent, max_usd=max_usd or 0.0
            )
        )

    async def on_step(self, step: StepTaken, _d: Delivery) -> None:
        scored = self.scored(step.group_id)
        if scored.is_set():
            self.counters["steps.skipped_scored"] += 1
            return
        if self.cfg.env.family == "coding":
            await self.on_program(step)
            return
        mode = self.cfg.judge.effective_mode
        prompt, ids = step_prompt(step, mode), step_prompt_ids(self.form, step, mode)
        ballot = asyncio.gather(*(self.vote(prompt, j, ids) for j in range(self.cfg.judge.m)))
        if not await unless_set(scored, ballot):
            self.counters["steps.abandoned_scored"] += 1
            return
        votes = ballot.result()
        versions = [v.model_version for v in votes if v.model_version is not None]
        await self.emit(
            self.event(
                StepJudged,
                cause=step,
                event_id=judged_id(step.event_id),
                correlation_id=step.group_id,
                step_event_id=step.event_id,
                trajectory_id=step.trajectory_id,
                task_id=step.task_id,
                group_id=step.group_id,
                step_index=step.step_index,
                votes=list(votes),
                judge_version=max(versions) if versions else None,
            )
        )

    # ---- coding variant: the judge writes unit tests (docs/algorithm.md §2) --------------------------

    async def group_tests(self, step: StepTaken) -> list[dict[str, Any]]:
        """The ``m`` tests of this step's group, written once (first writer wins, kept in KV)."""
        lock = self._test_locks.setdefault(step.group_id, asyncio.Lock())
        async with lock:
            if step.group_id in self._tests:
                return self._tests[step.group_id]
            kv = await self.bus.kv("judgetests")
            stored = await kv.get(step.group_id)
            if stored is not None:
                tests = json.loads(stored)
            else:  # not written yet
                entry = entry_point(step.objective)
                prompt = test_prompt(step.observation, entry)
                tests = []
                for j in range(self.cfg.judge.m):
                    try:
                        c = await self.client.complete(
                            prompt,
                            max_tokens=self.cfg.judge.max_tokens,
                            temperature=self.cfg.judge.temperature,
                            index=j,
                        )
                    except Exception as exc:
                        tests.append({"index": j, "code": None, "text": "", "error": str(exc)[:300]})
                        continue
                    tests.append(
                        {
                            "index": j,
                            "code": extract_test(c.text, entry),
                            "text": c.text,
                            "prompt_token_ids": c.prompt_token_ids,
                            "response_token_ids": c.response_token_ids,
                            "logprobs": c.logprobs,
                            "model_version": c.model_version,
                        }
                    )
                if not await kv.create(step.group_id, json.dumps(tests).encode()):
                    theirs = await kv.get(step.group_id)  # another judge wrote them first: use theirs
                    tests = json.loads(theirs) if theirs is not None else tests
            for oldest, _ in put_newest(self._tests, step.group_id, tests, TESTS_KEPT):
                self._test_locks.pop(oldest, None)
            return tests

    async def on_program(self, step: StepTaken) -> None:
        from coevo.envs.coding import run_tests

        tests = await self.group_tests(step)
        runnable = [t for t in tests if t["code"]]
        passed: list[bool] = []
        if runnable:
            passed, _ = await run_tests(
                step.artifact or step.action_text,
                entry_point(step.objective),
                [t["code"] for t in runnable],
                isolation=self.cfg.env.sandbox,
            )
        verdict = {t["index"]: p for t, p in zip(runnable, passed, strict=True)}
        votes = []
        for t in tests:
            common = {
                "index": t["index"],
                "rationale": t.get("code") or t.get("text", ""),
                "prompt_token_ids": t.get("prompt_token_ids", []),
                "response_token_ids": t.get("response_token_ids", []),
                "logprobs": t.get("logprobs", []),
                "model_version": t.get("model_version"),
            }
            if t.get("error"):
                votes.append(Vote(value=None, status="error", **common))
            elif t["index"] not in verdict:
                votes.append(Vote(value=None, status="unparseable", **common))
            else:
                votes.append(Vote(value=1 if verdict[t["index"]] else -1, status="ok", **common))
            self.counters[f"votes.{votes[-1].status}"] += 1
        await self.emit(
            self.event(
                StepJudged,
                cause=step,
                event_id=judged_id(step.event_id),
                correlation_id=step.group_id,
                step_event_id=step.event_id,
                trajectory_id=step.trajectory_id,
                task_id=step.task_id,
                group_id=step.group_id,
                step_index=step.step_index,
                votes=votes,
                judge_version=self.client.version,
            )
        )


def entry_point(objective: str) -> str:
    m = re.search(r"complete the function (\w+)", objective)
    return m.group(1) if m else "solution"


def test_prompt(problem: str, entry: str) -> str:
    return f"{problem}\n# One unit test for {entry}, as a single assert:\nassert {entry}("


def extract_test(text: str, entry: str) -> str | None:
    """The generated assert, rewritten to call ``candidate``; None when it does not parse."""
    import ast

    line = f"assert {entry}(" + text.strip().splitlines()[0] if text.strip() else ""
    if not line:
        return None
    code = line.replace(f"{entry}(", "candidate(")
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    return code
