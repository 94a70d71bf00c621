"""A LangGraph ReAct agent playing the corridor (``corridor.py``), trained by coevo through the Chat
Completions API, streamed (``ChatOpenAI(streaming=True)``):

    coevo run --family external --serve-policy 8000
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<the run's key> python examples/langgraph_agent.py

Each move is one ``astream`` of the graph over the conversation so far, with the episode's own key:
the model calls the ``choose`` tool, which plays the move and, ``return_direct``, ends the graph's run;
or it answers in words (a malformed tool call is words too), and the move is then random. A small
recursion limit bounds what a confused model can loop through.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from pathlib import Path

from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from langgraph.warnings import LangGraphDeprecatedSinceV10
from openai import APIConnectionError, AuthenticationError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # corridor.py lies next to this file (also under python -I)
from corridor import SYSTEM, Corridor, train

# create_react_agent lives on in langgraph 1.x; its successor is langchain's create_agent (another package)
warnings.filterwarnings("ignore", category=LangGraphDeprecatedSinceV10)


async def play(root: str, episode: dict, game: Corridor) -> None:
    @tool(return_direct=True)
    def choose(number: int) -> str:
        """Take the action with this number; what happens."""
        return game.take(number)

    model = ChatOpenAI(
        model="policy", base_url=f"{root}/v1", api_key=episode["key"], streaming=True, max_tokens=12, max_retries=0
    )
    agent = create_react_agent(model, [choose], prompt=SYSTEM)
    messages: list[AnyMessage] = []
    while game.outcome is None:
        moves = game.moves
        messages.append(HumanMessage(game.observation()))
        async for state in agent.astream({"messages": messages}, {"recursion_limit": 4}, stream_mode="values"):
            messages = state["messages"]
        if game.moves == moves:
            game.take(None, told=False)  # no move named: a random one


if __name__ == "__main__":
    sys.exit(asyncio.run(train(play, __doc__, "langgraph", gone=(APIConnectionError, AuthenticationError))))
