"""What a judge model knows about a step before any training: its vote against the family's step labels.

Steps come from episodes of held-out tasks played by uniform random choice (good and bad moves both),
each with the environment's own label (+1 on a shortest path to the goal). For each way of asking (the
chat template or the raw prompt, and the answer labels), one forward pass per step gives the model's
probability of the "good" label, renormalised over the two labels as the judge's constrained vote is.
From it:

- ``plus_share``: the expected share of +1 votes at the judge's temperature (0.5 is unbiased);
- ``accuracy``: the expected share of votes that agree with the label at that temperature;
- ``auc``: the chance a good step gets a higher probability than a bad one (0.5: the votes carry no
  step information, whatever their bias; ties count half);
- ``balanced_accuracy``: agreement when the threshold is the median probability (what the votes
  would be worth with their bias removed).

A judge whose AUC is near 0.5 cannot add a step signal to the policy until it learns one; a judge with
AUC well above 0.5 but ``plus_share`` near 0 or 1 has the information and hides it behind its bias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevo.config import ComputeDtype

if TYPE_CHECKING:
    from coevo.config import PolicyConfig
    from coevo.envs.base import Family, Observation, StepResult
    from coevo.schemas import TaskSpec

MAX_STEPS = 300
"""Labelled steps probed at most (the first ones, task by task)."""


@dataclass(frozen=True)
class LabelledStep:
    objective: str
    observation: str
    action: str
    next_observation: str
    label: int


@dataclass(frozen=True)
class Asking:
    """One way of asking the judge: the prompt form and the (good, bad) answer labels."""

    form: str
    ask: str
    labels: tuple[str, str]


def askings() -> dict[str, Asking]:
    from coevo.algorithm.prompts import JUDGE_ASK, JUDGE_ASK_YES_FIRST, VERDICT_LABELS

    yes_no = "Does this action move the agent towards the goal? Answer yes or no."
    return {
        "chat (the judge's)": Asking("chat", JUDGE_ASK, VERDICT_LABELS),
        "chat, + named first": Asking("chat", JUDGE_ASK_YES_FIRST, VERDICT_LABELS),
        "chat, yes / no": Asking("chat", yes_no, ("yes", "no")),
        "raw (the judge's)": Asking("raw", "", VERDICT_LABELS),
    }


async def labelled_steps(
    family: Family, tasks: Sequence[TaskSpec], policy: PolicyConfig, seed: int, limit: int = MAX_STEPS
) -> list[LabelledStep]:
    """The first ``limit`` steps that carry the environment's label, of one uniform-random episode per
    task (played as the held-out habits are: ``coevo.bench.heldout.habit_episode``)."""
    from coevo.acting.ceiling import habit_episode
    from coevo.bench.heldout import episode_key, uniform

    out: list[LabelledStep] = []

    def keep(obs: Observation, action: str, r: StepResult) -> None:
        if action and r.reference_label is not None:
            out.append(LabelledStep(obs.objective, obs.text, action, r.observation.text, r.reference_label))

    for i, task in enumerate(tasks):
        if len(out) >= limit:
            break
        await habit_episode(family, task, episode_key(task.task_id, seed, i), uniform, policy, keep)
    return out[:limit]


def auc(scores: Sequence[float], labels: Sequence[int]) -> float | None:
    """P(score of a +1 step > score of a -1 step), ties half; None without both kinds."""
    good = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    bad = [s for s, y in zip(scores, labels, strict=True) if y != 1]
    if not good or not bad:
        return None
    wins = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    return wins / (len(good) * len(bad))


def vote_stats(p_good: Sequence[float], labels: Sequence[int], temperature: float) -> dict[str, float | None]:
    """The table's numbers from each step's probability of the good label (at temperature 1)."""

    def tempered(p: float) -> float:
        p = min(max(p, 1e-12), 1 - 1e-12)
        z = math.log(p / (1 - p)) / max(temperature, 1e-5)
        return 1 / (1 + math.exp(-max(min(z, 700), -700)))

    q = [tempered(p) for p in p_good]
    median = sorted(p_good)[len(p_good) // 2]
    n = len(labels)
    return {
        "plus_share": round(sum(q) / n, 4),
        "accuracy": round(sum(x if y == 1 else 1 - x for x, y in zip(q, labels, strict=True)) / n, 4),
        "auc": None if (a := auc(p_good, labels)) is None else round(a, 4),
        "balanced_accuracy": round(sum((p >= median) == (y == 1) for p, y in zip(p_good, labels, strict=True)) / n, 4),
        "mean_p_good": round(sum(p_good) / n, 4),
    }


def probabilities(
    model: Path, steps: Sequence[LabelledStep], askings: dict[str, Asking], dtype: ComputeDtype = "auto"
) -> dict[str, list[float] | str]:
    """Per asking, the model's probability of the good label of each step, renormalised over the two
    labels (the model served in ``dtype``); a reason instead where a label is not one token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coevo.algorithm.prompts import judge_messages, judge_prompt
    from coevo.inference.chat import PromptForm
    from coevo.inference.engine import choice_token_ids, encode_prompt
    from coevo.inference.precision import model_dtype

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=model_dtype(dtype, None, model)).eval()
    chat = PromptForm(tok, "chat")
    out: dict[str, list[float] | str] = {}
    for name, asking in askings.items():
        try:
            labels = choice_token_ids(tok, list(asking.labels), {})
        except ValueError as e:
            out[name] = str(e)
            continue
        p = []
        for s in steps:
            if asking.form == "chat":
                messages = judge_messages(s.objective, s.observation, s.action, s.next_observation, ask=asking.ask)
                ids = chat.ids(messages) or []
            else:
                ids = encode_prompt(tok, judge_prompt(s.objective, s.observation, s.action, s.next_observation))
            with torch.no_grad():
                logits = lm(torch.tensor([ids])).logits[0, -1, labels].float()
            p.append(float(torch.softmax(logits, -1)[0]))
        out[name] = p
    return out


async def judge_probe(
    model: Path,
    family: Family,
    tasks: Sequence[TaskSpec],
    policy: PolicyConfig,
    temperature: float,
    seed: int,
    dtype: ComputeDtype = "auto",
) -> dict[str, Any]:
    """Each asking's vote statistics on the labelled steps of ``tasks`` (see the module's docstring)."""
    import asyncio

    steps = await labelled_steps(family, tasks, policy, seed)
    if not steps:
        return {}
    labels = [s.label for s in steps]
    result: dict[str, Any] = {
        "steps": len(steps),
        "labelled_good": round(sum(y == 1 for y in labels) / len(labels), 4),
        "temperature": temperature,
    }
    by_asking = await asyncio.to_thread(probabilities, model, steps, askings(), dtype)
    for name, p in by_asking.items():
        result[name] = p if isinstance(p, str) else vote_stats(p, labels, temperature)
    return result
