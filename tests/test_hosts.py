"""Hosts that are not loopback (``coevo.bench.hosts``): NATS nodes in network namespaces of their own,
reached over a bridge, and a host's link cut and healed, on the real server."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import nats
import pytest

from coevo.bench.hosts import Hosts
from coevo.runtime.server import EmbeddedCluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")


async def _published(nc: nats.NATS, data: bytes) -> object:
    async with asyncio.timeout(60):
        while True:
            try:
                return await nc.jetstream().publish("s.a", data, timeout=3.0)
            except nats.errors.Error:
                await asyncio.sleep(0.5)


async def test_a_cluster_across_hosts_loses_a_cut_off_node_and_gets_it_back(tmp_path: Path) -> None:
    with Hosts(3, tag="99") as hosts:
        placement = [(hosts.address(i), hosts.names[i]) for i in range(3)]
        cluster = EmbeddedCluster(tmp_path, nodes=3, hosts=placement)
        url = await asyncio.to_thread(cluster.start)
        try:
            assert url.split(",") == [f"nats://198.18.0.{i + 1}:{n.port}" for i, n in enumerate(cluster.nodes)]
            only0 = await nats.connect(cluster.urls[0], allow_reconnect=False)  # a client of node 0 only
            rest = await nats.connect(cluster.urls[1:])
            await rest.jetstream().add_stream(name="S", subjects=["s.>"], num_replicas=3)
            assert (await only0.jetstream().publish("s.a", b"1")).seq == 1  # replicated across the three hosts
            hosts.cut(0)
            with pytest.raises(nats.errors.Error):  # node 0 is cut off from its peers: no quorum on its side
                await only0.jetstream().publish("s.a", b"2", timeout=3.0)
            assert (await _published(rest, b"3")).seq >= 2  # the majority goes on (a new leader if need be)
            hosts.heal(0)
            assert (await _published(only0, b"4")).seq >= 3  # node 0 is back in the cluster
            await only0.close()
            await rest.close()
        finally:
            cluster.stop()
    listed = await asyncio.create_subprocess_exec("ip", "netns", "list", stdout=asyncio.subprocess.PIPE)
    out, _ = await listed.communicate()
    assert b"coevo-99-" not in out  # what it made is gone
