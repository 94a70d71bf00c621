"""Environment rewriters: critic summaries of failures, then a proposal (docs/algorithm.md §4).

The built-in rewriter needs no model: its critic turns each failure digest into one sentence,
and it applies the family's operators, ordered by what the summaries say went wrong. Where no knob
step can help (one step overshot, or none is left), any rewriter's slot gets a fresh world instead. The LLM
rewriter asks any inference client for a JSON task and validates it against the family's knobs;
invalid output is retried, then the proposal is rejected with the validation error.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, create_model

from coevo.algorithm import saturation
from coevo.algorithm.saturation import Overshoot
from coevo.envs.base import Family
from coevo.schemas import FailureDigest, TaskSpec

Direction = Literal["harder", "easier"]


@dataclass(frozen=True)
class Proposal:
    candidate: TaskSpec | None
    summaries: list[str]
    rewriter: str
    error: str | None = None


class Rewriter(Protocol):
    name: str

    async def propose(
        self, family: Family, task: TaskSpec, direction: Direction, failures: list[FailureDigest], moves: int = 1
    ) -> Proposal:
        """A candidate ``moves`` knob steps from ``task`` in ``direction`` (one child of ``task``)."""
        ...


def wants_fresh_world(family: Family, task: TaskSpec, direction: Direction, overshoot: Overshoot | None) -> bool:
    """Whether a slot's next candidate is the same knobs in another world rather than a rewriter's knob
    steps: even one knob step overshot in ``direction`` (``saturation.fresh``), or no knob can move that
    way (every one at its bound for the task's split)."""
    if saturation.fresh(direction, overshoot):
        return True
    return all(family.apply(task, op) is None for op in family.operators(direction))


def fresh_world(
    family: Family, task: TaskSpec, summaries: list[str], salt: str, by: str, avoid: Collection[str] = ()
) -> Proposal:
    """The same knobs in a world not seen before (``Family.fresh_world``, never one of ``avoid``: the
    held-out tasks' ``spec_hash``), proposed by rewriter ``by`` (its name gains ``:world``)."""
    candidate = family.fresh_world(task, salt, avoid)
    if candidate is None:
        return Proposal(None, summaries, by, f"{family.name} has no other world of these knobs")
    return Proposal(candidate, summaries, f"{by}:world")


def critic_summary(f: FailureDigest) -> str:
    """At most two sentences on why a trajectory failed (built-in critic, docs/algorithm.md §4.2): where it
    went wrong (the first step every judge vote called bad, else its end), then the judge's reasoning
    at that step if it wrote one, else whether it ran out of steps."""
    if f.all_negative_steps:
        k = f.all_negative_steps[0]
        line = f.steps[k - 1] if 0 < k <= len(f.steps) else "?"
        first = f"Went wrong at step {k} ({line.split('. ', 1)[-1]}), which every judge vote called bad."
    elif f.steps:
        first = f"Ended {f.outcome} after {len(f.steps)} steps; last: {f.steps[-1].split('. ', 1)[-1]}."
    else:
        first = f"Ended {f.outcome} without a valid step."
    why = next(
        (
            r.split(": ", 1)[-1]
            for r in f.rationales
            if f.all_negative_steps and r.startswith(f"step {f.all_negative_steps[0]}:")
        ),
        "",
    )
    if why:
        second = " The judge: " + " ".join(why.split())[:160].rstrip(".") + "."
    else:
        second = " Ran out of steps." if f.outcome == "truncated" else ""
    return (first + second).strip()


def failure_text(failures: list[FailureDigest], summaries: list[str], most: int = 3, lines: int = 12) -> str:
    """What the LLM rewriter reads of the failures: each one's summary, its numbered trajectory and
    the judge's reasoning where every vote was -1 (bounded: ``most`` failures, ``lines`` steps each)."""
    if not failures:
        return "(no failures)"
    out = []
    for i, (f, summary) in enumerate(zip(failures[:most], summaries, strict=False), 1):
        steps = f.steps[:lines] + ([f"... {len(f.steps) - lines} more steps"] if len(f.steps) > lines else [])
        out.append(f"Failure {i} ({f.outcome}): {summary}\n  " + "\n  ".join(steps or ["(no steps)"]))
        if f.all_negative_steps:
            out.append(f"  steps every judge vote called bad: {f.all_negative_steps}")
        out += [f"  judge on {r}" for r in f.rationales[:2]]
    return "\n".join(out)


# keywords in the summaries -> the knob that most likely caused the failure
_BLAME = (
    ("pit", "distractors"),
    ("does not fit", "distractors"),
    ("locked", "steps"),
    ("out of steps", "slack"),
    ("no valid action", "hints"),
    ("nothing happens", "hints"),
)


class BuiltinRewriter:
    name = "builtin"

    async def propose(
        self, family: Family, task: TaskSpec, direction: Direction, failures: list[FailureDigest], moves: int = 1
    ) -> Proposal:
        """Up to ``moves`` operator steps, each the first applicable one in order: easier by blame (the
        knob the summaries point at first, again while it moves), harder rotating through the knobs by
        version and step so that no knob runs away alone; one child of ``task``, named after its steps."""
        summaries = [critic_summary(f) for f in failures]
        text = " ".join(summaries).lower()
        blamed = [knob for word, knob in _BLAME if word in text]
        current, applied = task, []
        for step in range(moves):
            ops = family.operators(direction)
            if direction == "easier":
                ops.sort(key=lambda op: blamed.index(op[:-1]) if op[:-1] in blamed else len(_BLAME))
            else:
                shift = (task.version + step) % max(1, len(ops))
                ops = ops[shift:] + ops[:shift]
            moved = next(((op, c) for op in ops if (c := family.apply(current, op)) is not None), None)
            if moved is None:
                break
            applied.append(moved[0])
            current = moved[1]
        if not applied:
            return Proposal(None, summaries, self.name, f"every knob is at its {direction} bound")
        return Proposal(family.derive(task, current.knobs), summaries, f"{self.name}:{','.join(applied)}")


@runtime_checkable
class StructuredOutput(Protocol):
    """A client that can be asked for JSON matching a schema (``response_format``; it decides per model)."""

    def supports_schema(self) -> bool: ...


class LLMRewriter:
    """Any inference client proposes the new knobs as JSON; validated, retried, else rejected."""

    name = "llm"

    def __init__(self, client: object, retries: int = 2, max_tokens: int = 256) -> None:
        self.client = client
        self.retries = retries
        self.max_tokens = max_tokens

    def prompt(
        self,
        family: Family,
        task: TaskSpec,
        direction: Direction,
        summaries: list[str],
        failures: list[FailureDigest] | None = None,
        moves: int = 1,
    ) -> str:
        bounds = {k.name: list(family.bounds(k.name, task.split)) for k in family.knobs}
        wide = (
            (f"Every recent attempt ended the same way: move the knobs by about {moves} steps in total, not one.\n")
            if moves > 1
            else ""
        )
        return (
            f"You rewrite {family.name} tasks to make them {direction} while keeping their intent.\n"
            f"Current knobs: {json.dumps(task.knobs)}\nBounds: {json.dumps(bounds)}\n{wide}"
            f"Why recent attempts failed:\n{failure_text(failures or [], summaries)}\n"
            'Answer with JSON only: {"knobs": {...}, "reason": "..."}\n'
        )

    async def propose(
        self, family: Family, task: TaskSpec, direction: Direction, failures: list[FailureDigest], moves: int = 1
    ) -> Proposal:
        summaries = [critic_summary(f) for f in failures]
        prompt = self.prompt(family, task, direction, summaries, failures, moves)
        error = "no answer"
        schema = proposal_schema(family, task.split)
        for _ in range(self.retries + 1):
            kwargs = {"response_format": schema} if isinstance(self.client, StructuredOutput) else {}
            completion = await self.client.complete(prompt, max_tokens=self.max_tokens, **kwargs)  # type: ignore[attr-defined]
            try:
                candidate = parse_llm_proposal(family, task, direction, completion.text)
            except ValueError as exc:
                error = str(exc)
                prompt += f"\nYour previous answer was invalid: {error}. Answer with valid JSON only.\n"
                continue
            return Proposal(candidate, summaries, self.name)
        return Proposal(None, summaries, self.name, f"invalid rewriter output after {self.retries + 1} tries: {error}")


def proposal_schema(family: Family, split: str = "train") -> type[BaseModel]:
    """The JSON the LLM rewriter must return for a task of ``split``, as a pydantic model
    (``response_format`` where the provider supports structured output; validated by
    ``parse_llm_proposal`` in every case)."""
    fields: dict[str, Any] = {}
    for k in family.knobs:
        lo, hi = family.bounds(k.name, split)
        fields[k.name] = (int | None, Field(default=None, ge=lo, le=hi))
    knobs = create_model(f"{family.name.title()}Knobs", **fields)
    return create_model("Rewrite", knobs=(knobs, ...), reason=(str, ""))


def parse_llm_proposal(family: Family, task: TaskSpec, direction: Direction, text: str) -> TaskSpec:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("no JSON object in the answer")
    try:
        data = json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    knobs = data.get("knobs") if isinstance(data, dict) else None
    if not isinstance(knobs, dict):
        raise ValueError("missing 'knobs' object")
    knobs = {k: v for k, v in knobs.items() if v is not None}  # structured output sends nulls for the rest
    new = dict(task.knobs)
    for name, value in knobs.items():
        knob = next((k for k in family.knobs if k.name == name), None)
        if knob is None:
            raise ValueError(f"unknown knob {name!r}")
        lo, hi = family.bounds(name, task.split)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"knob {name}={value!r} outside [{lo}, {hi}]")
        new[name] = value
    candidate = family.derive(task, new)
    moved = family.difficulty(candidate) - family.difficulty(task)
    if (moved <= 0) if direction == "harder" else (moved >= 0):
        raise ValueError(f"the proposal does not make the task {direction}")
    return candidate
