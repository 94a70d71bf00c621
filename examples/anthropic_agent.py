"""An agent on the official ``anthropic`` SDK playing the corridor (``corridor.py``), trained by coevo
through the Anthropic Messages API (``/v1/messages``):

    coevo run --family external --serve-policy 8000
    ANTHROPIC_BASE_URL=http://127.0.0.1:8000 OPENAI_API_KEY=<the run's key> python examples/anthropic_agent.py

(``OPENAI_BASE_URL=http://127.0.0.1:8000/v1`` works too; the key may also be ``ANTHROPIC_API_KEY``.)
Each move is one ``messages.create`` with the ``choose`` tool, made with the episode's own key (sent
as ``x-api-key``): a ``tool_use`` block plays the move and is answered by a ``tool_result`` in the
next user turn; a reply in words is a move too, a random one.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from anthropic import APIConnectionError, AsyncAnthropic, AuthenticationError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corridor.py lies next to this file (also under python -I)
from corridor import SYSTEM, Corridor, train

TOOLS = [
    {
        "name": "choose",
        "description": "Take the action with this number; what happens.",
        "input_schema": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    }
]
seen_api = False


async def play(root: str, episode: dict, game: Corridor) -> None:
    global seen_api
    async with AsyncAnthropic(base_url=root, api_key=episode["key"], max_retries=0) as client:
        messages: list = [{"role": "user", "content": game.observation()}]
        while True:
            moves = game.moves
            reply = await client.messages.create(
                model="policy", max_tokens=12, system=SYSTEM, tools=TOOLS, messages=messages
            )
            if not seen_api:
                seen_api = True
                print(f"answered through the Messages API ({reply.id}) in {episode['task_id']}")
            messages.append({"role": "assistant", "content": reply.content})
            results = [
                {"type": "tool_result", "tool_use_id": block.id, "content": game.take(block.input.get("number"))}
                for block in reply.content
                if block.type == "tool_use"
            ]
            if game.moves == moves:
                game.take(None, told=False)  # no move named: a random one
            if game.outcome is not None:
                return
            messages.append({"role": "user", "content": [*results, {"type": "text", "text": game.observation()}]})


if __name__ == "__main__":
    os.environ.setdefault("OPENAI_API_KEY", os.environ.get("ANTHROPIC_API_KEY", "unused"))
    sys.exit(
        asyncio.run(
            train(
                play,
                __doc__,
                "anthropic",
                gone=(APIConnectionError, AuthenticationError),
                root=os.environ.get("ANTHROPIC_BASE_URL"),
            )
        )
    )
