"""An agent that exists on its own, trained by coevo through its OpenAI-compatible policy endpoint.

It knows nothing of coevo's code: it plays its own small text game (``corridor.py``, next to it, a
copy of the quick game's idea: walk a corridor of rooms to the coin, pits lose) and asks the model
for each move with the official ``openai`` SDK. Pointing ``OPENAI_BASE_URL`` at coevo, with the key of the run as
``OPENAI_API_KEY``, is all it takes to train that model:

    coevo run --family external --run-id ext          # serves http://127.0.0.1:8000/v1, key in a file
    OPENAI_API_KEY="$(cat runs/ext/policy-endpoint.key)" OPENAI_BASE_URL=http://127.0.0.1:8000/v1 \
        python examples/openai_agent.py

(the key is the one ``coevo run`` prints the file of: without it every call is refused, 401)

Two extra calls tell coevo where episodes start and end (plain HTTP, next to the OpenAI routes):
``POST /coevo/v1/episodes {"task_id", "goal"}`` returns an ``episode_id``, which every completion
of the episode carries as the OpenAI ``user`` field; ``POST /coevo/v1/episodes/{id}/finish
{"outcome": "won" | "lost"}`` ends it. coevo groups the episodes of one task id, has its judge vote
on every call, scores, trains, and the next calls are served by the new weights.

A reply that names no action is still a move: the agent then picks one at random (an untrained
model rarely answers well; its reply is what gets trained either way).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import urllib.error
from pathlib import Path

from openai import APIConnectionError, AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corridor.py lies next to this file (also under python -I)
from corridor import Corridor, coevo_root, post

SYSTEM = "You play a text adventure. Answer with the number of one action."


async def play(client: AsyncOpenAI, root: str, key: str, seed: int, rng: random.Random) -> str:
    """One episode of the corridor built from ``seed``; returns its outcome."""
    game = Corridor(seed, length=2 + seed % 2)
    goal = "take the coin at the end of the corridor"
    episode = await asyncio.to_thread(
        post, f"{root}/coevo/v1/episodes", {"task_id": f"corridor-{seed}", "goal": goal}, key
    )
    messages = [{"role": "system", "content": SYSTEM}]
    feedback, outcome = "", None
    while outcome is None:
        actions = game.actions()
        messages.append({"role": "user", "content": game.observation(feedback)})
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=3, user=episode["episode_id"]
        )
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})  # the reply as given: coevo reuses its tokens
        digits = [int(c) for c in text if c.isdigit() and int(c) < len(actions)]
        action = actions[digits[0]] if digits else rng.choice(actions)
        feedback, outcome = game.step(action)
    await asyncio.to_thread(
        post,
        f"{root}/coevo/v1/episodes/{episode['episode_id']}/finish",
        {"outcome": outcome, "observation": feedback},
        key,
    )
    return outcome


async def wait_for_endpoint(client: AsyncOpenAI, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.models.list()
            return
        except APIConnectionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=4, help="corridors (task ids) to cycle through")
    parser.add_argument("--group", type=int, default=4, help="episodes per corridor in a row (coevo's policy.n)")
    parser.add_argument("--rounds", type=int, default=0, help="passes over the corridors (0: until coevo stops)")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the endpoint to come up")
    args = parser.parse_args()
    key = os.environ.get("OPENAI_API_KEY", "unused")  # the key coevo printed (runs/<run>/policy-endpoint.key)
    client = AsyncOpenAI(api_key=key, max_retries=0)  # OPENAI_BASE_URL points it at coevo
    root = coevo_root(str(client.base_url))
    rng = random.Random(0)
    await wait_for_endpoint(client, args.wait)
    done = 0
    try:
        while args.rounds == 0 or done < args.rounds * args.tasks:
            seed = done % args.tasks
            outcomes = await asyncio.gather(*(play(client, root, key, seed, rng) for _ in range(args.group)))
            print(f"corridor-{seed}: {' '.join(outcomes)}", flush=True)
            done += 1
    except (APIConnectionError, urllib.error.URLError, ConnectionError) as exc:
        print(f"coevo went away ({exc!r}): stopping", flush=True)
    finally:
        await client.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
