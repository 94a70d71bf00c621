"""The clients of ``coevo bench hostile``: two hostile ones (an episode-key holder and an agent-key holder)
and honest agents, all speaking HTTP to the policy endpoint as outside agents do.

``ATTACKS`` names each attack with what a sound endpoint answers (``Expect``); an attack is one volley of
requests against its holder's open episode. ``Ledger`` keeps what the endpoint answered (episodes opened,
calls accepted inside them), for the stream to be checked against. ``attack_verdict`` is pure."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from coevo.errors import HarnessError

Expect = Literal["refused", "one_accepted", "no_5xx"]
"""refused: every answer a 4xx; one_accepted: exactly one 2xx, the others 4xx; no_5xx: 2xx or 4xx"""
NO_ANSWER = 0
"""the status recorded when no answer came (a connection refused or reset, a timeout)"""
HUGE_REWARDS = (1e39, -1e39, 1e300, 1e12)
"""finite in float64; 1e39 is infinite in float32"""


@dataclass(frozen=True)
class HostilePlan:
    seconds: float = 45.0
    """honest play from the first attack on (the attacks run meanwhile); then until an honest group is
    trained, at most ``seconds`` more"""
    honest: int = 2
    """honest agents playing at once"""
    repeat: int = 1
    """each attack, per key holder"""
    flood: int = 40
    """concurrent opens in a flood (above ``policy.max_concurrent_trajectories``: some are refused)"""
    finishes: int = 8
    """concurrent finishes of one episode"""
    group: int = 4
    """``policy.n``: episodes of one task id form a group"""
    attack_limit_s: float = 150.0
    """the attacks stop after this long (a poisoned run refuses and times out: reported as cut short)"""
    startup_s: float = 240.0
    overrides: dict[str, Any] = field(default_factory=dict)
    """config overrides (``--set``) on top of ``run_overrides``"""


@dataclass
class Tally:
    """One attack's answers."""

    expect: Expect
    statuses: Counter[int] = field(default_factory=Counter)
    sent: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, replies: list[Reply]) -> None:
        self.sent += len(replies)
        self.statuses.update(r.status for r in replies)
        if why := attack_verdict(self.expect, [r.status for r in replies]):
            wrong = [r for r in replies if r.status == NO_ANSWER or r.status >= 500 or 200 <= r.status < 300]
            self.violations.append(f"{why}; e.g. " + "; ".join(f"{r.what} -> {r.status}" for r in wrong[:3]))

    def report(self) -> dict[str, Any]:
        return {
            "expect": self.expect,
            "sent": self.sent,
            "seconds": round(self.seconds, 1),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "ok": not self.violations,
            "violations": self.violations[:4],
        }


def attack_verdict(expect: Expect, statuses: list[int]) -> str | None:
    """Why one volley of an attack was answered wrongly (None: as a sound endpoint answers)."""
    bad = [s for s in statuses if s == NO_ANSWER or s >= 500]
    if bad:
        return f"{len(bad)} of {len(statuses)} not answered or answered 5xx: {sorted(set(bad))}"
    accepted = sum(200 <= s < 300 for s in statuses)
    if expect == "refused" and accepted:
        return f"{accepted} of {len(statuses)} accepted (2xx), expected 4xx"
    if expect == "one_accepted" and accepted != 1:
        return f"{accepted} of {len(statuses)} accepted, expected exactly 1"
    return None


# ---- clients ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any
    retry_after: float = 1.0
    what: str = ""
    """the request, shortened (for the report)"""

    def code(self) -> str:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return str(err.get("code") or err.get("type")) if isinstance(err, dict) else str(self.status)


@dataclass
class Ledger:
    """What the endpoint answered: episodes opened (id -> trajectory id) and calls accepted."""

    trajectories: dict[str, str] = field(default_factory=dict)
    accepted: dict[str, set[int]] = field(default_factory=dict)

    def opened(self, body: Any) -> None:
        if isinstance(body, dict) and "episode_id" in body and "trajectory_id" in body:
            self.trajectories[body["episode_id"]] = body["trajectory_id"]

    def answered(self, body: Any) -> None:
        info = body.get("coevo") if isinstance(body, dict) else None
        if isinstance(info, dict) and info.get("episode_id") in self.trajectories:
            self.accepted.setdefault(self.trajectories[info["episode_id"]], set()).add(int(info["step_index"]))


