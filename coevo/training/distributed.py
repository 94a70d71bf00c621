"""The learner under ``torchrun``: rank 0 is the agent (it alone talks to NATS); the other ranks
follow its commands and train their share of every batch.

Invariants:
- every rank executes the same sequence of collective operations: rank 0 broadcasts each command
  (``step`` with the batch, ``publish``, ``checkpoint``, ``stop``) before doing it itself, and each
  rank trains its rows of the batch's shared plan (``batch.rank_plan``: the same number of
  micro-batches on every rank, padded with zero-weight rows), gradients averaged by FSDP2 or by an
  all-reduce;
- a command that fails on any rank ends that rank's process at once (``abort``): the others may be
  inside the command's collectives, so no rank retries or goes on alone. Its peers' collectives then
  fail on the closed connection and they end too, and so does torchrun; the process manager starts
  it again (torchrun's own ``--max-restarts`` sometimes failed to reconnect its gloo group here), which resumes from the newest durable checkpoint, and the groups
  not yet acknowledged are redelivered (the learner's invariants: none lost, none trained twice).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from coevo.schemas import TrainingSample
from coevo.training.lane import Lane, StepMetrics


def world_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed() -> tuple[int, int]:
    """Join the torchrun group (nccl on CUDA, gloo otherwise); (rank, world)."""
    import torch
    import torch.distributed as dist

    rank, world = world_from_env()
    if world > 1:  # a rank outlives neither torchrun nor, through it, whoever started torchrun
        from coevo.runtime.proc import die_with_launcher

        die_with_launcher()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return rank, world


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


EXIT_RANK_FAILED = 75
"""the exit status of a rank that ended its process group (torchrun restarts the group)"""

T = TypeVar("T")
log = structlog.get_logger("coevo.learner")


def abort(command: str, exc: BaseException) -> None:
    """End this rank's process now (from any thread): its peers cannot be told where it stopped."""
    rank, world = world_from_env()
    log.critical("learner.rank_failed", rank=rank, world=world, command=command, error=repr(exc)[:500])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RANK_FAILED)


def _or_abort(command: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except Exception as exc:
        abort(command, exc)
        raise  # not reached


_COLLECTIVES = threading.Lock()
"""Rank 0 trains its lanes from several threads; collectives must reach every rank in one order."""


class RankZeroLane:
    """What the learner agent holds on rank 0: a lane whose every operation the other ranks mirror."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lane, name)

    def step(self, samples: list[TrainingSample], groups: list[str]) -> StepMetrics:
        with _COLLECTIVES:
            _or_abort("step", lambda: _broadcast(("step", self.lane.role, [s.model_dump() for s in samples], groups)))
            return _or_abort("step", lambda: self.lane.step(samples, groups))

    def publish(self) -> Any:
        with _COLLECTIVES:
            _or_abort("publish", lambda: _broadcast(("publish", self.lane.role, None, None)))
            return _or_abort("publish", self.lane.publish)

    def begin_checkpoint(self) -> Any:
        with _COLLECTIVES:
            _or_abort("checkpoint", lambda: _broadcast(("checkpoint", self.lane.role, None, None)))
            return _or_abort("checkpoint", self.lane.begin_checkpoint)

    def checkpoint(self) -> Any:
        return self.begin_checkpoint().result()


def stop_followers() -> None:
    with _COLLECTIVES:
        _broadcast(("stop", None, None, None))


def follow(lanes: dict[str, Lane]) -> None:
    """Ranks > 0: mirror rank 0's commands until it says stop. SIGINT and SIGTERM are ignored here
    (torchrun, or a stop of the process group, signals every rank): rank 0 drains, writes the last
    checkpoint, which needs every rank, and then says stop."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        command, role, samples, groups = _or_abort("receive", lambda: _broadcast(None))
        if command == "stop":
            return
        _or_abort(command, functools.partial(_follow_one, lanes[role], command, samples, groups))


def _follow_one(lane: Lane, command: str, samples: Any, groups: Any) -> None:
    if command == "step":
        lane.step([TrainingSample.model_validate(s) for s in samples], groups)
    elif command == "publish":
        lane.publish()
    elif command == "checkpoint":
        lane.begin_checkpoint().result()
