"""The policy endpoint: OpenAI-compatible completions in front of the policy's inference client,
and episodes that turn an outside agent's calls into coevo's events.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``; ``POST
/coevo/v1/episodes`` (``{}``: the next rollout of the run's task pool; ``{"task_id", "goal"}``: the
agent's own task), ``POST /coevo/v1/episodes/{id}/finish`` (``{"outcome"}`` or ``{"reward"}``,
optionally the final ``"observation"``), ``GET /coevo/v1/episodes/{id}``. A call belongs to an
episode when it names it as the OpenAI ``user`` field or in the header ``X-Coevo-Episode``; calls
outside episodes are served and not recorded.

Invariants:
- each call of an episode is one ``StepTaken`` with the exact prompt and response token ids, the
  sampling log-probs and the weights version that produced them (token-in/token-out across turns:
  ``coevo.inference.chat``); a step is published when its next observation is known (the next call
  of its episode, or the finish), in call order, before the episode's ``TrajectoryCompleted``;
- every episode ends with exactly one ``TrajectoryCompleted`` (idle ones after
  ``policy.episode_timeout_s`` and, when the endpoint stops, open ones of the agents' own tasks,
  as ``aborted``); a pooled group abandoned by a stopping agent is redelivered, never aborted;
- every error is OpenAI-shaped; beyond loopback every request needs the API key.

The publishing is the policy agent's (``Sink``): this package knows no bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from pydantic import ValidationError

from coevo.config import CoevoConfig
from coevo.errors import ConfigError
from coevo.inference.chat import ChatTokens, Turn, completion_prompt, normalize
from coevo.inference.engine import KnowsContext
from coevo.schemas import TaskScheduled, TaskSpec
from coevo.schemas.events import Outcome
from coevo.serve import openai_api as oa
from coevo.serve.episodes import Book, Episode, OwnGroups, Pool

_IDENT = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
OUTCOMES = ("won", "lost", "truncated", "aborted")


class Sink(Protocol):
    """Where episodes become events (the policy agent)."""

    async def publish_group(self, task: TaskSpec) -> TaskScheduled: ...

    async def publish_step(self, episode: Episode, fields: dict[str, Any]) -> str: ...

    async def publish_end(self, episode: Episode, outcome: Outcome, error: str | None) -> None: ...


@dataclass(frozen=True)
class Sampled:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    text: str
    finish: oa.Finish
    version: int
    tokens: str
    """how the prompt was built: fresh, reused, mismatch, diverged (chat.TokenPath) or tokens (ids given)"""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def observation_of(messages: list[dict[str, Any]]) -> str:
    """What the agent saw before this call: the messages after the last assistant turn (no system)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    new = [m for m in messages[last + 1:] if m["role"] != "system"]
    parts = [(f"{m['role']}: " if m["role"] == "tool" else "") + m["content"] for m in new]
    return "\n".join(parts) if parts else messages[-1]["content"]


