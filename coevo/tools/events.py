"""A recorded run's event log, read and written offline: open, load, export, import, and its config.

Invariants:
- export writes every stored event of a run, in stream order, with its sequence number; importing
  an export under a new run id and exporting again gives the same events (up to the run id);
- loading gives the decodable events in stream order with their sequence numbers, optionally
  restricted to a closed range of sequence numbers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from coevo.config import CoevoConfig, load_config
from coevo.observe.progress import progress_bar, tracked
from coevo.runtime.bus import NatsBus
from coevo.schemas import Event, decode, readable


@asynccontextmanager
async def open_run(
    run_id: str, runs_dir: Path, url: str | None = None, credentials: Path | None = None
) -> AsyncIterator[NatsBus]:
    """The run's events: on ``url`` (with ``credentials``, or the run's own admin file), or on an
    embedded server over the run's own store."""
    from coevo.runtime.app import open_bus, run_reader_config

    store = runs_dir / run_id / "nats"
    async with open_bus(
        run_id, url=url, store=store, existing=True, cfg=run_reader_config(store, url, credentials)
    ) as bus:
        yield bus


def within(events: list[tuple[int, Event]], start: int | None, end: int | None) -> list[tuple[int, Event]]:
    return [(s, e) for s, e in events if (start is None or s >= start) and (end is None or s <= end)]


async def load_events(bus: NatsBus, start: int | None = None, end: int | None = None) -> list[tuple[int, Event]]:
    return within([(s, e) async for s, e, _ in bus.history() if e is not None], start, end)


def run_config(runs_dir: Path, run_id: str, overrides: dict[str, Any]) -> CoevoConfig:
    """The config the run was started with (``config.json``), with ``overrides`` on top."""
    path = runs_dir / run_id / "config.json"
    base = json.loads(path.read_text()) if path.exists() else {}
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and not prefix.endswith(("staleness_histogram", "params", "knobs")):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = node

    walk("", base)
    flat = {k: v for k, v in flat.items() if v is not None and not k.startswith(("nats.", "run."))}
    return load_config(overrides={**flat, **overrides})


# ---- export / import ---------------------------------------------------------------------------


async def export_events(bus: NatsBus, out: Path, fmt: str = "jsonl") -> int:
    rows = []
    with progress_bar(f"exporting run {bus.run_id}", await bus.last_sequence()) as bar:
        async for seq, event, msg in bus.history():
            # the decoded event (a large one's claim resolved), numbers as plain lists: for people and pandas
            payload: Any = readable(event) if event is not None else {"undecodable": msg.data.hex()}
            rows.append({"seq": seq, "subject": msg.subject, "event": payload})
            bar.advance()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")
    elif fmt == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise SystemExit("parquet export needs pyarrow: pip install 'coevo[parquet]'") from exc
        table = pa.table(
            {
                "seq": [r["seq"] for r in rows],
                "subject": [r["subject"] for r in rows],
                "kind": [r["event"].get("kind", "") for r in rows],
                "event": [json.dumps(r["event"], sort_keys=True) for r in rows],
            }
        )
        pq.write_table(table, out)
    else:
        raise SystemExit(f"unknown format {fmt!r} (jsonl or parquet)")
    return len(rows)


def read_export(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(path).to_pylist()
        return [{"seq": r["seq"], "subject": r["subject"], "event": json.loads(r["event"])} for r in t]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def import_events(bus: NatsBus, rows: Iterable[dict[str, Any]]) -> int:
    """Publish an export into ``bus``'s run (events get the new run id), in the recorded order."""
    n = 0
    for row in tracked(list(rows), f"importing into run {bus.run_id}"):
        data = dict(row["event"])
        if "undecodable" in data:
            continue
        data["run_id"] = bus.run_id
        event = decode(json.dumps(data))
        await bus.publish_sync(event)  # in order, one at a time: sequence numbers follow the export's
        n += 1
    return n


def normalized(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An export with run ids and subjects made run-neutral (to compare two runs' exports)."""
    out = []
    for r in rows:
        e = dict(r["event"])
        e.pop("run_id", None)
        out.append({"seq": r["seq"], "subject": r["subject"].split(".", 2)[-1], "event": e})
    return out
