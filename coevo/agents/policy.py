"""The policy agent: plays each scheduled task ``n`` times, one model call per step.

Invariants: every trajectory started for a ``TaskScheduled`` ends with exactly one
``TrajectoryCompleted`` (``aborted`` when the environment failed), listing the ids of the
``StepTaken`` events it emitted, in order; each step records the model version that chose it.
A redelivered task (the agent died mid-group) is played again under new trajectory ids; the
scorer keeps the first completed trajectory of each rollout index.
"""

from __future__ import annotations

import asyncio
from typing import Any

from coevo.agents.follower import WeightsFollower
from coevo.algorithm.prompts import INDEX_LABELS, parse_action, policy_prompt
from coevo.envs import make_family
from coevo.envs.base import EnvError, Environment
from coevo.inference.clients import make_client
from coevo.runtime.agent import Agent
from coevo.runtime.bus import Delivery
from coevo.runtime.consumer import Subscription
from coevo.schemas import StepTaken, TaskScheduled, TrajectoryCompleted, WeightsApplied


class PolicyAgent(WeightsFollower, Agent):
    role = "policy"
    emits = (StepTaken, TrajectoryCompleted, WeightsApplied)
    lane = "policy"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.family = make_family(self.cfg.env)
        self.client = make_client(self.cfg, "policy", seed=self.cfg.run.seed)
        self.rollout_permits = asyncio.Semaphore(self.cfg.policy.max_concurrent_trajectories)

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("policy", (TaskScheduled,), self.on_task, concurrency=16),
                *self.weight_subscriptions()]

    async def run(self) -> None:
        async with self.client:  # type: ignore[attr-defined]
            await super().run()

    def make_env(self) -> Environment:
        if self.cfg.env.remote:
            from coevo.envs.service import RemoteEnv

            return RemoteEnv(self.bus.nc, self.bus.run_id, self.cfg.env.family,
                             step_timeout_s=self.cfg.env.step_timeout_s)
        return self.family.make_env()

    async def on_task(self, event: TaskScheduled, delivery: Delivery) -> None:
        attempt = delivery.num_delivered
        async with asyncio.TaskGroup() as tg:
            for i in range(event.n_rollouts):
                tg.create_task(self.rollout(event, i, attempt), name=f"{event.group_id}-r{i}")
        self.counters["groups"] += 1

    async def rollout(self, task_event: TaskScheduled, index: int, attempt: int) -> None:
        cfg = self.cfg.policy
        traj_id = f"{task_event.group_id}-r{index}" + (f"-a{attempt}" if attempt > 1 else "")
        step_ids: list[str] = []
        versions: list[int] = []
        outcome, error = "aborted", None
        async with self.rollout_permits:
            env = self.make_env()
            try:
                obs = await env.reset(task_event.task)
                for k in range(self.family.max_steps_cap):
                    prompt = policy_prompt(obs.text, obs.candidates, cfg.mode)
                    cands = obs.candidates[: len(INDEX_LABELS)]
                    if cands and cfg.mode == "choice":
                        c = await self.client.complete(prompt, choices=list(INDEX_LABELS[: len(cands)]),
                                                       temperature=cfg.temperature)
                        index_ = c.choice
                    else:
                        c = await self.client.complete(prompt, max_tokens=cfg.max_tokens, temperature=cfg.temperature)
                        index_ = parse_action(c.text, len(cands)) if cands else None
                    parse_ok = index_ is not None or not cands
                    if not parse_ok:
                        self.counters["action_parse_failures"] += 1
                    action = cands[index_] if index_ is not None else (c.text if not cands else "")
                    result = await env.step(action)
                    step = self.event(
                        StepTaken, cause=task_event, correlation_id=task_event.group_id, trajectory_id=traj_id,
                        task_id=task_event.task.task_id, group_id=task_event.group_id, step_index=k,
                        objective=obs.objective, observation=obs.text, candidates=list(obs.candidates),
                        prompt_token_ids=c.prompt_token_ids, response_token_ids=c.response_token_ids,
                        logprobs=c.logprobs, allowed_token_ids=c.allowed_token_ids, response_text=c.text,
                        action_index=index_, action_text=action, parse_ok=parse_ok,
                        next_observation=result.observation.text, done=result.done,
                        reference_label=result.reference_label, policy_version=c.model_version,
                        artifact=result.info.get("program"))
                    await self.emit(step)
                    step_ids.append(step.event_id)
                    versions.append(c.model_version)
                    if result.done:
                        outcome = result.outcome or "truncated"
                        if outcome == "aborted":
                            error = str(result.info.get("error", "environment aborted"))
                        break
                    obs = result.observation
                else:
                    outcome = "truncated"
            except EnvError as exc:
                outcome, error = "aborted", str(exc)
                self.log.warning("policy.env_failed", trajectory_id=traj_id, error=error)
            finally:
                await env.close()
        self.counters[f"trajectories.{outcome}"] += 1
        await self.emit(self.event(
            TrajectoryCompleted, cause=task_event, correlation_id=task_event.group_id, trajectory_id=traj_id,
            task_id=task_event.task.task_id, group_id=task_event.group_id, rollout_index=index,
            outcome=outcome, num_steps=len(step_ids), step_event_ids=step_ids, policy_versions=versions,
            error=error))
