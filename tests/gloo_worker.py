"""One rank of the two-process gloo check: a lane step on the batch (each rank trains its rows), then the
collective checkpoint (FSDP2 gathers the full weights to rank 0)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from coevo.config import LearnerConfig
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane


def main() -> None:
    rank, world, init, model, samples_path, ckpt_root, parallel, max_tokens = sys.argv[1:9]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=int(rank), world_size=int(world))
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(samples_path).read_text())]
    lane = Lane(
        "policy",
        Path(model),
        Path(ckpt_root),
        LearnerConfig(lr=1e-2, parallel=parallel, max_batch_tokens=int(max_tokens)),
        device="cpu",
    )
    assert lane.fsdp == (parallel == "fsdp")
    metrics = lane.step(samples, ["g"])  # the whole batch: the lane takes its rows of the shared plan
    path, sha, _ = lane.checkpoint()
    if int(rank) == 0:
        print(json.dumps({"path": str(path), "sha": sha, "entropy": metrics.entropy}), flush=True)
    dist.barrier()  # both ranks are done with every collective before either tears gloo down
    dist.destroy_process_group()
    # gloo's worker threads can still abort the interpreter's finalization ("terminate called without
    # an active exception", 1 run in ~15 here; pytorch/pytorch#190489): the rank's work is done, so
    # skip it
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
