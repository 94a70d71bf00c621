"""The corridor game and the few plain HTTP calls that tell coevo where an episode starts and ends,
shared by the example agents in this folder (none of them imports coevo).

An episode: ``POST {root}/coevo/v1/episodes {"task_id", "goal"}`` answers its ``episode_id`` and its
own API ``key`` (every model call made with that key belongs to the episode); ``POST
{root}/coevo/v1/episodes/{id}/finish {"outcome": "won" | "lost"}`` ends it, and its key with it.
coevo groups the episodes of one task id, scores them and trains the model on them; while its learner
is behind it answers 429 with ``Retry-After`` to a new episode, which ``post`` waits out.

``train(play, ...)`` is the loop the agents share: groups of ``--group`` episodes of one corridor at
a time, one line per group (``{prefix}-{seed}: won lost ...``), until coevo stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable

DIRECTIONS = ("north", "south", "east", "west")
ROOMS = ("hall", "kitchen", "cellar", "attic", "garden", "library", "study", "pantry")
GOAL = "take the coin at the end of the corridor"
SYSTEM = "You play a text adventure. Call the tool choose with the number of one action."


class Corridor:
    """Rooms in a row; the right exit of each leads on, a wrong one is blocked or a pit; the coin waits
    in the last room. The same seed always builds the same corridor (random play sometimes wins)."""

    def __init__(self, seed: int, length: int) -> None:
        rng = random.Random(seed)
        self.rooms = rng.sample(ROOMS, length)
        self.exits = []
        for _ in range(length - 1):
            good, bad = rng.sample(DIRECTIONS, 2)
            self.exits.append({good: "on", bad: "pit" if rng.random() < 0.5 else "blocked"})
        self.exits.append({})
        self.room, self.steps_left = 0, length + 2
        self.feedback, self.outcome, self.moves, self.told = "", None, 0, False
        self.rng = random.Random()  # the moves of a reply that names none: each episode its own

    def actions(self) -> list[str]:
        here = [f"go {d}" for d in sorted(self.exits[self.room])]
        return here + (["take coin"] if self.room == len(self.rooms) - 1 else [])

    def describe(self) -> str:
        coin = " a coin lies here." if self.room == len(self.rooms) - 1 else ""
        return f"room: {self.rooms[self.room]}.{coin} steps left: {self.steps_left}."

    def observation(self, feedback: str | None = None) -> str:
        """What the player is told before a move: the last move's feedback (unless a tool's result told
        it already), the room, the numbered actions."""
        said = ("" if self.told else self.feedback) if feedback is None else feedback
        listing = " | ".join(f"{i} {a}" for i, a in enumerate(self.actions()))
        return f"{said} {self.describe()} actions: {listing}".strip()

    def step(self, action: str) -> tuple[str, str | None]:
        """Feedback, and the outcome once the game ended."""
        self.steps_left -= 1
        if action == "take coin" and self.room == len(self.rooms) - 1:
            return "you take the coin.", "won"
        where = self.exits[self.room].get(action.removeprefix("go "))
        if where == "pit":
            return "you fall into a pit.", "lost"
        if where == "on":
            self.room += 1
            feedback = "you walk on."
        else:
            feedback = "the way is blocked."
        return feedback, ("lost" if self.steps_left <= 0 else None)

    def take(self, number: object, told: bool = True) -> str:
        """Action ``number`` of ``actions()`` (anything else, a malformed tool call included: a random
        one); its feedback (``told``: the model gets it as the tool's result). After the end, nothing moves."""
        if self.outcome is not None:
            return "the game is over."
        self.told = told
        actions = self.actions()
        valid = isinstance(number, int) and not isinstance(number, bool) and 0 <= number < len(actions)
        action = actions[number] if valid and isinstance(number, int) else self.rng.choice(actions)
        self.feedback, self.outcome = self.step(action)
        self.moves += 1
        return self.feedback


def coevo_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def post(url: str, body: dict, key: str) -> dict:
    """POST JSON with a bearer key; an answer with a Retry-After (429: coevo's learner is behind or too many
    episodes are open; 503 ``no_task_available``: no pool task yet) is retried after it. Any other error,
    503 ``endpoint_stopping`` (the run stopped) included, is raised: time to stop."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    while True:
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.headers.get("Retry-After") is None:
                raise
            time.sleep(float(exc.headers["Retry-After"]))


def wait_for(root: str, key: str, timeout_s: float) -> None:
    """Until coevo's endpoint answers (it starts after the models are loaded)."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{root}/v1/models", headers={"Authorization": f"Bearer {key}"})
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10):
                return
        except (urllib.error.URLError, ConnectionError) as exc:
            if isinstance(exc, urllib.error.HTTPError) or time.monotonic() > deadline:  # it answered, or never came
                raise
            time.sleep(1.0)


