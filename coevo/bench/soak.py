"""``coevo bench soak``: does a long run stay flat? RSS of every process and the growth on disk.

Runs ``coevo run`` (every agent in one process, an embedded nats-server) for ``minutes`` and samples,
every ``every_s``: the resident memory of the coevo process and of nats-server, the bytes of the
run's stream, of its KV buckets and object store, and of the run directory (checkpoints, logs,
NATS store). Slopes are fitted over the samples after a warm-up (the first fifth) and reported
per hour, so a leak shows as a positive slope and bounded retention as a flat one: least squares
(``slope_per_hour``) and Theil–Sen (``robust_slope_per_hour``, the median of the pairwise slopes).
The coevo process's RSS swings by hundreds of MB within minutes (learner steps and engine batches
allocate and free), and a least-squares line through such a sawtooth moves by tens of MB/hour with
the phase at which the run ends; the median of pairwise slopes does not follow single swings. The
five-minute medians (``window_medians``) are kept beside them so the curve itself can be read.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coevo.runtime.memory import rss_bytes
from coevo.runtime.proc import die_with_parent

MB = 1024 * 1024


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per hour (0 with fewer than two points)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var * 3600


def robust_slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Theil–Sen slope of (seconds, value) samples, per hour: the median of the slopes between every
    pair of samples at distinct times (0 with fewer than two). Half the samples would have to be
    outliers to move it arbitrarily; a least-squares fit moves with one large swing."""
    pairs = [(v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(samples) for t2, v2 in samples[i + 1 :] if t2 != t1]
    return statistics.median(pairs) * 3600 if pairs else 0.0


def window_medians(samples: list[tuple[float, float]], window_s: float = 300.0) -> list[tuple[float, float]]:
    """(window start in seconds, median value) for consecutive windows of ``window_s``."""
    buckets: dict[int, list[float]] = {}
    for t, v in samples:
        buckets.setdefault(int(t // window_s), []).append(v)
    return [(k * window_s, statistics.median(buckets[k])) for k in sorted(buckets)]


def rss_mb(pid: int) -> float | None:
    rss = rss_bytes(pid)
    return None if rss is None else rss / 2**20


def children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (a process started from a worker thread is listed there)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def dir_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total / MB


def _proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def sample(coevo_pid: int, run_dir: Path) -> dict[str, float]:
    """One sample: RSS of coevo and nats-server (MB), and MB on disk by kind."""
    out: dict[str, float] = {}
    out["rss_coevo_mb"] = rss_mb(coevo_pid) or 0.0
    nats = [p for p in _descendants(coevo_pid) if _proc_name(p).startswith("nats-server")]
    out["rss_nats_mb"] = sum(rss_mb(p) or 0.0 for p in nats)
    js = run_dir / "nats" / "jetstream"
    streams = [d for d in js.rglob("streams/*") if d.is_dir()] if js.exists() else []
    out["stream_mb"] = sum(dir_mb(d) for d in streams if d.name.startswith("COEVO_"))
    out["kv_mb"] = sum(dir_mb(d) for d in streams if d.name.startswith("KV_"))
    out["objects_mb"] = sum(dir_mb(d) for d in streams if d.name.startswith("OBJ_"))
    out["checkpoints_mb"] = dir_mb(run_dir / "checkpoints") if (run_dir / "checkpoints").exists() else 0.0
    out["run_dir_mb"] = dir_mb(run_dir)
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def summarize_samples(samples: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    warm = samples[len(samples) // 5 :]
    keys = samples[0][1].keys() if samples else []
    return {
        "samples": len(samples),
        "slope_per_hour": {k: round(slope_per_hour([(t, s[k]) for t, s in warm]), 2) for k in keys},
        "robust_slope_per_hour": {k: round(robust_slope_per_hour([(t, s[k]) for t, s in warm]), 2) for k in keys},
        "window_medians": {
            k: [[round(t), round(v, 1)] for t, v in window_medians([(t, s[k]) for t, s in samples])]
            for k in keys
            if k.startswith("rss_")
        },
        "max": {k: round(max(s[k] for _, s in samples), 1) for k in keys if k.startswith("rss_")},
        "end": {k: round(v, 1) for k, v in samples[-1][1].items()} if samples else {},
        "series": [{"t_s": round(t, 1), **{k: round(v, 1) for k, v in s.items()}} for t, s in samples],
    }


async def bench_soak(minutes: float = 30.0, every_s: float = 10.0, extra: list[str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="coevo-soak-") as tmp:
        run_id = "soak"
        args = [
            sys.executable,
            "-m",
            "coevo",
            "run",
            "--minutes",
            str(minutes),
            "--run-id",
            run_id,
            "--set",
            f"run.runs_dir={tmp}",
            "--set",
            "log.console=off",
            *(extra or []),
        ]
        with (Path(tmp) / "stderr.txt").open("wb") as errf:  # a file, not a pipe: a long run cannot block on it
            proc = await asyncio.create_subprocess_exec(
                *args, stdout=subprocess.DEVNULL, stderr=errf, preexec_fn=die_with_parent
            )
        run_dir = Path(tmp) / run_id
        samples: list[tuple[float, dict[str, float]]] = []
        t0 = time.monotonic()
        while proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), every_s)
            except TimeoutError:
                if run_dir.exists():
                    samples.append((time.monotonic() - t0, await asyncio.to_thread(sample, proc.pid, run_dir)))
        err = (Path(tmp) / "stderr.txt").read_bytes()[-2000:].decode(errors="replace")
        summary = run_dir / "summary.json"
        result = {
            "minutes": minutes,
            "every_s": every_s,
            "run_args": extra or [],
            "returncode": proc.returncode,
            "learner_steps": json.loads(summary.read_text())["learner_steps"] if summary.exists() else None,
            **summarize_samples(samples),
            "final_run_dir_mb": round(dir_mb(run_dir), 1),
        }
        if proc.returncode != 0:
            result["stderr_tail"] = err
        return result
