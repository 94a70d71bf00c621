"""coevo's vLLM plugin: a ``coevo_gloo`` weight-transfer backend, vLLM's NCCL transfer over gloo.

vLLM loads this through the ``vllm.general_plugins`` entry point (coevo installed in vLLM's
environment: ``scripts/setup-vllm.sh`` does it) in every one of its processes. Started with
``--weight-transfer-config '{"backend": "coevo_gloo"}'``, a server takes weights through vLLM's
native endpoints (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) exactly as with ``"nccl"``, but the bytes travel over gloo, so the
whole in-place transfer path runs (and is tested) on CPU. On GPU, use vLLM's own ``"nccl"``.

Runs inside vLLM's workers only; imports nothing of coevo but ``coevo.weights.transfer``. The
workers' collective timeout comes from ``COEVO_TRANSFER_TIMEOUT_S`` in the server's environment
(default 120 s; keep it at least the learner's ``learner.weight_sync.timeout_s``).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

BACKEND = "coevo_gloo"


def register() -> None:
    """Entry point: register the backend (idempotent; vLLM may call it more than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


def __getattr__(name: str) -> Any:
    # the engine class subclasses vLLM's, so it is built on first access (this module imports without vLLM)
    if name == "GlooWeightTransferEngine":
        return _engine_class()
    raise AttributeError(name)


@cache
def _engine_class() -> type:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from coevo.weights.transfer import GlooCollective, Plan, receive

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):
        """vLLM's dense NCCL engine with gloo underneath: same init/update info, one tensor per broadcast."""

        def init_transfer_engine(self, init_info: Any) -> None:
            if init_info.master_address is None or init_info.master_port is None:
                raise ValueError("coevo_gloo needs master_address and master_port")
            if init_info.packed:
                raise ValueError("coevo_gloo sends one tensor per broadcast: packed must be false")
            pc = self.parallel_config
            rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
            self.shutdown()
            timeout_s = float(os.environ.get("COEVO_TRANSFER_TIMEOUT_S", "120"))  # vLLM's init info has no field
            self.model_update_group: GlooCollective | None = GlooCollective.join(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, timeout_s=timeout_s
            )

        def receive_weights(self, update_info: Any) -> None:
            if self.model_update_group is None:
                raise RuntimeError("coevo_gloo: init_weight_transfer_engine first")
            plan = Plan(
                tuple(update_info.names), tuple(update_info.dtype_names), tuple(tuple(s) for s in update_info.shapes)
            )
            for name, tensor in receive(self.model_update_group, plan, self.device):
                self.model.load_weights([(name, tensor)])

        def shutdown(self) -> None:
            if self.model_update_group is not None:
                self.model_update_group.close()
                self.model_update_group = None

    return GlooWeightTransferEngine
