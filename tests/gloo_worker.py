"""One rank of the two-process gloo check: a lane step on this rank's half of the batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from coevo.config import LearnerConfig
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane


def main() -> None:
    rank, world, init, model, samples_path, out = sys.argv[1:7]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=int(rank), world_size=int(world))
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(samples_path).read_text())]
    shard = samples[int(rank)::int(world)]
    lane = Lane("policy", Path(model), Path(out).parent / f"ckpt{rank}", LearnerConfig(lr=1e-2), device="cpu")
    lane.step(shard, [])
    if int(rank) == 0:
        torch.save({k: v.detach().clone() for k, v in lane.model.state_dict().items()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
