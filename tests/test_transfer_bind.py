"""The weight-transfer rendezvous listens only on the address it serves (``learner.weight_sync.host``):
the store and rank 0's gloo connections are bound to it. (A TCPStore of its own listens on every
interface: a peer on another interface could connect, and join.) CPU only: gloo."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from coevo.weights.transfer import GlooCollective, Plan, receive, send


def other_address() -> str:
    """A local address of this machine other than loopback (skips where there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = str(s.getsockname()[0])
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("no interface besides loopback here")
    return address


def refused(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect((address, port))
        except ConnectionRefusedError:
            return True
        return False


def test_the_store_and_rank_0_listen_on_the_served_address_only() -> None:
    other = other_address()
    store = GlooCollective.host_store("127.0.0.1", 2, 30.0)
    assert refused(other, store.port)  # another interface: nothing listens there
    assert not refused("127.0.0.1", store.port)
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    plan = Plan.of(tensors)
    got: dict[str, torch.Tensor] = {}

    def worker() -> None:
        peer = GlooCollective.join("127.0.0.1", store.port, 1, 2, 30.0)
        got.update(receive(peer, plan))

    thread = threading.Thread(target=worker)
    thread.start()
    group = GlooCollective(store, 0, 2, 30.0)
    send(group, tensors, plan)
    thread.join(30)
    assert torch.equal(got["w"], tensors["w"])  # the group still forms and delivers, bit-exact
    assert refused(other, store.port)
