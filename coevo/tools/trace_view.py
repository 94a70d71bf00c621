"""Rendering a trace as a rich tree (the data comes from ``trace.trace``)."""

from __future__ import annotations

from typing import Any

from rich.tree import Tree

GROUPS_SHOWN = 8
"""group ids listed under a learner step (``--json`` has them all)"""


def tree(t: dict[str, Any]) -> Tree:
    kind = t["kind"]
    if kind == "weights":
        return _weights(t)
    if kind == "task":
        root = Tree(f"[bold]task {t['task_id']}[/]")
        _lineage(root, t["lineage"])
        groups = root.add(f"{len(t['groups'])} groups")
        for g in t["groups"]:
            groups.add(f"{g['group_id']} ({g['purpose']}): accuracy {g['accuracy']:.3f}")
        return root
    root = Tree(f"[bold]trajectory {t['trajectory_id']}[/] on task {t['task_id']}: [bold]{t['outcome']}[/]")
    _lineage(root, t["lineage"])
    reasons = any(v["rationale"] for s in t["steps"] for v in s["votes"])
    steps = root.add(
        "steps"
        + (
            ""
            if reasons or not t["steps"]
            else " [dim](no vote rationales: a judge in "
            "'verdict' mode votes with one token; judge.mode = 'reasoned' writes them)[/]"
        )
    )
    for s in t["steps"]:
        votes = " ".join(
            {1: "+", -1: "-"}.get(v["value"], "?") if v["status"] == "ok" else v["status"][0] for v in s["votes"]
        )
        adv = f" A={s['advantage']:+.3f}" if s.get("advantage") is not None else ""
        node = steps.add(
            f"{s['step']}. {s['action']!r} -> {s['result'][:60]!r} votes [{votes}]"
            f" ref {s['reference_label']} v{s['policy_version']}{adv}"
        )
        if reasons:
            _votes(node, s["votes"])
    if t.get("group"):
        g = t["group"]
        root.add(
            f"scored in {g['group_id']}: accuracy {g['accuracy']:.3f}"
            + (f" (flagged: {g['flagged']})" if g["flagged"] else "")
        )
    if not t.get("learner_step"):
        root.add("[dim]not trained (yet): held-out, flagged, out of the policy band, or still queued[/]")
    else:
        ls = t["learner_step"]
        w = root.add(
            f"trained by policy learner step {ls['version']} -> weights policy v{ls['version']} (loss {ls['loss']:.4f})"
        )
        for a in (t.get("weights") or {}).get("applied", []):
            w.add(f"applied on {a['server']} ({'ok' if a['ok'] else 'FAILED'}, pause {a['pause_ms']:.1f} ms)")
    return root


def _votes(node: Tree, votes: list[dict[str, Any]]) -> None:
    """Each vote with its rationale (an error vote's rationale is the error)."""
    for i, v in enumerate(votes):
        value = {1: "+1", -1: "-1"}.get(v["value"], "?") if v["status"] == "ok" else v["status"]
        node.add(f"[dim]vote {i}: {value}: {v['rationale'][-160:] or '(none)'}[/]")


def _lineage(root: Tree, lineage: list[dict[str, Any]]) -> None:
    if not lineage:
        return
    node = root.add("rewrite lineage")
    for step in lineage:
        verdict = {True: "accepted", False: "rejected", None: "pending"}[step["accepted"]]
        node.add(
            f"{step['parent_id']} -> {step['task_id']} ({step['direction']}, {step['rewriter']}, {verdict}: "
            f"{step.get('reason') or ''})"
        )


def _weights(t: dict[str, Any]) -> Tree:
    """A weights version: its path (or that it was pruned), its learner step and groups, where it was applied."""
    pruned = " [dim](pruned: no longer on disk)[/]" if t.get("on_disk") is False else ""
    root = Tree(f"[bold]weights {t['role']} v{t['version']}[/] {t.get('path') or ''}{pruned}")
    if t.get("learner_step"):
        ls = t["learner_step"]
        step = root.add(
            f"{t['role']} learner step {t['version']}: loss {ls['loss']:.4f} kl {ls['kl']:.4f} "
            f"clip fraction {ls['clip_fraction']:.3f} samples {ls['samples']} groups {len(ls['group_ids'])}"
        )
        shown = ls["group_ids"][:GROUPS_SHOWN]
        for group_id in shown:
            step.add(f"group {group_id}")
        if len(ls["group_ids"]) > len(shown):
            step.add(f"[dim]... {len(ls['group_ids']) - len(shown)} more (--json lists them all)[/]")
    for a in t["applied"]:
        root.add(f"applied on {a['server']} ({'ok' if a['ok'] else 'FAILED'}, pause {a['pause_ms']:.1f} ms)")
    return root
