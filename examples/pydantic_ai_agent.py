"""A pydantic-ai agent playing the corridor (``corridor.py``), trained by coevo through the Chat
Completions API (``OpenAIChatModel`` with an ``OpenAIProvider`` pointed at coevo):

    coevo run --family external --serve-policy 8000
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<the run's key> python examples/pydantic_ai_agent.py

Each move is one ``agent.run`` over the message history so far, with the episode's own key. The
``choose`` tool is an output function: the model calling it plays the move and that ends the run; a
reply in words is the run's other output, and the move is then random. A tool call that does not
validate is retried once, then given up (``UnexpectedModelBehavior``, that exchange left out of the
history): a random move as well.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pydantic_ai import Agent, RunContext, ToolOutput, UsageLimits
from pydantic_ai.exceptions import (
    ModelAuthenticationError,
    ModelConnectionError,
    UnexpectedModelBehavior,
    UsageLimitExceeded,
)
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corridor.py lies next to this file (also under python -I)
from corridor import SYSTEM, Corridor, train


def choose(ctx: RunContext[Corridor], number: int) -> str:
    """Take the action with this number; what happens."""
    return ctx.deps.take(number, told=False)  # an output function's result is not sent back: say it next turn


agent = Agent(
    deps_type=Corridor,
    output_type=[ToolOutput(choose, name="choose"), str],
    instructions=SYSTEM,
    retries=1,
    model_settings={"max_tokens": 12},
)


async def play(root: str, episode: dict, game: Corridor) -> None:
    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=f"{root}/v1", api_key=episode["key"]))
    history: list[ModelMessage] = []
    while game.outcome is None:
        moves = game.moves
        try:
            result = await agent.run(
                game.observation(),
                model=model,
                deps=game,
                message_history=history,
                usage_limits=UsageLimits(request_limit=3),
            )
            history = result.all_messages()
        except (UnexpectedModelBehavior, UsageLimitExceeded):
            pass  # the failed exchange is left out of the history
        if game.moves == moves:
            game.take(None, told=False)  # no move named: a random one


if __name__ == "__main__":
    sys.exit(asyncio.run(train(play, __doc__, "pydantic", gone=(ModelConnectionError, ModelAuthenticationError))))
