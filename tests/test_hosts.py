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
from coevo.runtime.placement import placed
from coevo.runtime.server import EmbeddedCluster

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2"
)


async def _published(nc: nats.NATS, data: bytes, msg_id: str | None = None) -> object:
    """``data`` published once it can be (a node learns of a stream, or a new leader, a moment after
    the cluster does): retried until acknowledged; with ``msg_id`` a retry whose first try was stored
    after all is deduplicated by the stream, so the sequence is the first try's."""
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    async with asyncio.timeout(60):
        while True:
            try:
                return await nc.jetstream().publish("s.a", data, timeout=3.0, headers=headers)
            except nats.errors.Error:
                await asyncio.sleep(0.5)


async def test_a_cluster_across_hosts_loses_a_cut_off_node_and_gets_it_back(tmp_path: Path) -> None:
    with Hosts(3, tag="99") as hosts:
        cluster = EmbeddedCluster(tmp_path, nodes=3, hosts=hosts.placement())
        url = await asyncio.to_thread(cluster.start)
        try:
            assert url.split(",") == [f"nats://198.18.0.{i + 1}:{n.port}" for i, n in enumerate(cluster.nodes)]
            only0 = await nats.connect(cluster.urls[0], allow_reconnect=False)  # a client of node 0 only
            rest = await nats.connect(cluster.urls[1:])
            await placed(lambda: rest.jetstream().add_stream(name="S", subjects=["s.>"], num_replicas=3))
            # node 0 learns of the stream created through the others a moment later (CI: no responders)
            assert (await _published(only0, b"1", "first")).seq == 1  # replicated across the three hosts
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


@pytest.mark.parametrize("node", [0, 1], ids=["its-own-node", "a-node-across-the-cut"])
async def test_an_agent_cut_off_honours_sigterm_within_5_s(tmp_path: Path, node: int) -> None:
    """Connected to its own node, the connection stays up but nothing it publishes is acknowledged
    (the node lost its quorum): the bus counts that as gone, so the drain does not wait its full
    timeout. Connected to a node across the cut, the TCP connection is silently dead: closing it
    waited for writes that could never be sent (chaos: 12 to 18 s)."""
    import signal
    import time

    from coevo.runtime.bus import NatsBus
    from coevo.schemas import TaskScheduled, TaskSpec
    from tests.agents_for_tests import Echo
    from tests.test_agents import spawn_agent, wait_exit

    with Hosts(3, tag="98") as hosts:
        cluster = EmbeddedCluster(tmp_path / "nats", nodes=3, hosts=hosts.placement())
        await asyncio.to_thread(cluster.start)
        try:
            async with await NatsBus.connect(cluster.url, "cut1") as bus:
                await bus.provision()
                for i in range(40):
                    await bus.publish(
                        Echo(bus, None).event(
                            TaskScheduled, task=TaskSpec(task_id=f"t{i}", family="q"), group_id=f"g{i}", n_rollouts=1
                        )
                    )  # type: ignore[arg-type]
                await bus.flush()
                agent = spawn_agent(
                    "tests.agents_for_tests:Echo",
                    cluster.urls[node],
                    "cut1",
                    {"COEVO_TEST_DELAY": "3.0", "COEVO_TEST_RUNS": str(tmp_path)},
                    prefix=hosts.prefix(0),
                )
                async with asyncio.timeout(60):  # it works
                    while not await bus.events(["trajectory.completed"]):
                        await asyncio.sleep(0.2)
            hosts.cut(0)
            await asyncio.sleep(4.0)  # it is cut off, still connected to node 0, its handlers mid-task
            assert agent.poll() is None
            t0 = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            await wait_exit(agent, 30)
            assert time.monotonic() - t0 < 5.0, time.monotonic() - t0
        finally:
            hosts.heal(0)
            cluster.stop()
