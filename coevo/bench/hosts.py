"""Hosts that are not loopback: network namespaces on one machine, joined by a bridge.

``Hosts(n)`` makes ``n`` namespaces (``coevo-h<i>``), each with one veth link to a bridge in the
machine's own namespace, on the project's test network ``198.18.0.0/24`` (RFC 2544's range for
benchmark networks, never routed): host ``i`` is ``198.18.0.<i+1>``, the machine itself (where the
bench and its fault injector run) ``198.18.0.254``. A process started with ``prefix(i)`` in front
of its command runs on host ``i``: it sees only that host's address and reaches the others over
the bridge, as on separate machines. ``cut(i)`` takes host ``i``'s link down (its processes keep
running, cut off from every other host) and ``heal(i)`` brings it back.

Invariant: what ``Hosts`` creates it removes on exit (namespaces, links, bridge), whatever
happened inside; names carry ``tag`` so two benches never touch each other's.

Needs root and ``ip`` (iproute2). The same layout on real machines: docs/operations.md.
"""

from __future__ import annotations

import shutil
import subprocess
from types import TracebackType

from coevo.errors import HostsUnavailable

NET = "198.18.0"
"""the test network's first three octets (RFC 2544 benchmarking range)"""
GATEWAY = f"{NET}.254"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


class Hosts:
    def __init__(self, n: int, tag: str = "0") -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"between 1 and 200 hosts, got {n}")
        self.n = n
        self.tag = tag
        self.bridge = f"cvbr{tag}"
        self.names = [f"coevo-{tag}-h{i}" for i in range(n)]
        self._links = [f"cv{tag}h{i}" for i in range(n)]

    def address(self, i: int) -> str:
        return f"{NET}.{i + 1}"

    def placement(self) -> list[tuple[str, str]]:
        """(address, namespace) of every host: where ``EmbeddedCluster(hosts=...)`` puts node ``i``."""
        return [(self.address(i), self.names[i]) for i in range(self.n)]

    def prefix(self, i: int) -> list[str]:
        """Put in front of a command to run it on host ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        _ip("link", "set", self._links[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._links[i], "up")

    def __enter__(self) -> Hosts:
        if shutil.which("ip") is None:
            raise HostsUnavailable("no `ip` command (apt-get install iproute2)")
        self._remove()  # a previous bench killed before its cleanup
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{GATEWAY}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (ns, link) in enumerate(zip(self.names, self._links, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._remove()

    def _remove(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)  # its veth end goes with it
        for link in (*self._links, self.bridge):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
