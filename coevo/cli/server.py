"""``coevo server``: an embedded nats-server with JetStream in the foreground."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from coevo.cli._table import Command, arg


def cmd_server(args: argparse.Namespace) -> int:
    import signal
    import socket
    import threading

    from coevo.runtime.server import EmbeddedCluster, EmbeddedServer, server_security

    security = server_security(  # ConfigError (exit 2) for a non-loopback bind without authentication
        args.host,
        args.store,
        token_env=args.token_env,
        generate_token=args.generate_token,
        user=args.user,
        password_env=args.password_env,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        run_ids=tuple(args.run_id or ()),
        insecure_loopback=args.insecure_loopback,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    opts: dict[str, Any] = {"port": args.port, "host": args.host, "auth": security.auth, "tls": security.tls}
    server = (
        EmbeddedCluster(args.store, nodes=args.cluster, **opts) if args.cluster else EmbeddedServer(args.store, **opts)
    )
    with server:
        url = server.url or ""
        print(f"nats-server ready at {url} (JetStream in {server.store_dir}); Ctrl-C stops it", flush=True)
        if security.token_file is not None:
            print(f"the token is in {security.token_file} (mode 0600)", flush=True)
        if security.credentials is not None:
            from coevo.runtime.app import provision_runs
            from coevo.runtime.credentials import ADMIN, credential_path

            asyncio.run(
                provision_runs(
                    url,
                    credential_path(security.credentials, ADMIN),
                    tuple(args.run_id),
                    replicas=min(3, args.cluster or 1),
                )
            )
            print(
                f"each role's credentials are in {security.credentials}/ROLE.json (mode 0600; admin.json for the "
                f"process that starts the run and tools); the stream and buckets of {', '.join(args.run_id)} "
                "exist",
                flush=True,
            )
        public = url.replace("0.0.0.0", socket.gethostname())
        print(f"agents connect with: {agent_command(security.agent_command(public), args.run_id)}", flush=True)
        done.wait()
    return 0


def agent_command(command: str, run_ids: list[str] | None) -> str:
    """The agent command line a server prints, runnable as printed (ROLE aside): the server's users
    are allowed only its runs, so the command names the run (``--run-id``)."""
    if not run_ids:
        return command
    if len(run_ids) == 1:
        return f"{command} --run-id {run_ids[0]}"
    return f"{command} --run-id RUN (RUN: one of {', '.join(run_ids)})"


COMMANDS: tuple[Command, ...] = (
    Command(
        "server",
        "run an embedded nats-server with JetStream in the foreground",
        cmd_server,
        args=(
            arg("--port", type=int, default=4222, help="port (-1: any free port)"),
            arg("--host", default="127.0.0.1", help="address to listen on; beyond loopback it needs auth"),
            arg("--store", type=Path, default=Path("runs/nats"), help="JetStream storage directory"),
            arg(
                "--cluster",
                type=int,
                choices=(3, 5),
                help="start N nodes on this host joined by routes "
                "(ports PORT..PORT+N-1; stores STORE/n<i>); prints the comma-separated URLs",
            ),
            arg(
                "--run-id",
                action="append",
                metavar="RUN",
                help="require a user per role with run RUN's permissions (repeatable), credentials in "
                "STORE/credentials/ROLE.json (mode 0600; docs/security.md)",
            ),
            arg(
                "--generate-token",
                action="store_true",
                help="require a random token, kept in STORE/nats-token (mode 0600)",
            ),
            arg(
                "--insecure-loopback",
                action="store_true",
                help="serve on loopback without authentication: any local user or program can publish",
            ),
            arg("--token-env", metavar="NAME", help="require the token held by environment variable NAME"),
            arg("--user", help="require this user (with --password-env)"),
            arg("--password-env", metavar="NAME", help="environment variable holding --user's password"),
            arg("--tls-cert", type=Path, help="server certificate (PEM): clients connect over TLS"),
            arg("--tls-key", type=Path, help="key of --tls-cert"),
            arg("--tls-ca", type=Path, help="require client certificates signed by this CA (mutual TLS)"),
        ),
    ),
)