class Http:
    def __init__(self, session: Any, ledger: Ledger) -> None:
        self.session, self.ledger = session, ledger

    async def call(
        self,
        path: str,
        key: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> Reply:
        import aiohttp

        data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
        h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
        what = f"{method} {path} {(data or b'')[:70]!r}{' ' + str(headers) if headers else ''}"
        try:
            async with self.session.request(method, path, data=data, headers=h) as r:
                text = await r.read()
                status, after = r.status, float(r.headers.get("Retry-After", 1.0))
        except (aiohttp.ClientError, TimeoutError):
            return Reply(NO_ANSWER, None, what=what)
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if status == 200:
            self.ledger.opened(parsed)
            self.ledger.answered(parsed)
        return Reply(status, parsed, after, what)


def chat_body(text: str = "go on", **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


@dataclass
class Holder:
    """A hostile client: an episode key (opened for it with the run's key) or an agent key."""

    kind: Literal["episode", "agent"]
    key: str = ""
    episode: dict[str, Any] = field(default_factory=dict)
    ended: bool = False

    @property
    def episode_id(self) -> str:
        return str(self.episode.get("episode_id", ""))


@dataclass
class Ctx:
    http: Http
    run_key: str
    vocab: int
    plan: HostilePlan
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    setup_refused: Counter[str] = field(default_factory=Counter)
    victims_touched: int = 0
    orphans: int = 0
    ids: Iterator[int] = field(default_factory=itertools.count)
    """episodes a flood of rotations opened that the agent key does not hold (nobody can finish them)"""
    cotenant_ms: dict[str, list[float]] = field(default_factory=dict)
    """an honest co-tenant's call latency (ms; NaN: not answered 200) before and during the schema attacks"""

    async def open(self, body: dict[str, Any], key: str, path: str = "/coevo/v1/episodes") -> Reply:
        """Open (or rotate) until the endpoint takes it, as a client honouring Retry-After does."""
        from coevo.runtime.aio import wait_event

        deadline = time.monotonic() + 30.0
        while True:
            r = await self.http.call(path, key, body)
            if r.status != 429 or time.monotonic() > deadline or self.stop.is_set():
                return r
            await wait_event(self.stop, r.retry_after)

    async def ready(self, h: Holder, *, call: bool = True, task_id: str | None = None) -> None:
        """Give ``h`` a new open episode, its previous one finished (won at even rollout indices: the
        attackers' groups carry a learning signal too), with one recorded call waiting for its reward
        when ``call``. A legitimate request refused on the way (an earlier attack's poison) is counted in
        ``setup_refused``."""
        outcome = {"outcome": "won" if h.episode.get("rollout_index", 0) % 2 == 0 else "lost"}
        if h.kind == "episode" and h.episode and not h.ended:
            r = await self.http.call(_ep(h, "finish"), h.key, outcome)
            if r.status == 400 or r.status >= 500:  # 401, 409: it ended already (idle past its timeout)
                self.setup_refused[f"episode finish: {r.status} {r.code()} {_message(r)}"] += 1
        for _ in range(3):
            if h.kind == "agent":
                if not h.key:
                    h.key = (await self.http.call("/coevo/v1/agent-keys", self.run_key, {})).body["agent_key"]
                body = {"task_id": task_id or "hostile-ak", "goal": "attack", **outcome}
                r = await self.open(body, h.key, ROTATE)
            else:
                r = await self.open({"task_id": task_id or "hostile-ek", "goal": "attack"}, self.run_key)
            if r.status == 200:
                break
            self.setup_refused[f"{h.kind} open: {r.status} {r.code()} {_message(r)}"] += 1
        else:
            raise HarnessError(f"could not open an episode for the {h.kind} key holder: {r.status} {r.body}")
        h.episode, h.ended = r.body, False
        if h.kind == "episode":
            h.key = r.body["key"]
        if call and (got := await self.http.call(CHAT, h.key, chat_body())).status != 200:
            self.setup_refused[f"{h.kind} call: {got.status} {got.code()} {_message(got)}"] += 1

    async def fill(self, task_id: str, n: int) -> None:
        """``n`` honest episodes of ``task_id`` (one call each, won at even rollout indices)."""
        for _ in range(n):
            r = await self.open({"task_id": task_id, "goal": "attack"}, self.run_key)
            if r.status != 200:
                self.setup_refused[f"filler open: {r.status} {r.code()} {_message(r)}"] += 1
                continue
            await self.http.call(CHAT, r.body["key"], chat_body())
            outcome = "won" if r.body["rollout_index"] % 2 == 0 else "lost"
            await self.http.call(
                f"/coevo/v1/episodes/{r.body['episode_id']}/finish", r.body["key"], {"outcome": outcome}
            )


def _message(r: Reply) -> str:
    err = r.body.get("error") if isinstance(r.body, dict) else None
    return str(err.get("message", ""))[:80] if isinstance(err, dict) else ""


CHAT, COMPLETIONS, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
ROTATE = "/coevo/v1/episodes/rotate"
Attack = Callable[[Ctx, Holder], Awaitable[list[Reply]]]
"""one volley against ``h``'s open episode (a call of it waits for its reward); it may end the episode
(``h.ended``): the next volley starts from a new one"""


def _ep(h: Holder, what: str) -> str:
    return f"/coevo/v1/episodes/{h.episode_id}/{what}"


def _ends(h: Holder, r: Reply) -> Reply:
    """``r`` answers a finish or a rotation of ``h``: a 200 ended its episode (a rotation opened the next)."""
    if r.status == 200:
        if "key" in (r.body or {}):  # a rotation: the agent key's episode is the new one
            h.episode = r.body
        else:
            h.ended = True
    return r


async def bad_json(c: Ctx, h: Holder) -> list[Reply]:
    paths = [CHAT, COMPLETIONS, MESSAGES, RESPONSES, _ep(h, "reward"), _ep(h, "finish")]
    if h.kind == "agent":
        paths.append(ROTATE)
    return [await c.http.call(p, h.key, raw=raw) for p in paths for raw in (b'{"messages": [', b"[1, 2]", b"\xff\xfe")]


async def wrong_types(c: Ctx, h: Holder) -> list[Reply]:
    bodies: list[tuple[str, Any]] = [
        (CHAT, {"messages": "hi"}),
        (CHAT, chat_body(max_tokens="many")),
        (CHAT, chat_body(max_tokens=-1)),
        (CHAT, chat_body(n=0)),
        (COMPLETIONS, {"prompt": {"a": 1}, "max_tokens": 4}),
        (COMPLETIONS, {"prompt": [1.5, 2.5], "max_tokens": 4}),
        (MESSAGES, {"max_tokens": "x", "messages": [{"role": "user", "content": "hi"}]}),
        (RESPONSES, {"input": 7}),
        (_ep(h, "reward"), {"reward": "1"}),
        (_ep(h, "reward"), {"reward": True}),
        (_ep(h, "reward"), {"reward": [1]}),
        (_ep(h, "reward"), {"reward": 1, "call_id": 7}),
        (_ep(h, "finish"), {"outcome": 5}),
        (_ep(h, "finish"), {"reward": "won"}),
    ]
    return [await c.http.call(p, h.key, b) for p, b in bodies]


async def loose_messages(c: Ctx, h: Holder) -> list[Reply]:
    """Messages are loose by design (``coevo.inference.chat.normalize``: content becomes text, any role
    goes to the chat template); what is recorded is what was sampled, so accepting them poisons nothing."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": 5}, {"role": "wizard", "content": "hi"}]
    return [await c.http.call(CHAT, h.key, {"messages": [m], "max_tokens": 4}) for m in messages]


async def missing_fields(c: Ctx, h: Holder) -> list[Reply]:
    bodies: list[tuple[str, dict[str, Any]]] = [(CHAT, {}), (COMPLETIONS, {}), (MESSAGES, {}), (RESPONSES, {})]
    bodies.append((_ep(h, "reward"), {}))
    bodies.append((_ep(h, "finish"), {"observation": "no outcome, no reward"}))
    return [await c.http.call(p, h.key, b) for p, b in bodies]


async def step_rewards(c: Ctx, h: Holder) -> list[Reply]:
    """Each reward at the last of four calls of an episode whose group three honest episodes of one
    call complete: the step is alone at its index, so its reward is its advantage (docs/algorithm.md)."""
    out = []
    raws = [json.dumps({"reward": x}).encode() for x in (*HUGE_REWARDS, math.nan, math.inf, -math.inf)]
    for raw in [*raws, b'{"reward": 1e999}', b'{"reward": -1e999}']:
        task = f"poison-{h.kind}-{next(c.ids)}"
        await c.ready(h, task_id=task)
        for _ in range(3):
            await c.http.call(CHAT, h.key, chat_body())
        out.append(await c.http.call(_ep(h, "reward"), h.key, raw=raw))
        await c.fill(task, c.plan.group - 1)
    return out


async def finish_rewards(c: Ctx, h: Holder) -> list[Reply]:
    """An episode finished (or an agent key rotated) with a reward that is not a bounded number."""
    out = []
    for x in (math.nan, math.inf, -math.inf, 1e39):
        if h.ended:
            await c.ready(h)
        out.append(_ends(h, await c.http.call(_ep(h, "finish"), h.key, raw=json.dumps({"reward": x}).encode())))
        if h.kind == "agent":
            body = {"reward": x, "task_id": "hostile-ak", "goal": "attack"}
            out.append(_ends(h, await c.http.call(ROTATE, h.key, raw=json.dumps(body).encode())))
    return out


async def oov_ids(c: Ctx, h: Holder) -> list[Reply]:
    v = c.vocab
    prompts = [[v], [1, 2, v + 1000], [2**31 - 1], [-1], [2**63 - 1], [[1, 2], [v]]]
    return [await c.http.call(COMPLETIONS, h.key, {"prompt": p, "max_tokens": 4}) for p in prompts]


async def oversized(c: Ctx, h: Holder) -> list[Reply]:
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (17 << 20) + b'"}]}'
    long = chat_body("lorem ipsum " * 20_000)  # within the body limit, past the model's context
    return [
        await c.http.call(CHAT, h.key, raw=big),
        await c.http.call(_ep(h, "reward"), h.key, raw=big),
        await c.http.call(CHAT, h.key, long),
    ]


async def flood_opens(c: Ctx, h: Holder) -> list[Reply]:
    """``plan.flood`` opens at once: rotations of the agent key; the episode key may not open."""
    if h.kind == "agent":
        body: dict[str, Any] = {"task_id": "hostile-flood", "goal": "flood", "outcome": "lost"}
        path = ROTATE
    else:
        body, path = {"task_id": "hostile-flood", "goal": "flood"}, "/coevo/v1/episodes"
    replies = list(await asyncio.gather(*(c.http.call(path, h.key, body) for _ in range(c.plan.flood))))
    opened = [r.body for r in replies if r.status == 200 and "key" in (r.body or {})]
    if opened:
        held = await c.http.call(CHAT, h.key, chat_body())  # the episode the agent key holds now
        mine = held.body.get("coevo", {}).get("episode_id") if held.status == 200 else None
        h.episode = next((b for b in opened if b["episode_id"] == mine), opened[-1])
        others = [b["episode_id"] for b in opened if b["episode_id"] != mine]
        still = await asyncio.gather(*(c.http.call(f"/coevo/v1/episodes/{e}", c.run_key, method="GET") for e in others))
        c.orphans += sum(r.status == 200 for r in still)  # open, and held by no key (ended ones answer 409)
    return replies


async def concurrent_finishes(c: Ctx, h: Holder) -> list[Reply]:
    outcome = "won" if h.episode.get("rollout_index", 0) % 2 == 0 else "lost"
    path = _ep(h, "finish")
    finishes = [c.http.call(path, h.key, {"outcome": outcome}) for _ in range(c.plan.finishes)]
    return [_ends(h, r) for r in await asyncio.gather(*finishes)]


async def finish_race(c: Ctx, h: Holder) -> list[Reply]:
    """A finish racing calls and a reward of the same episode: whatever wins, nothing recorded is lost."""
    replies = await asyncio.gather(
        c.http.call(CHAT, h.key, chat_body()),
        c.http.call(_ep(h, "reward"), h.key, {"reward": 0.5}),
        c.http.call(_ep(h, "finish"), h.key, {"outcome": "lost"}),
        c.http.call(CHAT, h.key, chat_body()),
    )
    _ends(h, replies[2])
    return list(replies)


async def other_episode(c: Ctx, h: Holder) -> list[Reply]:
    """Acting on a victim's episode (opened now, one call) with this holder's key; the victim must be
    as it was (``Ctx.victims_touched`` counts those that are not)."""
    opened = await c.open({"task_id": "victim", "goal": "be left alone"}, c.run_key)
    if opened.status != 200:
        raise HarnessError(f"could not open the victim's episode: {opened.status} {opened.body}")
    v = opened.body["episode_id"]
    await c.http.call(CHAT, opened.body["key"], chat_body())
    at = f"/coevo/v1/episodes/{v}"
    replies = [
        await c.http.call(f"{at}/reward", h.key, {"reward": 1.0}),
        await c.http.call(f"{at}/finish", h.key, {"outcome": "won"}),
        await c.http.call(at, h.key, method="GET"),
        await c.http.call(CHAT, h.key, chat_body(), headers={"X-Coevo-Episode": v}),
        await c.http.call(CHAT, h.key, chat_body(user=v)),
        await c.http.call(MESSAGES, h.key, {**chat_body(), "metadata": {"user_id": v}}),
        await c.http.call("/coevo/v1/agent-keys", h.key, {}),
        await c.http.call("/coevo/v1/episodes", h.key, {"task_id": "stolen", "goal": "x"}),
    ]
    after = await c.http.call(at, c.run_key, method="GET")
    if not (isinstance(after.body, dict) and after.body.get("calls") == 1 and not after.body.get("ended")):
        c.victims_touched += 1
    outcome = "won" if opened.body["rollout_index"] % 2 == 0 else "lost"
    await c.http.call(f"{at}/finish", opened.body["key"], {"outcome": outcome})
    return replies


async def dead_key(c: Ctx, h: Holder) -> list[Reply]:
    """An episode key after its episode ended (the agent key outlives its episodes: nothing to try)."""
    if h.kind != "episode":
        return []
    old, path = h.key, _ep(h, "reward")
    _ends(h, await c.http.call(_ep(h, "finish"), h.key, {"outcome": "lost"}))
    return [
        await c.http.call(CHAT, old, chat_body()),
        await c.http.call(path, old, {"reward": 1.0}),
        await c.http.call(_ep(h, "finish"), old, {"outcome": "won"}),
    ]


async def stale_call_id(c: Ctx, h: Holder) -> list[Reply]:
    """A reward naming a call that is no longer the last (its step is published)."""
    first = await c.http.call(CHAT, h.key, chat_body())
    await c.http.call(CHAT, h.key, chat_body())
    info = first.body.get("coevo", {}) if isinstance(first.body, dict) else {}
    return [await c.http.call(_ep(h, "reward"), h.key, {"reward": 0.1, "call_id": info.get("call_id", "call-x")})]


def _schema(schema: Any) -> dict[str, Any]:
    return chat_body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


OVER_BUDGET_SCHEMAS: tuple[tuple[str, Any], ...] = (
    ("huge enum", {"enum": [f"value-{i}" for i in range(100_000)]}),  # ~1.3 MB: over the bytes
    ("many enum values", {"enum": list(range(5000))}),  # ~30 KB: over the values
    ("deep", _deep(200)),
    ("wide", {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 9} for i in range(3000)}}),
    ("not enforceable", {"type": "array", "items": {"not": {"type": "null"}}, "uniqueItems": True}),
)
"""structured-output schemas a sound endpoint refuses before compiling (a budget, or a keyword it cannot hold)"""
HEAVY_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"enum": [f"v{i}-{k}" for k in range(4)]} for i in range(250)},
}
"""within every budget, as costly as they allow: served, or refused by the compile's time budget"""


async def _cotenant(c: Ctx, when: str) -> None:
    """One honest call outside episodes (with the run's key), its latency kept under ``when``."""
    t0 = time.monotonic()
    r = await c.http.call(CHAT, c.run_key, chat_body("co-tenant: say yes"))
    c.cotenant_ms.setdefault(when, []).append((time.monotonic() - t0) * 1e3 if r.status == 200 else math.nan)


async def schema_attacks(c: Ctx, h: Holder) -> list[Reply]:
    """Schemas over a budget (huge, deep, wide) or with keywords a grammar cannot hold, sent at once
    while an honest co-tenant calls: each refused, and the co-tenant's latency reported."""
    await _cotenant(c, "before_schema_attacks")
    replies = await asyncio.gather(
        *(c.http.call(CHAT, h.key, _schema(s)) for _, s in OVER_BUDGET_SCHEMAS), _cotenant(c, "during_schema_attacks")
    )
    return [r for r in replies if isinstance(r, Reply)]


async def heavy_schema(c: Ctx, h: Holder) -> list[Reply]:
    """The costliest schema within the budgets, several at once, while an honest co-tenant calls."""
    bodies = [_schema({**HEAVY_SCHEMA, "title": f"heavy {next(c.ids)}"}) for _ in range(3)]  # distinct: no cache
    replies = await asyncio.gather(*(c.http.call(CHAT, h.key, b) for b in bodies), _cotenant(c, "during_heavy_schemas"))
    return [r for r in replies if isinstance(r, Reply)]


ATTACKS: dict[str, tuple[Expect, Attack]] = {
    "malformed_json": ("refused", bad_json),
    "wrong_types": ("refused", wrong_types),
    "missing_fields": ("refused", missing_fields),
    "loose_messages": ("no_5xx", loose_messages),
    "step_reward_not_bounded": ("refused", step_rewards),
    "finish_reward_not_bounded": ("refused", finish_rewards),
    "out_of_vocabulary_ids": ("refused", oov_ids),
    "oversized": ("refused", oversized),
    "other_episode": ("refused", other_episode),
    "dead_episode_key": ("refused", dead_key),
    "stale_call_id": ("refused", stale_call_id),
    "flood_opens": ("no_5xx", flood_opens),
    "concurrent_finishes": ("one_accepted", concurrent_finishes),
    "finish_races_call": ("no_5xx", finish_race),
    "structured_output_schemas": ("refused", schema_attacks),
    "structured_output_heavy_schema": ("no_5xx", heavy_schema),
}


# ---- honest agents ----------------------------------------------------------------------------------


@dataclass
class Honest:
    episodes: int = 0
    groups: set[str] = field(default_factory=set)
    refused: Counter[str] = field(default_factory=Counter)
    """opens answered 429, by code (learner_behind, too_many_episodes)"""
    failed: Counter[str] = field(default_factory=Counter)
    """requests of an honest agent answered otherwise than 200 or 429"""


HONEST_TURNS: tuple[tuple[str, dict[str, Any]], ...] = (
    (CHAT, chat_body("turn 0: say yes")),
    (MESSAGES, chat_body("turn 1: say yes")),
    (RESPONSES, {"model": "policy", "input": "turn 2: say yes", "max_output_tokens": 4}),
)


async def honest_agent(c: Ctx, i: int, tally: Honest) -> None:
    """Episodes of three calls each, one through each API (Chat Completions, Messages, Responses), a reward
    per call, won at even rollout indices: a learning signal."""
    from coevo.runtime.aio import wait_event

    while not c.stop.is_set():
        r = await c.http.call("/coevo/v1/episodes", c.run_key, {"task_id": f"honest-{i % 2}", "goal": "say yes"})
        if r.status != 200:
            (tally.refused if r.status == 429 else tally.failed)[r.code()] += 1
            await wait_event(c.stop, r.retry_after)
            continue
        ep, key = r.body, r.body["key"]
        tally.groups.add(ep["group_id"])
        for path, body in HONEST_TURNS:
            got = await c.http.call(path, key, body)
            if got.status != 200:
                tally.failed[f"{path} {got.code()}"] += 1
                continue
            rew = await c.http.call(f"/coevo/v1/episodes/{ep['episode_id']}/reward", key, {"reward": 0.25})
            if rew.status != 200:
                tally.failed[f"reward {rew.code()}"] += 1
        outcome = "won" if ep["rollout_index"] % 2 == 0 else "lost"
        fin = await c.http.call(f"/coevo/v1/episodes/{ep['episode_id']}/finish", key, {"outcome": outcome})
        if fin.status == 200:
            tally.episodes += 1
        else:
            tally.failed[f"finish {fin.code()}"] += 1


async def attack_all(c: Ctx, holders: list[Holder], tallies: dict[str, Tally]) -> bool:
    """Every attack, ``plan.repeat`` times per holder, each from a new episode; False when cut short."""
    deadline = time.monotonic() + c.plan.attack_limit_s
    for name, (_expect, attack) in ATTACKS.items():
        for h in holders:
            for _ in range(c.plan.repeat):
                if c.stop.is_set() or time.monotonic() > deadline:
                    return False
                tally, started = tallies[f"{name}/{h.kind}"], time.monotonic()
                try:
                    await c.ready(h)
                    tally.add(await attack(c, h))
                except HarnessError as exc:
                    tally.violations.append(f"not set up: {exc}"[:300])
                    h.episode = {}
                tally.seconds += time.monotonic() - started
    return True
