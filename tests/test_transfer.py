"""Pushed weights without vLLM: the plan, a real gloo group of two ranks, and the learner's weight
server answering over a real NATS server (connect, push, refusals)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from coevo.config import LearnerConfig, PushSync
from coevo.errors import BusError
from coevo.schemas import TransferConnect, TransferEndpoint, TransferOffer, TransferRequest, transfer_subject
from coevo.training.lane import Lane
from coevo.weights.server import WeightServer
from coevo.weights.transfer import GlooCollective, Plan, load_checkpoint_tensors, receive, send


def pair(timeout_s: float = 5.0) -> tuple[GlooCollective, GlooCollective]:
    store = GlooCollective.host_store("127.0.0.1", 2, timeout_s)
    box: dict[str, GlooCollective] = {}
    joiner = threading.Thread(
        target=lambda: box.setdefault("r", GlooCollective.join("127.0.0.1", store.port, 1, 2, timeout_s))
    )
    joiner.start()
    rank0 = GlooCollective(store, 0, 2, timeout_s)
    joiner.join()
    return rank0, box["r"]


def test_plan_describes_tensors_in_order_and_counts_bytes() -> None:
    t = {
        "b.weight": torch.zeros(3, 4),
        "a.bias": torch.zeros(5, dtype=torch.bfloat16),
        "n": torch.zeros((), dtype=torch.int64),
    }
    plan = Plan.of(t)
    assert plan.names == ("b.weight", "a.bias", "n")  # insertion order, not sorted: the sender's order
    assert plan.dtype_names == ("float32", "bfloat16", "int64")
    assert plan.shapes == ((3, 4), (5,), ())
    assert plan.bytes == 12 * 4 + 5 * 2 + 8
    offer = TransferOffer(
        version=3,
        sha256="x",
        names=list(plan.names),
        dtype_names=list(plan.dtype_names),
        shapes=[list(s) for s in plan.shapes],
    )
    assert offer.update_info() == plan.update_info()  # what vLLM's /update_weights takes
    assert plan.empty(1).dtype == torch.bfloat16 and plan.empty(1).shape == (5,)


def test_gloo_broadcast_delivers_every_tensor_bit_exact() -> None:
    rank0, rank1 = pair()
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(17, 33),
        "ids": torch.arange(50, dtype=torch.int64),
        "h": torch.randn(8).to(torch.bfloat16),
    }
    plan = Plan.of(tensors)
    sender = threading.Thread(target=send, args=(rank0, tensors, plan))
    sender.start()
    got = dict(receive(rank1, plan))
    sender.join()
    assert list(got) == list(plan.names)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_send_to_a_peer_that_never_receives_times_out_instead_of_hanging() -> None:
    rank0, _rank1 = pair(timeout_s=2.0)
    big = {"x": torch.zeros(16 << 20)}  # 64 MB: more than socket buffers hold
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"[Tt]imed out"):
        send(rank0, big, Plan.of(big))
    assert time.monotonic() - t0 < 30


async def test_weight_server_connects_pushes_the_newest_checkpoint_and_refuses_clearly(
    bus, model_cache: Path, tmp_path: Path
) -> None:
    from coevo.inference.models import ensure_default_model

    model = ensure_default_model("policy", model_cache)
    lane = Lane("policy", model, tmp_path, LearnerConfig(), device="cpu")
    path, sha, _ = await asyncio.to_thread(lane.checkpoint)
    published = {"policy": (lane.version, path, sha)}
    server = WeightServer(bus, PushSync(transport="gloo", timeout_s=5.0))
    await server.serve("policy", lambda: published["policy"])
    push = transfer_subject(bus.run_id, "policy", "push")
    try:
        with pytest.raises(BusError, match="connect first"):
            await bus.request(push, TransferRequest(server="vllm-a", version=0), TransferOffer)
        with pytest.raises(BusError, match="malformed TransferConnect"):
            await bus.request(
                transfer_subject(bus.run_id, "policy", "connect"),
                TransferRequest(server="vllm-a", version=0),
                TransferEndpoint,
            )
        ep = await bus.request(
            transfer_subject(bus.run_id, "policy", "connect"),
            TransferConnect(server="vllm-a", workers=1),
            TransferEndpoint,
        )
        assert ep.backend == "gloo" and ep.world_size == 2 and ep.init_info()["rank_offset"] == 1
        worker = await asyncio.to_thread(GlooCollective.join, ep.master_address, ep.master_port, 1, 2, 5.0)

        offer = await bus.request(
            push, TransferRequest(server="vllm-a", version=0, token=ep.token), TransferOffer, timeout_s=30
        )
        plan = Plan(tuple(offer.names), tuple(offer.dtype_names), tuple(tuple(s) for s in offer.shapes))
        got = dict(await asyncio.to_thread(lambda: list(receive(worker, plan))))
        expected = load_checkpoint_tensors(path)
        assert offer.version == 0 and offer.sha256 == sha and set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)

        # a newer version is published; the follower asks for an older one: it gets the newest
        with torch.no_grad():
            next(lane.model.parameters()).add_(1.0)
        lane.version = 1
        path1, sha1, _ = await asyncio.to_thread(lane.checkpoint)
        published["policy"] = (1, path1, sha1)
        offer = await bus.request(
            push, TransferRequest(server="vllm-a", version=0, token=ep.token), TransferOffer, timeout_s=30
        )
        got = dict(await asyncio.to_thread(lambda: list(receive(worker, plan))))
        assert offer.version == 1 and offer.sha256 == sha1
        name = next(iter(lane.model.state_dict()))
        assert torch.equal(got[name], load_checkpoint_tensors(path1)[name])
        assert not torch.equal(got[name], expected[name])

        # a follower that takes the offer and never receives: the send times out, the group is closed
        big = tmp_path / "big"
        big.mkdir()
        save_file({"x": torch.zeros(16 << 20)}, big / "model.safetensors")  # more than socket buffers hold
        published["policy"] = (2, big, "sha-big")
        await bus.request(
            push, TransferRequest(server="vllm-a", version=2, token=ep.token), TransferOffer, timeout_s=30
        )
        link = server.links[("policy", "vllm-a")]
        assert link.sending is not None
        await asyncio.wait_for(link.sending, 60)
        assert link.broken is not None
        with pytest.raises(BusError, match="connect again"):
            await bus.request(
                push, TransferRequest(server="vllm-a", version=2, token=ep.token), TransferOffer, timeout_s=30
            )
        assert server.sent == {"vllm-a": 1}
    finally:
        await server.aclose()


async def _connect(bus, server: str, workers: int = 1, token: str | None = None) -> TransferEndpoint:  # type: ignore[no-untyped-def]
    return await bus.request(
        transfer_subject(bus.run_id, "policy", "connect"),
        TransferConnect(server=server, workers=workers, token=token),
        TransferEndpoint,
    )


async def test_a_connect_takes_only_an_allowed_free_name_or_its_own_link_and_links_are_bounded(
    bus, model_cache: Path, tmp_path: Path
) -> None:
    """Any policy-credentialed process could ask: a name held by another server's link is refused
    (it closed that link before), so is a push without the link's token, a name outside
    ``servers``, more workers than ``max_workers`` and a link past ``max_links``."""
    from coevo.inference.models import ensure_default_model

    model = ensure_default_model("policy", model_cache)
    lane = Lane("policy", model, tmp_path, LearnerConfig(), device="cpu")
    path, sha, _ = await asyncio.to_thread(lane.checkpoint)
    sync = PushSync(transport="gloo", timeout_s=5.0, servers=("vllm-a", "vllm-b", "vllm-c"), max_links=2, max_workers=4)
    server = WeightServer(bus, sync)
    await server.serve("policy", lambda: (lane.version, path, sha))
    push = transfer_subject(bus.run_id, "policy", "push")
    try:
        ep = await _connect(bus, "vllm-a")
        assert len(ep.token) >= 32
        worker = await asyncio.to_thread(GlooCollective.join, ep.master_address, ep.master_port, 1, 2, 5.0)
        held = server.links[("policy", "vllm-a")]
        for token in (None, "not-the-token"):  # another process naming vllm-a: refused, the link stays
            with pytest.raises(BusError, match="vllm-a is connected"):
                await _connect(bus, "vllm-a", token=token)
        assert server.links[("policy", "vllm-a")] is held and held.broken is None
        with pytest.raises(BusError, match="not vllm-a's token"):
            await bus.request(push, TransferRequest(server="vllm-a", version=0, token="x" * 43), TransferOffer)
        # the link's own follower pushes with its token, and the weights arrive
        offer = await bus.request(push, TransferRequest(server="vllm-a", version=0, token=ep.token), TransferOffer, 30)
        plan = Plan(tuple(offer.names), tuple(offer.dtype_names), tuple(tuple(s) for s in offer.shapes))
        got = dict(await asyncio.to_thread(lambda: list(receive(worker, plan))))
        assert all(torch.equal(got[k], v) for k, v in load_checkpoint_tensors(path).items())
        with pytest.raises(BusError, match=r"vllm-x is not one of learner\.weight_sync\.servers"):
            await _connect(bus, "vllm-x")
        with pytest.raises(BusError, match=r"5 workers: over learner\.weight_sync\.max_workers 4"):
            await _connect(bus, "vllm-b", workers=5)
        await _connect(bus, "vllm-b")
        with pytest.raises(BusError, match=r"2 servers are connected: learner\.weight_sync\.max_links"):
            await _connect(bus, "vllm-c")
        again = await _connect(bus, "vllm-a", token=ep.token)  # its own follower replaces its own link
        assert again.token != ep.token and server.links[("policy", "vllm-a")] is not held
        assert len(server.links) == 2
        # vllm-b's workers never join: once its group failed to form, a new server may take its place
        await asyncio.wait([server.links[("policy", "vllm-b")].ready])
        await _connect(bus, "vllm-c")
        assert set(server.links) == {("policy", "vllm-a"), ("policy", "vllm-c")}
    finally:
        await server.aclose()


async def test_transfer_work_never_holds_the_executor_the_learners_step_runs_on(bus) -> None:  # type: ignore[no-untyped-def]
    """Each connect opens rank 0 of a group in a thread, held until the server's workers join (up to
    ``timeout_s``); as many connects as the default executor has threads, whose workers never join:
    the learner's step (``asyncio.to_thread``, the default executor) still runs at once."""
    import os

    threads = min(32, (os.cpu_count() or 1) + 4)  # the default executor's size
    server = WeightServer(bus, PushSync(transport="gloo", timeout_s=6.0, max_links=threads))
    await server.serve("policy", lambda: (0, Path("/nonexistent"), ""))
    try:
        for i in range(threads):
            await _connect(bus, f"vllm-{i}")
        assert len(server.links) == threads
        t0 = time.monotonic()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "stepped"), 3.0) == "stepped"
        assert time.monotonic() - t0 < 3.0
    finally:
        await server.aclose()
