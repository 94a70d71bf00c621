"""An agent that exists on its own, trained by coevo through its OpenAI-compatible policy endpoint.

It knows nothing of coevo's code: it plays its own small text game (``corridor.py``, next to it, a
copy of the quick game's idea: walk a corridor of rooms to the coin, pits lose) and asks the model
for each move with the official ``openai`` SDK. Pointing ``OPENAI_BASE_URL`` at coevo, with the key of the run as
``OPENAI_API_KEY``, is all it takes to train that model:

    coevo run --family external --run-id ext          # serves http://127.0.0.1:8000/v1, key in a file
    OPENAI_API_KEY="$(cat runs/ext/policy-endpoint.key)" OPENAI_BASE_URL=http://127.0.0.1:8000/v1 \
        python examples/openai_agent.py

(the key is the one ``coevo run`` prints the file of: without it every call is refused, 401)

One key scheme: the run's key opens an episode, ``POST /coevo/v1/episodes {"task_id", "goal"}``,
which answers the episode's id and its own ``key``; every model call made with that key belongs to
the episode, and ``POST /coevo/v1/episodes/{id}/finish {"outcome": "won" | "lost"}`` ends it (and
the key with it). While coevo's learner is behind, opening an episode answers 429 with
``Retry-After``, which ``corridor.post`` waits out; once the run stops, every request answers 503
``endpoint_stopping`` and the agent stops. coevo groups the episodes of one task id (``policy.n``
of them, gathered across rounds of ``--group``), has its judge vote on every call, scores, trains,
and the next calls are served by the new weights.

A reply that names no action is still a move: the game then picks one at random (an untrained
model rarely answers well; its reply is what gets trained either way).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from openai import APIConnectionError, AsyncOpenAI, AuthenticationError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corridor.py lies next to this file (also under python -I)
from corridor import Corridor, train

SYSTEM = "You play a text adventure. Answer with the number of one action."


async def play(root: str, episode: dict, game: Corridor) -> None:
    """One episode: each move is one Chat Completions call made with the episode's own key."""
    async with AsyncOpenAI(base_url=f"{root}/v1", api_key=episode["key"], max_retries=0) as client:
        messages = [{"role": "system", "content": SYSTEM}]
        while game.outcome is None:
            messages.append({"role": "user", "content": game.observation()})
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})  # the reply as given: coevo reuses its tokens
            digits = [int(c) for c in text if c.isdigit()]
            game.take(digits[0] if digits else None, told=False)


if __name__ == "__main__":
    sys.exit(asyncio.run(train(play, __doc__, "corridor", gone=(APIConnectionError, AuthenticationError))))
