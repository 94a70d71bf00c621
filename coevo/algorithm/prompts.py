"""Prompt rendering and output parsing. Pure functions, tested without models.

Each prompt has two forms: the raw text (after BOS, for base models and the tiny models coevo
builds) and messages (a system instruction and the user turn) that a model's chat template renders
(``coevo.inference.chat.PromptForm`` picks one per role; the chat form numbers actions from 1). The policy's candidates are shown in an
order shuffled per step from the episode's seed (``shown_order``), so a label carries no information.

Vote parsing follows docs/algorithm.md: the vote is the content of the *last* ``\\boxed{...}`` of the
judge's output; ``1``/``+1`` is +1, ``-1`` is -1; anything else (missing, ``0``, ``1/2``, words,
unbalanced braces) is unparseable.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

INDEX_LABELS = "0123456789abcdefghijklmnopqrstuvwxyz"
"""Choice mode answers with one character per candidate (so at most 36 candidates)."""
VERDICT_LABELS = ("+", "-")

_BOXED = "\\boxed{"

CHAT_LABELS = "123456789abcdefghijklmnopqrstuvwxyz0"
"""The labels of the chat form: numbered from 1, as an instruct model numbers a list (as many as
``INDEX_LABELS``, so the same candidates are shown). SmolLM2-135M-Instruct puts about half its next-token
probability on them, against a third numbered from 0 and nearly none on the raw prompt."""
POLICY_ASK = "Which action do you take? Answer with its number."
POLICY_ASK_REASONED = "Which action do you take? Think briefly, then give its number as \\boxed{number}."
JUDGE_ASK = "Does this action move the agent towards the goal? Answer - for no or + for yes."
"""The verdict question of the chat form. "no" named first: asked "+ for yes or - for no",
SmolLM2-135M-Instruct votes + on 4 % of steps, a judge whose m votes on a step nearly always agree and so
give it nothing to learn from; asked this way, 25 %, with the same step information (AUC against the
step labels 0.61 against 0.63; ``coevo bench heldout --judge-probe``, docs/benchmarks.md)."""
JUDGE_ASK_YES_FIRST = "Does this action move the agent towards the goal? Answer + for yes or - for no."
JUDGE_ASK_REASONED = (
    "Does this action move the agent towards the goal? Reason step by step, then answer \\boxed{1} for a "
    "good step or \\boxed{-1} for a bad one."
)
Messages = list[dict[str, str]]


def episode_seed(key: str) -> int:
    """A stable seed from an episode's key (its trajectory id; an evaluator's task, seed and episode)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def shown_order(n: int, seed: int, step: int) -> list[int]:
    """The order the ``n`` candidates of step ``step`` are shown in: position ``j`` shows candidate
    ``order[j]``. A permutation drawn from (episode seed, step) alone: the same episode shows the same
    orders on replay, and no label is tied to an action or a position rule."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + step).shuffle(order)
    return order


def policy_messages(
    observation: str, candidates: list[str], mode: Literal["choice", "generate"] = "choice"
) -> Messages:
    """The policy's prompt as the user turn of a conversation: the observation, the actions numbered
    from 1 (``CHAT_LABELS``), the question (the template adds the model's own system turn, if any)."""
    shown = candidates[: len(CHAT_LABELS)]
    actions = "\n".join(f"{CHAT_LABELS[i]}. {c}" for i, c in enumerate(shown))
    ask = POLICY_ASK if mode == "choice" else POLICY_ASK_REASONED
    return [{"role": "user", "content": f"{observation}\n\nActions:\n{actions}\n\n{ask}"}]


def judge_messages(
    objective: str,
    observation: str,
    action: str,
    next_observation: str,
    mode: Literal["verdict", "reasoned"] = "verdict",
    ask: str | None = None,
) -> Messages:
    """The judge's prompt as the user turn of a conversation (the chat form of ``judge_prompt``);
    ``ask``: another question than the mode's."""
    ask = ask or (JUDGE_ASK if mode == "verdict" else JUDGE_ASK_REASONED)
    body = f"An agent plays a text game.\nGoal: {objective}\nState: {observation}\nAction: {action}\nResult: {next_observation}"
    return [{"role": "user", "content": f"{body}\n\n{ask}"}]


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


def parse_action(text: str, n_candidates: int, labels: str = INDEX_LABELS) -> int | None:
    """Candidate index from ``\\boxed{label}`` (a choice label of ``labels``, or a decimal numbered as
    they number: from 0 for ``INDEX_LABELS``, from 1 for ``CHAT_LABELS``); None if invalid."""
    inner = last_boxed(text)
    if inner is None:
        return None
    value = inner.strip()
    if value.isdigit():
        index = int(value) - (1 if labels == CHAT_LABELS else 0)
    elif len(value) == 1 and value in labels:
        index = labels.index(value)
    else:
        return None
    return index if 0 <= index < n_candidates else None
