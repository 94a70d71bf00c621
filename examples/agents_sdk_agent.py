"""An OpenAI Agents SDK agent playing the corridor (``corridor.py``), trained by coevo through the
Responses API, the SDK's default (``OpenAIResponsesModel``):

    coevo run --family external --serve-policy 8000
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<the run's key> python examples/agents_sdk_agent.py

Each move is one ``Runner.run_streamed`` over the conversation so far, made with the episode's own
key: the model calls the ``choose`` tool, which plays the move and ends the run
(``tool_use_behavior="stop_on_first_tool"``), or it answers in words, and the move is then random.
The SDK treats a reply cut at ``max_tokens`` (status ``incomplete``) as an error: that reply, as
streamed, stays in the conversation and the move is random too. No tracing: nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import APIConnectionError, AsyncOpenAI, AuthenticationError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corridor.py lies next to this file (also under python -I)
from corridor import SYSTEM, Corridor, train

set_tracing_disabled(True)
seen_api = False


@function_tool
def choose(ctx: RunContextWrapper[Corridor], number: int) -> str:
    """Take the action with this number; what happens."""
    return ctx.context.take(number)


explorer = Agent[Corridor](
    name="explorer",
    instructions=SYSTEM,
    tools=[choose],
    tool_use_behavior="stop_on_first_tool",
    model_settings=ModelSettings(max_tokens=12),
)


async def play(root: str, episode: dict, game: Corridor) -> None:
    global seen_api
    client = AsyncOpenAI(base_url=f"{root}/v1", api_key=episode["key"], max_retries=0)
    config = RunConfig(model=OpenAIResponsesModel("policy", openai_client=client))
    history: list = []
    try:
        while game.outcome is None:
            turn = [*history, {"role": "user", "content": game.observation()}]
            moves, text = game.moves, ""
            run = Runner.run_streamed(explorer, turn, context=game, max_turns=1, run_config=config)
            try:
                async for event in run.stream_events():
                    if event.type != "raw_response_event":
                        continue
                    if event.data.type == "response.created" and not seen_api:
                        seen_api = True
                        print(f"answered through the Responses API ({event.data.response.id}) in {episode['task_id']}")
                    elif event.data.type == "response.output_text.delta":
                        text += event.data.delta
                history = run.to_input_list()
            except (ModelBehaviorError, MaxTurnsExceeded):  # cut at max_tokens, or a tool call it cannot parse
                history = [*turn, {"role": "assistant", "content": text}]
            if game.moves == moves:
                game.take(None, told=False)  # no move named: a random one
    finally:
        await client.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(train(play, __doc__, "agents", gone=(APIConnectionError, AuthenticationError))))
