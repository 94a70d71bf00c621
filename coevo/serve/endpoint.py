"""The policy endpoint: OpenAI-compatible completions in front of the policy's inference client,
and episodes that turn an outside agent's calls into coevo's events.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (OpenAI
Responses), ``POST /v1/messages`` (Anthropic Messages), ``GET /v1/models``; ``POST
/coevo/v1/episodes`` (``{}``: the next rollout of the run's task pool; ``{"task_id", "goal"}``: the
agent's own task; the answer carries the episode's own ``key``), ``POST
/coevo/v1/episodes/{id}/reward`` (``{"reward", "call_id"?}``: the environment's reward for the
episode's last call), ``POST /coevo/v1/episodes/{id}/finish`` (``{"outcome"}`` or ``{"reward"}``,
optionally the final ``"observation"``), ``GET /coevo/v1/episodes/{id}``. A call belongs to an
episode when it is authenticated with the episode's key, or names the episode as the OpenAI
``user`` field (Anthropic ``metadata.user_id``) or in the header ``X-Coevo-Episode``, or carries an
agent key (``POST /coevo/v1/agent-keys``: for agents whose key is fixed; its calls belong to the
key's current episode, and ``POST /coevo/v1/episodes/rotate`` ends that one and opens the next); calls outside
episodes are served (at most ``policy.serve_max_unrecorded`` at once) and not recorded.

Invariants:
- each call of an episode is one ``StepTaken`` with the exact prompt and response token ids, the
  sampling log-probs and the weights version that produced them (token-in/token-out across turns:
  ``coevo.inference.chat``); a step is published when its next observation is known (the next call
  of its episode, or the finish), in call order, before the episode's ``TrajectoryCompleted``;
- every episode ends with exactly one ``TrajectoryCompleted`` (idle ones after
  ``policy.episode_timeout_s`` and, when the endpoint stops, open ones of the agents' own tasks,
  as ``aborted``); a pooled group abandoned by a stopping agent is redelivered, never aborted;
- an episode key acts only on its own episode and dies with it; beyond loopback every other request
  needs the run's API key;
- while the learner is behind (``coevo.algorithm.admission``), opening an episode answers 429 with
  ``Retry-After``: rollouts are paced instead of played and dropped as stale;
- every error is in its API's shape (Anthropic's on ``/v1/messages``, OpenAI's elsewhere);
- once the endpoint stops, every request, and every call that waited on an episode the stop
  ended, answers 503 ``endpoint_stopping``: an agent tells coevo's stop from its own mistakes;
- numbers are bounded where they enter: a body with ``Infinity`` or ``NaN`` is not JSON (400), a
  reward is a finite number within ±``scorer.max_abs_env_reward`` (a step's rewards add up within
  it too; else 400 naming ``reward``), and prompt token ids lie inside the vocabulary (400 naming
  ``prompt``);
- a recorded step is kept until it is durably published: a publish that fails leaves it pending
  (the call fails, and the next call or the finish publishes it, with the same event id), so an
  episode's step indices have no gap.

The publishing is the policy agent's (``Sink``): this package knows no bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, cast

from aiohttp import web
from pydantic import ValidationError

from coevo.algorithm.admission import Backlog, behind
from coevo.config import CoevoConfig
from coevo.errors import ApiError, ConfigError, GrammarOverBudget, InvalidTokens
from coevo.inference.chat import Turn, normalize
from coevo.inference.schema_rules import SchemaBudget
from coevo.schemas import TaskScheduled, TaskSpec, new_id
from coevo.schemas.events import Outcome
from coevo.serve import constraints as cs
from coevo.serve import messages_api as ma
from coevo.serve import openai_api as oa
from coevo.serve import responses_api as ra
from coevo.serve.episodes import Book, Episode, OwnGroups, Pool
from coevo.serve.sampler import Answer, ChatCall, Sampled, Sampler

_IDENT = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def wait_seconds(body: dict[str, Any]) -> float:
    """The pool request's ``wait_s`` (default 30), clamped to 0-300 s; anything but a finite number is a 400."""
    value = body.get("wait_s", 30.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"wait_s must be a number of seconds (0-300), not {json.dumps(value)[:40]}", param="wait_s")
    return min(max(float(value), 0.0), 300.0)


OUTCOMES = ("won", "lost", "truncated", "aborted")
BOUND: web.RequestKey[Any] = web.RequestKey("coevo_episode", object)
"""the episode a request's key binds it to (None: the run's key, or an agent key between episodes)"""
AGENT: web.RequestKey[Any] = web.RequestKey("coevo_agent_key", object)
"""the agent key a request carries (None: another key)"""
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models")


