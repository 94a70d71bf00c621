"""Resume checkpoints, written off the critical path: snapshot to CPU memory, write on a thread.

A resume checkpoint is everything a restarted learner needs: fp32 weights, optimizer state,
counters and the groups trained into those weights. ``CheckpointWriter.start`` is called between
two optimiser steps; its thread copies the weights and the optimizer state into CPU buffers (on
CUDA: pinned buffers, a side stream) while the next step's forward and backward passes run, then
writes, fsyncs and renames the directory. The next ``optimizer.step()`` waits only for the copy
(``wait_copied``): that wait is all the checkpoint costs the critical path.

Invariants:
- the snapshot is exactly the state after the step it was started after: parameters and
  optimizer state change only in ``optimizer.step()``, which waits for the copy to end;
- one checkpoint is written at a time; a directory is written as ``.tmp-vN``, fsynced, renamed to
  ``vN`` and only then marked ``COMPLETE``; only complete checkpoints are ever loaded;
- the newest ``KEEP`` complete checkpoints are kept, older ones removed.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coevo.weights import tensorfiles
from coevo.weights.manifest import file_sha256

MARKER = "COMPLETE"
KEEP = 3


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    digest: str
    """the manifest digest (what ``verify`` checks)"""
    bytes: int
    """bytes of every file written"""
    version: int
    consumed: tuple[str, ...]
    """the groups trained into these weights"""
    seconds: float
    """from the start of the copy to the complete mark"""


@dataclass
class CheckpointJob:
    """What a checkpoint holds, as references to the live tensors (copied by the writer's thread)."""

    version: int
    role: str
    consumed: list[str]
    steps_total: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    config_json: str
    base_model: Path
    adapter_config_json: str | None = None
    """a LoRA lane's: ``model_state`` is its adapter, written as a PEFT adapter directory"""
    entropy_coef: float | None = None
    """an adaptive entropy bonus's coefficient (``learner.entropy_target``), which a resumed lane goes on with"""


def latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in Path(root).glob("v*") if (p / MARKER).exists())
    return done[-1] if done else None


def prune(root: Path, keep: int = KEEP) -> None:
    done = sorted(p for p in root.glob("v*") if (p / MARKER).exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    """One lane's resume checkpoints: at most one in flight, written by one owned thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pool: ThreadPoolExecutor | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._buffers: dict[str, torch.Tensor] = {}
        self.in_flight: Future[Checkpoint] | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight is not None and not self.in_flight.done()

    def start(self, job: CheckpointJob) -> Future[Checkpoint]:
        """Snapshot and write ``job`` on the writer thread (call between optimiser steps)."""
        if self.busy:
            raise RuntimeError("a checkpoint is already being written")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"coevo-ckpt-{job.role}")
        ready = None
        device = next((t.device for t in job.model_state.values() if t.is_cuda), None)
        if device is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # the copy starts after the step's kernels
        self._copied.clear()
        self.in_flight = self._pool.submit(self._run, job, ready)
        return self.in_flight

    def wait_copied(self) -> float:
        """Block until the snapshot in flight (if any) is in CPU memory; the seconds waited."""
        if self._copied.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _run(self, job: CheckpointJob, ready: Any) -> Checkpoint:
        t0 = time.perf_counter()
        try:
            weights, optimizer = self._snapshot(job, ready)
        finally:
            self._copied.set()
        final, digest, size = write_checkpoint(self.root, job, weights, optimizer)
        return Checkpoint(final, digest, size, job.version, tuple(job.consumed), time.perf_counter() - t0)

    def _snapshot(self, job: CheckpointJob, ready: Any) -> tuple[dict[str, torch.Tensor], Any]:
        if ready is None:
            return self._copy_state(job)
        device = next(t.device for t in job.model_state.values() if t.is_cuda)
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()  # beside the training's stream: the next step runs meanwhile
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                out = self._copy_state(job)
            stream.synchronize()
        return out

    def _copy_state(self, job: CheckpointJob) -> tuple[dict[str, torch.Tensor], Any]:
        seen: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        weights = {}
        for name, t in job.model_state.items():
            key = (t.data_ptr(), tuple(t.shape))
            if key not in seen:  # tied weights: one copy, written under each name
                seen[key] = self._copy(f"m/{name}", t)
            weights[name] = seen[key]
        return weights, self._copy_tree("o", job.optimizer_state)

    def _copy_tree(self, key: str, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy(key, obj)
        if isinstance(obj, dict):
            return {k: self._copy_tree(f"{key}/{k}", v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self._copy_tree(f"{key}/{i}", v) for i, v in enumerate(obj))
        return obj

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """Into a reused CPU buffer (pinned for CUDA tensors)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        return buf


def write_checkpoint(
    root: Path,
    job: CheckpointJob,
    weights: dict[str, torch.Tensor],
    optimizer: Any,
    extra: dict[str, Path] | None = None,
) -> tuple[Path, str, int]:
    """Write, fsync, rename and mark one checkpoint from CPU tensors; (path, digest, bytes).
    ``extra``: files written elsewhere (optimizer shards of other ranks), moved in and hashed."""
    final = root / f"v{job.version:06d}"
    tmp = root / f".tmp-v{job.version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if job.adapter_config_json is None:
        files = tensorfiles.write_weights(tmp, weights)
    else:
        files = tensorfiles.write_adapter(tmp, weights, job.adapter_config_json)
    if optimizer is not None:
        files["optimizer.pt"] = tensorfiles.torch_save(tmp / "optimizer.pt", optimizer)
    for name, src in (extra or {}).items():
        src.rename(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
    files.update(model_files(tmp, job))
    digest = tensorfiles.seal(tmp, final, files, durable=True, version=job.version, role=job.role)
    (final / MARKER).write_text(str(job.version))
    tensorfiles.fsync_dir(final)
    prune(root)
    return final, digest, sum(int(f["bytes"]) for f in files.values())


def model_files(folder: Path, job: CheckpointJob) -> dict[str, tensorfiles.FileInfo]:
    """config, tokenizer files and counters beside the weights (what from_pretrained and vLLM read)."""
    files = {"config.json": tensorfiles.write_text(folder / "config.json", job.config_json)}
    files.update(tensorfiles.copy_files(job.base_model, folder, tensorfiles.TOKENIZER_FILES))
    files["state.json"] = tensorfiles.write_text(
        folder / "state.json",
        json.dumps(
            {
                "version": job.version,
                "role": job.role,
                "steps_total": job.steps_total,
                "consumed_groups": job.consumed,
                **({"entropy_coef": job.entropy_coef} if job.entropy_coef is not None else {}),
            }
        ),
    )
    return files
