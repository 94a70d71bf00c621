"""Published weights into inference servers over a collective: gloo on CPU, NCCL on GPU.

The learner is rank 0 of one small group per inference server (the server's workers are ranks
``1..n``) and hosts its rendezvous store. A transfer is: both sides agree on a ``Plan`` (names,
dtypes, shapes, in order), then rank 0 broadcasts each tensor in that order and every worker loads
it into its model.

Invariants:
- the sender sends one immutable set of published weights (the serving-dtype copy the learner
  took between two steps and holds in memory, or a version's safetensors read whole before the
  plan is announced), never live parameters, so a transfer never races the next optimiser step
  nor a directory pruned meanwhile;
- every collective has a timeout; after a failure the group is unusable and is closed (the next
  transfer connects again).
- rank 0 listens only on the address it serves (``learner.weight_sync.host``): the store and its
  gloo connections are bound to it, not to every interface. The rendezvous itself is not
  authenticated: whoever reaches that address and port can join (docs/security.md).

This module imports only torch and safetensors (and vLLM for the NCCL sender): vLLM's workers
import it through ``coevo.weights.vllm_plugin``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

Backend = Literal["gloo", "nccl"]
STORE_PREFIX = "coevo-weights"


@dataclass(frozen=True)
class Plan:
    """What rank 0 will broadcast, in order; ``update_info`` is vLLM's ``/update_weights`` body."""

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Plan:
        names = tuple(tensors)
        return cls(
            names,
            tuple(str(tensors[n].dtype).removeprefix("torch.") for n in names),
            tuple(tuple(tensors[n].shape) for n in names),
        )

    def update_info(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
        }

    def empty(self, index: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shapes[index], dtype=getattr(torch, self.dtype_names[index]), device=device)

    @property
    def bytes(self) -> int:
        return sum(
            torch.empty((), dtype=getattr(torch, d)).element_size() * _numel(s)
            for d, s in zip(self.dtype_names, self.shapes, strict=True)
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_checkpoint_tensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (name order of files, then of tensors)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        loaded = load_file(f, device=device)
        out.update((k, loaded[k]) for k in sorted(loaded))
    return out


class Collective(Protocol):
    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class GlooCollective:
    """A process group of its own (no global torch.distributed state), rank 0 hosting the store."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.store = store
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        # rank 0 accepts its peers' connections on the store's address only (a worker, on its default one)
        device = dist.ProcessGroupGloo.create_device(hostname=store.host) if rank == 0 else None
        options._devices = [device or dist.ProcessGroupGloo.create_default_device()]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, options)

    @staticmethod
    def host_store(host: str, world_size: int, timeout_s: float) -> Any:
        """Rank 0's store on a free port (``store.port``) of ``host`` only (a TCPStore of its own would
        listen on every interface); returns at once, peers join later."""
        import torch.distributed as dist

        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
            port = listener.getsockname()[1]
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now
        return store

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> GlooCollective:
        import torch.distributed as dist

        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, world_size, timeout_s)

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        self.pg = None
        self.store = None


class NcclCollective:
    """The sender's end of vLLM's own NCCL transfer group (needs vLLM and CUDA in this process)."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(
            tensor if tensor.is_contiguous() else tensor.contiguous(), src=0, stream=torch.cuda.current_stream()
        )

    def close(self) -> None:
        torch.cuda.current_stream().synchronize()
        self.comm.destroy()


def send(group: Collective, tensors: dict[str, torch.Tensor], plan: Plan) -> None:
    """Rank 0's side of one transfer: every tensor of ``plan``, in its order."""
    for name in plan.names:
        group.broadcast(tensors[name])
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.current_stream().synchronize()


def receive(group: Collective, plan: Plan, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """A worker's side of one transfer: yields ``(name, tensor)`` in the plan's order, as received."""
    for i, name in enumerate(plan.names):
        t = plan.empty(i, device)
        group.broadcast(t)
        yield name, t
