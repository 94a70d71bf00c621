"""Environments as live services: a host agent serving episodes over NATS, and its client.

Invariants:
- a session lives on exactly one worker; ``step``/``close`` are addressed to that worker;
- a worker hosts at most ``env.max_sessions`` episodes and closes those idle for ``session_idle_s``;
- when the worker holding a session is gone, the client ends the episode as ``aborted`` (never a
  failure); a step slower than ``env.step_timeout_s`` raises ``EnvTimeout`` naming the worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import TypeAdapter, ValidationError

from coevo.envs import make_family
from coevo.envs.base import Environment, Observation, StepResult
from coevo.errors import EnvError, EnvTimeout
from coevo.runtime.agent import Agent
from coevo.runtime.rpc import is_request
from coevo.schemas import TaskSpec, new_id
from coevo.schemas.envproto import EnvClose, EnvObservation, EnvOpen, EnvReply, EnvStep, env_subject

_REQUEST_TYPE: Any = EnvOpen | EnvStep | EnvClose  # a union: pydantic takes it, its stub says type[T]
_REQUEST: TypeAdapter[EnvOpen | EnvStep | EnvClose] = TypeAdapter(_REQUEST_TYPE)


def _obs(o: Observation) -> EnvObservation:
    return EnvObservation(text=o.text, candidates=list(o.candidates), objective=o.objective)


class EnvHost(Agent):
    """``coevo agent env --family F``: hosts episodes of family F for any client on the bus."""

    role = "env"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.family = make_family(self.cfg.env)
        self.sessions: dict[str, tuple[Environment, float]] = {}

    async def main(self) -> None:
        fam = self.cfg.env.family
        nc = self.bus.nc
        # nats-py runs one callback of a subscription at a time: hand each request to a task
        # owned here, so slow episodes do not queue behind each other.
        subjects = (env_subject(self.bus.run_id, fam), env_subject(self.bus.run_id, fam, self.agent_id))
        async with asyncio.TaskGroup() as tg:

            async def dispatch(msg: Msg) -> None:
                if any(is_request(msg, s) for s in subjects):
                    tg.create_task(self._on_request(msg), name=f"{self.agent_id}:request")
                else:
                    self.counters["env.not_a_request"] += 1

            shared = await nc.subscribe(subjects[0], queue=f"env-{fam}", cb=dispatch)
            own = await nc.subscribe(subjects[1], cb=dispatch)
            self.log.info("env.serving", family=fam)
            try:
                while await self.sleep(min(5.0, self.cfg.env.session_idle_s / 2)):
                    await self._expire_idle()
            finally:
                await shared.unsubscribe()
                await own.unsubscribe()
        for env, _ in self.sessions.values():
            await env.close()
        self.sessions.clear()

    async def _expire_idle(self) -> None:
        limit = time.monotonic() - self.cfg.env.session_idle_s
        for sid, (env, last) in list(self.sessions.items()):
            if last < limit:
                await env.close()
                del self.sessions[sid]
                self.counters["sessions_expired"] += 1

    async def _on_request(self, msg: Msg) -> None:
        try:
            req = _REQUEST.validate_json(msg.data)
            reply = await self._serve(req)
        except ValidationError as exc:
            reply = EnvReply(ok=False, error=f"bad request: {exc.errors()[0]['msg']}", worker_id=self.agent_id)
        except Exception as exc:  # reported to the client, counted here
            self.counters["env_errors"] += 1
            reply = EnvReply(ok=False, error=f"{type(exc).__name__}: {exc}", worker_id=self.agent_id)
        await msg.respond(reply.model_dump_json().encode())

    async def _serve(self, req: EnvOpen | EnvStep | EnvClose) -> EnvReply:
        if isinstance(req, EnvOpen):
            if len(self.sessions) >= self.cfg.env.max_sessions:
                return EnvReply(ok=False, error="busy", worker_id=self.agent_id)
            env = self.family.make_env()
            obs = await env.reset(req.task)
            sid = new_id()
            self.sessions[sid] = (env, time.monotonic())
            self.counters["sessions_opened"] += 1
            return EnvReply(ok=True, worker_id=self.agent_id, session_id=sid, observation=_obs(obs))
        entry = self.sessions.get(req.session_id)
        if entry is None:
            return EnvReply(ok=False, error=f"no session {req.session_id} on {self.agent_id}", worker_id=self.agent_id)
        env, _ = entry
        if isinstance(req, EnvClose):
            await env.close()
            del self.sessions[req.session_id]
            return EnvReply(ok=True, worker_id=self.agent_id, session_id=req.session_id)
        result = await env.step(req.action)
        self.counters["steps"] += 1
        if result.done:
            await env.close()
            del self.sessions[req.session_id]
        else:
            self.sessions[req.session_id] = (env, time.monotonic())
        return EnvReply(
            ok=True,
            worker_id=self.agent_id,
            session_id=req.session_id,
            observation=_obs(result.observation),
            done=result.done,
            outcome=result.outcome,
            reference_label=result.reference_label,
            info_json=json.dumps(result.info, default=str),
        )


class RemoteEnv(Environment):
    """An ``Environment`` whose episodes run on an env worker somewhere on the bus."""

    def __init__(
        self, nc: NATS, run_id: str, family: str, *, step_timeout_s: float = 30.0, open_retries: int = 5
    ) -> None:
        self.nc = nc
        self.run_id = run_id
        self.family = family
        self.step_timeout_s = step_timeout_s
        self.open_retries = open_retries
        self.worker_id: str | None = None
        self.session_id: str | None = None

    async def _request(self, subject: str, payload: bytes, timeout_s: float) -> EnvReply:
        msg = await self.nc.request(subject, payload, timeout=timeout_s)
        return EnvReply.model_validate_json(msg.data)

    async def reset(self, task: TaskSpec) -> Observation:
        await self.close()
        payload = EnvOpen(task=task).model_dump_json().encode()
        last = "no worker"
        for attempt in range(self.open_retries):
            try:
                reply = await self._request(env_subject(self.run_id, self.family), payload, self.step_timeout_s)
            except nats.errors.NoRespondersError:
                last = f"no {self.family} environment worker is running (start: coevo agent env --family {self.family})"
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            except (nats.errors.TimeoutError, TimeoutError) as exc:
                raise EnvTimeout("(any)", self.step_timeout_s) from exc
            if reply.ok and reply.observation is not None:
                self.worker_id, self.session_id = reply.worker_id, reply.session_id
                o = reply.observation
                return Observation(o.text, list(o.candidates), o.objective)
            last = reply.error or "unknown error"
            if last != "busy":
                raise EnvError(f"{self.family} worker {reply.worker_id}: {last}")
            await asyncio.sleep(0.05 * (attempt + 1))
        raise EnvError(f"cannot open a {self.family} episode: {last}")

    async def step(self, action: str) -> StepResult:
        if self.session_id is None or self.worker_id is None:
            raise EnvError("step without an open episode (call reset)")
        subject = env_subject(self.run_id, self.family, self.worker_id)
        payload = EnvStep(session_id=self.session_id, action=action).model_dump_json().encode()
        try:
            reply = await self._request(subject, payload, self.step_timeout_s)
        except nats.errors.NoRespondersError:
            return self._aborted(f"environment worker {self.worker_id} is gone")
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise EnvTimeout(self.worker_id, self.step_timeout_s) from exc
        if not reply.ok or reply.observation is None:
            if reply.error and reply.error.startswith("no session"):
                return self._aborted(reply.error)
            raise EnvError(f"{self.family} worker {self.worker_id}: {reply.error}")
        if reply.done:
            self.session_id = None
        o = reply.observation
        return StepResult(
            Observation(o.text, list(o.candidates), o.objective),
            reply.done,
            reply.outcome,
            reply.reference_label,
            json.loads(reply.info_json),
        )

    def _aborted(self, why: str) -> StepResult:
        self.session_id = None
        return StepResult(Observation(text=""), True, "aborted", None, {"error": why})

    async def close(self) -> None:
        """End the session on its worker. Within a cancellation (an agent stopping) the answer is waited
        for half a second only: the worker closes a session left idle for ``env.session_idle_s``
        anyway, and a stop across a cut waited 5 s per rollout for an answer that could not come."""
        if self.session_id is None or self.worker_id is None:
            return
        sid, self.session_id = self.session_id, None
        task = asyncio.current_task()
        wait_s = 0.5 if task is not None and task.cancelling() else 5.0
        try:
            await self._request(
                env_subject(self.run_id, self.family, self.worker_id),
                EnvClose(session_id=sid).model_dump_json().encode(),
                wait_s,
            )
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            pass
