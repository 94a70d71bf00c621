"""Markdown tables of a ``bench learn`` / ``bench ladder`` result over seeds (pure: a result in, text out).

``coevo bench table RESULT.json`` prints them; docs/benchmarks.md quotes them. Cells are mean ± the 95 %
Student-t half-width over the seeds (``coevo.bench.learn.seed_stats``); "paired" lines are the per-seed
differences against the first configuration (learn: first minus second), where the runs of one seed share
initial weights, tokenizer, sampling and pool. The per-step table is each run's evaluation at its
milestones (under ``--budget steps:N`` the exact policy version of that step), and the seconds it took to
get there: the same step budget costs different wall clock per configuration.
"""

from __future__ import annotations

from typing import Any

from coevo.bench.heldout import verb_lines
from coevo.bench.learn import Result, seed_stats

COLUMNS = (
    ("train success (start → end)", ("train_success_initial", "train_success")),
    ("best train success", ("best_train_success",)),
    ("held-out success (start → end)", ("heldout_success_initial", "heldout_success")),
    ("held-out change", ("heldout_gain",)),
    ("held-out step agreement (start → end)", ("heldout_step_agreement_initial", "heldout_step_agreement")),
    ("policy entropy (start → end)", ("policy_entropy_start", "policy_entropy")),
    ("judge process acc.", ("judge_process_accuracy",)),
    ("judge outcome acc.", ("judge_outcome_accuracy",)),
    ("rewrites accepted", ("rewrites_accepted",)),
    ("policy steps", ("policy_steps",)),
    ("seconds", ("seconds",)),
    ("trajectories/s", ("trajectories_per_second",)),
)
PAIRED_SHOWN = (
    "train_success",
    "best_train_success",
    "heldout_success",
    "heldout_step_agreement",
    "judge_process_accuracy",
    "seconds",
)


def cell(stats: dict[str, Any] | None, digits: int = 2) -> str:
    """``mean ± half-width`` (``—`` without values, the mean alone for one)."""
    if not stats or stats.get("mean") is None:
        return "—"
    mean = f"{stats['mean']:.{digits}f}"
    return mean if stats.get("half_width") is None else f"{mean} ± {stats['half_width']:.{digits}f}"


def _digits(metric: str) -> int:
    return 0 if metric in ("seconds", "policy_steps", "rewrites_accepted") else 2


def summary_table(result: Result) -> str:
    """One row per configuration: the final metrics over seeds."""
    head = "| configuration | " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for config, block in result["configs"].items():
        summary = block["summary"]
        cells = [" → ".join(cell(summary.get(m), _digits(m)) for m in metrics) for _, metrics in COLUMNS]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_lines(result: Result) -> str:
    """The per-seed differences, one line per comparison."""
    out = []
    for comparison, metrics in result.get("paired", {}).items():
        shown = [f"{m} {_signed(metrics[m], _digits(m))}" for m in PAIRED_SHOWN if metrics.get(m, {}).get("n")]
        out.append(f"paired {comparison}: " + "; ".join(shown))
    return "\n\n".join(out)


def _signed(stats: dict[str, Any], digits: int) -> str:
    text = cell(stats, digits)
    return text if text.startswith("-") or text == "—" else "+" + text


def step_table(result: Result) -> str:
    """Success at each evaluation milestone (mean ± interval over seeds), and the seconds it took."""
    configs = result["configs"]
    runs_of = {c: block["runs"] for c, block in configs.items()}
    steps = sorted({p["step"] for runs in runs_of.values() for r in runs for p in r["curve"]})
    head = "| configuration | " + " | ".join(f"step {s}" for s in steps) + " |"
    lines = [head, "|" + "---|" * (len(steps) + 1)]
    for config, runs in runs_of.items():
        row = []
        for s in steps:
            points = [next((p for p in r["curve"] if p["step"] == s), None) for r in runs]
            success = seed_stats([p["success"] if p else None for p in points])
            seconds = seed_stats([p["seconds"] if p else None for p in points])
            row.append(cell(success) + ("" if s == 0 else f" ({cell(seconds, 0)} s)"))
        lines.append(f"| {config} | " + " | ".join(row) + " |")
    return "\n".join(lines)


CURVE_KEYS = ("success", "seconds", "policy_version")


def time_table(result: Result) -> str:
    """Under a wall-clock budget: success at each run's i-th evaluation (mean ± interval over seeds), with
    the seconds and the policy version it was taken at."""
    runs_of = {c: block["runs"] for c, block in result["configs"].items()}
    n = max(len(r["curve"]) for runs in runs_of.values() for r in runs)
    head = "| configuration | " + " | ".join(f"evaluation {i}" for i in range(n)) + " |"
    lines = [head, "|" + "---|" * (n + 1)]
    for config, runs in runs_of.items():
        row = []
        for i in range(n):
            points = [r["curve"][i] if i < len(r["curve"]) else None for r in runs]
            success, seconds, version = (seed_stats([p[k] if p else None for p in points]) for k in CURVE_KEYS)
            row.append(f"{cell(success)} ({cell(seconds, 0)} s, version {cell(version, 0)})")
        lines.append(f"| {config} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def protocol_table(result: Result, key: str = "heldout_protocol", measure: str = "success") -> str:
    """The held-out protocol's table: every habit and the base beside each configuration, on the same
    tasks and evaluation seeds, with the words ``verdict`` allows (a gain clears the base's greedy score
    and every habit); ``key="heldout_steps"``: the same for step agreement (``coevo.bench.steps``)."""
    table = result.get(key)
    if not table:
        return ""
    lines = [f"| held-out (same tasks and seeds) | {measure} [95 % interval] | verdict |", "|---|---|---|"]
    for name, row in table["rows"].items():
        rule = f" ({row['rule']})" if "rule" in row else ""
        lines.append(f"| {name}{rule} | {row['mean']:.2f} [{row['low']:.2f}, {row['high']:.2f}] | |")
    for config, row in table["trained"].items():
        lines.append(f"| {config} | {row['mean']:.2f} [{row['low']:.2f}, {row['high']:.2f}] | {row['verdict']} |")
    for comparison, row in table["paired"].items():
        lines.append(f"| paired {comparison} | {row['mean']:+.2f} [{row['low']:+.2f}, {row['high']:+.2f}] | |")
    return "\n".join(lines)


def tables(result: Result) -> str:
    """Everything above, with the run's conditions in one line."""
    seeds = result.get("seeds", [])
    title = (
        f"{result.get('family')}, {result.get('budget')} per run, seeds {seeds}, "
        f"{result.get('episodes_per_evaluation')} evaluation episodes"
    )
    steps = protocol_table(result, "heldout_steps", "step agreement")
    if verbs := result.get("heldout_steps", {}).get("by_verb"):
        steps += "\n\nstep agreement by the ceiling's verb:\n" + "\n".join(verb_lines(verbs))
    parts = [title, summary_table(result), paired_lines(result), protocol_table(result), steps]
    curves = [p for block in result["configs"].values() for r in block["runs"] for p in r.get("curve", [])]
    if curves and all("step" in p for p in curves):
        parts += ["train success per policy step (seconds to reach it):", step_table(result)]
    elif curves:
        parts += ["train success at each evaluation (seconds, policy version):", time_table(result)]
    return "\n\n".join(p for p in parts if p) + "\n"