class Endpoint:
    def __init__(self, cfg: CoevoConfig, client: Any, sink: Sink, *, family: Any, counters: Any, log: Any,
                 key: str | None = None, key_file: Path | None = None) -> None:
        """``key``: what every request must carry (None only with ``policy.serve_insecure_loopback``);
        ``key_file``: where a generated key was written, to tell the user."""
        self.cfg, self.pc = cfg, cfg.policy
        self.client, self.sink, self.family, self.counters, self.log = client, sink, family, counters, log
        self.pool = Pool()
        self.own = OwnGroups(cfg.policy.n)
        self.book = Book(cfg.policy.max_concurrent_trajectories)
        self.model_name = cfg.policy.served_name or "coevo-policy"
        self.key = key
        self.key_file = key_file
        self.url: str | None = None
        self._chat: ChatTokens | None = None
        self._texts: dict[str, dict[str, Any]] = {}

    @property
    def chat(self) -> ChatTokens:
        if self._chat is None:
            self._chat = ChatTokens(self.client.tokenizer)
        return self._chat

    # ---- lifecycle ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Endpoint]:
        host, port = self.pc.serve_host, self.cfg.endpoint_port
        if self.key is None and not (self.pc.serve_insecure_loopback and is_loopback(host)):
            raise ConfigError(f"policy.serve_host = {host!r}: the endpoint needs an API key (in the environment "
                              f"variable {self.pc.serve_api_key_env}); serving without one is allowed only on "
                              "loopback with policy.serve_insecure_loopback = true", field="policy.serve_insecure_loopback")
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port or 0)
            await site.start()
            self.url = f"http://{host}:{runner.addresses[0][1]}/v1"
            self.log.info("policy.endpoint", url=self.url, key_required=self.key is not None)
            where = "no key (policy.serve_insecure_loopback)" if self.key is None else \
                f"key in {self.key_file} (OPENAI_API_KEY)" if self.key_file else f"key in ${self.pc.serve_api_key_env}"
            print(f"coevo policy endpoint at {self.url} (OPENAI_BASE_URL), {where}", flush=True)
            yield self
        finally:
            await self.abort_open("the policy endpoint stopped")
            await runner.cleanup()

    async def abort_open(self, why: str) -> None:
        """End the open episodes of the agents' own tasks as aborted (a pooled group is redelivered)."""
        for ep in list(self.book.episodes.values()):
            if ep.on_end is None:
                async with ep.lock:
                    await self.end(ep, "aborted", why)

    async def expire_idle(self, stopping: asyncio.Event) -> None:
        """Until ``stopping``: end episodes idle longer than ``policy.episode_timeout_s`` as aborted."""
        timeout = self.pc.episode_timeout_s
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(5.0, timeout / 4)):
                    await stopping.wait()
            for ep in self.book.idle(time.monotonic(), timeout):
                async with ep.lock:
                    await self.end(ep, "aborted", f"idle for more than {timeout:g} s")
                    self.counters["episodes.expired"] += 1

    # ---- the HTTP surface --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=16 * 1024**2)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/coevo/v1/episodes", self.open_episode)
        app.router.add_post("/coevo/v1/episodes/{episode_id}/finish", self.finish_episode)
        app.router.add_get("/coevo/v1/episodes/{episode_id}", self.get_episode)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        try:
            self._authorize(request)
            return await handler(request)
        except oa.ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            return web.json_response(oa.ApiError(400, f"{param}: {err['msg']}", param=param).body(), status=400)
        except web.HTTPException as exc:
            body = oa.ApiError(exc.status, exc.reason or "error", code="not_found" if exc.status == 404 else None)
            return web.json_response(body.body(), status=exc.status)
        except Exception as exc:
            self.log.error("policy.endpoint_failed", path=request.path, error=repr(exc), exc_info=exc)
            self.counters["endpoint.errors"] += 1
            return web.json_response(oa.ApiError(500, f"internal error: {exc!r}"[:500], type="server_error").body(),
                                     status=500)

    def _authorize(self, request: web.Request) -> None:
        if self.key is None:
            return
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.key.encode()):
            raise oa.ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                              type="authentication_error", code="invalid_api_key")

    @staticmethod
    async def _json(request: web.Request, *, empty_ok: bool = False) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip() and empty_ok:
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise oa.ApiError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise oa.ApiError(400, "the body must be a JSON object")
        return body

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "coevo"}]})

    def _episode_of(self, request: web.Request, user: str | None) -> Episode | None:
        """The episode a call belongs to: header ``X-Coevo-Episode``, else an ``ep-`` id as ``user``."""
        header = request.headers.get("X-Coevo-Episode")
        if header:
            return self._lookup(header)
        return self._lookup(user) if user and user.startswith("ep-") else None

    def _lookup(self, episode_id: str) -> Episode:
        ep = self.book.get(episode_id)
        if ep is None:
            if episode_id in self.book.ended:
                raise oa.ApiError(409, f"episode {episode_id} has ended ({self.book.ended[episode_id]})",
                                  code="episode_ended")
            raise oa.ApiError(404, f"unknown episode {episode_id}", code="episode_not_found")
        return ep

    # ---- sampling ----------------------------------------------------------------------------

    def _max_tokens(self, asked: int | None) -> int:
        return min(asked or self.pc.max_tokens, self.pc.serve_max_tokens)

    def _limit(self) -> int | None:
        return self.client.context_length if isinstance(self.client, KnowsContext) else None

    async def sample(self, prompt_ids: list[int], how: str, max_tokens: int, stops: list[str]) -> Sampled:
        limit = self._limit()
        if limit is not None and len(prompt_ids) + max_tokens > limit:
            raise oa.ApiError(400, f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                              f"context of {limit}", param="messages", code="context_length_exceeded")
        c = await self.client.complete("", prompt_ids=prompt_ids, max_tokens=max_tokens,
                                       temperature=self.pc.temperature)
        ids, lps, finish = list(c.response_token_ids), list(c.logprobs), c.finish_reason
        text = self.client.tokenizer.decode(ids, skip_special_tokens=True)
        if stops:
            k, before = oa.cut_at_stop(lambda t: self.client.tokenizer.decode(t, skip_special_tokens=True), ids, stops)
            if before is not None:
                ids, lps, text, finish = ids[:k], lps[:k], before, "stop"
        self.counters[f"endpoint.tokens.{how}"] += 1
        return Sampled(list(c.prompt_token_ids), ids, lps, text, "length" if finish == "length" else "stop",
                       c.model_version, how)

    def _pieces(self, s: Sampled, shown: str) -> list[str]:
        """The text each token added (for streaming); the whole text at once when it was rewritten."""
        decode = self.client.tokenizer.decode
        full = decode(s.ids, skip_special_tokens=True)
        if full != shown:
            return [shown] if shown else []
        out, before = [], ""
        for k in range(1, len(s.ids) + 1):
            now = decode(s.ids[:k], skip_special_tokens=True)
            if now != before:
                out.append(now[len(before):])
                before = now
        return out

    def _token_logprobs(self, s: Sampled) -> list[tuple[str, float]]:
        tok = self.client.tokenizer
        return [(tok.decode([t], skip_special_tokens=False), lp) for t, lp in zip(s.ids, s.logprobs, strict=True)]

    # ---- completions -------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = oa.ChatRequest.model_validate(await self._json(request))
        ep = self._episode_of(request, req.user)
        messages, max_tokens = normalize(req.messages), self._max_tokens(req.max_completion_tokens or req.max_tokens)
        tools = bool(req.tools) and req.tool_choice != "none"
        if ep is None:
            ids, how = self.chat.prompt(messages, req.tools)
            samples = await asyncio.gather(*(self.sample(ids, how, max_tokens, req.stops()) for _ in range(req.n)))
            answers = [self._answer(s, tools) for s in samples]
            self.counters["endpoint.calls.unrecorded"] += 1
        else:
            self._check_call(ep, req.n)
            async with ep.lock:
                self._check_open(ep)
                ids, how = self.chat.prompt(messages, req.tools, ep.turn)
                await self._flush(ep, observation_of(messages))
                s = await self.sample(ids, how, max_tokens, req.stops())
                shown, calls = answer = self._answer(s, tools)
                self._record(ep, s, observation_of(messages), json.dumps([c["function"] for c in calls]) if calls
                             else shown)
                assistant = {"role": "assistant", "content": shown, **({"tool_calls": calls} if calls else {})}
                ep.turn = Turn(messages, normalize([assistant])[0], s.prompt_ids, s.ids, req.tools)
            samples, answers = [s], [answer]
        choices = [oa.chat_choice(i, shown, calls, "tool_calls" if calls else s.finish,
                                  self._token_logprobs(s) if req.logprobs else None)
                   for i, (s, (shown, calls)) in enumerate(zip(samples, answers, strict=True))]
        pieces = [self._pieces(s, shown) for s, (shown, _) in zip(samples, answers, strict=True)]
        body = oa.envelope("chat.completion", self.model_name, choices, self._usage(samples), self._extra(ep, samples))
        return await self._respond(request, body, pieces, req)

    @staticmethod
    def _answer(s: Sampled, tools: bool) -> tuple[str, list[dict[str, Any]]]:
        return oa.parse_tool_calls(s.text) if tools else (s.text, [])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = oa.CompletionRequest.model_validate(await self._json(request))
        ep = self._episode_of(request, req.user)
        prompt, max_tokens = req.single(), self._max_tokens(req.max_tokens)
        text = prompt if isinstance(prompt, str) else self.client.tokenizer.decode(prompt, skip_special_tokens=False)
        if ep is None:
            ids, how = self._text_prompt(prompt, None)
            samples = await asyncio.gather(*(self.sample(ids, how, max_tokens, req.stops()) for _ in range(req.n)))
            self.counters["endpoint.calls.unrecorded"] += 1
        else:
            self._check_call(ep, req.n)
            async with ep.lock:
                self._check_open(ep)
                prev = ep.text_turn
                ids, how = self._text_prompt(prompt, prev)
                seen = text[len(prev[0]) + len(prev[2]):] if prev and text.startswith(prev[0] + prev[2]) else text
                await self._flush(ep, seen)
                s = await self.sample(ids, how, max_tokens, req.stops())
                self._record(ep, s, seen, s.text)
                ep.text_turn = (text, s.prompt_ids, s.text, s.ids)
            samples = [s]
        echo = text if req.echo else ""
        choices = [oa.completion_choice(i, echo + s.text, s.finish, self._token_logprobs(s) if req.logprobs else None)
                   for i, s in enumerate(samples)]
        body = oa.envelope("text_completion", self.model_name, choices, self._usage(samples), self._extra(ep, samples))
        return await self._respond(request, body, [self._pieces(s, s.text) for s in samples], req)

    def _text_prompt(self, prompt: str | list[int], prev: tuple[str, list[int], str, list[int]] | None
                     ) -> tuple[list[int], str]:
        if isinstance(prompt, list):
            return list(prompt), "tokens"
        ids, how = completion_prompt(self.client.tokenizer, prompt, prev)
        return ids, how

    def _check_call(self, ep: Episode, n: int) -> None:
        if n > 1:
            raise oa.ApiError(400, "n > 1 inside an episode: an episode is one sequence of calls (open n episodes "
                              "instead)", param="n")

    def _check_open(self, ep: Episode) -> None:
        if ep.ended:
            raise oa.ApiError(409, f"episode {ep.episode_id} has ended", code="episode_ended")
        if ep.calls >= self.cfg.env.max_steps:
            raise oa.ApiError(409, f"episode {ep.episode_id} made env.max_steps = {self.cfg.env.max_steps} calls: "
                              "finish it", code="episode_step_cap")

    def _record(self, ep: Episode, s: Sampled, observation: str, action: str) -> None:
        """This call's step, published once its next observation is known."""
        ep.pending = {"step_index": ep.calls, "observation": observation, "prompt_token_ids": s.prompt_ids,
                      "response_token_ids": s.ids, "logprobs": s.logprobs, "response_text": s.text,
                      "action_text": action, "policy_version": s.version}
        ep.calls += 1
        ep.last_active = time.monotonic()
        self.counters["endpoint.calls.recorded"] += 1

    async def _flush(self, ep: Episode, next_observation: str, done: bool = False) -> None:
        if ep.pending is None:
            return
        fields, ep.pending = ep.pending, None
        step_id = await self.sink.publish_step(ep, {**fields, "next_observation": next_observation, "done": done})
        ep.step_ids.append(step_id)
        ep.versions.append(int(fields["policy_version"]))

    def _usage(self, samples: list[Sampled]) -> dict[str, int]:
        return oa.usage(len(samples[0].prompt_ids), sum(len(s.ids) for s in samples))

    def _extra(self, ep: Episode | None, samples: list[Sampled]) -> dict[str, Any]:
        info: dict[str, Any] = {"policy_version": samples[0].version, "tokens": samples[0].tokens}
        if ep is not None:
            info.update(episode_id=ep.episode_id, step_index=ep.calls - 1)
        return {"coevo": info}

    async def _respond(self, request: web.Request, body: dict[str, Any], pieces: list[list[str]],
                       req: oa._Request) -> web.StreamResponse:
        headers = {"X-Coevo-Policy-Version": str(body["coevo"]["policy_version"])}
        if not req.stream:
            return web.json_response(body, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include = bool((req.stream_options or {}).get("include_usage"))
        for chunk in oa.stream_chunks(body, pieces, include):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- episodes ----------------------------------------------------------------------------

    async def open_episode(self, request: web.Request) -> web.Response:
        body = await self._json(request, empty_ok=True)
        if self.book.full():
            raise oa.ApiError(429, f"{self.book.max_open} episodes are open (policy.max_concurrent_trajectories): "
                              "finish some first", type="rate_limit_error", code="too_many_episodes")
        ep = await (self._own_episode(body) if "task_id" in body else self._pooled_episode(body))
        self.counters["endpoint.episodes.opened"] += 1
        return web.json_response({**ep.describe(), **self._texts.get(ep.episode_id, {}),
                                  "policy_version": self.client.version})

    async def _own_episode(self, body: dict[str, Any]) -> Episode:
        task_id, goal = body.get("task_id"), body.get("goal", "")
        if not isinstance(task_id, str) or not _IDENT.match(task_id):
            raise oa.ApiError(400, "task_id must be 1-128 characters of A-Z a-z 0-9 _ . : -", param="task_id")
        if not isinstance(goal, str):
            raise oa.ApiError(400, "goal must be text", param="goal")
        async with self.own.lock:
            slot = self.own.next_slot(task_id)
            if slot is None:
                task = TaskSpec(task_id=task_id, family="external", params={"goal": goal})
                scheduled = await self.sink.publish_group(task)
                slot = (scheduled, self.own.opened(scheduled))
        scheduled, index = slot
        return self.book.add(scheduled, index, f"{scheduled.group_id}-r{index}", goal)

    async def _pooled_episode(self, body: dict[str, Any]) -> Episode:
        if self.cfg.env.family != "external":
            raise oa.ApiError(409, f"this run's pool ({self.cfg.env.family}) is played by coevo's policy agent: send "
                              "your own {\"task_id\", \"goal\"}, or run with --family external", code="no_pool")
        if self.cfg.env.tasks_from is None:
            raise oa.ApiError(409, "this run has no task pool (env.tasks_from is not set): send your own "
                              "{\"task_id\", \"goal\"}", code="no_pool")
        wait_s = min(max(float(body.get("wait_s", 30.0)), 0.0), 300.0)
        rollout = await self.pool.take(wait_s)
        if rollout is None:
            raise oa.ApiError(503, f"no task was scheduled within {wait_s:g} s: retry", type="server_error",
                              code="no_task_available")
        info = await self.task_text(rollout.group.scheduled.task)
        ep = self.book.add(rollout.group.scheduled, rollout.index, rollout.trajectory_id, info["goal"],
                           on_end=rollout.group.ended_one)
        self._texts[ep.episode_id] = info
        return ep

    async def task_text(self, task: TaskSpec) -> dict[str, Any]:
        """What an agent is told of a pooled task: the family's first observation of it."""
        env = self.family.make_env()
        try:
            obs = await env.reset(task)
        finally:
            await env.close()
        return {"goal": obs.text, "candidates": list(obs.candidates), "objective": obs.objective}

    async def finish_episode(self, request: web.Request) -> web.Response:
        ep = self._lookup(request.match_info["episode_id"])
        body = await self._json(request, empty_ok=True)
        outcome = body.get("outcome")
        if outcome is None and isinstance(body.get("reward"), int | float):
            outcome = "won" if float(body["reward"]) > self.cfg.env.win_threshold else "lost"
        if outcome not in OUTCOMES:
            raise oa.ApiError(400, f"give \"outcome\" (one of {', '.join(OUTCOMES)}) or a numeric \"reward\"",
                              param="outcome")
        observation = body.get("observation", "")
        async with ep.lock:
            if ep.ended:  # finished concurrently
                raise oa.ApiError(409, f"episode {ep.episode_id} has ended", code="episode_ended")
            await self.end(ep, outcome, body.get("error") if outcome == "aborted" else None, str(observation))
        return web.json_response({"episode_id": ep.episode_id, "trajectory_id": ep.trajectory_id, "outcome": outcome,
                                  "steps": len(ep.step_ids)})

    async def get_episode(self, request: web.Request) -> web.Response:
        return web.json_response(self._lookup(request.match_info["episode_id"]).describe())

    async def end(self, ep: Episode, outcome: Outcome, error: str | None, observation: str = "") -> None:
        """Publish the last step and the trajectory (call with ``ep.lock`` held)."""
        if ep.ended:
            return
        await self._flush(ep, observation, done=True)
        await self.sink.publish_end(ep, outcome, error)
        self.book.close(ep, outcome)
        self._texts.pop(ep.episode_id, None)
        self.counters[f"endpoint.episodes.{outcome}"] += 1
