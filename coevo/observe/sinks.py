"""Where points go besides the dashboard: TensorBoard event files, Weights & Biases (offline).

Invariants: a sink receives each point once, in the order the aggregator produced them; ``close()``
is idempotent and leaves everything written (TensorBoard's writer thread flushed and joined).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import structlog

from coevo.observe.series import Point, tb_tag

log = structlog.get_logger("coevo.observe")


class Sink(Protocol):
    def write(self, points: Iterable[Point]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars in ``<dir>/events.out.tfevents.*`` (tags ``chart/name/labels``; step: see ``Point``)."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._writer: Any = EventFileWriter(str(directory), flush_secs=10)

    def write(self, points: Iterable[Point]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            return
        for p in points:
            value = Summary.Value(tag=tb_tag(p.name, p.labels), simple_value=p.value)
            self._writer.add_event(Event(wall_time=p.wall, step=p.step, summary=Summary(value=[value])))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def wandb_available() -> bool:
    return importlib.util.find_spec("wandb") is not None


class WandbSink:
    """Weights & Biases in offline mode (``wandb sync`` uploads later): one history row per point."""

    def __init__(self, directory: Path, run_id: str, project: str, config: dict[str, Any] | None = None) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project,
            name=run_id,
            id=run_id,
            dir=str(directory),
            mode="offline",
            config=config or {},
            resume="allow",
        )

    def write(self, points: Iterable[Point]) -> None:
        if self._run is None:
            return
        for p in points:
            self._run.log({tb_tag(p.name, p.labels): p.value, "elapsed_s": p.t})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def make_sinks(
    run_dir: Path,
    run_id: str,
    *,
    tensorboard: bool,
    wandb: bool,
    project: str = "coevo",
    config: dict[str, Any] | None = None,
) -> list[Sink]:
    """The sinks a run's config asks for: TensorBoard under ``run_dir/tb``; W&B when asked and installed."""
    sinks: list[Sink] = []
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tb"))
    if wandb:
        if wandb_available():
            sinks.append(WandbSink(run_dir, run_id, project, config))
        else:
            log.warning("wandb.unavailable", hint="log.wandb = true but wandb is not installed: pip install wandb")
    return sinks