def _not_json(constant: str) -> Any:
    """``json.loads`` takes ``Infinity``, ``-Infinity`` and ``NaN``; JSON has no such numbers."""
    raise ValueError(f"{constant} is not a JSON number")


class Sink(Protocol):
    """Where episodes become events (the policy agent)."""

    async def publish_group(self, task: TaskSpec) -> TaskScheduled: ...

    async def publish_step(self, episode: Episode, fields: dict[str, Any]) -> str: ...

    async def publish_end(self, episode: Episode, outcome: Outcome, error: str | None) -> None: ...


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
    new = [m for m in messages[last + 1 :] if m["role"] != "system"]
    parts = [(f"{m['role']}: " if m["role"] == "tool" else "") + m["content"] for m in new]
    return "\n".join(parts) if parts else messages[-1]["content"]


def action_of(answer: Answer) -> str:
    return json.dumps([c["function"] for c in answer.calls]) if answer.calls else answer.text


class Endpoint:
    def __init__(
        self,
        cfg: CoevoConfig,
        client: Any,
        sink: Sink,
        *,
        family: Any,
        counters: Any,
        log: Any,
        key: str | None = None,
        key_file: Path | None = None,
    ) -> None:
        """``key``: what every request must carry (None only with ``policy.serve_insecure_loopback``);
        ``key_file``: where a generated key was written, to tell the user."""
        self.cfg, self.pc = cfg, cfg.policy
        self.client, self.sink, self.family, self.counters, self.log = client, sink, family, counters, log
        self.pool = Pool()
        self.own = OwnGroups(cfg.policy.n)
        self.book = Book(cfg.policy.max_concurrent_trajectories)
        self.history = ra.History()
        self.sampler = Sampler(client, cfg.policy.temperature, counters)
        self.backlog = Backlog(cfg.policy.serve_backlog_timeout_s)
        self._ends: Counter[str] = Counter()
        self._unrecorded = asyncio.Semaphore(cfg.policy.serve_max_unrecorded)
        self.model_name = cfg.policy.served_name or "coevo-policy"
        self.key = key
        self.key_file = key_file
        self.url: str | None = None
        self.stopping = False
        self._texts: dict[str, dict[str, Any]] = {}

    @property
    def chat(self) -> Any:
        return self.sampler.chat

    # ---- lifecycle ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Endpoint]:
        host, port = self.pc.serve_host, self.cfg.endpoint_port
        if self.key is None and not (self.pc.serve_insecure_loopback and is_loopback(host)):
            raise ConfigError(
                f"policy.serve_host = {host!r}: the endpoint needs an API key (in the environment "
                f"variable {self.pc.serve_api_key_env}); serving without one is allowed only on "
                "loopback with policy.serve_insecure_loopback = true",
                field="policy.serve_insecure_loopback",
            )
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port or 0)
            await site.start()
            self.url = f"http://{host}:{runner.addresses[0][1]}/v1"
            self.log.info("policy.endpoint", url=self.url, key_required=self.key is not None)
            where = (
                "no key (policy.serve_insecure_loopback)"
                if self.key is None
                else f"key in {self.key_file} (OPENAI_API_KEY)"
                if self.key_file
                else f"key in ${self.pc.serve_api_key_env}"
            )
            print(f"coevo policy endpoint at {self.url} (OPENAI_BASE_URL), {where}", flush=True)
            yield self
        finally:
            self.stopping = True
            await self.abort_open("the policy endpoint stopped")
            await runner.cleanup()
            self.sampler.close()

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
                    try:
                        await self.end(ep, "aborted", f"idle for more than {timeout:g} s")
                    except Exception as exc:  # its step or end was not published: kept, tried again next round
                        self.log.warning("policy.expire_failed", episode_id=ep.episode_id, error=repr(exc)[:300])
                        continue
                    self.counters["episodes.expired"] += 1

    def trained(self, group_ids: list[str]) -> None:
        """The policy learner is done with these groups (``LearnerStepped.disposed_group_ids``: trained,
        or disposed of untrained): they no longer wait."""
        self.backlog.trained(group_ids)

    # ---- the HTTP surface --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=16 * 1024**2)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/coevo/v1/episodes", self.open_episode)
        app.router.add_post("/coevo/v1/agent-keys", self.agent_key)
        app.router.add_post("/coevo/v1/episodes/rotate", self.rotate)
        app.router.add_post("/coevo/v1/episodes/{episode_id}/reward", self.reward_step)
        app.router.add_post("/coevo/v1/episodes/{episode_id}/finish", self.finish_episode)
        app.router.add_get("/coevo/v1/episodes/{episode_id}", self.get_episode)
        return app

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            if self.stopping:
                raise self._stopped()
            request[BOUND], request[AGENT] = self._authorize(request)
            return await handler(request)
        except ApiError as exc:
            return self._error(request, exc)
        except InvalidTokens as exc:  # the engine's own guard (ids the endpoint's check let through)
            return self._error(request, ApiError(400, str(exc), param="prompt", code="invalid_token_id"))
        except GrammarOverBudget as exc:  # the engine's compile budget (policy.grammar.compile_timeout_s)
            return self._error(request, ApiError(400, str(exc), code="grammar_over_budget"))
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            return self._error(request, ApiError(400, f"{param}: {err['msg']}", param=param))
        except web.HTTPException as exc:
            return self._error(
                request, ApiError(exc.status, exc.reason or "error", code="not_found" if exc.status == 404 else None)
            )
        except Exception as exc:
            self.log.error("policy.endpoint_failed", path=request.path, error=repr(exc), exc_info=exc)
            self.counters["endpoint.errors"] += 1
            return self._error(request, ApiError(500, f"internal error: {exc!r}"[:500], type="server_error"))

    @staticmethod
    def _stopped(episode_id: str | None = None) -> ApiError:
        aborted = f" (episode {episode_id} was aborted)" if episode_id else ""
        return ApiError(
            503, f"coevo is stopping: the run ended{aborted}", type="server_error", code="endpoint_stopping"
        )

    @staticmethod
    def _error(request: web.Request, exc: ApiError) -> web.Response:
        body = ma.error_body(exc) if request.path == "/v1/messages" else exc.body()
        headers = {"Retry-After": f"{exc.retry_after:g}"} if exc.retry_after is not None else None
        return web.json_response(body, status=exc.status, headers=headers)

    def _authorize(self, request: web.Request) -> tuple[Episode | None, str | None]:
        """(the episode the request's key binds it to, the agent key it carries); (None, None) for
        the run's key, or when none is needed."""
        auth = request.headers.get("Authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth else request.headers.get("x-api-key", "").strip()
        if given in self.book.agents:
            ep = self.book.get(self.book.agents[given] or "")
            self._bound_route(request, ep, agent=True)
            return ep, given
        ep = self.book.by_key(given) if given else None
        if ep is not None:
            self._bound_route(request, ep)
            return ep, None
        if self.key is not None and not hmac.compare_digest(given.encode(), self.key.encode()):
            raise ApiError(
                401,
                "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY); an "
                "episode's key stops working when the episode ends",
                type="authentication_error",
                code="invalid_api_key",
            )
        return None, None

    @staticmethod
    def _bound_route(request: web.Request, ep: Episode | None, agent: bool = False) -> None:
        """An episode key may call the model and act on its own episode; an agent key also rotates."""
        own = request.match_info.get("episode_id")
        if request.path in MODEL_ROUTES or (agent and request.path == "/coevo/v1/episodes/rotate"):
            return
        if ep is not None and own == ep.episode_id:
            return
        who = "an agent key" if agent else f"the key of episode {ep.episode_id if ep else '?'}"
        raise ApiError(403, f"{who} acts only on its own episode", type="permission_error", code="episode_key_scope")

    async def _sampling_request(self, request: web.Request) -> dict[str, Any]:
        """The body of a call that samples, its sampling parameters checked (``_knobs``)."""
        body = await self._json(request)
        self._knobs(body)
        return body

    def _knobs(self, body: dict[str, Any]) -> None:
        """A request's sampling parameters the policy does not sample with: refused under
        ``policy.serve_strict``, else served at the policy's own and counted."""
        ignored = cs.ignored_knobs(body, self.pc.temperature, self.pc.sampling)
        if ignored and self.pc.serve_strict:
            raise ApiError(
                400,
                f"{ignored[0]} {body[ignored[0]]!r}: the policy samples at its own settings (policy.temperature, "
                "policy.sampling), the distribution the learner trains; policy.serve_strict refuses others",
                param=ignored[0],
            )
        for name in ignored:
            self.counters[f"endpoint.knobs_ignored.{name}"] += 1

    @staticmethod
    async def _json(request: web.Request, *, empty_ok: bool = False) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip() and empty_ok:
            return {}
        try:
            body = json.loads(raw, parse_constant=_not_json)
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON ({exc})"[:300]) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "coevo",
                        "type": "model",
                        "display_name": self.model_name,
                        "created_at": "1970-01-01T00:00:00Z",
                    }
                ],
            }
        )

    def _episode_of(self, request: web.Request, user: str | None) -> Episode | None:
        """The episode a call belongs to: its key's, else header ``X-Coevo-Episode``, else an ``ep-``
        id as ``user``."""
        header = request.headers.get("X-Coevo-Episode")
        named = header or (user if user and user.startswith("ep-") else None)
        bound: Episode | None = request.get(BOUND)
        if bound is None and request.get(AGENT) is not None:
            raise ApiError(
                409,
                "this agent key has no open episode: POST /coevo/v1/episodes/rotate opens its next",
                code="no_open_episode",
            )
        if bound is not None:
            if named is not None and named != bound.episode_id:
                raise ApiError(
                    403,
                    f"the key of episode {bound.episode_id} cannot call for episode {named}",
                    type="permission_error",
                    code="episode_key_scope",
                )
            return bound
        return self._lookup(named) if named else None

    def _lookup(self, episode_id: str) -> Episode:
        ep = self.book.get(episode_id)
        if ep is None:
            if episode_id in self.book.ended:
                raise ApiError(
                    409, f"episode {episode_id} has ended ({self.book.ended[episode_id]})", code="episode_ended"
                )
            raise ApiError(404, f"unknown episode {episode_id}", code="episode_not_found")
        return ep

    def _check_ids(self, prompt: str | list[int]) -> None:
        """Token-in prompts: every id inside the vocabulary (else 400, before any model sees it)."""
        if isinstance(prompt, str):
            return
        vocab = len(self.client.tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400,
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                param="prompt",
                code="invalid_token_id",
            )

    def _reward(self, value: Any, before: float = 0.0) -> float:
        """A reward as it may enter: a finite number within ±``scorer.max_abs_env_reward``, and so is
        ``before`` plus it (else 400 naming ``reward``)."""
        bound = self.cfg.scorer.max_abs_env_reward
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or not abs(value) <= bound or not abs(before + float(value)) <= bound:
            raise ApiError(
                400,
                f'"reward" must be a finite number within ±{bound:g} (scorer.max_abs_env_reward), '
                f"and so must the call's rewards added up (so far {before:g}); got {str(value)[:40]}",
                param="reward",
            )
        return float(value)

    def _max_tokens(self, asked: int | None) -> int:
        return min(asked or self.pc.max_tokens, self.pc.serve_max_tokens)

    # ---- one call, whatever the API ----------------------------------------------------------

    async def answer_chat(self, ep: Episode | None, call: ChatCall, n: int = 1) -> list[Answer]:
        """Sample ``n`` answers to a chat-shaped call; inside an episode, record it as a step."""
        if ep is None:
            async with self._outside():
                ids, how = await self.sampler.chat_prompt(call)
                samples = await asyncio.gather(
                    *(self.sampler.sample(ids, how, call.max_tokens, call.stops, call.grammar) for _ in range(n))
                )
            return [self.sampler.answer(s, call.parse_tools) for s in samples]
        self._check_call(ep, n)
        async with ep.lock:
            self._check_open(ep)
            ids, how = await self.sampler.chat_prompt(call, ep.turn)
            seen = observation_of(call.messages)
            await self._flush(ep, seen)
            s = await self.sampler.sample(ids, how, call.max_tokens, call.stops, call.grammar)
            answer = self.sampler.answer(s, call.parse_tools)
            self._record(ep, s, seen, action_of(answer))
            assistant = ra.assistant_message(answer.text, answer.calls)
            ep.turn = Turn(call.messages, normalize([assistant])[0], s.prompt_ids, s.ids, call.tools)
        return [answer]

    @contextlib.asynccontextmanager
    async def _outside(self) -> AsyncIterator[None]:
        """A call outside episodes, while fewer than ``policy.serve_max_unrecorded`` run (else 429)."""
        if self._unrecorded.locked():
            self.counters["endpoint.calls.refused_unrecorded"] += 1
            raise ApiError(
                429,
                f"{self.pc.serve_max_unrecorded} calls outside episodes are running "
                "(policy.serve_max_unrecorded): open an episode, or retry",
                type="rate_limit_error",
                code="too_many_unrecorded_calls",
                retry_after=1.0,
            )
        async with self._unrecorded:
            yield
        self.counters["endpoint.calls.unrecorded"] += 1

    async def _grammar(self, *args: Any, **kw: Any) -> str | None:
        """``constraints.grammar_for`` within ``policy.grammar``'s budgets, in a worker thread (a schema's
        conversion never runs on the loop); the engine compiles it on its own worker (``Grammars``)."""
        budget = SchemaBudget.of(self.pc.grammar)
        return cast("str | None", await asyncio.to_thread(cs.grammar_for, *args, budget=budget, **kw))

    # ---- Chat Completions and Completions ----------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = oa.ChatRequest.model_validate(await self._sampling_request(request))
        req.check()
        ep = self._episode_of(request, req.user)
        grammar = await self._grammar(
            req.tools,
            cs.chat_tool_choice(req.tool_choice),
            cs.json_schema_of(req.response_format, "response_format", nested=True),
            tools_off=req.tool_choice == "none",
        )
        call = ChatCall(
            normalize(req.messages),
            req.tools,
            bool(req.tools) and req.tool_choice != "none",
            self._max_tokens(req.max_completion_tokens or req.max_tokens),
            req.stops(),
            grammar,
        )
        answers = await self.answer_chat(ep, call, req.n)
        choices = [
            oa.chat_choice(
                i, a.text, a.calls, a.finish, self.sampler.token_logprobs(a.sample) if req.logprobs else None
            )
            for i, a in enumerate(answers)
        ]
        samples = [a.sample for a in answers]
        body = oa.envelope("chat.completion", self.model_name, choices, self._usage(samples), self._extra(ep, samples))
        return await self._respond(request, body, [a.pieces for a in answers], req)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = oa.CompletionRequest.model_validate(await self._sampling_request(request))
        req.check()
        ep = self._episode_of(request, req.user)
        prompt, max_tokens = req.single(), self._max_tokens(req.max_tokens)
        self._check_ids(prompt)
        text = prompt if isinstance(prompt, str) else self.client.tokenizer.decode(prompt, skip_special_tokens=False)
        if ep is None:
            async with self._outside():
                ids, how = await self.sampler.text_prompt(prompt, None)
                samples = await asyncio.gather(
                    *(self.sampler.sample(ids, how, max_tokens, req.stops()) for _ in range(req.n))
                )
        else:
            self._check_call(ep, req.n)
            async with ep.lock:
                self._check_open(ep)
                prev = ep.text_turn
                ids, how = await self.sampler.text_prompt(prompt, prev)
                seen = text[len(prev[0]) + len(prev[2]) :] if prev and text.startswith(prev[0] + prev[2]) else text
                await self._flush(ep, seen)
                s = await self.sampler.sample(ids, how, max_tokens, req.stops())
                self._record(ep, s, seen, s.text)
                ep.text_turn = (text, s.prompt_ids, s.text, s.ids)
            samples = [s]
        echo = text if req.echo else ""
        choices = [
            oa.completion_choice(
                i, echo + s.text, s.finish, self.sampler.token_logprobs(s) if req.logprobs is not None else None
            )
            for i, s in enumerate(samples)
        ]
        body = oa.envelope("text_completion", self.model_name, choices, self._usage(samples), self._extra(ep, samples))
        return await self._respond(request, body, [list(s.pieces) for s in samples], req)

    # ---- Responses and Messages --------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        req = ra.ResponsesRequest.model_validate(await self._sampling_request(request))
        req.check()
        ep = self._episode_of(request, req.user)
        owner = ep.episode_id if ep is not None else None
        history = self.history.before(req.previous_response_id, owner)
        conversation = normalize([*history, *ra.to_messages(req.input)])
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        tools = ra.chat_tools(req.tools)
        grammar = await self._grammar(
            tools,
            cs.responses_tool_choice(req.tool_choice),
            cs.json_schema_of((req.text or {}).get("format"), "text.format", nested=False),
            tools_off=req.tool_choice == "none",
            format_param="text.format",
        )
        call = ChatCall(
            normalize(system) + conversation,
            tools,
            req.parse_tools,
            self._max_tokens(req.max_output_tokens),
            [],
            grammar,
        )
        (a,) = await self.answer_chat(ep, call)
        logprobs = ra.text_logprobs(self.sampler.token_logprobs(a.sample)) if req.logprobs else None
        items = ra.output_items(a.text, a.calls, logprobs)
        body = ra.response_body(
            req,
            self.model_name,
            items,
            a.finish,
            len(a.sample.prompt_ids),
            len(a.sample.ids),
            self._extra(ep, [a.sample]),
        )
        if req.store is not False:
            self.history.keep(body["id"], [*conversation, *normalize([ra.assistant_message(a.text, a.calls)])], owner)
        if not req.stream:
            return web.json_response(body, headers=self._headers(body))
        return await self._events(request, body, ra.stream_events(body, a.pieces))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        req = ma.MessagesRequest.model_validate(await self._sampling_request(request))
        req.check()
        ep = self._episode_of(request, req.user)
        tools = ma.chat_tools(req.tools)
        grammar = await self._grammar(
            tools,
            cs.messages_tool_choice(req.tool_choice),
            None,
            tools_off=(req.tool_choice or {}).get("type") == "none",
        )
        call = ChatCall(
            normalize(ma.to_messages(req)),
            tools,
            req.parse_tools,
            self._max_tokens(req.max_tokens),
            req.stops(),
            grammar,
        )
        (a,) = await self.answer_chat(ep, call)
        body = ma.message_body(
            self.model_name,
            ma.content_blocks(a.text, a.calls),
            a.finish,
            a.sample.stop_hit,
            len(a.sample.prompt_ids),
            len(a.sample.ids),
            self._extra(ep, [a.sample]),
        )
        if not req.stream:
            return web.json_response(body, headers=self._headers(body))
        return await self._events(request, body, ma.stream_events(body, a.pieces))

    # ---- recording ---------------------------------------------------------------------------

    def _check_call(self, ep: Episode, n: int) -> None:
        if n > 1:
            raise ApiError(
                400, "n > 1 inside an episode: an episode is one sequence of calls (open n episodes instead)", param="n"
            )

    def _check_live(self, ep: Episode) -> None:
        """``ep`` has not ended (while a request waited on its lock, say)."""
        if ep.ended and self.stopping:
            raise self._stopped(ep.episode_id)
        if ep.ended:
            raise ApiError(409, f"episode {ep.episode_id} has ended", code="episode_ended")

    def _check_open(self, ep: Episode) -> None:
        self._check_live(ep)
        if ep.calls >= self.cfg.env.max_steps:
            raise ApiError(
                409,
                f"episode {ep.episode_id} made env.max_steps = {self.cfg.env.max_steps} calls: finish it",
                code="episode_step_cap",
            )

    def _record(self, ep: Episode, s: Sampled, observation: str, action: str) -> None:
        """This call's step, published once its next observation is known (its event id fixed now: a
        publish tried again is the same event, deduplicated)."""
        ep.pending = {
            "event_id": new_id(),
            "step_index": ep.calls,
            "observation": observation,
            "prompt_token_ids": s.prompt_ids,
            "response_token_ids": s.ids,
            "logprobs": s.logprobs,
            "response_text": s.text,
            "action_text": action,
            "policy_version": s.version,
            "grammar": s.grammar,
        }
        ep.pending_call = f"call-{new_id()[:24]}"
        ep.calls += 1
        ep.last_active = time.monotonic()
        self.counters["endpoint.calls.recorded"] += 1
        if s.tokens == "diverged":
            self.counters["endpoint.prefix_breaks"] += 1

    async def _flush(self, ep: Episode, next_observation: str, done: bool = False) -> None:
        """Publish the pending step; it stays pending until the publish is confirmed (a failure
        raises, and the next call or the finish publishes it)."""
        if ep.pending is None:
            return
        fields = ep.pending
        step_id = await self.sink.publish_step(ep, {**fields, "next_observation": next_observation, "done": done})
        ep.pending = None
        ep.step_ids.append(step_id)
        ep.versions.append(int(fields["policy_version"]))

    def _usage(self, samples: list[Sampled]) -> dict[str, int]:
        return oa.usage(len(samples[0].prompt_ids), sum(len(s.ids) for s in samples))

    def _extra(self, ep: Episode | None, samples: list[Sampled]) -> dict[str, Any]:
        info: dict[str, Any] = {"policy_version": samples[0].version, "tokens": samples[0].tokens}
        if ep is not None:
            info.update(episode_id=ep.episode_id, step_index=ep.calls - 1, call_id=ep.pending_call)
        return {"coevo": info}

    @staticmethod
    def _headers(body: dict[str, Any]) -> dict[str, str]:
        info = body["coevo"]
        return {
            "X-Coevo-Policy-Version": str(info["policy_version"]),
            **({"X-Coevo-Call-Id": info["call_id"]} if info.get("call_id") else {}),
        }

    async def _respond(
        self, request: web.Request, body: dict[str, Any], pieces: list[list[str]], req: oa._Request
    ) -> web.StreamResponse:
        if not req.stream:
            return web.json_response(body, headers=self._headers(body))
        include = bool((req.stream_options or {}).get("include_usage"))
        chunks = [f"data: {json.dumps(c)}\n\n".encode() for c in oa.stream_chunks(body, pieces, include)]
        return await self._stream(request, body, [*chunks, b"data: [DONE]\n\n"])

    async def _events(
        self, request: web.Request, body: dict[str, Any], events: list[tuple[str, dict[str, Any]]]
    ) -> web.StreamResponse:
        return await self._stream(
            request, body, [f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events]
        )

    async def _stream(self, request: web.Request, body: dict[str, Any], frames: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={**self._headers(body), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for frame in frames:
            await resp.write(frame)
        await resp.write_eof()
        return resp

    # ---- episodes ----------------------------------------------------------------------------

    async def open_episode(self, request: web.Request) -> web.Response:
        ep = await self._open(await self._json(request, empty_ok=True))
        return self._opened(ep)

    async def _open(self, body: dict[str, Any]) -> Episode:
        """A new episode (``{"task_id", "goal"}``: of the agent's own task; else the pool's next)."""
        why = behind(
            self.client.version,
            self.backlog.oldest(time.monotonic()),
            len(self.backlog.groups),
            self.cfg.learner.max_staleness,
            self.cfg.tasks.max_groups_in_flight,
        )
        if why is not None:
            self.counters["endpoint.episodes.refused_behind"] += 1
            raise ApiError(
                429,
                f"{why}: retry later",
                type="rate_limit_error",
                code="learner_behind",
                retry_after=self.pc.serve_retry_after_s,
            )
        with self.book.reserve() as reserved:
            if not reserved:
                raise ApiError(
                    429,
                    f"{self.book.max_open} episodes are open (policy.max_concurrent_trajectories): finish some first",
                    type="rate_limit_error",
                    code="too_many_episodes",
                    retry_after=self.pc.serve_retry_after_s,
                )
            ep = await (self._own_episode(body) if "task_id" in body else self._pooled_episode(body))
        self.counters["endpoint.episodes.opened"] += 1
        return ep

    def _opened(self, ep: Episode) -> web.Response:
        return web.json_response(
            {
                **ep.describe(),
                **self._texts.get(ep.episode_id, {}),
                "key": ep.key,
                "policy_version": self.client.version,
            }
        )

    async def agent_key(self, request: web.Request) -> web.Response:
        """A long-lived key for an agent whose key is fixed (a closed harness): its calls belong to
        the key's current episode; ``/coevo/v1/episodes/rotate`` ends that and opens the next."""
        if request.get(BOUND) is not None or request.get(AGENT) is not None:
            raise ApiError(
                403, "agent keys are made with the run's key", type="permission_error", code="episode_key_scope"
            )
        key = self.book.new_agent()
        return web.json_response({"agent_key": key})

    async def rotate(self, request: web.Request) -> web.Response:
        """An agent key's next episode: its current one (if open) ends with the body's ``outcome`` /
        ``reward``; the rest of the body opens the next, as ``POST /coevo/v1/episodes`` does."""
        agent = request.get(AGENT)
        if agent is None:
            raise ApiError(
                403,
                "rotate needs an agent key (POST /coevo/v1/agent-keys)",
                type="permission_error",
                code="episode_key_scope",
            )
        body = await self._json(request, empty_ok=True)
        async with self.book.rotations[agent]:  # one at a time: each ends the episode the one before opened
            current = self.book.current(agent)  # read under the lock, not as the request arrived
            if current is not None:
                outcome, error, observation = self._outcome(body)
                async with current.lock:
                    await self.end(current, outcome, error, observation)
            rest = {k: v for k, v in body.items() if k not in ("outcome", "reward", "error", "observation")}
            ep = await self._open(rest)
            self.book.agents[agent] = ep.episode_id
        return self._opened(ep)

    async def _own_episode(self, body: dict[str, Any]) -> Episode:
        task_id, goal = body.get("task_id"), body.get("goal", "")
        if not isinstance(task_id, str) or not _IDENT.match(task_id):
            raise ApiError(400, "task_id must be 1-128 characters of A-Z a-z 0-9 _ . : -", param="task_id")
        if not isinstance(goal, str):
            raise ApiError(400, "goal must be text", param="goal")
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
            raise ApiError(
                409,
                f"this run's pool ({self.cfg.env.family}) is played by coevo's policy agent: send "
                'your own {"task_id", "goal"}, or run with --family external',
                code="no_pool",
            )
        if self.cfg.env.tasks_from is None:
            raise ApiError(
                409,
                'this run has no task pool (env.tasks_from is not set): send your own {"task_id", "goal"}',
                code="no_pool",
            )
        wait_s = wait_seconds(body)
        rollout = await self.pool.take(wait_s)
        if rollout is None:
            raise ApiError(
                503,
                f"no task was scheduled within {wait_s:g} s: retry",
                type="server_error",
                code="no_task_available",
                retry_after=self.pc.serve_retry_after_s,
            )
        info = await self.task_text(rollout.group.scheduled.task)
        ep = self.book.add(
            rollout.group.scheduled, rollout.index, rollout.trajectory_id, info["goal"], on_end=rollout.group.ended_one
        )
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

    async def reward_step(self, request: web.Request) -> web.Response:
        """The environment's reward for the episode's last call (before its next call or the finish;
        ``call_id``, when given, must name that call). Rewards of one call add up."""
        ep = self._lookup(request.match_info["episode_id"])
        body = await self._json(request)
        reward = body.get("reward")
        self._reward(reward)
        async with ep.lock:
            self._check_live(ep)
            if ep.pending is None:
                raise ApiError(
                    409,
                    "no call waits for a reward: reward a call before the episode's next call",
                    code="no_pending_call",
                )
            call_id = body.get("call_id")
            if call_id is not None and call_id != ep.pending_call:
                raise ApiError(
                    409,
                    f"call_id {call_id!r} is not the episode's last call ({ep.pending_call}): a "
                    "call's reward comes before the next call",
                    param="call_id",
                    code="call_published",
                )
            before = float(ep.pending.get("env_reward") or 0.0)
            ep.pending["env_reward"] = before + self._reward(reward, before)
        self.counters["endpoint.step_rewards"] += 1
        return web.json_response(
            {
                "episode_id": ep.episode_id,
                "step_index": ep.pending["step_index"],
                "env_reward": ep.pending["env_reward"],
            }
        )

    def _outcome(self, body: dict[str, Any]) -> tuple[Outcome, str | None, str]:
        """(outcome, error, final observation) of a finish: ``{"outcome"}`` or a numeric ``{"reward"}``."""
        outcome = body.get("outcome")
        if "reward" in body:  # bounded as a step's reward is, whether or not it decides the outcome
            reward = self._reward(body["reward"])
            if outcome is None:
                outcome = "won" if reward > self.cfg.env.win_threshold else "lost"
        if outcome not in OUTCOMES:
            raise ApiError(400, f'give "outcome" (one of {", ".join(OUTCOMES)}) or a numeric "reward"', param="outcome")
        return outcome, body.get("error") if outcome == "aborted" else None, str(body.get("observation", ""))

    async def finish_episode(self, request: web.Request) -> web.Response:
        ep = self._lookup(request.match_info["episode_id"])
        outcome, error, observation = self._outcome(await self._json(request, empty_ok=True))
        async with ep.lock:
            self._check_live(ep)  # finished concurrently
            await self.end(ep, outcome, error, observation)
        return web.json_response(
            {
                "episode_id": ep.episode_id,
                "trajectory_id": ep.trajectory_id,
                "outcome": outcome,
                "steps": len(ep.step_ids),
            }
        )

    async def get_episode(self, request: web.Request) -> web.Response:
        return web.json_response(self._lookup(request.match_info["episode_id"]).describe())

    async def end(self, ep: Episode, outcome: Outcome, error: str | None, observation: str = "") -> None:
        """Publish the last step and the trajectory (call with ``ep.lock`` held); a group whose
        episodes all ended waits for the learner (``trained``)."""
        if ep.ended:
            return
        await self._flush(ep, observation, done=True)
        await self.sink.publish_end(ep, outcome, error)
        self.book.close(ep, outcome)
        self._texts.pop(ep.episode_id, None)
        self.counters[f"endpoint.episodes.{outcome}"] += 1
        group = ep.scheduled
        self._ends[group.group_id] += 1
        if self._ends[group.group_id] >= group.n_rollouts:
            del self._ends[group.group_id]
            if group.purpose == "train":
                self.backlog.scored(group.group_id, group.source.model_version or 0, time.monotonic())
