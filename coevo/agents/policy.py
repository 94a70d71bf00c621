"""The policy agent: plays each scheduled task ``n`` times, one model call per step.

Invariants: every trajectory started for a ``TaskScheduled`` ends with exactly one
``TrajectoryCompleted`` (``aborted`` when the environment failed), listing the ids of the
``StepTaken`` events it emitted, in order; each step records the model version that chose it.
A group is played with weights no older than the version it was scheduled at (its
``source.model_version``) less ``learner.max_staleness``: at 0, the weights of the step just taken
(the agent waits for them, at most ``weights_wait_s``).
A redelivered task (the agent died mid-group) is played again under new trajectory ids; the
scorer keeps the first completed trajectory of each rollout index.

With the policy endpoint on (``policy.serve_port``, or ``env.family = "external"``) the agent also
serves its inference client to agents outside coevo (``coevo.serve``) and publishes their episodes:
the groups of their own tasks (``TaskScheduled``), each call as a ``StepTaken``, each episode as a
``TrajectoryCompleted``. With family ``external`` it does not play scheduled tasks itself: it hands
their rollouts out as episodes and acknowledges a group once every rollout ended.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevo.acting import choose, step_order
from coevo.acting.ceiling import agreement, ceiling_path, choice_probs
from coevo.envs import make_family
from coevo.envs.base import Environment, Observation, StepResult
from coevo.errors import EnvError
from coevo.inference.chat import ChatTokens, Conversation, PromptForm
from coevo.inference.clients import make_client
from coevo.inference.engine import Completion, engine_counters
from coevo.runtime import faults
from coevo.runtime.agent import Agent
from coevo.runtime.aio import wait_event
from coevo.runtime.consumer import Delivery, Subscription
from coevo.runtime.credentials import generated_token
from coevo.schemas import (
    ENDPOINT_GROUPS,
    LearnerStepped,
    StepAgreementMeasured,
    StepTaken,
    TaskScheduled,
    TaskSpec,
    TrajectoryCompleted,
    WeightsApplied,
    WeightsPublished,
    new_id,
)
from coevo.schemas.events import Outcome, Role
from coevo.weights.follower import WeightsFollower, report_applied, weights_subscription

if TYPE_CHECKING:
    from coevo.config import CoevoConfig
    from coevo.serve.episodes import Episode


def endpoint_key(cfg: CoevoConfig, run_id: str) -> tuple[str | None, Path | None]:
    """The policy endpoint's API key and the file it was written to: the configured environment
    variable's, else one generated for the run (``runs/<run>/policy-endpoint.key``, mode 0600, kept
    across restarts); none with ``policy.serve_insecure_loopback``."""
    given = os.environ.get(cfg.policy.serve_api_key_env)
    if given:
        return given, None
    if cfg.policy.serve_insecure_loopback:
        return None, None
    path = cfg.run.runs_dir / run_id / "policy-endpoint.key"
    return generated_token(path), path


class PolicyAgent(Agent):
    role = "policy"
    emits = (StepTaken, TrajectoryCompleted, StepAgreementMeasured, WeightsApplied, TaskScheduled)
    lane: Role = "policy"
    weights_wait_s = 120.0
    """how long a group waits for the weights it was scheduled at before it is played with older ones"""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.family = make_family(self.cfg.env)
        self.client = make_client(self.cfg, "policy", seed=self.cfg.run.seed)
        self.weights = WeightsFollower.of(
            self.cfg, self.bus, self.lane, self.client, server=self.agent_id, counters=self.counters
        )
        self.rollout_permits = asyncio.Semaphore(self.cfg.policy.max_concurrent_trajectories)
        self.measures_agreement = self.cfg.policy.mode == "choice" and self.family.has_ceiling
        """whether evaluation groups get a ``StepAgreementMeasured`` (a choosing policy, a family with a ceiling)"""
        self._chat_tokens: ChatTokens | None = None
        self.form = PromptForm.of(self.client, self.cfg.policy.prompt_format)
        self.endpoint: Any = None
        self.weights_changed = asyncio.Event()
        if self.cfg.endpoint_port is not None:
            from coevo.serve import Endpoint

            key, key_file = endpoint_key(self.cfg, self.bus.run_id)
            self.endpoint = Endpoint(
                self.cfg,
                self.client,
                self,
                family=self.family,
                counters=self.counters,
                log=self.log,
                key=key,
                key_file=key_file,
            )

    def snapshot_counters(self) -> dict[str, int]:
        return {**super().snapshot_counters(), **engine_counters(self.client)}

    def subscriptions(self) -> list[Subscription]:
        subs = [
            # the tasks agent's groups (the endpoint's own are played through it); rollouts are slow
            Subscription("policy", (TaskScheduled,), self.on_task, concurrency=16, batch=1, scope="tasks"),
            weights_subscription(self.lane, self.on_weights),
        ]
        if self.cfg.endpoint_port is not None:  # new episodes wait while the learner is behind on the endpoint's groups
            subs.append(
                Subscription(
                    "policy-steps",
                    (LearnerStepped,),
                    self.on_stepped,
                    concurrency=1,
                    shared=False,
                    deliver="last",
                    scope=self.lane,
                )
            )
        return subs

    async def on_stepped(self, event: LearnerStepped, _d: Delivery) -> None:
        if event.role == "policy":  # trained or not: every group it names is done with the learner
            self.endpoint.trained(event.disposed_group_ids)

    async def run(self) -> None:
        async with self.client:  # type: ignore[attr-defined]
            if self.endpoint is None:
                await super().run()
                return
            async with self.endpoint.serving():
                await super().run()

    async def main(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.expire_idle(self.stopping)

    async def on_weights(self, event: WeightsPublished, delivery: Delivery) -> None:
        if (applied := await self.weights.follow(event, delivery)) is not None:
            await report_applied(self, applied)
            self.weights_changed.set()

    async def weights_for(self, task: TaskScheduled) -> None:
        """Wait until the client serves weights no older than ``task`` allows (at most ``weights_wait_s``:
        then it is played as it is, counted and logged)."""
        want = (task.source.model_version or 0) - self.cfg.learner.max_staleness
        deadline = time.monotonic() + self.weights_wait_s
        while self.weights.follows and self.client.version < want:
            left = deadline - time.monotonic()
            if left <= 0:
                self.counters["groups.played_behind"] += 1
                self.log.warning(
                    "policy.weights_behind", group_id=task.group_id, want=want, serving=self.client.version
                )
                return
            self.weights_changed.clear()
            await wait_event(self.weights_changed, left)

    def make_env(self) -> Environment:
        if self.cfg.env.remote:
            from coevo.envs.service import RemoteEnv

            return RemoteEnv(
                self.bus.nc, self.bus.run_id, self.cfg.env.family, step_timeout_s=self.cfg.env.step_timeout_s
            )
        return self.family.make_env()

    async def on_task(self, event: TaskScheduled, delivery: Delivery) -> None:
        attempt = delivery.num_delivered
        if event.task.family == "external":  # an outside agent's own task: its episodes come through the endpoint
            return
        if self.cfg.env.family == "external":  # played by agents outside coevo, through the endpoint
            await self.endpoint.pool.offer(event, attempt)
            self.counters["groups"] += 1
            return
        await self.weights_for(event)
        async with asyncio.TaskGroup() as tg:
            for i in range(event.n_rollouts):
                tg.create_task(self.rollout(event, i, attempt), name=f"{event.group_id}-r{i}")
            if event.purpose == "eval" and self.measures_agreement:
                tg.create_task(self.step_agreement(event), name=f"{event.group_id}-agreement")
        self.counters["groups"] += 1

    async def step_agreement(self, task: TaskScheduled) -> None:
        """The policy's agreement with the ceiling on an evaluation group's task (``coevo.acting.ceiling``):
        on the ceiling's path through the episode of the group's first rollout key, one forward pass a
        state, no draw, under one rollout permit. A client without choice distributions (a server without
        constrained log-probs) turns the measurement off for the agent's life. Either way, and when the
        measurement fails, the group's rollouts go on: no event, counted and logged (that round's
        agreement is then left out, as a round not every group of which was measured)."""
        try:
            async with self.rollout_permits:
                path = await ceiling_path(self.family, task.task, f"{task.group_id}-r0", self.cfg.policy, self.make_env)
                measured = [await choice_probs(self.client, self.cfg.policy, s, self.form) for s in path]
        except Exception as exc:  # an extra measurement: it never costs the group its rollouts
            self.counters["agreement.failed"] += 1
            self.log.warning("policy.agreement_failed", group_id=task.group_id, error=repr(exc)[:300])
            return
        known = [m for m in measured if m is not None]
        if len(known) < len(measured):
            self.measures_agreement = False
            self.counters["agreement.unsupported"] += 1
            self.log.warning("policy.agreement_unsupported", client=type(self.client).__name__)
            return
        pairs = [agreement(probs, s.pick) for (probs, _), s in zip(known, path, strict=True)]
        await self.emit(
            self.event(
                StepAgreementMeasured,
                cause=task,
                correlation_id=task.group_id,
                group_id=task.group_id,
                task_id=task.task.task_id,
                policy_version=min((version for _, version in known), default=self.client.version),
                states=len(pairs),
                agreement=round(sum(p for p, _ in pairs) / len(pairs), 6) if pairs else None,
                greedy=round(sum(g for _, g in pairs) / len(pairs), 6) if pairs else None,
            )
        )

    def conversation(self) -> Conversation:
        if self._chat_tokens is None:
            self._chat_tokens = ChatTokens(self.client.tokenizer)  # type: ignore[attr-defined]
        return Conversation(self._chat_tokens)

    async def choose(
        self, obs: Observation, cands: list[str], conversation: Conversation | None, order: list[int] | None
    ) -> tuple[Completion, int | None]:
        """One model call for ``obs``: the completion and the candidate it names (None: none)."""
        c, index, how = await choose(
            self.client, self.cfg.policy, obs, cands, conversation, order=order, form=self.form
        )
        if how is not None:
            self.counters[f"chat.tokens.{how}"] += 1
        return c, index

    async def rollout(self, task_event: TaskScheduled, index: int, attempt: int) -> None:
        cfg = self.cfg.policy
        traj_id = f"{task_event.group_id}-r{index}" + (f"-a{attempt}" if attempt > 1 else "")
        step_ids: list[str] = []
        versions: list[int] = []
        outcome, error = "aborted", None
        async with self.rollout_permits:
            env = self.make_env()
            conversation = self.conversation() if cfg.mode == "chat" else None
            try:
                obs = await env.reset(task_event.task)
                for k in range(self.family.max_steps_cap):
                    cands = list(obs.candidates)
                    order = step_order(cfg, f"{task_event.group_id}-r{index}", k, len(cands))
                    c, index_ = await self.choose(obs, cands, conversation, order)
                    parse_ok = index_ is not None or not cands
                    if not parse_ok:
                        self.counters["action_parse_failures"] += 1
                    action = cands[index_] if index_ is not None else (c.text if not cands else "")
                    result = await env.step(action)
                    step = self.step_event(task_event, traj_id, k, obs, c, index_, action, parse_ok, result, order)
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
        await self.emit(
            self.event(
                TrajectoryCompleted,
                cause=task_event,
                correlation_id=task_event.group_id,
                trajectory_id=traj_id,
                task_id=task_event.task.task_id,
                group_id=task_event.group_id,
                rollout_index=index,
                outcome=outcome,
                num_steps=len(step_ids),
                step_event_ids=step_ids,
                policy_versions=versions,
                error=error,
            )
        )

    def step_event(
        self,
        task_event: TaskScheduled,
        traj_id: str,
        k: int,
        obs: Observation,
        c: Completion,
        index: int | None,
        action: str,
        parse_ok: bool,
        result: StepResult,
        order: list[int] | None = None,
    ) -> StepTaken:
        """The ``StepTaken`` of step ``k``: what was seen, sampled (tokens, log-probs) and done, and its result."""
        return self.event(
            StepTaken,
            cause=task_event,
            correlation_id=task_event.group_id,
            trajectory_id=traj_id,
            task_id=task_event.task.task_id,
            group_id=task_event.group_id,
            step_index=k,
            objective=obs.objective,
            observation=obs.text,
            candidates=list(obs.candidates),
            prompt_token_ids=c.prompt_token_ids,
            response_token_ids=c.response_token_ids,
            logprobs=c.logprobs,
            allowed_token_ids=c.allowed_token_ids,
            response_text=c.text,
            action_index=index,
            shown_order=order,
            action_text=action,
            parse_ok=parse_ok,
            next_observation=result.observation.text,
            done=result.done,
            reference_label=result.reference_label,
            policy_version=c.model_version,
            artifact=result.info.get("program"),
        )

    # ---- the endpoint's episodes as events (coevo.serve.Sink) ----------------------------------

    async def publish_group(self, task: TaskSpec) -> TaskScheduled:
        """A group of an outside agent's own task (its next ``n`` episodes fill it)."""
        group_id = f"{ENDPOINT_GROUPS}{new_id()[:16]}"  # the endpoint's subject (coevo.schemas.registry)
        event = self.event(
            TaskScheduled,
            task=task,
            group_id=group_id,
            n_rollouts=self.cfg.policy.n,
            purpose="train",
            correlation_id=group_id,
        )
        await self.emit(event, confirm=True)
        return event

    async def publish_step(self, episode: Episode, fields: dict[str, Any]) -> str:
        await faults.ahit("endpoint.publish_step")  # a publish that fails: the endpoint keeps the step pending
        sched = episode.scheduled
        step = self.event(
            StepTaken,
            cause=sched,
            correlation_id=sched.group_id,
            trajectory_id=episode.trajectory_id,
            task_id=sched.task.task_id,
            group_id=sched.group_id,
            objective=episode.goal,
            **fields,
        )
        await self.emit(step, confirm=True)
        return step.event_id

    async def publish_end(self, episode: Episode, outcome: Outcome, error: str | None) -> None:
        sched = episode.scheduled
        self.counters[f"trajectories.{outcome}"] += 1
        await self.emit(
            self.event(
                TrajectoryCompleted,
                cause=sched,
                correlation_id=sched.group_id,
                trajectory_id=episode.trajectory_id,
                task_id=sched.task.task_id,
                group_id=sched.group_id,
                rollout_index=episode.rollout_index,
                outcome=outcome,
                num_steps=len(episode.step_ids),
                step_event_ids=list(episode.step_ids),
                policy_versions=list(episode.versions),
                error=error,
            ),
            confirm=True,
        )
