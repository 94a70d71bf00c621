"""A finished (or running) run's metrics from its stored events: the same aggregator, fed from history.

Invariant: ``aggregate`` folds every stored event once, in stream order, exactly as the live
observer would have; the report of a run is therefore the same whether written at its end or later.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from coevo.observe.aggregate import Aggregator
from coevo.observe.progress import progress_bar
from coevo.runtime.app import open_bus
from coevo.runtime.bus import NatsBus


async def aggregate(bus: NatsBus) -> Aggregator:
    """Every stored event of the run folded into a new aggregator (with a progress bar on a terminal)."""
    agg = Aggregator()
    with progress_bar(f"reading run {bus.run_id}", await bus.last_sequence()) as bar:
        async for seq, event, _msg in bus.history():
            agg.add(event, seq)
            bar.advance()
    agg.finish()
    return agg


async def run_report(run_id: str, runs_dir: Path, url: str | None, out: Path, credentials: Path | None = None) -> Path:
    """``coevo report --run``: read the run (its own store, or ``url``), write ``out/index.html``."""
    from coevo.observe.report import write_report
    from coevo.runtime.app import run_reader_config

    store = runs_dir / run_id / "nats"
    async with open_bus(
        run_id, url=url, store=store, existing=True, name="coevo-report", cfg=run_reader_config(store, url, credentials)
    ) as bus:
        agg = await aggregate(bus)
    summary_path = runs_dir / run_id / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return await asyncio.to_thread(write_report, agg, out, summary=summary)