Play = Callable[[str, dict, Corridor], Awaitable[None]]
"""``play(root, episode, game)``: play ``game`` to its end with the model of ``episode`` (its ``key``)"""


async def episode(play: Play, root: str, key: str, task_id: str, seed: int) -> str:
    """One episode of corridor ``seed``, opened, played and finished; its outcome."""
    game = Corridor(seed, length=2 + seed % 2)
    ep = await asyncio.to_thread(post, f"{root}/coevo/v1/episodes", {"task_id": task_id, "goal": GOAL}, key)
    try:
        await play(root, ep, game)
    except BaseException as exc:  # every episode is finished: one cut short is not trained on
        with contextlib.suppress(OSError):
            await asyncio.to_thread(
                post,
                f"{root}/coevo/v1/episodes/{ep['episode_id']}/finish",
                {"outcome": "aborted", "error": repr(exc)[:500]},
                ep["key"],
            )
        raise
    await asyncio.to_thread(
        post,
        f"{root}/coevo/v1/episodes/{ep['episode_id']}/finish",
        {"outcome": game.outcome, "observation": game.feedback},
        ep["key"],
    )
    return str(game.outcome)


def stopping(exc: BaseException) -> bool:
    """coevo answered 503 (``endpoint_stopping``: the run ended, a call in flight was cut short);
    every SDK here keeps the status as ``status_code``."""
    return getattr(exc, "status_code", None) == 503


async def train(
    play: Play, doc: str, prefix: str, gone: tuple[type[BaseException], ...] = (), root: str | None = None
) -> int:
    """The agents' command line and loop; 0 once coevo went away (``gone``: the framework's own
    connection and refused-key errors)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=4, help="corridors (task ids) to cycle through")
    parser.add_argument(
        "--group",
        type=int,
        default=4,
        help="episodes per corridor at once (coevo fills groups of policy.n across them)",
    )
    parser.add_argument("--rounds", type=int, default=0, help="passes over the corridors (0: until coevo stops)")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the endpoint to come up")
    parser.add_argument("--prefix", default=prefix, help="task ids are PREFIX-SEED (agents sharing a run differ)")
    args = parser.parse_args()
    key = os.environ.get("OPENAI_API_KEY", "unused")  # the key coevo printed (runs/<run>/policy-endpoint.key)
    root = root or coevo_root(os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    await asyncio.to_thread(wait_for, root, key, args.wait)
    done = 0
    try:
        while args.rounds == 0 or done < args.rounds * args.tasks:
            seed = done % args.tasks
            task_id = f"{args.prefix}-{seed}"
            outcomes = await asyncio.gather(*(episode(play, root, key, task_id, seed) for _ in range(args.group)))
            print(f"{task_id}: {' '.join(outcomes)}", flush=True)
            done += 1
    except Exception as exc:
        if not (isinstance(exc, (urllib.error.URLError, ConnectionError, *gone)) or stopping(exc)):
            raise
        print(f"coevo went away ({exc!r}): stopping", flush=True)
    return 0
