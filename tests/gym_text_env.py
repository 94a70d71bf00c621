"""Small text Gymnasium envs for tests/test_gym_env.py (``env.family = "gym:tests.gym_text_env:..."``)."""

from __future__ import annotations

from typing import Any

import gymnasium
from gymnasium import spaces


class TextWalk(gymnasium.Env):
    """A corridor in text: walk ``forward`` to the treasure ``distance`` rooms away; ``back`` from the
    entrance falls into a pit. Text observations and text actions; random play wins about a third of
    the time at distance 2 (both outcomes in most groups)."""

    metadata: dict[str, Any] = {"render_modes": []}
    coevo_knobs = (("distance", 1, 5, 1, 2), ("slack", 0, 4, -1, 2))
    objective = "reach the treasure"

    def __init__(self, distance: int = 2) -> None:
        self.observation_space = spaces.Text(max_length=200)
        self.action_space = spaces.Text(max_length=16)
        self.distance, self.slack, self.pos, self.steps = distance, 2, 0, 0

    def _obs(self, feedback: str = "") -> tuple[str, dict[str, Any]]:
        text = f"{feedback} room {self.pos} of a corridor; the treasure is in room {self.distance}.".strip()
        return text, {"candidates": ["forward", "back"]}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        self.distance = int(options.get("distance", self.distance))
        self.slack = int(options.get("slack", self.slack))
        self.pos, self.steps = 0, 0
        return self._obs()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        label = 1 if action == "forward" else -1
        if action == "forward":
            self.pos += 1
        elif action == "back":
            self.pos -= 1
        if self.pos < 0:
            text, info = self._obs("you fall into a pit.")
            return text, 0.0, True, False, {**info, "reference_label": label}
        won = self.pos >= self.distance
        text, info = self._obs("you find the treasure." if won else f"you go {action}.")
        truncated = not won and self.steps >= self.distance + self.slack
        return text, 1.0 if won else 0.0, won, truncated, {**info, "reference_label": label}


gymnasium.register("CoevoTextWalk-v0", entry_point=TextWalk, max_episode_steps=6)


class CountDown(gymnasium.Env):
    """Integer observations and a ``Discrete`` action space: needs the text adapter below. Action 1
    counts down by one (reach 0 to win), action 0 gives up (lost)."""

    metadata: dict[str, Any] = {"render_modes": []}
    action_labels = ("give up", "count down")

    def __init__(self, start: int = 3) -> None:
        self.observation_space = spaces.Discrete(10)
        self.action_space = spaces.Discrete(2)
        self.start, self.n = start, start

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        super().reset(seed=seed)
        self.n = self.start
        return self.n, {}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        if action == 0:
            return self.n, -1.0, True, False, {"won": False}
        self.n -= 1
        return self.n, 1.0 if self.n == 0 else 0.0, self.n == 0, False, {}


def count_text(obs: int, info: dict[str, Any]) -> str:
    return f"the counter shows {obs}."
