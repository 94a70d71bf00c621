"""``coevo report``: a self-contained HTML report with PNG plots (matplotlib), of a run or of a benchmark.

Invariant: the report is a pure function of the aggregator's state (a run) or of the benchmark's JSON;
the HTML embeds its plots (base64 PNG) and needs nothing else to open, and the same PNGs are written
next to it (``plots/``) to attach elsewhere.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coevo.observe.aggregate import Aggregator
from coevo.observe.series import CHARTS, SPECS, Series
from coevo.observe.tally import SUMMARY_FIELDS

REQUIRED = ("success", "reward", "judge", "kl", "weights")
"""Plotted even when empty (the report says "no data" rather than leaving them out)."""
ORDER = (
    *REQUIRED,
    "consistency",
    "loss",
    "clip",
    "entropy",
    "entropy_coef",
    "mismatch_kl",
    "tokens",
    "rates",
    "staleness",
    "staleness_hist",
    "rewrites",
    "difficulty",
    "judge_calls",
    "judge_cost",
    "dead_letters",
    "consumers",
    "restarts",
    "weights_failed",
)
SMOOTHED = {"success_train", "reward_mean", "judge_process_accuracy", "judge_outcome_accuracy", "judge_consistency"}


def _figure(width: float = 6.4, height: float = 3.0) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90, layout="constrained")
    return fig, fig.add_subplot()


def _png(fig: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def _rolling(values: list[float], k: int = 8) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _label(s: Series, many_names: bool) -> str:
    labels = " ".join(v for _, v in s.labels)
    return " ".join(x for x in (s.name if many_names else "", labels) if x) or s.name


def chart_png(chart: str, series: list[Series]) -> bytes:
    """One chart of ``CHARTS`` as a PNG (x: minutes of the run; the staleness histogram: bars)."""
    return _png(chart_figure(chart, series))


LEGEND_ROWS = 10
"""legend entries per column: past it the legend (beside the plot, never over it) gets another column"""


def chart_figure(chart: str, series: list[Series]) -> Any:
    """The figure of ``chart_png``: the legend beside the axes, inside the figure, clear of the title."""
    title, unit = CHARTS[chart]
    fig, ax = _figure()
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    data = [s for s in series if s.visible()]
    if not data:
        ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif chart == "staleness_hist":
        bars = sorted(((_label(s, False), s.visible()[-1][1]) for s in data), key=lambda b: b[0])
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color="#2b6cb0")
        ax.set_xlabel("role, staleness (versions)", fontsize=9)
    else:
        many = len({s.name for s in data}) > 1
        for s in data:
            pts = s.visible()
            xs, ys = [t / 60 for t, _ in pts], [v for _, v in pts]
            if s.name in SMOOTHED and len(ys) > 8:
                line = ax.plot(xs, _rolling(ys), label=_label(s, many) + " (moving mean of 8)")[0]
                ax.scatter(xs, ys, s=6, alpha=0.3, color=line.get_color())
            else:
                ax.plot(xs, ys, marker="o" if len(ys) < 60 else None, markersize=3, label=_label(s, many))
        ax.set_xlabel("run time (minutes)", fontsize=9)
        columns = -(-len(data) // LEGEND_ROWS)
        fig.set_figwidth(fig.get_figwidth() + 1.6 * columns)  # room beside the plot, which keeps its width
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, ncols=columns)
    return fig


def _table(rows: Iterable[Iterable[Any]], headers: Iterable[str]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)
    return "–" if v is None else str(v)


PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>
body{{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#1a202c;padding:0 16px}}
table{{border-collapse:collapse;margin:8px 0 20px;font-size:13px}}td,th{{border:1px solid #e2e8f0;padding:3px 8px;
text-align:left;vertical-align:top}}th{{background:#edf2f7}}.plots{{display:grid;grid-template-columns:repeat(auto-fill,
minmax(540px,1fr));gap:10px}}figure{{margin:0}}img{{max-width:100%;border:1px solid #e2e8f0}}figcaption{{font-size:12px;
color:#4a5568}}</style></head><body><h1>{title}</h1>{body}</body></html>
"""


def _save_plots(pngs: list[tuple[str, str, bytes]], out: Path) -> str:
    (out / "plots").mkdir(parents=True, exist_ok=True)
    figures = []
    for name, caption, data in pngs:
        (out / "plots" / f"{name}.png").write_bytes(data)
        b64 = base64.b64encode(data).decode()
        figures.append(
            f'<figure id="plot-{name}"><img alt="{html.escape(caption)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{html.escape(caption)} (plots/{name}.png)</figcaption></figure>"
        )
    return '<div class="plots">' + "".join(figures) + "</div>"


LEARNER_KEYS = ("version", "loss", "kl", "clip_fraction", "mismatch_kl", "entropy", "tokens_per_second")
SLOT_KEYS = ("slot_id", "split", "task_id", "knobs", "difficulty", "accuracy", "accepted", "rejected")
REWRITE_KEYS = ("slot_id", "parent_id", "candidate_id", "direction", "accepted", "reason")


