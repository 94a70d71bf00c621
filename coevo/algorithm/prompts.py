"""Prompt rendering and output parsing. Pure functions, tested without models.

Vote parsing follows docs/algorithm.md: the vote is the content of the *last* ``\\boxed{...}`` of the
judge's output; ``1``/``+1`` is +1, ``-1`` is -1; anything else (missing, ``0``, ``1/2``, words,
unbalanced braces) is unparseable.
"""

from __future__ import annotations

import re
from typing import Literal

INDEX_LABELS = "0123456789abcdefghijklmnopqrstuvwxyz"
"""Choice mode answers with one character per candidate (so at most 36 candidates)."""
VERDICT_LABELS = ("+", "-")

_BOXED = "\\boxed{"


def policy_prompt(observation: str, candidates: list[str], mode: Literal["choice", "generate"] = "choice") -> str:
    shown = candidates[: len(INDEX_LABELS)]
    actions = " | ".join(f"{INDEX_LABELS[i]} {c}" for i, c in enumerate(shown))
    if mode == "choice":
        return f"{observation}\nactions: {actions}\nchoose:"
    return (
        f"{observation}\nactions: {actions}\nThink briefly, then give the index of your action as \\boxed{{index}}.\n"
    )


def judge_prompt(
    objective: str,
    observation: str,
    action: str,
    next_observation: str,
    mode: Literal["verdict", "reasoned"] = "verdict",
) -> str:
    body = f"judge. goal: {objective}\nstate: {observation}\naction: {action}\nresult: {next_observation}\n"
    if mode == "verdict":
        return body + "verdict:"
    return body + (
        "Does this action move the agent towards the goal? Reason step by step, then answer "
        "\\boxed{1} for a good step or \\boxed{-1} for a bad one.\n"
    )


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) : i]
            i += 1
        start = text.rfind(_BOXED, 0, start)  # unbalanced: try an earlier one
    return None


_PLUS = re.compile(r"^\+?1(\.0+)?$")
_MINUS = re.compile(r"^[-\u2212]1(\.0+)?$")


def parse_vote(text: str) -> Literal[1, -1] | None:
    inner = last_boxed(text)
    if inner is None:
        return None
    value = inner.strip().strip("$ ").replace("\\text{", "").rstrip("}").strip()
    if _PLUS.match(value):
        return 1
    if _MINUS.match(value):
        return -1
    return None


def parse_action(text: str, n_candidates: int) -> int | None:
    """Candidate index from ``\\boxed{index}`` (a decimal or a choice label); None if invalid."""
    inner = last_boxed(text)
    if inner is None:
        return None
    value = inner.strip()
    if value.isdigit():
        index = int(value)
    elif len(value) == 1 and value in INDEX_LABELS:
        index = INDEX_LABELS.index(value)
    else:
        return None
    return index if 0 <= index < n_candidates else None
