"""``coevo bench merge``: one ``bench learn``/``ladder`` result from parts that ran disjoint seeds.

Five 30-minute runs on two cores take longer than one sitting: ``--first-seed S`` runs a later part of
a seed range, and this joins the parts. Invariant: a merge joins only runs that one command would have
made (the same family, preset, budget, evaluation, configurations and, where the parts record them,
config fields), each seed once, and its statistics are recomputed from the runs (``summarize_configs``,
then the kind's paired differences), never averaged from the parts' summaries. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from coevo.bench.learn import Result, heldout_protocol, ladder_result, learn_result, summarize_configs
from coevo.bench.machine import kind
from coevo.bench.steps import agreement_table

SAME = (
    "family",
    "preset",
    "budget",
    "budget_kind",
    "minutes_per_run",
    "steps_per_run",
    "episodes_per_evaluation",
    "heldout_seed",
    "lora",
    "heldout_states_per_path",
)
"""What every part must share (a key a part lacks reads as None)."""
DERIVED = (
    "configs",
    "seeds",
    "overrides",
    "paired",
    "rungs",
    "headline",
    "curves",
    "target",
    "heldout_protocol",
    "heldout_steps",
    "machine",
)
"""What a merge computes again rather than copies from the first part (the machine: each part's, in
``merged_from``)."""


def result_kind(result: Result) -> str:
    """``ladder`` or ``learn``: the result's paired differences are the kind's."""
    if "configs" in result and "rungs" in result:
        return "ladder"
    if "configs" in result and "headline" in result:
        return "learn"
    raise ValueError("not a bench learn or bench ladder result (no configs with rungs or headline)")


def merge_results(parts: list[Result]) -> Result:
    """The result one command over the parts' seeds would have given (a ValueError naming what differs)."""
    if len(parts) < 2:
        raise ValueError(f"a merge takes two or more results, got {len(parts)}")
    first = parts[0]
    kind = result_kind(first)
    for i, part in enumerate(parts[1:], start=2):
        if result_kind(part) != kind:
            raise ValueError(f"part {i} is a bench {result_kind(part)} result, part 1 a bench {kind} result")
        for key in SAME:
            if part.get(key) != first.get(key):
                raise ValueError(f"part {i}'s {key} is {part.get(key)!r}, part 1's {first.get(key)!r}")
        if list(part["configs"]) != list(first["configs"]):
            raise ValueError(f"part {i} ran {list(part['configs'])}, part 1 {list(first['configs'])}")
    _same_machine(parts)
    overrides, unrecorded = _overrides(parts)
    runs = {
        c: sorted((r for p in parts for r in p["configs"][c]["runs"]), key=lambda r: r["seed"])
        for c in first["configs"]
    }
    for c, rs in runs.items():
        seeds = [r["seed"] for r in rs]
        if twice := sorted({s for s in seeds if seeds.count(s) > 1}):
            raise ValueError(f"seed(s) {twice} of {c!r} are in more than one part")
    out: Result = {
        **{k: v for k, v in first.items() if k not in DERIVED},
        "seeds": [r["seed"] for r in next(iter(runs.values()))],
        "merged_from": [
            {"seeds": p["seeds"], "overrides_recorded": "overrides" in p, "machine": p.get("machine")} for p in parts
        ],
        "configs": summarize_configs(runs),
    }
    if overrides is not None:
        out["overrides"] = overrides
    if unrecorded:
        out["overrides_unrecorded_for_seeds"] = unrecorded
    if "heldout_protocol" in first and all("heldout_wins" in r for rs in runs.values() for r in rs):
        habits = {k: v for k, v in first["heldout_protocol"]["rows"].items() if not k.startswith("base ")}
        out["heldout_protocol"] = heldout_protocol(runs, habits)  # habits: the same tasks and seeds in every part
    if "heldout_steps" in first and all("heldout_steps" in r for rs in runs.values() for r in rs):
        habits = {k: v for k, v in first["heldout_steps"]["rows"].items() if not k.startswith("base ")}
        verbs = {k: v for k, v in first["heldout_steps"].get("by_verb", {}).items() if k in (*habits, "states")}
        out["heldout_steps"] = agreement_table(runs, habits, verbs)
    return ladder_result(out) if kind == "ladder" else learn_result(out, {c: {} for c in first["configs"]})


def _same_machine(parts: list[Result]) -> None:
    """Parts of a wall-clock budget must have run on one kind of machine (``machine.kind``): a minute buys
    another number of steps elsewhere. Step budgets join across machines; a part that recorded no
    machine (written before results did) is not checked."""
    if parts[0].get("budget_kind") != "seconds":
        return
    recorded = [(i, p["machine"]) for i, p in enumerate(parts, start=1) if p.get("machine")]
    for i, m in recorded[1:]:
        j, first = recorded[0]
        if kind(m) != kind(first):
            raise ValueError(
                f"part {i} ran on {kind(m)} (cpu, cores, gpu), part {j} on {kind(first)}: a wall-clock budget "
                "buys other numbers on another machine"
            )


def _overrides(parts: list[Result]) -> tuple[dict[str, Any] | None, list[int]]:
    """The config fields the parts record (equal in every part that records them), and the seeds of the
    parts that record none (results written before the bench recorded them)."""
    recorded = [p["overrides"] for p in parts if "overrides" in p]
    for o in recorded[1:]:
        if o != recorded[0]:
            differ = sorted(k for k in {*o, *recorded[0]} if o.get(k) != recorded[0].get(k))
            raise ValueError(f"the parts ran with different config fields: {', '.join(differ)}")
    unrecorded = sorted(s for p in parts if "overrides" not in p for s in p["seeds"])
    return (recorded[0] if recorded else None), unrecorded