def _pick(row: dict[str, Any], keys: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(row.get(k) for k in keys)


def write_report(agg: Aggregator, out: Path, *, summary: dict[str, Any] | None = None) -> Path:
    """The report of a run (its aggregator, after every event was added); returns ``out/index.html``."""
    by_chart: dict[str, list[Series]] = {}
    for s in agg.series.values():
        by_chart.setdefault(SPECS[s.name].chart, []).append(s)
    pngs = []
    for chart in ORDER:
        series = sorted(by_chart.get(chart, []), key=lambda s: (s.name, s.labels))
        if chart in REQUIRED or series:
            helps = "; ".join(sorted({f"{s.name}: {SPECS[s.name].help}" for s in series})) or CHARTS[chart][0]
            pngs.append((chart, helps, chart_png(chart, series)))
    summary = summary or agg.finished or agg.summary()
    state = agg.state_json()
    body = [
        f"<p>Run <code>{html.escape(str(agg.run_id))}</code>: {agg.last_seq} events over "
        f"{agg.t_last / 60:.1f} minutes of event time.</p>",
        "<h2>Curves</h2>",
        _save_plots(pngs, out),
        "<h2>Summary</h2>",
        _table(((k, summary.get(k), SUMMARY_FIELDS.get(k, "")) for k in summary), ("field", "value", "meaning")),
        "<h2>Learner (last step per lane)</h2>",
        _table(
            ((role, *_pick(v, LEARNER_KEYS)) for role, v in agg.learner.items()),
            ("lane", "version", "loss", "KL", "clip fraction", "mismatch KL", "tokens/s"),
        ),
        "<h2>Task slots</h2>",
        _table(
            (_pick(s, SLOT_KEYS) for s in state["slots"]),
            ("slot", "split", "active task", "knobs", "difficulty", "last accuracy", "rewrites accepted", "rejected"),
        ),
        "<h2>Rewrites (newest 100)</h2>",
        _table(
            (_pick(r, REWRITE_KEYS) for r in state["rewrites"][:100]),
            ("slot", "parent", "candidate", "direction", "accepted", "reason"),
        ),
        "<h2>Agents</h2>",
        _table(
            ((a["agent_id"], a["role"], a["state"], a["restarts"]) for a in state["agents"]),
            ("agent", "role", "last state", "restarts"),
        ),
        f"<h2>Dead letters ({len(state['dead_letters'])})</h2>",
        _table(
            ((d["consumer"], d["subject"], d["reason"]) for d in state["dead_letters"]),
            ("consumer", "subject", "reason"),
        ),
    ]
    return _write(out, f"coevo run {agg.run_id}", "".join(body))


def _write(out: Path, title: str, body: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(PAGE.format(title=html.escape(title), body=body))
    return path


# ---- benchmark results -------------------------------------------------------------------------


def _curves_png(title: str, curves: dict[str, list[dict[str, Any]]]) -> bytes:
    fig, ax = _figure()
    for name, curve in curves.items():
        ax.plot([p["seconds"] / 60 for p in curve], [p["success"] for p in curve], marker="o", markersize=3, label=name)
    ax.set(title=title, xlabel="minutes", ylabel="success (evaluator)", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def _rungs_png(rungs: dict[str, dict[str, Any]]) -> bytes:
    fig, ax = _figure()
    keys = tuple(
        k
        for k in ("train_success", "heldout_success", "heldout_step_agreement", "judge_process_accuracy")
        if any(r.get(k) is not None for r in rungs.values())  # a bench that measured steps only has no success
    ) or ("train_success",)
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax.bar(
            [j + i * width for j in range(len(rungs))],
            [r.get(key) or 0.0 for r in rungs.values()],
            width,
            label=key.replace("_", " "),
        )
    ax.set_xticks([j + width for j in range(len(rungs))], list(rungs))
    ax.set(title="Ablation ladder at equal wall-clock budget", ylim=(0, 1))
    ax.legend(fontsize=8)
    return _png(fig)


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        if k in ("curve", "curves"):
            continue
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, v))
    return out


def write_bench_report(result: dict[str, Any], out: Path, *, name: str = "benchmark") -> Path:
    """The report of a ``coevo bench ... --json`` file: learn (curves), ladder (rungs), or any other (a table)."""
    pngs = []
    if "curves" in result:
        pngs.append(
            ("curves", "success over time, per configuration", _curves_png("coevo bench learn", result["curves"]))
        )
    if "rungs" in result:
        rungs = result["rungs"]
        pngs.append(("rungs", "final success and judge accuracy per rung", _rungs_png(rungs)))
        curves = {k: r["curve"] for k, r in rungs.items() if r.get("curve")}
        if curves:
            pngs.append(("curves", "success over time, per rung", _curves_png("coevo bench ladder", curves)))
    body = (_save_plots(pngs, out) if pngs else "") + "<h2>Results</h2>" + _table(_flat(result), ("field", "value"))
    return _write(out, f"coevo {name}", body)
