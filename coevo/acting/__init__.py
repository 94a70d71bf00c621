"""How the policy acts, stated once for the policy agent and for every evaluator that must act exactly
like it (the benches, the ceiling's step agreement): which candidates a step shows and in what order
(``step_order``), and the one model call that picks among them (``choose``).

Invariant: an evaluator that shows a state through ``step_order`` and asks through ``choose`` sees the
distribution the policy agent samples from at that state (same prompt form, same labels, same order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from coevo.algorithm.prompts import (
    CHAT_LABELS,
    INDEX_LABELS,
    episode_seed,
    parse_action,
    policy_messages,
    policy_prompt,
    shown_order,
)

if TYPE_CHECKING:
    from coevo.config import PolicyConfig
    from coevo.envs.base import Observation
    from coevo.inference.chat import Conversation, PromptForm
    from coevo.inference.engine import Completion


async def choose(
    client: Any,
    cfg: PolicyConfig,
    obs: Observation,
    cands: list[str],
    conversation: Conversation | None,
    *,
    order: list[int] | None = None,
    form: PromptForm | None = None,
) -> tuple[Completion, int | None, str | None]:
    """How the policy acts on ``obs`` (the agent, and evaluators that must act exactly like it): one
    model call; the completion, the index in ``cands`` of the candidate it names (None: none parsed,
    or no candidates) and, in chat mode, how the conversation's tokens were reused. ``order``: the
    order the candidates are shown in (``shown_order``; default as given); ``form``: raw text or the
    model's chat template (default raw)."""
    order = order if order is not None else list(range(min(len(cands), len(INDEX_LABELS))))
    shown = [cands[i] for i in order]

    def named(label: int | None) -> int | None:
        return None if label is None else order[label]

    if conversation is not None:  # chat: the whole episode is one conversation, token-in/token-out
        c, how = await conversation.ask(
            client, policy_prompt(obs.text, shown, "generate"), max_tokens=cfg.max_tokens, temperature=cfg.temperature
        )
        return c, (named(parse_action(c.text, len(shown))) if shown else None), how
    mode: Literal["choice", "generate"] = "choice" if cfg.mode == "choice" and shown else "generate"
    chat = form is not None and form.chat
    labels = CHAT_LABELS if chat else INDEX_LABELS
    text = policy_prompt(obs.text, shown, mode)
    ids = form.ids(policy_messages(obs.text, shown, mode)) if form is not None and chat else None
    if mode == "choice":
        c = await client.complete(text, choices=list(labels[: len(shown)]), temperature=cfg.temperature, prompt_ids=ids)
        return c, named(c.choice), None
    c = await client.complete(text, max_tokens=cfg.max_tokens, temperature=cfg.temperature, prompt_ids=ids)
    return c, (named(parse_action(c.text, len(shown), labels)) if shown else None), None


def step_order(cfg: PolicyConfig, key: str, step: int, n: int) -> list[int]:
    """Which of its ``n`` candidates step ``step`` of the episode ``key`` shows, in order: position ``j``
    shows candidate ``order[j]``. At most ``len(INDEX_LABELS)`` (a label each): with more candidates (a
    TextWorld kitchen), a different draw of them at every step, so no admissible command is out of reach
    for good; shuffled from the episode's key with ``policy.shuffle_choices``, else the first ones as given."""
    if cfg.shuffle_choices and n > 1:
        return shown_order(n, episode_seed(key), step)[: len(INDEX_LABELS)]
    return list(range(min(n, len(INDEX_LABELS))))
